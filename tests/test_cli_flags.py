"""Issue 22 §4: every numeric flag of every verb refuses NaN, infinities, negatives and huge values
in one line naming the flag (exit 2) before any work; Ctrl-C in `hebrus-mlx chat` is a clean exit.

The named cases (`--seed -1`, `--seed 2**70`, `--expert-cache-gb 1e300`, `--temp inf`) run as real
CLI subprocesses; the class is checked over every parser: no bare int/float flag is left, and each
typed flag, given each hostile value, either names itself in a UsageError or parses within its
declared bounds.
"""

import importlib
import io
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from hebrus_mlx.cli import main
from hebrus_mlx.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ["nan", "NaN", "inf", "-inf", "-1", "-0.5", "1e300", "-1e300", str(2**70), "-" + str(2**70), "x", ""]
# verb -> (module, argv prefix needed to reach the flags: required args, sub-command)
PARSERS = {
    "generate": ("hebrus_mlx.commands.verb_flags", []),
    "server": ("hebrus_mlx.commands.server", []),
    "chat": ("hebrus_mlx.commands.chat", []),
    "convert": ("hebrus_mlx.commands.convert", ["--hf-path", "h", "--out", "o"]),
    "qualify": ("hebrus_mlx.commands.qualify", []),
    "bench": ("hebrus_mlx.commands.bench", []),
    "simulate": ("hebrus_mlx.commands.simulate", []),
    "traces replay": ("hebrus_mlx.commands.traces", ["replay", "d"]),
    "traces export": ("hebrus_mlx.commands.traces", ["export", "d", "--out", "o"]),
    "traces eval": ("hebrus_mlx.commands.traces", ["eval", "d"]),
}


def _parser_and_actions(verb):
    module, prefix = PARSERS[verb]
    parser = importlib.import_module(module).build_parser()
    actions = parser._actions
    if verb.startswith("traces "):
        sub = next(a for a in parser._actions if a.dest == "cmd").choices[verb.split()[1]]
        actions = sub._actions
    return parser, prefix, [a for a in actions if a.option_strings and a.nargs is None and a.const is None]


def _numeric(action):
    return getattr(action.type, "bounds", None) is not None


@pytest.mark.parametrize("verb", sorted(PARSERS))
def test_no_numeric_flag_is_a_bare_int_or_float(verb):
    _, _, actions = _parser_and_actions(verb)
    bare = [a.option_strings[0] for a in actions if a.type in (int, float)]
    assert bare == [], f"{verb}: {bare} take int/float without range checks (use hebrus_mlx.flags)"


@pytest.mark.parametrize("verb", sorted(PARSERS))
def test_every_numeric_flag_refuses_hostile_values_naming_itself(verb):
    parser, prefix, actions = _parser_and_actions(verb)
    numeric = [a for a in actions if _numeric(a)]
    assert numeric, verb
    for a in numeric:
        flag = a.option_strings[0] if a.option_strings[0].startswith("--") else a.option_strings[-1]
        lo, hi = a.type.bounds
        for v in HOSTILE:
            try:
                got = getattr(parser.parse_args(prefix + [flag, v]), a.dest)
            except UsageError as e:
                assert e.field in a.option_strings, (verb, flag, v, e)
                continue
            assert math.isfinite(got), (verb, flag, v, got)
            assert (lo is None or got >= lo) and (hi is None or got <= hi), (verb, flag, v, got)


def _cli(*argv, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--seed", "-1"),
        ("--seed", str(2**70)),
        ("--expert-cache-gb", "1e300"),
        ("--temp", "inf"),
        ("--num-draft-tokens", "100000000000"),
    ],
)
def test_named_cases_are_one_line_naming_the_flag(flag, value):
    """Today: tracebacks (seed, cache), exit 0 with empty text (temp inf), a hang (draft tokens)."""
    r = _cli("generate", "-p", "hi", "-m", "2", "--verbose", "false", "--draft-model", "ngram", flag, value)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith(f"hebrus-mlx generate: error: {flag}: ") and r.stderr.count("\n") == 1, r.stderr


