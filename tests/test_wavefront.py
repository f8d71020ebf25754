"""The streamed decode wavefront (AFN-019 H4): a one-token step computes each routed expert as its
record lands instead of waiting for all top-k, and stays bitwise equal to the resident model and
to the resolve-all streamed path whatever order the reads land in. Also the engine's priority rule
the wavefront's reads rely on: P2 (speculative) reads only take bandwidth P0/P1 leave spare.

Reads are ordered with the test-only fault injector (tests/support/fault_injection.py): a per-record
delay (``set_offset_delay_us``) makes later route positions land first, or any other order."""

import json
import os
import time

import mlx.core as mx
import numpy as np
import pytest
from support.chunked_greedy import chunked_greedy
from support.fault_injection import FaultyEngine
from support.stream_store import cache_gb

from hebrus_mlx.artifact import constants as C
from hebrus_mlx.artifact import expert_major as em
from hebrus_mlx.loader import DEMO_DIR, load_model
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream import experts as SE
from hebrus_mlx.stream.streaming import Streaming
from hebrus_mlx.stream.switch import attach

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 64), (4, 32)])
def test_one_row_gather_qmm_equals_its_row_of_the_k_row_call(bits, group):
    """AFN-019 H4 premise: on this backend the wavefront's per-expert gather_qmm (one rhs row)
    gives bitwise the row the resolve-all path's k-row call gives, for each projection shape."""
    rng = np.random.default_rng(bits + group)
    for n_out, n_in in [(128, 256), (256, 128), (768, 512)]:
        w = mx.array(rng.standard_normal((16, n_out, n_in)).astype(np.float32))
        wq, s, b = mx.quantize(w, group_size=group, bits=bits)
        x = mx.array(rng.standard_normal((1, 1, 1, 1, n_in)).astype(np.float32))
        rows = mx.array(rng.permutation(16)[:10].astype(np.uint32)).reshape(1, 1, 10)

        def qmm(r):
            return mx.gather_qmm(x, wq, s, b, rhs_indices=r, transpose=True, group_size=group, bits=bits)

        one = mx.concatenate([qmm(rows[..., j : j + 1]) for j in range(10)], axis=-3)
        assert mx.array_equal(qmm(rows), one).item()


def _demo_experts(rows, threads=10, wavefront=True, prefetch_previous=False):
    path, fam, codec = _store()
    with em.ExpertMajorReader(path, fam, codec) as reader:
        eng = FaultyEngine(cache_bytes=1 << 16, threads=threads)
        offsets = [reader.geometry.record_offset(i) for i in range(fam.num_hidden_layers * fam.num_experts)]
        experts = SE.StreamedExperts(eng, reader, rows, prefetch_previous=prefetch_previous, wavefront=wavefront)
    return experts, offsets


def _store():
    with open(os.path.join(DEMO_DIR, C.MANIFEST_NAME)) as f:
        m = json.load(f)
    s = next(s for s in m["stores"] if s["role"] == "experts")
    return os.path.join(DEMO_DIR, s["path"]), C.family(m["family"]), s["codec"]


def test_wave_takes_records_in_arrival_order_resident_first():
    """AFN-019 H4: a wave's takes return the records as they land, not in route order: records
    already resident first (in route order), then the misses in the order their reads finish; each
    take's row holds the record of the position it reports, and nothing stays pinned."""
    experts, offsets = _demo_experts(rows=16)
    eng = experts.engine
    ids = [5, 9, 1, 30, 12]
    resident = mx.array([[ids[3]]], dtype=mx.uint32)  # position 3 is in the arena before the wave
    rows, lease = experts.resolve(0, resident)
    mx.eval(eng.release_after(rows, lease))
    # Misses land in reverse route order: position 4 first, then 2, 1, 0, 150 ms apart (wide
    # enough that a take on this loaded machine runs before the next record lands).
    for pos, e in enumerate(ids):
        eng.set_offset_delay_us(offsets[e], (5 - pos) * 150_000)
    wave = experts.wave(0, mx.array([ids], dtype=mx.uint32))
    after, rows, positions = wave.lease, [], []
    for n in (2, 1, 2):  # takes of several records too
        row, pos = wave.take(after, n)
        rows.append(row)
        positions.append(pos)
        after = row
    mx.eval(eng.release_after(after, wave.lease))
    rows, order = (np.concatenate([np.array(a) for a in arrs]).tolist() for arrs in (rows, positions))
    assert order == [3, 4, 2, 1, 0]
    part = experts.weights["gate"]["weight"]
    with em.ExpertMajorReader(*_store()) as reader:
        for row, pos in zip(rows, order):
            want = reader.read_expert(0, ids[pos])["gate"]["weight"]
            np.testing.assert_array_equal(np.array(part[row]).view(np.uint8), want.view(np.uint8))
    assert eng.memory()["pinned_slots"] == 0
    with pytest.raises(Exception, match="cover the wave"):
        wave.take(after)


