"""Tests for hebrus_mlx/stream/experts.py: a real ExpertMajor store streamed
through the engine's arena.

Provenance: weights are quantized by mx.quantize (upstream capture), written
with the artifact writer, and the resident reference reads them back through
ExpertMajorReader.read_expert (an independent read path: Python pread +
hashlib), not through the engine.
"""

import mlx.core as mx
import numpy as np
import pytest
from support import families

from hebrus_mlx.artifact import constants as C
from hebrus_mlx.artifact import expert_major as em
from hebrus_mlx.loading.plan import GIB, plan_experts
from hebrus_mlx.simulate import synthetic_stack as S
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream.experts import StreamedExperts

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")

FAM = families.QWEN4EXP_TINY_TEST
CODEC = "affine4-g64"
BITS, GROUP = 4, 64


def _u16(a):
    return np.array(a.view(mx.uint16))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    mx.random.seed(11)
    geom = em.Geometry(FAM, CODEC)
    shapes = {comp: shape for comp, part, _, shape, _, _ in geom.layout if part == "weight"}
    records = []
    for layer in range(FAM.num_hidden_layers):
        for e in range(FAM.num_experts):
            parts = {}
            for comp, (rows, packed) in shapes.items():
                w = (mx.random.normal((rows, packed * 32 // BITS)) * 0.1).astype(mx.bfloat16)
                q, s, b = mx.quantize(w, group_size=GROUP, bits=BITS)
                parts[comp] = {"weight": np.array(q), "scales": _u16(s), "biases": _u16(b)}
            records.append((layer, e, parts))
    path = str(tmp_path_factory.mktemp("experts") / "experts.hbem")
    em.publish(path, FAM, CODEC, iter(records))
    return path


def resident_layer(reader, layer):
    """Stacked [E, ...] MLX arrays of one layer via the artifact reader."""
    per = [reader.read_expert(layer, e) for e in range(FAM.num_experts)]
    out = {}
    for comp in ("gate", "up", "down"):
        q = mx.array(np.stack([p[comp]["weight"] for p in per]))
        s = mx.array(np.stack([p[comp]["scales"] for p in per])).view(mx.bfloat16)
        b = mx.array(np.stack([p[comp]["biases"] for p in per])).view(mx.bfloat16)
        out[comp] = (q, s, b)
    return out


def switch_glu(x, w, idx):
    assert (GROUP, BITS) == (S.GROUP, S.BITS)
    return S.switch_glu(x, [w["gate"], w["up"], w["down"]], idx)


def test_streamed_layers_equal_resident_reader(store):
    """AFN-019: streamed experts (cache far below the store) give the same
    SwitchGLU output bit for bit as weights read by the artifact reader;
    routes stay in the graph and the previous token's top-k is the P1
    prefetch control."""
    H = FAM.hidden_size
    with em.ExpertMajorReader(store, FAM, CODEC) as reader:
        eng = se.StreamEngine(cache_bytes=1 << 20, threads=2)
        experts = StreamedExperts(eng, reader, rows=6)
        arena = {c: (p["weight"], p["scales"], p["biases"]) for c, p in experts.weights.items()}
        resident = [resident_layer(reader, layer) for layer in range(FAM.num_hidden_layers)]
        router = mx.random.normal((H, FAM.num_experts))
        prev = {}
        for token in range(3):
            for layer in range(FAM.num_hidden_layers):
                x = mx.random.normal((2, 1, 1, H))
                idx = mx.argpartition(-(x.reshape(2, H) @ router), 1, axis=-1)[:, :2]
                hint = experts.prefetch(layer, prev[layer]) if layer in prev else None
                rows, lease = experts.resolve(layer, idx, owner=0, generation=token)
                y = eng.release_after(switch_glu(x, arena, rows), lease)
                mx.eval(y, *([hint] if hint is not None else []))
                assert mx.array_equal(y, switch_glu(x, resident[layer], idx)).item()
                prev[layer] = idx
        c = eng.counters()
        assert c["exact_bytes"] > 0 and c["errors"] == 0
        assert eng.memory()["pinned_slots"] == 0


def test_corrupt_record_is_refused_with_the_store_digest(store, tmp_path):
    """AFN-003: the store's per-record SHA-256 is enforced by the engine; the
    corrupt expert fails with a clear error, the others still stream."""
    bad = tmp_path / "bad.hbem"
    data = bytearray(open(store, "rb").read())
    with em.ExpertMajorReader(store, FAM, CODEC) as r:
        off = r.geometry.record_offset(r.geometry.index(1, 3))
    data[off + 100] ^= 0x01
    bad.write_bytes(bytes(data))
    with em.ExpertMajorReader(str(bad), FAM, CODEC) as reader:  # header/table intact
        eng = se.StreamEngine(cache_bytes=1 << 20, threads=2)
        experts = StreamedExperts(eng, reader, rows=4)
        rows, lease = experts.resolve(1, mx.array([[3, 4]]))
        with pytest.raises(RuntimeError, match="SHA-256 mismatch"):
            mx.eval(rows)
        rows, lease = experts.resolve(1, mx.array([[4, 5]]))
        mx.eval(eng.release_after(rows, lease))
        assert eng.memory()["pinned_slots"] == 0
    with pytest.raises(ValueError, match="layer"):
        experts.resolve(FAM.num_hidden_layers, mx.array([0]))


def test_plan_resident_or_streamed():
    """Resident when the store fits in available - reserve; otherwise the
    arena rows the budget holds; --expert-cache-gb overrides; too small a
    budget is a ValueError naming the field (hand arithmetic)."""
    rec = 2_764_800
    store = 48 * 512 * rec
    assert plan_experts(store, rec, available=80 * GIB, reserve=8 * GIB) is None
    assert plan_experts(store, rec, available=64 * GIB, reserve=8 * GIB) == 56 * GIB // rec
    assert plan_experts(store, rec, 80 * GIB, 8 * GIB, expert_cache_gb=28) == 28 * GIB // rec
    assert plan_experts(10 * rec, rec, 0, 0, expert_cache_gb=1) == 10  # capped at the store
    with pytest.raises(ValueError, match="expert_cache_gb"):
        plan_experts(store, rec, 80 * GIB, 0, expert_cache_gb=0.01, min_rows=10)
    with pytest.raises(ValueError, match="available memory"):
        plan_experts(store, rec, available=GIB, reserve=GIB, min_rows=10)


def _fds_and_threads():
    """{fd: target} and {tid: name} of this process, from /proc."""
    import os
    import threading

    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, gone by now
            pass
    py = {t.native_id: t.name for t in threading.enumerate()}
    tasks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                tasks[tid] = py.get(int(tid), f.read().strip())
        except OSError:  # exited meanwhile
            pass
    return fds, tasks


def _new_since(before, settle=2.0):
    """Descriptors and threads that exist now and did not before. Sets, not counts: the test
    process is shared with every earlier test, whose leftovers may end while this one runs (an
    unclosed engine freed by the cyclic GC joins its workers; a subprocess pipe is closed when its
    Popen is collected; a server test's worker thread exits after its stop()), and a count would
    blame that on the code under test. What was created here and is still open is ours.

    Polled for up to ``settle`` seconds: pthread_join returns once the kernel clears the joined
    thread's tid, a moment before the kernel reaps it from /proc/self/task, so a worker the engine
    did join can still be listed right after close() (a CI run saw exactly that). A leaked worker
    waits for work forever and is still listed when the deadline passes."""
    import time

    deadline = time.monotonic() + settle
    while True:
        fds, tasks = _fds_and_threads()
        new = (
            {fd: t for fd, t in fds.items() if before[0].get(fd) != t},
            {tid: n for tid, n in tasks.items() if tid not in before[1]},
        )
        if new == ({}, {}) or time.monotonic() >= deadline:
            return new
        time.sleep(0.01)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs /proc")
def test_failed_construction_releases_reader_and_engine():
    """Issue 10: a construction failure after the reader and the engine
    exist (here: an arena of 0 rows) closes both before raising - no
    descriptor or reader thread outlives the error, even while the error
    (and its traceback) is still held."""
    from hebrus_mlx.loader import DEMO_DIR
    from hebrus_mlx.stream.errors import StreamRequestError

    # The arena is evaluated on MLX's default CPU stream, whose scheduler thread MLX starts on
    # first use and keeps for the process: start it first so it is not counted as ours.
    mx.eval(mx.zeros((4096,), mx.uint8))
    before = _fds_and_threads()
    with pytest.raises(StreamRequestError, match="row") as err:
        StreamedExperts.from_artifact(str(DEMO_DIR), rows=0, threads=3)
    assert _new_since(before) == ({}, {}), err.value
    # Later, once the engine has opened the store: its descriptors go too.
    with pytest.MonkeyPatch.context() as mp:

        def refuse(*a, **k):
            raise StreamRequestError("offsets: injected failure")

        mp.setattr(se.StreamEngine, "register_table", refuse)
        with pytest.raises(StreamRequestError, match="injected") as err:
            StreamedExperts.from_artifact(str(DEMO_DIR), rows=8, threads=3)
        assert _new_since(before) == ({}, {}), err.value
    # A caller's engine is the caller's: left open, still usable.
    eng = se.StreamEngine(cache_bytes=1 << 20, threads=1)
    with pytest.raises(StreamRequestError):
        StreamedExperts.from_artifact(str(DEMO_DIR), rows=0, engine=eng)
    assert eng.memory()["capacity"] == 1 << 20
    eng.close()


def test_artifact_without_expert_store_is_a_typed_error(tmp_path):
    """Issue 10: an artifact whose manifest lost its expert store is refused
    with a typed error naming the field (admission runs first), never a bare
    StopIteration out of next()."""
    import json
    import shutil

    from hebrus_mlx.artifact.errors import ArtifactError
    from hebrus_mlx.loader import DEMO_DIR

    art = tmp_path / "a"
    shutil.copytree(DEMO_DIR, art)
    m = json.loads((art / C.MANIFEST_NAME).read_text())
    m["stores"] = [s for s in m["stores"] if s["role"] != "experts"]
    (art / C.MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="experts"):
        StreamedExperts.from_artifact(str(art), rows=4)


def test_planned_arena_rows_stay_within_the_engine_part_bound():
    """The real family's 2-bit store planned from ~10 GiB of free memory (or --expert-cache-gb 8) asked
    for more arena rows than the engine's per-part bound (rows * largest part < 2^31): load raised
    an internal StreamRequestError. The planner caps the rows at the bound, and the engine accepts
    exactly that many rows of such a part and refuses one more (the bound is the engine's own)."""
    from hebrus_mlx.loading.plan import ARENA_PART_BYTES_MAX

    fam = C.QWEN38_FLASH_NEXT
    g = em.Geometry(fam, "affine2-g64")
    part = max(n for *_, n in g.layer_layout(0))  # the gate/up weight part: 409,600 bytes
    rec = g.record_stride
    rows = plan_experts(g.payload_bytes, rec, available=24 * GIB, reserve=4 * GIB, part_bytes=part)
    assert rows == ARENA_PART_BYTES_MAX // part < 20 * GIB // rec
    assert plan_experts(g.payload_bytes, rec, 0, 0, expert_cache_gb=8, part_bytes=part) == rows
    eng = se.StreamEngine(cache_bytes=1 << 20)
    try:
        small = 64  # the bound in a few KiB of arena: 64-byte parts
        limit = ARENA_PART_BYTES_MAX // small
        with pytest.raises(se.StreamRequestError, match="part_bytes"):
            eng.create_arena([small], limit + 1)
    finally:
        eng.close()