def test_cache_sizes_are_bounded_in_the_api_too():
    """bench --ab expert-cache-gb=1e300 reaches the loader, not the flag: refused there too."""
    from hebrus_mlx.loader import DEMO_DIR, load_model

    for bad in (1e300, float("inf"), float("nan"), -1.0):
        with pytest.raises(UsageError) as e:
            load_model(DEMO_DIR, expert_cache_gb=bad)
        assert e.value.field == "expert_cache_gb", e.value


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["traces", "export", "d", "--out", "o", "--fractions", "nan,0.5,0.5"], "--fractions"),
        (["traces", "export", "d", "--out", "o", "--fractions", "inf,-inf,1"], "--fractions"),
        (["traces", "eval", "d", "--budgets", str(2**70)], "--budgets"),
        (["traces", "eval", "d", "--cache-sizes", "nan"], "--cache-sizes"),
        (["simulate", "--cache-gb", "nan"], "--cache-gb"),
        (["simulate", "--cache-gb", "1e300"], "--cache-gb"),
        (["simulate", "--draft-depths", "-1"], "--draft-depths"),
        (["bench", "--prompt-tokens", str(2**70)], "--prompt-tokens"),
        (["bench", "--gen-tokens", "nan"], "--gen-tokens"),
        (["qualify", "--report-cache-gb", "nan,4"], "--report-cache-gb"),
        (["qualify", "--report-cache-gb", "4,inf"], "--report-cache-gb"),
    ],
)
def test_numeric_lists_refuse_hostile_items(argv, flag):
    rc, out, err = _run(argv)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (rc, out, err)
    assert f": error: {flag}: " in err, err


# The chat as a terminal starts it: SIGINT at its default disposition. A process started with
# SIGINT ignored (a runner that launched the suite as a background job of a non-interactive shell)
# passes SIG_IGN on through exec, and Python then never installs its KeyboardInterrupt handler: the
# signal is dropped and the reply runs to its end. The wrapper resets it before exec'ing the chat.
_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, sys.argv[1:])"
)


