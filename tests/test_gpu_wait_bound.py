"""A host task the GPU waits on has a bounded wait per read (metal_ext/ops.h gpu_task_wait_bound):
a stalled SSD read must not hold a Metal command buffer open into macOS's GPU watchdog; past the
bound the step fails typed and rolls back like any read error. CPU-stream tasks (the default
path, all this machine runs) hold no GPU and keep waiting."""

import mlx.core as mx
import numpy as np
import pytest
from support.fault_injection import FaultyEngine
from support.stream_store import REC, random_store

from hebrus_mlx import kernels
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream.errors import StreamTimeoutError

PARTS = [4096, 4096]


@pytest.fixture
def bound():
    old = se.gpu_task_wait_bound()
    yield
    se.gpu_task_wait_bound(old)


def _table(eng, path):
    sid = eng.add_store(path)
    arena, _ = eng.create_arena(PARTS, rows=4)
    return eng.register_table(sid, [i * REC for i in range(4)], [REC] * 4, arena=arena)


def test_the_bound_is_a_setting_with_a_default(bound):
    assert se.gpu_task_wait_bound() == pytest.approx(2.0)
    assert se.gpu_task_wait_bound(0.25) == pytest.approx(0.25)
    assert se.gpu_task_wait_bound() == pytest.approx(0.25)


def test_cpu_stream_tasks_are_not_bounded(tmp_path, bound):
    """The default path: a read slower than the bound still lands (no GPU is held)."""
    path, data = random_store(tmp_path, 4, seed=7)
    se.gpu_task_wait_bound(0.05)
    eng = FaultyEngine(cache_bytes=4 * REC, threads=2)
    try:
        table = _table(eng, path)
        eng.set_read_delay_us(200_000)
        rows, lease = eng.resolve(table, mx.array([2], mx.uint32))
        out = eng.release_after(rows + 0, lease)
        mx.eval(out)
        assert eng.counters()["errors"] == 0 and eng.memory()["pinned_slots"] == 0
    finally:
        eng.close()


@pytest.mark.metal
@pytest.mark.skipif(not se.gpu_events_compiled(), reason="GPU-event path not compiled (macOS Metal builds only)")
@pytest.mark.skipif(not kernels.metal_available(), reason="no Metal device")
def test_a_stalled_read_fails_the_gpu_step_typed_and_releases_the_gpu(tmp_path, bound):
    """On a Metal device with GPU events on: a read held past the bound fails the step with a
    StreamTimeoutError (check_gpu_event_errors), no slot stays pinned, and the next step reads.
    Written without a Mac: not run here."""
    path, data = random_store(tmp_path, 4, seed=8)
    se.gpu_task_wait_bound(0.2)
    from hebrus_mlx import _ext

    _ext.set_gpu_events(True)
    eng = FaultyEngine(cache_bytes=4 * REC, threads=2)
    try:
        table = _table(eng, path)
        eng.set_read_delay_us(1_000_000)
        rows, lease = eng.resolve(table, mx.array([1], mx.uint32))
        mx.eval(eng.release_after(rows + 0, lease))
        with pytest.raises(StreamTimeoutError):
            se.check_gpu_event_errors()
        eng.set_read_delay_us(0)
        rows, lease = eng.resolve(table, mx.array([3], mx.uint32))
        mx.eval(eng.release_after(rows + 0, lease))
        se.check_gpu_event_errors()
        assert np.array(rows).size == 1 and eng.memory()["pinned_slots"] == 0
    finally:
        _ext.set_gpu_events(False)
        eng.close()
