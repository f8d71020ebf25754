"""Tests for the zero-copy arena path of hebrus_mlx/stream/engine.py.

Provenance: expert weights are quantized in memory by mx.quantize (affine,
4-bit, group 64) and written to a synthetic store by the test; the resident
run computes the same SwitchGLU with those in-memory arrays (independent
cross-check of the streamed path, which reads the bytes back from disk).
"""

import hashlib

import mlx.core as mx
import numpy as np
import pytest
from support.fault_injection import FaultyEngine

from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream import errors
from hebrus_mlx.stream.errors import DigestMismatchError  # noqa: F401

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")

H, I, E, K, G, BITS = 128, 64, 12, 2, 64, 4
COMPONENTS = (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))


@pytest.fixture
def experts(tmp_path):
    """Quantized gate|up|down per expert, one 4096-aligned record each."""
    mx.random.seed(5)
    parts, resident = [], {}
    for name, (o, i) in COMPONENTS:
        w = (mx.random.normal((E, o, i)) * 0.1).astype(mx.bfloat16)
        q, s, b = mx.quantize(w, group_size=G, bits=BITS)
        mx.eval(q, s, b)
        resident[name] = (q, s, b)
        parts += [(name, q), (name, s), (name, b)]
    part_bytes = [a[0].nbytes for _, a in parts]
    record = sum(part_bytes)
    stride = (record + 4095) // 4096 * 4096
    blob = bytearray(E * stride)
    for e in range(E):
        rec = b"".join(np.array(a[e].view(mx.uint8)).tobytes() for _, a in parts)
        blob[e * stride : e * stride + record] = rec
    path = tmp_path / "experts.bin"
    path.write_bytes(bytes(blob))
    offsets = [e * stride for e in range(E)]
    digests = [hashlib.sha256(blob[o : o + record]).digest() for o in offsets]
    return path, part_bytes, parts, resident, offsets, record, digests


def switch_glu(x, weights, idx):
    """mlx-lm SwitchGLU shape convention: x [T, 1, 1, H], idx [T, K]."""

    def proj(name, h):
        q, s, b = weights[name]
        return mx.gather_qmm(h, q, s, b, rhs_indices=idx, transpose=True, group_size=G, bits=BITS)

    h = mx.sigmoid(g := proj("gate", x)) * g * proj("up", x)
    return proj("down", h)


def arena_weights(parts, arena_parts, rows):
    """Zero-copy typed views of the arena parts: [rows, out, in/8] etc."""
    out = {}
    for p in range(0, len(parts), 3):
        name = parts[p][0]
        views = []
        for k in range(3):
            ref = parts[p + k][1]
            views.append(arena_parts[p + k].view(ref.dtype).reshape(rows, *ref.shape[1:]))
        out[name] = tuple(views)
    return out


def open_arena(experts, rows, digests=True, **kw):
    path, part_bytes, parts, resident, offsets, record, dig = experts
    eng = FaultyEngine(cache_bytes=1 << 20, threads=2, **kw)
    aid, arena_parts = eng.create_arena(part_bytes, rows)
    table = eng.register_table(eng.add_store(path), offsets, [record] * E, dig if digests else None, arena=aid)
    return eng, table, arena_weights(parts, arena_parts, rows)


def test_streamed_switch_glu_bit_identical_to_resident(experts):
    """AFN-019: streaming changes which bytes arrive when, never arithmetic:
    routes come from an unevaluated router (no read-back) and the streamed
    gather_qmm over arena rows equals the resident one bit for bit."""
    resident = experts[3]
    eng, table, weights = open_arena(experts, rows=7)
    router = mx.random.normal((H, E))
    for step in range(6):
        x = mx.random.normal((3, 1, 1, H))
        logits = x.reshape(3, H) @ router
        idx = mx.argpartition(-logits, K - 1, axis=-1)[:, :K]
        rows, lease = eng.resolve(table, idx, owner=1, generation=step)
        streamed = eng.release_after(switch_glu(x, weights, rows), lease)
        if step % 2:
            # Next-layer style hint for the following step (P1, no blocking).
            nxt = eng.prefetch(table, idx[:, ::-1], priority=se.P1)
            mx.eval(streamed, nxt)
        mx.eval(streamed)
        expected = switch_glu(x, resident, idx)
        assert mx.array_equal(streamed, expected).item(), step
        m = eng.memory()
        assert m["pinned_slots"] == 0 and m["tickets"] == 0 and m["arena_rows"] <= 7
    c = eng.counters()
    assert c["misses"] > 0 and c["evictions"] > 0


@pytest.mark.parametrize("held", [4, 2])
def test_a_resolve_past_rows_that_predictions_hold_waits_for_them(experts, held):
    """Where queued predictions hold the rows a resolve needs (all four, or all but two), the
    records past the free rows wait for the predictions to publish instead of failing: each
    record read once, each row its record (the streamed SwitchGLU equals the resident one)."""
    resident = experts[3]
    eng, table, weights = open_arena(experts, rows=4)
    eng.set_read_delay_us(50_000)  # the predictions are still reading when the resolve issues
    mx.eval(eng.prefetch(table, mx.array(list(range(held))), priority=se.P1))
    assert eng.memory()["arena_rows"] + eng.memory()["queued_reads"] + eng.memory()["inflight_reads"] >= held
    x = mx.random.normal((2, 1, 1, H))
    idx = mx.array([[6, 7], [8, 9]])
    rows, lease = eng.resolve(table, idx)
    streamed = eng.release_after(switch_glu(x, weights, rows), lease)
    mx.eval(streamed)
    assert mx.array_equal(streamed, switch_glu(x, resident, idx)).item()
    c = eng.counters()
    assert c["predicted_reads"] == held and c["exact_misses"] == 4 and c["errors"] == 0
    m = eng.memory()
    assert m["pinned_slots"] == 0 and m["tickets"] == 0