DELAYS = ["none", "reverse", "shuffle", "alternate"]


def _delay_pattern(kind, offsets, num_experts):
    """A per-record read delay (us) by expert id, so a layer's misses land in `kind` order."""
    rng = np.random.default_rng(7)
    perm = rng.permutation(num_experts)
    delays = {}
    for rec, off in enumerate(offsets):
        e = rec % num_experts
        if kind == "reverse":
            d = (num_experts - e) * 150
        elif kind == "shuffle":
            d = int(perm[e]) * 150
        elif kind == "alternate":
            d = 6000 if e % 2 else 0
        else:
            d = 0
        delays[off] = d
    return delays


class _Recorder:
    """Wraps StreamedExperts.wave to keep each take's reported position (read after the step)."""

    def __init__(self, experts):
        self.experts, self.orders = experts, []
        self._wave = experts.wave

    def __call__(self, *a, **k):
        wave = self._wave(*a, **k)
        order = []
        self.orders.append(order)

        class Taking:
            lease = wave.lease

            def take(_, after, n=1):
                row, pos = wave.take(after, n)
                order.append(pos)
                return row, pos

        return Taking()


def _streamed(rows, wavefront, threads=10):
    model = load_model(DEMO_DIR, expert_cache_gb=cache_gb(str(DEMO_DIR), 0.05)[0])
    experts, offsets = _demo_experts(rows, threads, wavefront, prefetch_previous=True)
    switches = attach([layer.mlp for layer in model.model.layers], experts)
    model.streaming = Streaming(experts.engine, experts, switches)
    return model, experts, offsets


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("delay", DELAYS)
def test_wavefront_decode_bitwise_equals_resident_and_resolve_all(delay, width):
    """AFN-019 H4 (exactness): with reads delayed so each layer's misses land in a different
    order (none, reversed, shuffled, odd experts late), greedy tokens and every forward's logits of
    the wavefront (one expert per step, or 3, 3, 3, 1) equal the resident model's and the
    resolve-all streamed path's bitwise, at the same 5% cache; the takes really came out of route order, and no slot stays pinned."""
    _, rows = cache_gb(str(DEMO_DIR), 0.05)
    resident = load_model(DEMO_DIR)
    prompt = np.random.default_rng(3).integers(2, resident.args.vocab_size, 6).tolist()
    chunk = max(1, rows // resident.args.num_experts_per_tok)
    want = chunked_greedy(resident, prompt, 12, chunk)
    results = {}
    for wavefront in (True, False):
        model, experts, offsets = _streamed(rows, wavefront)
        experts.wave_width = width
        for off, us in _delay_pattern(delay, offsets, experts.num_experts).items():
            if us:
                experts.engine.set_offset_delay_us(off, us)
        rec = _Recorder(experts)
        experts.wave = rec
        results[wavefront] = chunked_greedy(model, prompt, 12, chunk)
        c = experts.engine.counters()
        assert c["misses"] > 0 and c["errors"] == 0 and experts.engine.memory()["pinned_slots"] == 0
        if wavefront:
            orders = [np.concatenate([np.array(p) for p in o]).tolist() for o in rec.orders]
            assert len(orders) == 12 * len(model.model.layers)
            assert all(sorted(o) == list(range(len(o))) for o in orders)
            assert any(o != sorted(o) for o in orders)
        else:
            assert rec.orders == []
    for got in results.values():
        assert got[0] == want[0]
        for a, b in zip(got[1], want[1]):
            np.testing.assert_array_equal(a, b)


def _read_starts(eng):
    ev, _ = eng.trace_events()
    reads = ev[ev["kind"] == "read"]
    return {int(e["expert"]): (int(e["priority"]), int(e["start_ns"])) for e in reads}


@pytest.mark.parametrize("threads", [1, 3])
def test_p2_reads_start_only_when_no_p0_or_p1_read_waits(threads):
    """AFN-019 (P2 = spare bandwidth only): P2 reads queued before P0 and P1 reads never start
    while a P0 or P1 read is still queued, P0 reads start first, and with several workers P2
    never holds the worker an exact miss needs."""
    experts, _ = _demo_experts(rows=32, threads=threads)
    eng = experts.engine
    eng.enable_trace(256)
    eng.set_read_delay_us(20_000)
    eng.hold(True)
    # All queued while the workers are held, lowest priority first.
    mx.eval(experts.prefetch(1, mx.array([0, 1, 2]), se.P2))
    mx.eval(experts.prefetch(1, mx.array([10, 11]), se.P1))
    mx.eval(experts.prefetch(1, mx.array([20, 21]), se.P0))
    assert eng.memory()["queued_reads"] == 7
    eng.hold(False)
    while eng.memory()["inflight_reads"] + eng.memory()["queued_reads"]:
        time.sleep(0.01)  # the hints' reads drain (no assert on time)
    starts = _read_starts(eng)
    base = experts.num_experts
    p0 = [starts[base + e][1] for e in (20, 21)]
    p1 = [starts[base + e][1] for e in (10, 11)]
    p2 = [starts[base + e][1] for e in (0, 1, 2)]
    assert [starts[base + e][0] for e in (0, 1, 2, 10, 11, 20, 21)] == [se.P2] * 3 + [se.P1] * 2 + [se.P0] * 2
    assert max(p0) <= min(p1 + p2)
    assert max(p1) <= min(p2)


def test_wave_reads_are_p0_exact_with_a_deadline():
    """AFN-019: a wave's exact misses are P0 requests due ``wave_deadline_s`` after the issue op
    ran (the engine orders P0 by deadline and counts reads published after it); a read held past
    it is counted as a deadline miss, and the wave still completes."""
    experts, _ = _demo_experts(rows=16)
    eng = experts.engine
    experts.wave_deadline_s = 0.02
    eng.hold(True)
    wave = experts.wave(2, mx.array([[3, 4]], dtype=mx.uint32))
    t0 = se.trace_clock_ns()
    mx.eval(wave.lease)
    infos = [eng.ticket_info(int(t)) for t in np.array(wave.lease)]
    assert [(i["priority"], i["exact"]) for i in infos] == [(se.P0, True)] * 2
    assert all(t0 < i["deadline_ns"] <= se.trace_clock_ns() + 20_000_000 for i in infos)
    time.sleep(0.05)  # past the deadline before any read starts
    eng.hold(False)
    after = wave.lease
    for _ in range(2):
        after, _pos = wave.take(after)
    mx.eval(eng.release_after(after, wave.lease))
    assert eng.counters()["deadline_misses"] == 2
    assert eng.memory()["pinned_slots"] == 0


def test_an_index_past_the_table_is_refused_by_every_table_op():
    """gather, resolve and the wave share one bounds check (TableRead::row): an expert id past
    the layer's table is a StreamRequestError naming `indices`, and nothing stays pinned or open."""
    from hebrus_mlx.stream.errors import StreamRequestError, translate

    experts, _ = _demo_experts(rows=16)
    eng = experts.engine
    bad = mx.array([[3, experts.num_layers * experts.num_experts]], dtype=mx.uint32)  # record ids
    ops = {
        "gather": lambda: eng.gather(experts.table, bad),
        "resolve": lambda: eng.resolve(experts.table, bad)[0],
        "wave": lambda: eng.resolve_wave(experts.table, bad).lease,
    }
    for name, op in ops.items():
        with pytest.raises(RuntimeError) as e:  # a failed graph op: tagged, typed by translate
            mx.eval(op())
        typed = translate(e.value)
        assert isinstance(typed, StreamRequestError) and "indices" in str(typed), name
        assert "out of range" in str(typed), name
        assert eng.memory()["pinned_slots"] == 0 and eng.memory()["tickets"] == 0, name


@pytest.mark.parametrize("fault", ["cancel", "eio"])
def test_a_failed_wave_raises_once_and_its_later_takes_stay_quiet(fault):
    """A wave whose record fails (its ticket cancelled, or its read failing) raises from the take
    that meets the failure; the wave's later takes raise nothing. MLX clears a stream's error once
    the main thread has raised it, and a pipelined step's main thread raises it while the failed
    step's later takes may still be queued: a second error from one of them would fail the next,
    healthy step (naming the failed step's ticket). Here the main thread raises the first error
    before the later takes run, every time: they must not fail again, and nothing stays pinned."""
    from hebrus_mlx.stream.errors import StreamIOError, TicketCancelledError, translate

    experts, _ = _demo_experts(rows=16)
    eng = experts.engine
    eng.hold(True)
    wave = experts.wave(0, mx.array([[3, 4, 5]], dtype=mx.uint32))
    mx.eval(wave.lease)
    first, _pos = wave.take(wave.lease)
    rest, _pos = wave.take(first, 2)
    if fault == "cancel":
        assert eng.cancel(int(np.array(wave.lease)[0]))
    else:
        # Every read of the wave fails: which record the readers take first is the threads' choice,
        # and the first take must meet a failure whichever it is.
        eng.inject_fault("eio", 3)
        eng.set_read_delay_us(0)
    eng.hold(False)
    with pytest.raises(RuntimeError) as e:
        mx.eval(first)
    assert type(translate(e.value)) is (TicketCancelledError if fault == "cancel" else StreamIOError)
    # The failed step's later takes run after the main thread has raised (and MLX cleared) its error.
    mx.eval(eng.release_after(rest, wave.lease))
    mx.eval(mx.array(1) + 1)  # no error left for the next evaluation
    assert eng.memory()["pinned_slots"] == 0 and eng.memory()["tickets"] == 0
