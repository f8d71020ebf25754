"""mx.clear_cache() with a streamed step in flight returns (the deadlock found in issue 26 §4).

MLX's clear_cache and set_cache_limit synchronize every CPU stream while holding the GIL. The
extension's graph ops and their CPU-stream tasks hold shared_ptr<Engine> / shared_ptr<SweepRing>;
while those were made by nanobind per call from the Python object, dropping the last one (the task,
on the MLX stream thread, once it ran) took the GIL in nanobind's deleter: the stream thread waited
for the GIL, the GIL holder for the stream. They now share the object's C++ owner (make_shared in
the bindings), so no stream thread needs the GIL.

Each case runs tests/support/clear_cache_script.py in a child with a timeout: a hang fails the test with
the stage it hung in. The oracle for tokens and logits is the resident demo (experts in memory, no
engine), greedy, so streamed output must be identical."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hebrus_mlx.stream import engine as se

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "support" / "clear_cache_script.py"


def _run(stages, timeout):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(
            [sys.executable, str(SCRIPT), *stages], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        started = [line.split()[1] for line in out.splitlines() if line.startswith("stage ")]
        pytest.fail(f"hung (no exit in {timeout} s) in stage {started[-1] if started else '(start-up)'}:\n{out}")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [line for line in p.stdout.splitlines() if line.startswith("done ")] == [f"done {s}" for s in stages]


def test_engine_op_in_flight_clear_cache_and_set_cache_limit_return():
    """Deterministic: the op's read is held 300 ms, so its CPU task is running when clear_cache
    synchronizes (before the fix this hung every time)."""
    _run(["engine"], timeout=120)


def test_streamed_demo_forward_sweep_mlx_lm_and_hebrus_loop_with_clear_cache():
    """The issue's repro (forward, async_eval, clear_cache), the prefill ring's ops, mlx_lm's
    stream_generate (clear_cache with its next step queued) and hebrus's loop with
    CLEAR_CACHE_EVERY=1; logits and 20 greedy tokens equal to the resident run's."""
    _run(["forward", "sweep", "mlx_lm", "loop"], timeout=400)