def test_arena_read_matches_file_bytes(experts):
    """AFN-003: a record scattered over arena parts reads back as one
    snapshot identical to the file (preadv scatter + incremental SHA-256)."""
    path, _, _, _, offsets, record, digests = experts
    data = path.read_bytes()
    for direct in (True, False):
        eng, table, _ = open_arena(experts, rows=3, direct=direct)
        for e in (0, 7, 11):
            t = eng.request(0, offsets[e], record, arena=0, digest=digests[e])
            assert eng.read(t) == data[offsets[e] : offsets[e] + record]
            eng.release(t)


def test_arena_fault_and_full_are_clean(experts):
    """AFN-010: a corrupt record or a too-small arena fails the eval with a
    clear error, leaves no row pinned, and the next resolve succeeds."""
    resident = experts[3]
    eng, table, weights = open_arena(experts, rows=2)
    x = mx.random.normal((1, 1, 1, H))
    idx = mx.array([[3, 4]])
    eng.inject_fault("digest", 1)
    rows, lease = eng.resolve(table, idx)
    with pytest.raises(RuntimeError, match="SHA-256 mismatch"):
        mx.eval(eng.release_after(switch_glu(x, weights, rows), lease))
    assert eng.memory()["pinned_slots"] == 0
    rows, lease = eng.resolve(table, mx.array([[1, 2, 5]]))  # 3 rows > 2
    with pytest.raises(RuntimeError, match="arena 0 full"):
        mx.eval(rows)
    assert eng.memory()["pinned_slots"] == 0 and eng.memory()["tickets"] == 0
    rows, lease = eng.resolve(table, idx)
    y = eng.release_after(switch_glu(x, weights, rows), lease)
    assert mx.array_equal(y, switch_glu(x, resident, idx)).item()
    assert eng.memory()["pinned_slots"] == 0


def test_expanded_parts_hold_fp32_and_read_back_stored_bytes(experts):
    """AFN-003/AFN-019: bf16 scale/bias parts flagged ``expand`` are widened
    to fp32 in the arena after the digest check (the digest covers the
    stored bytes, so a corrupt record still fails), the copy path returns
    the stored bytes, and gather_qmm over the fp32 views equals the
    resident run with fp32 scales (what the artifact loader builds).
    Control: the widened values are mx's own bf16 -> fp32 cast."""
    path, part_bytes, parts, resident, offsets, record, digests = experts
    data = path.read_bytes()
    expand = [a.dtype == mx.bfloat16 for _, a in parts]
    assert sum(expand) == 6
    rows = 3
    eng = FaultyEngine(cache_bytes=1 << 20, threads=2)
    aid, arena_parts = eng.create_arena(part_bytes, rows, expand)
    assert [p.shape[1] for p in arena_parts] == [n * (2 if w else 1) for n, w in zip(part_bytes, expand)]
    table = eng.register_table(eng.add_store(path), offsets, [record] * E, digests, arena=aid)
    weights = {}
    for p in range(0, len(parts), 3):
        name = parts[p][0]
        weights[name] = tuple(
            arena_parts[p + k]
            .view(mx.float32 if expand[p + k] else parts[p + k][1].dtype)
            .reshape(rows, *parts[p + k][1].shape[1:])
            for k in range(3)
        )
    wide = {n: (q, s.astype(mx.float32), b.astype(mx.float32)) for n, (q, s, b) in resident.items()}
    x = mx.random.normal((2, 1, 1, H))
    idx = mx.array([[3, 4], [4, 9]])
    r, lease = eng.resolve(table, idx)
    y = eng.release_after(switch_glu(x, weights, r), lease)
    assert mx.array_equal(y, switch_glu(x, wide, idx)).item()
    for e in (3, 9):
        t = eng.request(0, offsets[e], record, arena=aid, digest=digests[e])
        assert eng.read(t) == data[offsets[e] : offsets[e] + record]
        eng.release(t)
    eng.inject_fault("digest", 1)
    r, lease = eng.resolve(table, mx.array([[0, 1]]))
    with pytest.raises(RuntimeError, match="SHA-256 mismatch"):
        mx.eval(eng.release_after(switch_glu(x[:1], weights, r), lease))
    assert eng.memory()["pinned_slots"] == 0
    with pytest.raises(errors.StreamRequestError, match="expand"):
        eng.create_arena(part_bytes, rows, expand[:-1])


@pytest.mark.parametrize("values", [0, 1, 2047, 2048, 2049, 4096 * 3 + 5, 25600])
def test_in_place_widening_equals_mx_cast_across_chunks(values):
    """AFN-003: the readers' in-place bf16 -> fp32 widening (the engine's and
    the prefill sweep's; chunked, backwards) equals mx's own cast at sizes
    around its 2,048-value chunk and at a real scale part (25,600 values),
    every bit pattern class included (signed zeros, infinities, NaNs,
    subnormals)."""
    from hebrus_mlx import _testing

    rng = np.random.default_rng(values)
    bits = rng.integers(0, 1 << 16, size=values, dtype=np.uint16)
    bits[: min(values, 8)] = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x8001, 0x3F80][: min(values, 8)]
    got = _testing.widen_bf16(bits.tobytes())
    want = np.array(mx.array(bits).view(mx.bfloat16).astype(mx.float32).view(mx.uint32))
    assert got == want.tobytes()
