"""Command-line pieces every verb shares: a parser whose errors are typed (one line, exit 2 at
`cli.run`), the boolean flag type and the streaming flags (--expert/--ple-cache-gb, --prefetch*,
--prefill-sweep, --graph) with their conversion into what the loader takes, the flags several verbs
add alike (--overwrite, --pipeline-split/--pipeline-timeout), and mlx-lm's flags that are refused with
a reason (MLX_LM_REFUSED). generate's model, cache and sampling flags, their checks and the loader
they feed are verb_flags.py's `build_parser`, `check_args` and `load_from_args` (chat and server
reuse them). MLX-free: `admit` and `verify` parse with it."""

import argparse
import difflib
import re

from .. import flags
from ..errors import KV_QUANT_UNSUPPORTED, UsageError

__all__ = [
    "ArgumentParser",
    "str2bool",
    "add_stream_cache_arguments",
    "add_prefetch_argument",
    "prefetch_from_args",
    "add_sweep_argument",
    "add_overwrite_argument",
    "add_pipeline_arguments",
    "check_pipeline_timeout",
    "graph_options_from_args",
    "sweep_from_args",
    "read_prompt",
    "MAX_STDIN_PROMPT_BYTES",
    "LOAD_FLAGS",
    "MLX_LM_REFUSED",
    "MLX_LM_SERVER_REFUSED",
    "add_refused_arguments",
    "refuse_mlx_lm_flags",
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

_KV_QUANT = KV_QUANT_UNSUPPORTED
_TEMPLATE = "not supported: the model's own chat template is used (--ignore-chat-template for plain text)"

# mlx-lm's flags that hebrus-mlx does not take, each with its reason: parsed, then refused in one
# line, so an mlx-lm user hears why instead of "unrecognized arguments". flag -> (takes a value, reason).
MLX_LM_REFUSED = {
    "--kv-bits": (True, _KV_QUANT),
    "--kv-group-size": (True, _KV_QUANT),
    "--quantized-kv-start": (True, _KV_QUANT),
    "--adapter-path": (
        True,
        "LoRA adapters are not supported; fuse them into the checkpoint before `hebrus-mlx convert`",
    ),
    "--trust-remote-code": (False, "not needed: no code from the model repository is run (Qwen4Exp is built in)"),
    "--extra-eos-token": (True, "not supported: stop tokens come from the artifact's tokenizer and generation config"),
    "--image": (True, "not supported: Qwen4Exp here is text only"),
    "--prefill-response": (True, "not supported: the reply starts after the chat template's generation prompt"),
    "--use-default-chat-template": (False, _TEMPLATE),
    "--chat-template-config": (True, _TEMPLATE),
    "--quantize-activations": (False, "not supported: activations run in --dtype"),
}
# mlx_lm.server's own (the server adds them to generate's).
MLX_LM_SERVER_REFUSED = {
    "--chat-template": (True, _TEMPLATE),
    "--chat-template-args": (True, "give chat_template_kwargs (enable_thinking) in the request body"),
    "--prompt-cache-size": (True, "the prefix cache is bounded in bytes here: --prompt-cache-bytes"),
    "--pipeline": (False, "not needed: under mlx.launch the layers are split across ranks by --pipeline-split"),
}


def add_refused_arguments(parser: argparse.ArgumentParser, names) -> None:
    """Add the MLX_LM_REFUSED flags `names`; `refuse_mlx_lm_flags` refuses them once parsed."""
    for name in names:
        takes_value, reason = {**MLX_LM_REFUSED, **MLX_LM_SERVER_REFUSED}[name]
        kw = {"metavar": "X"} if takes_value else {"action": "store_true"}
        parser.add_argument(
            name, default=None if takes_value else False, help="mlx-lm's flag; refused: " + reason, **kw
        )


def refuse_mlx_lm_flags(args) -> None:
    """UsageError naming the first MLX_LM_REFUSED flag the user gave, with its reason."""
    for name, (_, reason) in {**MLX_LM_REFUSED, **MLX_LM_SERVER_REFUSED}.items():
        if getattr(args, name[2:].replace("-", "_"), None) not in (None, False):
            raise UsageError(name, reason)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors raise a UsageError naming the flag instead of exiting
    (``argument --seed: must be ...`` becomes UsageError("--seed", ...)); numeric flags take their
    types from `hebrus_mlx.flags`."""

    def error(self, message):
        m = re.match(r"argument ([^:/\s]+)(?:/\S+)?: (.*)", message, re.S)
        if m:
            raise UsageError(m.group(1), m.group(2))
        m = re.match(r"unrecognized arguments: (-\S+)", message)
        if m:
            flag = m.group(1).split("=", 1)[0]
            close = difflib.get_close_matches(flag, [o for o in self._option_string_actions if o.startswith("--")], 1)
            raise UsageError(flag, "unrecognized argument" + (f"; did you mean {close[0]}?" if close else ""))
        raise UsageError("arguments", message)


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
    from ..stream.predict import DEFAULT as PREFETCH_DEFAULT  # streaming (MLX) only once a parser is built

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
    from ..stream.predict import DEFAULT as PREFETCH_DEFAULT
    from ..stream.predict import parse_prefetch

    if args.prefetch is None and args.prefetch_budget is None and not args.prefetch_threshold:
        return None
    try:
        return parse_prefetch(args.prefetch or PREFETCH_DEFAULT, args.prefetch_budget, args.prefetch_threshold)
    except UsageError as e:
        raise UsageError("--" + e.field, e.message) from None


def graph_options_from_args(args):
    """`--graph` as a GraphOptions (None: the defaults); a bad key or value is a UsageError."""
    from ..models.options import GraphOptions

    return None if getattr(args, "graph", None) is None else GraphOptions.parse(args.graph)


def add_sweep_argument(parser: argparse.ArgumentParser) -> None:
    """``--prefill-sweep`` for generate/server/chat/bench (wherever ``--prefetch`` is)."""
    from ..stream.sweep import DEFAULT as SWEEP_DEFAULT

    parser.add_argument(
        "--prefill-sweep",
        default=None,
        metavar="auto|on|off",
        help="read a layer's whole expert extent for long prefill chunks (streamed experts): "
        f"auto switches at the measured crossover (default {SWEEP_DEFAULT})",
    )


def sweep_from_args(args):
    """The mode the flag names; None when not given (the loader's default)."""
    from ..stream.sweep import parse_mode

    value = getattr(args, "prefill_sweep", None)
    if value is None:
        return None
    try:
        return parse_mode(value)
    except UsageError as e:
        raise UsageError("--prefill-sweep", e.message) from None


def add_overwrite_argument(
    parser: argparse.ArgumentParser, outputs: str | None = None, *, help: str | None = None
) -> None:
    """``--overwrite`` of every verb that writes files (artifact.atomic.check_output_file and the
    writers refuse a file hebrus-mlx did not write without it). help: "let OUTPUTS replace a file
    hebrus-mlx did not write" unless the verb says more."""
    if help is None:
        help = f"let {outputs} replace a file hebrus-mlx did not write"
    parser.add_argument("--overwrite", action="store_true", help=help)


def add_pipeline_arguments(parser: argparse.ArgumentParser, *, state_defaults: bool = True) -> None:
    """``--pipeline-split`` and ``--pipeline-timeout`` (under mlx.launch) for generate's verbs and
    bench; check the timeout with :func:`check_pipeline_timeout`. state_defaults: the help names the
    loader's defaults (bench's does not)."""
    parser.add_argument(
        "--pipeline-split",
        default=None,
        help="under mlx.launch: layers per rank, e.g. 5,3"
        + (" (default: from each rank's free memory)" if state_defaults else ""),
    )
    parser.add_argument(
        "--pipeline-timeout",
        type=flags.seconds(),
        default=None,
        help="under mlx.launch: seconds a rank waits on another before the run ends with an error"
        + (" (default 60)" if state_defaults else ""),
    )


def check_pipeline_timeout(args) -> None:
    """A --pipeline-timeout that is not a positive, finite number of seconds is a UsageError."""
    if args.pipeline_timeout is not None and not (0 < args.pipeline_timeout < float("inf")):
        raise UsageError("--pipeline-timeout", f"must be a positive number of seconds, got {args.pipeline_timeout}")


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
