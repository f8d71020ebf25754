"""`hebrus-mlx cache-prompt` (also `cache_prompt`, as mlx-lm's): the verb's command line over
hebrus_mlx/cache_prompt.py."""

import argparse
import sys
import time

from ..artifact.atomic import check_output_file
from ..cache_prompt import TEMPLATE_KEY, cached_prompt_ids
from ..errors import UsageError
from ..generate import context_limit, prefill
from ..prompt_cache import save_prompt_cache
from .cli_args import LOAD_FLAGS, ArgumentParser, add_overwrite_argument, read_prompt
from .verb_flags import check_args, load_from_args

# generate's flags that describe the model and how to load and prefill it.
_USED = LOAD_FLAGS | {"prompt", "system_prompt", "ignore_chat_template", "dtype", "seed", "verbose"}


def build_parser() -> argparse.ArgumentParser:
    from .verb_flags import share_generate_flags

    p = ArgumentParser(
        prog="hebrus-mlx cache-prompt",
        description="Prefill a prompt and save its state for `generate --prompt-cache-file`.",
        conflict_handler="resolve",
    )
    p.shared = share_generate_flags(p, {"help", "prompt_cache_file"})
    for a in p.shared:  # still parsed, so using one says it is refused rather than unknown
        if a.dest not in _USED:
            a.help = argparse.SUPPRESS
    p.add_argument(
        "--prompt-cache-file",
        required=True,
        metavar="FILE",
        help="where to write the state (.safetensors, mlx-lm's prompt-cache layout); "
        "an existing file only with --overwrite, a symlink never",
    )
    add_overwrite_argument(p, help="let --prompt-cache-file replace an existing file")
    return p


def main(argv=None) -> int:
    """`hebrus-mlx cache-prompt`; typed errors propagate to `cli.run` (one line, exit 2)."""
    from .verb_flags import refuse_unused

    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args)
    refuse_unused(args, parser.shared, _USED, "cache-prompt")
    # Before the model loads: an existing file only with --overwrite, a symlink never.
    check_output_file(args.prompt_cache_file, overwrite=args.overwrite, field="--prompt-cache-file")
    prompt = read_prompt(args.prompt)
    if not prompt.strip():
        raise UsageError("--prompt", "the prompt is empty")
    model, tok = load_from_args(args)
    templated = not args.ignore_chat_template and tok.chat_template is not None
    ids = cached_prompt_ids(tok, prompt, args.system_prompt, templated)
    limit = context_limit(model)
    if limit is not None and len(ids) >= limit:
        raise UsageError("--prompt", f"{len(ids)} tokens; the model context is {limit}")
    import mlx.core as mx

    cache = model.make_cache()
    tic = time.perf_counter()
    prefill(model, mx.array(ids, dtype=mx.int32), cache, args.prefill_step_size)
    seconds = time.perf_counter() - tic
    save_prompt_cache(
        args.prompt_cache_file,
        cache,
        model,
        tokens=ids,
        metadata={TEMPLATE_KEY: "1" if templated else "0", "model": str(args.model)},
        overwrite=args.overwrite,
        field="--prompt-cache-file",
    )
    if args.verbose:
        print(f"Prompt: {len(ids)} tokens, {len(ids) / max(seconds, 1e-9):.3f} tokens-per-sec")
        print(f"Saved {args.prompt_cache_file}")
    return 0


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("cache-prompt", main))
