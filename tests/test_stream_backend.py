"""Tests for the read-backend option of hebrus_mlx/stream/engine.py
(EngineOptions::backend in metal_ext/engine.cpp, io_mtlio.h).

Provenance: every expected byte string is sliced from the store file the test
writes from a seeded RNG (contract control); the pure-Python ReferenceEngine
(os.preadv + hashlib) is an independent cross-check of the bytes the C++
engine publishes. No fixture is produced by the code under test.
"""

import hashlib
import os
import sys

import pytest
from support.fault_injection import FaultyEngine
from support.stream_store import REC, random_store

from hebrus_mlx import kernels
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream.errors import ShortReadError, StreamRequestError
from hebrus_mlx.testing.stream_reference import ReferenceEngine

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")

PARTS = [4096, 1024, 3072]  # arena parts of one REC-byte record


@pytest.fixture
def store(tmp_path):
    return random_store(tmp_path, 8, seed=606, tail=100)


def os_threads():
    """Threads of this process as the OS sees them (the engine's workers
    are std::threads, invisible to the threading module)."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None


def read_all(eng, store_id, arena, data):
    """(slab reads, arena reads) of every record, digest-verified."""
    slab, rows = [], []
    for i in range(8):
        off = i * REC
        dig = hashlib.sha256(data[off : off + REC]).digest()
        t = eng.request(store_id, off, REC, digest=dig)
        slab.append(eng.read(t))
        eng.release(t)
        t = eng.request(store_id, off, REC, digest=dig, arena=arena)
        rows.append(eng.read(t))
        eng.release(t)
    return slab, rows


def test_default_backend_is_pread():
    """AFN-013: the unverified MTLIO path is never the default; an engine
    built without naming a backend reads with pread on every platform."""
    eng = se.StreamEngine(cache_bytes=4 * REC)
    assert eng.backend == "pread"
    assert "backend='pread'" in repr(eng)
    eng.close()


def test_backends_of_this_build():
    """AFN-013: compiled backends are reported, pread first (the default);
    MTLIO can only be compiled on macOS (contract control: sys.platform)."""
    names = se.backends()
    assert names[0] == "pread"
    assert set(names) <= {"pread", "mtlio"}
    if sys.platform != "darwin":
        assert names == ["pread"]


@pytest.mark.skipif("mtlio" in se.backends(), reason="MTLIO compiled into this build")
def test_mtlio_refused_here_before_any_thread(store):
    """AFN-013 fail-closed: asking for "mtlio" where it is not compiled is a
    typed request error naming `backend`, raised at construction before any
    worker thread exists; a pread engine built next reads bytes identical to
    the file and to the Python reference (AFN-019 publication path)."""
    path, data = store
    before = os_threads()
    with pytest.raises(StreamRequestError, match=r"^backend: 'mtlio' is not compiled") as e:
        se.StreamEngine(cache_bytes=16 * REC, threads=3, backend="mtlio")
    assert "pread" in str(e.value)  # says what is available
    assert os_threads() == before

    eng = se.StreamEngine(cache_bytes=16 * REC, threads=3, backend="pread")
    sid = eng.add_store(path)
    arena, _ = eng.create_arena(PARTS, rows=4)
    slab, rows = read_all(eng, sid, arena, data)
    ref = ReferenceEngine()
    rsid = ref.add_store(path)
    for i in range(8):
        want = data[i * REC : (i + 1) * REC]
        t = ref.request(rsid, i * REC, REC)
        assert ref.read(t) == want
        assert slab[i] == want and rows[i] == want
    ref.close()
    mem = eng.memory()
    assert mem["pinned_slots"] == 0 and mem["tickets"] == 0
    eng.close()


@pytest.mark.parametrize("name", ["gpu", "", "PREAD", "mtlio "])
def test_unknown_backend_rejected(name):
    """AFN-013: no alias or near-miss spelling selects a backend; the error
    names the field and nothing starts (no worker threads)."""
    before = os_threads()
    with pytest.raises(StreamRequestError, match=r"^backend: expected 'pread' or 'mtlio'"):
        se.StreamEngine(cache_bytes=4 * REC, threads=2, backend=name)
    assert os_threads() == before


def test_pread_fault_path_unchanged(store):
    """AFN-019: with the byte-moving step factored out, a short arena read
    still fails typed, publishes nothing, and the next read succeeds."""
    path, data = store
    eng = FaultyEngine(cache_bytes=8 * REC, threads=2, backend="pread")
    sid = eng.add_store(path)
    arena, _ = eng.create_arena(PARTS, rows=2)
    eng.inject_fault("short_read")
    t = eng.request(sid, REC, REC, arena=arena)
    with pytest.raises(ShortReadError):
        eng.read(t)
    eng.release(t)
    t = eng.request(sid, REC, REC, arena=arena)
    assert eng.read(t) == data[REC : 2 * REC]
    eng.release(t)
    assert eng.memory()["arena_rows"] == 1
    eng.close()


@pytest.mark.metal
@pytest.mark.skipif("mtlio" not in se.backends(), reason="MTLIO not compiled (macOS Metal only)")
@pytest.mark.skipif(
    not kernels.metal_available(), reason="no Metal device (MTLIO reads through one; the hosted macOS job has none)"
)
def test_mtlio_matches_pread_where_compiled(store):
    """AFN-013 private seam, AFN-019 publication: on a Metal build, an
    explicitly chosen MTLIO engine publishes arena rows byte-identical to the
    file and to a pread engine, and a record past EOF is a short read.
    Never run on the Linux machine this was written on (unverified)."""
    path, data = store
    try:
        eng = se.StreamEngine(cache_bytes=16 * REC, threads=2, backend="mtlio")
    except StreamRequestError as e:  # compiled, but no device / IO queue
        pytest.skip(str(e))
    ctl = se.StreamEngine(cache_bytes=16 * REC, threads=2, backend="pread")
    results = []
    for e in (eng, ctl):
        sid = e.add_store(path)
        arena, _ = e.create_arena(PARTS, rows=4)
        results.append(read_all(e, sid, arena, data))
    want = [data[i * REC : (i + 1) * REC] for i in range(8)]
    assert results[0] == (want, want)
    assert results[0] == results[1]
    sid = eng.add_store(path)
    arena, _ = eng.create_arena(PARTS, rows=1)
    t = eng.request(sid, 8 * REC, REC, arena=arena)  # only 100 bytes exist
    with pytest.raises(ShortReadError):
        eng.read(t)
    eng.release(t)
    eng.close()
    ctl.close()
