"""Issue 22 (audit) / charter "docs/CLI.md for flags": every flag each verb's `--help` lists is
documented in docs/CLI.md, in that verb's section (server and chat share generate's model, cache
and prefetch flags, documented once under generate; so does cache-prompt), and every documented verb exists.

The flags come from the real `hebrus-mlx VERB --help` output, not from a list kept here."""

import io
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from hebrus_mlx.cli import VERBS, main

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "CLI.md").read_text()
SUBCOMMANDS = {"traces": ["replay", "export", "eval"]}
SHARES_GENERATE = {"server", "chat", "cache-prompt"}


def _help(argv):
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        try:
            main([*argv, "--help"])
        except SystemExit:
            pass
    return out.getvalue()


def _flags(text):
    """Long options of argparse's option lines (`  -m N, --max-tokens N  help...`)."""
    flags = set()
    for line in text.splitlines():
        m = re.match(r"^\s{2}(?:-\w+(?: [^,]+)?, )?(--[a-z0-9][a-z0-9-]*)", line)
        if m and m.group(1) != "--help":
            flags.add(m.group(1))
    return flags


def _section(verb):
    """The text of the docs/CLI.md sections whose heading names `hebrus-mlx VERB`."""
    parts = re.split(r"^## ", DOC, flags=re.M)
    got = [p for p in parts[1:] if re.match(rf"[^\n]*`hebrus-mlx {verb}\b", p)]
    assert got, f"docs/CLI.md has no section for hebrus-mlx {verb}"
    return "\n".join(got)


def _documented(flag, text):
    return re.search(re.escape(flag) + r"(?![a-z0-9-])", text) is not None


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_flag_of_every_verb_is_in_docs_cli(verb):
    section = _section(verb)
    shared = _section("generate") if verb in SHARES_GENERATE else ""
    texts = [_help([verb, sub]) for sub in SUBCOMMANDS.get(verb, [])] or [_help([verb])]
    flags = set().union(*map(_flags, texts))
    assert flags or verb in ("admit", "verify"), f"{verb} --help listed no flags: {texts}"
    missing = sorted(f for f in flags if not _documented(f, section) and not _documented(f, shared))
    assert not missing, f"docs/CLI.md's {verb} section lacks {missing}"


def test_every_documented_flag_exists():
    """The other direction for the verbs' own sections: no flag documented that --help lacks."""
    stale = []
    for verb in VERBS:
        section = _section(verb)
        texts = [_help([verb, sub]) for sub in SUBCOMMANDS.get(verb, [])] or [_help([verb])]
        flags = set().union(*map(_flags, texts))
        if verb in SHARES_GENERATE:
            flags |= _flags(_help(["generate"]))
        heading = section.splitlines()[0]
        for f in set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", heading)):
            if f not in flags:
                stale.append((verb, f))
    assert not stale, stale
