"""generate's flags that the chat and server verbs share: taken from generate's own parser, so the
verbs cannot drift, and refused while a verb does not use them (never silently ignored). Also the
errors both verbs report as the caller's (PROMPT_ERRORS)."""

import argparse
import importlib

from . import flags
from .cli_args import LOAD_FLAGS
from .errors import UsageError
from .pipeline import launched as pipeline_launched
from .prompt_cache_disk import DEFAULT_DIR_BYTES, open_dir
from .text.chat_template import ChatError
from .text.tokenizer import TokenizerError

gen = importlib.import_module("hebrus_mlx.generate")  # the package attribute is the function

# What a bad prompt or request raises (the template, the tokenizer, generation's own checks): chat
# prints it as one line and goes on, the server answers 400. Never a fault of the process.
PROMPT_ERRORS = (ChatError, TokenizerError, gen.GenerationError)

# generate's flags that describe the model, its caches and sampling defaults; taken from its parser
# so the two verbs cannot drift. A flag generate gains later appears here too, and is refused
# until this verb uses it (never silently ignored).
USED = LOAD_FLAGS | {
    "max_tokens",
    "temp",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "draft_model",
    "num_draft_tokens",
    "pipeline_split",
    "pipeline_timeout",
}


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


def add_prompt_cache_arguments(p, default_bytes, zero):
    """The prefix-snapshot cache of chat and server: --prompt-cache-bytes in memory (`default_bytes`;
    `zero` says what 0 means to the verb), --prompt-cache-dir and its bound on disk."""
    p.add_argument(
        "--prompt-cache-bytes",
        type=flags.integer(0, flags.INT64_MAX),
        default=default_bytes,
        help=f"byte limit of cached prefix snapshots, LRU (0: {zero})",
    )
    p.add_argument(
        "--prompt-cache-dir",
        default=None,
        metavar="DIR",
        help="keep prefix snapshots in DIR across restarts (keyed by the artifact and the tokens; "
        "foreign, stale or corrupted entries are refused and recomputed)",
    )
    p.add_argument(
        "--prompt-cache-dir-bytes",
        type=flags.integer(1, flags.INT64_MAX),
        default=DEFAULT_DIR_BYTES,
        metavar="N",
        help=f"byte limit of this model's snapshots in --prompt-cache-dir, LRU, shared by every process using "
        f"the directory (default {DEFAULT_DIR_BYTES >> 30} GiB)",
    )


def check_shared_flags(args, parser, verb, also_used=frozenset()):
    """chat's and server's checks of what they share (after generate's own, `gen.check_args`): a
    generate flag the verb does not use (USED | also_used) is refused, then --prompt-cache-bytes and
    the --prompt-cache-dir pair are checked."""
    refuse_unused(args, parser.shared, USED | also_used, verb)
    if args.prompt_cache_bytes < 0:
        raise UsageError("--prompt-cache-bytes", f"must be >= 0, got {args.prompt_cache_bytes}")
    check_prompt_cache_dir(args)


def check_prompt_cache_dir(args):
    if args.prompt_cache_dir is None:
        if args.prompt_cache_dir_bytes != DEFAULT_DIR_BYTES:
            raise UsageError("--prompt-cache-dir-bytes", "needs --prompt-cache-dir")
        return
    if pipeline_launched():
        raise UsageError("--prompt-cache-dir", "not supported under mlx.launch (each rank holds its own layers)")
    import os

    if os.path.exists(args.prompt_cache_dir) and not os.path.isdir(args.prompt_cache_dir):
        raise UsageError("--prompt-cache-dir", f"{args.prompt_cache_dir}: not a directory")
    # Usable (created, writable, its lock file a regular file) before the model loads: a failure
    # later, on the server's worker thread, would end the process from its exit path.
    os.close(open_dir(args.prompt_cache_dir))
