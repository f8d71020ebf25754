"""Child `hebrus-mlx` processes for tests and benchmarks: one argv builder and one environment
builder, so every caller starts the CLI the same way (its checkout first on PYTHONPATH), a started
server's port, and the rows of the tables of bad flags that the CLI must refuse in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
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


def start_server(log: Path, *extra: str, env: dict | None = None, **kw) -> subprocess.Popen:
    """`server_argv(*extra, **kw)` as a child (stdout piped as text, stderr into the file `log`)."""
    with open(log, "wb") as err:
        return subprocess.Popen(
            server_argv(*extra, **kw),
            cwd=ROOT,
            env=child_env() if env is None else env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )


def server_port(proc: subprocess.Popen, log: Path, timeout: float = 90) -> int:
    """The port a `start_server` child prints once listening; RuntimeError (with its log's tail) when
    it exits first or `timeout` seconds pass."""
    deadline, line = time.monotonic() + timeout, ""
    while "listening on" not in line:
        line = proc.stdout.readline()
        if (not line and proc.poll() is not None) or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start: {log.read_text()[-3000:]}")
    return int(line.rsplit(":", 1)[1])


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s; its stdout closed."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    proc.stdout.close()


def child_env(root: str | Path = ROOT, **extra: str) -> dict[str, str]:
    """os.environ with `root` first on PYTHONPATH (so its tree wins), plus `extra`."""
    path = str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=path, **extra)
