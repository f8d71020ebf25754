"""`hebrus-mlx VERB ...`: one verb per module, each with its own main(); `run` is the one place a
typed error becomes the user's one line (exit 2)."""

import importlib
import os
import sys
import traceback

from . import __version__
from .errors import HebrusError

VERBS = {
    "generate": "hebrus_mlx.commands.generate",
    "convert": "hebrus_mlx.commands.convert",
    "admit": "hebrus_mlx.commands.admit",
    "verify": "hebrus_mlx.commands.verify",
    "upgrade": "hebrus_mlx.commands.upgrade",
    "server": "hebrus_mlx.commands.server",
    "chat": "hebrus_mlx.commands.chat",
    "cache-prompt": "hebrus_mlx.commands.cache_prompt",
    "traces": "hebrus_mlx.commands.traces",
    "qualify": "hebrus_mlx.commands.qualify",
    "bench": "hebrus_mlx.commands.bench",
    "simulate": "hebrus_mlx.commands.simulate",
    "perplexity": "hebrus_mlx.commands.perplexity",
}

# Other names of a verb: the ones mlx-lm users type (`mlx_lm.cache_prompt`).
ALIASES = {"cache_prompt": "cache-prompt"}

SUMMARY = {  # one line per verb for `hebrus-mlx --help`; each verb's own --help has the flags
    "generate": "generate text from a prompt (like mlx_lm.generate)",
    "convert": "convert a Hugging Face checkpoint into a hebrus-mlx artifact",
    "admit": "check an artifact's manifest, config and stores without loading it (no MLX)",
    "verify": "verify every digest of an artifact",
    "upgrade": "give an older artifact the fast per-read check tables (replaced atomically)",
    "server": "OpenAI-compatible HTTP server (like mlx_lm.server)",
    "chat": "interactive chat in the terminal (like mlx_lm.chat)",
    "cache-prompt": "prefill a prompt once and save its state for generate --prompt-cache-file (alias cache_prompt)",
    "traces": "replay, export and evaluate expert-route traces",
    "qualify": "check kernels and I/O on this machine; write the profile load() reads (--report FILE)",
    "bench": "measure this model on this machine and recommend settings",
    "simulate": "project decode speed on a machine that is not this one",
    "perplexity": "perplexity of a model on a text (like mlx_lm.perplexity), resident or streamed",
}


def usage() -> str:
    width = max(map(len, VERBS))
    lines = [
        f"usage: hebrus-mlx {{{','.join(VERBS)}}} [args...]",
        "",
        "MLX-native runtime for Qwen4Exp with SSD-streamed experts.",
        "",
        "commands:",
    ]
    lines += [f"  {verb:<{width}}  {SUMMARY[verb]}" for verb in VERBS]
    lines += ["", "`hebrus-mlx VERB --help` lists a command's flags; `hebrus-mlx --version` prints the version."]
    return "\n".join(lines)


# HEBRUS_TRACEBACK=1 also prints the traceback of a typed error (for debugging; bugs always show it).
TRACEBACK_ENV = "HEBRUS_TRACEBACK"


def _typed():
    # stream.errors imports only `re`: the admit verb stays free of MLX (AFN-004).
    from .stream.errors import StreamError

    return (HebrusError, StreamError, OSError)


def describe(e: BaseException) -> str:
    """``field: message`` on one line: the field a HebrusError names; a streaming failure's typed
    class (its message names the store and record); an OS error's file."""
    if isinstance(e, HebrusError):
        text = f"{e.field}: {e.message}"
        stage = getattr(e, "stage", None)
        if stage is not None:
            text += f" (admission stage {stage})"
    elif isinstance(e, OSError) and e.filename is not None:
        text = f"{e.filename}: {e.strerror or e}"
    else:
        text = f"{type(e).__name__}: {e}"
    return " ".join(text.split())


def run(verb: str, main, argv=None) -> int:
    """main(argv) of one verb; a typed error ends as ``hebrus-mlx VERB: error: FIELD: MESSAGE`` on
    stderr and exit 2. Ctrl-C ends the verb quietly with 130 (atomic publishers drop their
    temporaries on the way out). Any other exception is a bug and propagates with its traceback."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # past the ^C echo
        return 130
    except _typed() as e:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            traceback.print_exc()
        print(f"hebrus-mlx {verb}: error: {describe(e)}", file=sys.stderr)
        return 2


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"hebrus-mlx {__version__}")
        return 0
    verb, rest = ALIASES.get(argv[0], argv[0]), argv[1:]
    if verb not in VERBS:
        print(f"hebrus-mlx: unknown command {verb!r}; choose from {', '.join(VERBS)}", file=sys.stderr)
        return 2
    return run(verb, importlib.import_module(VERBS[verb]).main, rest)


if __name__ == "__main__":
    sys.exit(main())
