"""Child `hebrus-mlx` processes for tests and benchmarks: one argv builder and one environment
builder, so every caller starts the CLI the same way (its checkout first on PYTHONPATH), and the
rows of the tables of bad flags that the CLI must refuse in one line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli_argv(verb: str, *args: str) -> list[str]:
    """`python -m hebrus_mlx.cli VERB ARGS...` with this interpreter."""
    return [sys.executable, "-m", "hebrus_mlx.cli", verb, *args]


def flag_cases(*cases: tuple) -> list[tuple[list[str], str]]:
    """(argv, field) rows for a bad-input table: each case (FLAG, VALUE) is the argv [FLAG, VALUE] whose
    error must name FLAG; a case (FLAG, VALUE, FIELD) names FIELD instead (a short flag's long name)."""
    return [([flag, value], named[0] if named else flag) for flag, value, *named in cases]


def server_argv(*extra: str, model: str = "demo", log_level: str = "WARNING") -> list[str]:
    """`hebrus-mlx server` on a free port (it prints `listening on HOST:PORT`), then `extra`."""
    return cli_argv("server", "--model", model, "--port", "0", "--log-level", log_level, *extra)


def child_env(root: str | Path = ROOT, **extra: str) -> dict[str, str]:
    """os.environ with `root` first on PYTHONPATH (so its tree wins), plus `extra`."""
    path = str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=path, **extra)
