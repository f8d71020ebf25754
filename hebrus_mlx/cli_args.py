"""Command-line pieces every verb shares: a parser whose errors are typed (one line, exit 2 at
`cli.run`), the boolean flag type and the streaming flags (--expert/--ple-cache-gb, --prefetch*,
--prefill-sweep) with their conversion into what the loader takes. generate's model, cache and sampling flags, their checks and
the loader they feed are `generate.build_parser`, `generate.check_args` and `generate.load_from_args`
(chat and server reuse them)."""

import argparse

from . import flags
from .errors import UsageError
from .flags import Parser

__all__ = [
    "ArgumentParser",
    "str2bool",
    "add_stream_cache_arguments",
    "add_prefetch_argument",
    "prefetch_from_args",
    "add_sweep_argument",
    "sweep_from_args",
    "read_prompt",
    "MAX_STDIN_PROMPT_BYTES",
    "LOAD_FLAGS",
]

# `-p -` reads at most this much: a 1M-token context is ~4 MB of text; past it the prompt is
# refused without reading on (a stream that never ends must not fill memory).
MAX_STDIN_PROMPT_BYTES = 16 << 20

# generate's flags that name the model and say how it is loaded, streamed and prefilled: shared by the
# verbs that load a model the way generate does (chat and server: verb_flags.USED; cache-prompt).
LOAD_FLAGS = frozenset(
    {
        "model",
        "prefill_step_size",
        "max_kv_size",
        "expert_cache_gb",
        "ple_cache_gb",
        "prefetch",
        "prefetch_budget",
        "prefetch_threshold",
        "expert_mirror",
        "prefill_sweep",
    }
)


class ArgumentParser(Parser):
    """argparse whose usage errors raise a UsageError naming the flag (flags.Parser) instead of
    exiting; numeric flags take their types from `hebrus_mlx.flags`."""


def str2bool(s: str) -> bool:
    """``--verbose true|false`` (also t/f, 1/0, yes/no)."""
    if s.lower() in ("true", "t", "1", "yes"):
        return True
    if s.lower() in ("false", "f", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def add_stream_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """``--expert-cache-gb`` and ``--ple-cache-gb`` (generate and the verbs that share its flags,
    perplexity): the sizes of the caches the two streamed stores go through."""
    for store, what in (("expert", "routed experts"), ("ple", "PLE table pages")):
        parser.add_argument(
            f"--{store}-cache-gb",
            type=flags.gib(),
            default=None,
            help=f"stream {what} through a cache of this many GiB (default: decide from free memory)",
        )


def add_prefetch_argument(parser: argparse.ArgumentParser) -> None:
    """``--prefetch`` (+ ``--prefetch-budget``, ``--prefetch-threshold``) for generate/server/bench;
    turn the parsed namespace into a spec with :func:`prefetch_from_args`."""
    from .stream.predict import DEFAULT as PREFETCH_DEFAULT  # streaming (MLX) only once a parser is built

    parser.add_argument(
        "--prefetch",
        default=None,
        help="streamed-expert read-ahead: off | previous | router-reuse[:1|2] | hyper-reuse "
        f"(default {PREFETCH_DEFAULT})",
    )
    parser.add_argument(
        "--prefetch-budget",
        type=flags.integer(1),
        default=None,
        help="predicted experts per layer, most probable first (default: the model's top-k)",
    )
    parser.add_argument(
        "--prefetch-threshold",
        type=flags.number(0, 1, hi_open=True),
        default=0.0,
        help="skip predicted experts whose router probability is below this",
    )


def prefetch_from_args(args):
    """The stream.predict.PrefetchSpec the flags name; None when none was given (the loader's default)."""
    from .stream.predict import DEFAULT as PREFETCH_DEFAULT
    from .stream.predict import parse_prefetch

    if args.prefetch is None and args.prefetch_budget is None and not args.prefetch_threshold:
        return None
    try:
        return parse_prefetch(args.prefetch or PREFETCH_DEFAULT, args.prefetch_budget, args.prefetch_threshold)
    except UsageError as e:
        raise UsageError("--" + e.field, e.message) from None


def add_sweep_argument(parser: argparse.ArgumentParser) -> None:
    """``--prefill-sweep`` for generate/server/chat/bench (wherever ``--prefetch`` is)."""
    from .stream.sweep import DEFAULT as SWEEP_DEFAULT

    parser.add_argument(
        "--prefill-sweep",
        default=None,
        metavar="auto|on|off",
        help="read a layer's whole expert extent for long prefill chunks (streamed experts): "
        f"auto switches at the measured crossover (default {SWEEP_DEFAULT})",
    )


def sweep_from_args(args):
    """The mode the flag names; None when not given (the loader's default)."""
    from .stream.sweep import parse_mode

    value = getattr(args, "prefill_sweep", None)
    if value is None:
        return None
    try:
        return parse_mode(value)
    except UsageError as e:
        raise UsageError("--prefill-sweep", e.message) from None


def read_prompt(value: str) -> str:
    """The text of `--prompt`: the argument, or stdin for ``-`` (at most MAX_STDIN_PROMPT_BYTES).
    Either must be valid UTF-8: undecodable argv bytes arrive as lone surrogates, which the
    tokenizer cannot encode."""
    if value != "-":
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UsageError("--prompt", f"not valid UTF-8 text (undecodable byte at character {e.start})") from None
        return value
    import sys

    data = sys.stdin.buffer.read(MAX_STDIN_PROMPT_BYTES + 1)
    if len(data) > MAX_STDIN_PROMPT_BYTES:
        raise UsageError(
            "--prompt", f"stdin holds more than {MAX_STDIN_PROMPT_BYTES >> 20} MiB (cli_args.MAX_STDIN_PROMPT_BYTES)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError("--prompt", f"stdin is not UTF-8 ({e.reason} at byte {e.start})") from None