def _sigint_ignored(pid) -> bool | None:
    """Whether `pid` ignores SIGINT (its SigIgn mask in /proc), or None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line for line in f if line.startswith("SigIgn:"))
    except OSError:
        return None
    return bool(int(mask.split()[1], 16) >> (signal.SIGINT - 1) & 1)


def _chat_proc():
    chat = [sys.executable, "-m", "hebrus_mlx.cli", "chat", "--max-tokens", "2000", "--verbose", "false"]
    p = subprocess.Popen(
        [sys.executable, "-c", _DEFAULT_SIGINT, *chat],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    line = p.stdout.readline()
    assert line.startswith(b"[INFO] Chatting"), (line, p.stderr.read() if p.poll() is not None else b"")
    assert _sigint_ignored(p.pid) in (False, None)
    return p


def _read_until(stream, needle, timeout=60):
    os.set_blocking(stream.fileno(), False)
    seen, deadline = b"", time.monotonic() + timeout
    while needle not in seen:
        assert time.monotonic() < deadline, seen
        chunk = stream.read()
        seen += chunk or b""
        time.sleep(0.02)
    return seen


def test_ctrl_c_in_chat_is_a_clean_exit():
    """At the prompt: exit 0; during a reply: exit 130. Neither prints a traceback."""
    p = _chat_proc()
    _read_until(p.stdout, b">> ")
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0 and b"Traceback" not in err and b"KeyboardInterrupt" not in err, err
    p = _chat_proc()
    # A long message: its prefill takes seconds (3,810 tokens, ~9 s here), so a signal sent just after
    # the chat has read it lands inside the reply whatever the model would answer (a short greedy
    # reply once ended before the signal and the chat was back at its prompt: exit 0).
    p.stdin.write(b"Tell me about the lighthouse keeper and the storm. " * 200 + b"\n")
    p.stdin.flush()
    _read_until(p.stdout, b">> ")
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and b"Traceback" not in err and b"KeyboardInterrupt" not in err, (err, out)
    assert b">> " not in out, out  # it never went back to the prompt


def test_help_lists_each_verb_with_one_line(capsys):
    """`hebrus-mlx --help`: every verb once, each with its one-line summary; no args is a usage error."""
    from hebrus_mlx import cli

    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split(None, 1) for line in out if line.startswith("  ")]
    assert [r[0] for r in rows] == list(cli.VERBS) and all(len(r) == 2 and r[1].strip() for r in rows)
    assert cli.main([]) == 2 and "commands:" in capsys.readouterr().err


def test_version_prints_the_package_version(capsys):
    import hebrus_mlx
    from hebrus_mlx import cli

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hebrus-mlx {hebrus_mlx.__version__}"
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'\nversion = "{hebrus_mlx.__version__}"\n' in pyproject  # the one the package is built with


class _Captured(Exception):
    pass


def _mlx_lm_server_options(monkeypatch):
    """mlx_lm.server builds its parser inside main(): catch it at parse_args."""
    import argparse

    import mlx_lm.server

    def capture(self, *a, **k):
        raise _Captured(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Captured) as e:
        mlx_lm.server.main()
    monkeypatch.undo()
    return [o for a in e.value.args[0]._actions for o in a.option_strings if o.startswith("--")]


def test_every_mlx_lm_flag_is_taken_or_refused_with_a_reason(monkeypatch):
    """An mlx-lm user's flag is never 'unrecognized': every option of the installed mlx_lm.generate
    and mlx_lm.server parsers is one hebrus-mlx takes, or one it refuses in one line with a reason."""
    from mlx_lm.generate import setup_arg_parser

    from hebrus_mlx.commands.cli_args import MLX_LM_REFUSED, MLX_LM_SERVER_REFUSED

    refused = {**MLX_LM_REFUSED, **MLX_LM_SERVER_REFUSED}
    for verb, options in (
        ("generate", [o for a in setup_arg_parser()._actions for o in a.option_strings if o.startswith("--")]),
        ("server", _mlx_lm_server_options(monkeypatch)),
    ):
        ours = importlib.import_module(PARSERS[verb][0]).build_parser()
        known = set(ours._option_string_actions)
        assert [o for o in options if o not in known] == [], verb
        for flag in (o for o in options if o in refused):
            takes_value, reason = refused[flag]
            buf = io.StringIO()
            with redirect_stderr(buf):
                assert main([verb, flag, *(["4"] if takes_value else [])]) == 2
            assert buf.getvalue() == f"hebrus-mlx {verb}: error: {flag}: {reason}\n"


def test_a_mistyped_flag_names_the_closest_one():
    buf = io.StringIO()
    with redirect_stderr(buf):
        assert main(["generate", "--max-tokes", "5"]) == 2
    assert (
        buf.getvalue() == "hebrus-mlx generate: error: --max-tokes: unrecognized argument; did you mean --max-tokens?\n"
    )


def test_sampling_flags_show_their_defaults_in_help():
    text = importlib.import_module("hebrus_mlx.commands.verb_flags").build_parser().format_help()
    text = " ".join(text.split())
    for flag, default in (("--temp", "0.0"), ("--top-p", "1.0"), ("--top-k", "0"), ("--min-p", "0.0")):
        start = text.index(f"{flag} {flag[2:].upper().replace('-', '_')} ")
        assert f"(default {default}" in text[start : start + 120], flag


def test_mlx_lm_spellings_of_convert_and_bench():
    """What an mlx-lm user types: convert's --model / --mlx-path / -q name our source, output and
    (default) quantization; bench's short flags mean what they mean to the installed
    mlx_lm.benchmark (-n trials, -g generated tokens, -p prompt tokens)."""
    from mlx_lm.benchmark import setup_arg_parser

    convert = importlib.import_module("hebrus_mlx.commands.convert").build_parser()
    a = convert.parse_args(["--model", "h", "--mlx-path", "o", "-q"])
    assert (a.hf_path, a.out, a.quantize) == ("h", "o", True)
    buf = io.StringIO()
    with redirect_stderr(buf):
        assert main(["convert", "--model", "/nonexistent", "--mlx-path", "o", "-q", "--dtype", "float32"]) == 2
    assert buf.getvalue().startswith("hebrus-mlx convert: error: --quantize: contradicts --dtype float32")

    theirs = {o: a.dest for a in setup_arg_parser()._actions for o in a.option_strings}
    ours = importlib.import_module("hebrus_mlx.commands.bench").build_parser()
    meaning = {"num_trials": "repeats", "generation_tokens": "gen_tokens", "prompt_tokens": "prompt_tokens"}
    for short in ("-n", "-g", "-p"):
        assert ours._option_string_actions[short].dest == meaning[theirs[short]], short
        long = next(o for o, d in theirs.items() if d == theirs[short] and o.startswith("--"))
        assert ours._option_string_actions[long].dest == meaning[theirs[short]], long
