"""`hebrus-mlx chat`: an interactive chat REPL like `mlx_lm.chat`.

Each turn renders the whole conversation with the checkpoint's template (caller text stays DATA,
AFN-006) and restores the longest cached prefix, so a turn prefills only what is new since the
previous one. Commands: /reset (forget the conversation, keep the system prompt), /help, /exit
(or q, or end of input); a command with arguments or an unknown /word is refused in one line and
never sent to the model (a message starting with // is sent with one leading / removed).
"""

import argparse
import sys

from ..errors import UsageError
from ..generate import GenerationError, context_limit
from ..prompt_cache import PromptCache, Usage, stream_with_cache
from ..sample_utils import make_sampler
from ..stream.errors import StreamError
from ..text.tokenizer import PROMPT_ERRORS
from .cli_args import ArgumentParser, str2bool
from .verb_flags import (
    add_prompt_cache_arguments,
    check_args,
    check_shared_flags,
    load_from_args,
    share_generate_flags,
)

HELP = (
    "Type a message. /reset clears the conversation, /help shows this, /exit or q quits; "
    "start a message with // to send one that begins with /."
)
COMMANDS = ("/exit", "q", "/help", "/reset")
_NOT_SHARED = {"help", "prompt", "ignore_chat_template", "verbose", "prompt_cache_file"}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="hebrus-mlx chat", description="Chat with a hebrus-mlx model in the terminal.", conflict_handler="resolve"
    )
    # generate's model, cache and sampling flags (incl. --system-prompt), so the verbs cannot drift.
    p.shared = share_generate_flags(p, _NOT_SHARED)
    p.add_argument("--verbose", type=str2bool, default=True, help="print a stats line after each reply")
    add_prompt_cache_arguments(p, 1 << 30, "prefill the whole conversation every turn")
    p.set_defaults(max_tokens=256)
    return p


def _stats(u: Usage) -> str:
    new = u.prompt_tokens - u.cached_tokens
    ptps = new / u.prompt_seconds if u.prompt_seconds > 0 else 0.0
    gtps = (u.completion_tokens - 1) / u.generation_seconds if u.generation_seconds > 0 else 0.0
    return (
        f"[prompt: {u.prompt_tokens} tokens ({u.cached_tokens} cached, {new} prefilled, {ptps:.1f} tokens-per-sec); "
        f"generation: {u.completion_tokens} tokens, {gtps:.1f} tokens-per-sec]"
    )


def main(argv=None) -> int:
    """`hebrus-mlx chat`; typed errors propagate to `cli.run` (one line, exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args)
    check_shared_flags(args, parser, "chat", also_used={"system_prompt"})
    if args.seed is not None:
        import mlx.core as mx

        mx.random.seed(args.seed)
    model, tok = load_from_args(args)
    if tok.chat_template is None:
        raise UsageError("--model", f"model {args.model!r} has no chat template")

    sampler = make_sampler(temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)
    cache = PromptCache(args.prompt_cache_bytes)
    if args.prompt_cache_dir is not None:  # earlier sessions' prefixes (e.g. a long system prompt)
        from ..prompt_cache_disk import DiskPromptCache

        cache.disk = DiskPromptCache(args.prompt_cache_dir, args.prompt_cache_dir_bytes, model)
        import atexit

        atexit.register(cache.disk.flush, 60)  # the writer thread publishes the last turn's snapshots
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
    messages = list(system)
    limit = context_limit(model)
    print(f"[INFO] Chatting with {args.model}. {HELP}", flush=True)
    while True:
        try:
            line = input(">> ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: a clean exit
            print()
            return 0
        text = line.strip()
        word, _, rest = text.partition(" ")
        if text.startswith("//"):  # the escape for a message that starts with "/"
            line = line.lstrip()[1:]
        elif word in COMMANDS and rest.strip():
            print(f"[ERROR] {word} takes no arguments. {HELP}", flush=True)
            continue
        elif word in ("/exit", "q"):
            return 0
        elif word == "/help":
            print(HELP)
            continue
        elif word == "/reset":
            messages = list(system)
            print("[INFO] conversation cleared")
            continue
        elif word.startswith("/"):  # never sent to the model as text
            print(f"[ERROR] unknown command {word}. {HELP}", flush=True)
            continue
        if not text:
            continue
        turn = messages + [{"role": "user", "content": line}]
        try:
            ids = tok.apply_chat_template(turn)
            max_tokens = args.max_tokens if limit is None else min(args.max_tokens, limit - len(ids))
            if max_tokens < 1:
                raise GenerationError(f"the conversation has {len(ids)} tokens, the context is {limit}; /reset")
            usage, reply = Usage(0, 0), ""
            for r in stream_with_cache(
                model,
                tok,
                ids,
                cache,
                max_tokens,
                sampler=sampler,
                prefill_step_size=args.prefill_step_size,
                usage=usage,
                draft_model=args.draft_model,
                num_draft_tokens=args.num_draft_tokens,
            ):
                print(r.text, end="", flush=True)
                reply += r.text
            print()
        except StreamError as e:
            print(f"[ERROR] {type(e).__name__}: {e}", flush=True)
            continue
        except PROMPT_ERRORS as e:
            print(f"[ERROR] {e}", flush=True)
            continue
        messages = turn + [{"role": "assistant", "content": reply}]
        if args.verbose:
            print(_stats(usage), flush=True)


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("chat", main))
