"""`hebrus-mlx cache-prompt`: prefill a prompt once and save the sequence state to a file, like
`mlx_lm.cache_prompt`; `hebrus-mlx generate --prompt-cache-file FILE --prompt TEXT` then continues
from it without prefilling it again.

As in mlx-lm, with a chat template the cached prompt is the start of a user message and the
generate prompt its continuation: the file holds the template's tokens up to the end of the cached
text (the message left open), and generate appends the continuation's text and the tokens the
template writes after it (end of turn, generation prompt). Both sides are tokenized by provenance
(AFN-006): the caller's text stays DATA. With --ignore-chat-template both are plain text.

The file is mlx-lm's prompt-cache layout bound to the artifact (prompt_cache.py): another model,
dtype or layer layout is refused with the field named. Its metadata also records the token IDs and
whether the chat template was used (a continuation in the other mode is refused). An existing file
is replaced only with --overwrite, a symlink never.
"""

import argparse
import sys
import time

from .artifact.atomic import check_output_file
from .cli_args import LOAD_FLAGS, ArgumentParser, read_prompt
from .errors import UsageError
from .generate import context_limit, prefill
from .prompt_cache import PromptCacheFileError, load_prompt_cache, save_prompt_cache
from .text.chat_template import DATA
from .verb_flags import check_args, load_from_args

TEMPLATE_KEY = "chat_template"  # "1": the cached prompt opens a user message; "0": plain text

# generate's flags that describe the model and how to load and prefill it.
_USED = LOAD_FLAGS | {"prompt", "system_prompt", "ignore_chat_template", "dtype", "seed", "verbose"}


def _last_data(pieces, text: str, where: str) -> int:
    """The index of the last DATA piece, which must be the user's `text` (as the template wrote it)."""
    k = max((i for i, (kind, _) in enumerate(pieces) if kind == DATA), default=None)
    if k is None or pieces[k][1].strip() != text.strip():
        raise UsageError(
            where,
            "the chat template does not end the user message with its text, so it cannot be "
            "continued; use --ignore-chat-template",
        )
    return k


def _messages(text: str, system):
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]


def cached_prompt_ids(tok, prompt: str, system=None, chat_template: bool = True):
    """The IDs `cache-prompt` prefills: the template's tokens through the end of `prompt` (the user
    message left open), or the plain text."""
    if not chat_template:
        return tok.encode(prompt)
    pieces = tok.render_chat(_messages(prompt, system), add_generation_prompt=False).pieces()
    return tok.encode_segments(pieces[: _last_data(pieces, prompt, "--prompt") + 1])


def continuation_ids(tok, prompt: str, chat_template: bool = True):
    """The IDs generate appends to a cached prompt: `prompt`'s text, then what the template writes
    after a user message (end of turn, generation prompt)."""
    if not chat_template:
        return tok.encode(prompt, add_special_tokens=False)
    pieces = tok.render_chat(_messages(prompt, None), add_generation_prompt=True).pieces()
    return tok.encode_segments(pieces[_last_data(pieces, prompt, "--prompt") :])


def load_for_generate(path, model, tok, prompt: str, ignore_chat_template: bool):
    """(cache, IDs to feed after it) for `generate --prompt-cache-file`."""
    try:
        cache, meta = load_prompt_cache(path, model, return_metadata=True)
    except PromptCacheFileError as e:
        raise UsageError("--prompt-cache-file", f"{e.field}: {e.message}") from None
    templated = meta.get(TEMPLATE_KEY) == "1"
    if templated and (ignore_chat_template or tok.chat_template is None):
        raise UsageError("--ignore-chat-template", "the cache file was made with the chat template")
    if not templated and not ignore_chat_template and tok.chat_template is not None:
        raise UsageError("--prompt-cache-file", "the file was made with --ignore-chat-template; pass it here too")
    return cache, continuation_ids(tok, prompt, templated)


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
    p.add_argument("--overwrite", action="store_true", help="let --prompt-cache-file replace an existing file")
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
    from .cli import run

    sys.exit(run("cache-prompt", main))
