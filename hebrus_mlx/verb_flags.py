"""generate's flags that the chat and server verbs share: taken from generate's own parser, so the
verbs cannot drift, and refused while a verb does not use them (never silently ignored)."""

import argparse
import importlib

from .errors import UsageError

gen = importlib.import_module("hebrus_mlx.generate")  # the package attribute is the function

# generate's flags that describe the model, its caches and sampling defaults; taken from its parser
# so the two verbs cannot drift. A flag generate gains later appears here too, and is refused
# until this verb uses it (never silently ignored).
USED = {"model", "max_tokens", "temp", "top_p", "top_k", "min_p", "seed", "prefill_step_size", "max_kv_size",
        "draft_model", "num_draft_tokens", "pipeline_split", "pipeline_timeout",
        "expert_cache_gb", "ple_cache_gb", "prefetch", "prefetch_budget", "prefetch_threshold", "expert_mirror",
        "prefill_sweep"}


def share_generate_flags(p: argparse.ArgumentParser, exclude) -> list:
    """Add generate's flags (but `exclude`) to `p`; returns the added actions."""
    added = []
    for action in gen.build_parser()._actions:
        if action.dest not in exclude:
            p._add_action(action)
            added.append(action)
    return added


def refuse_unused(args, actions, used, verb):
    for a in actions:
        if a.dest not in used and getattr(args, a.dest) != a.default:
            raise UsageError(a.option_strings[0], f"not supported by `hebrus-mlx {verb}` yet")
