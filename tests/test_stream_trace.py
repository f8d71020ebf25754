"""Tests for the engine trace in hebrus_mlx/stream/engine.py and the
benchmark-only raw_pread (hebrus_mlx._bench) (metal_ext/trace.h,
trace_ops.cpp, bench/rawbench.cpp).

AFN-019 defended: exposed wait per layer and read issue->ready times must
come from the engine's own timestamps (not a run that syncs once per
layer), and the raw-read roofline they are compared with must be measured
outside the engine. Provenance: expected bytes are sliced from the store
file the test wrote from a seeded RNG (contract control); expected event
counts are the engine's own miss / blocked-wait counters, which
test_stream_engine.py checks independently against the request pattern
(cross-check), plus counts derived from the request pattern here.
"""

import time

import mlx.core as mx
import pytest
from support.fault_injection import FaultyEngine
from support.stream_store import REC, random_store

from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream import errors
from hebrus_mlx.stream.errors import StreamRequestError

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


@pytest.fixture
def store(tmp_path):
    return random_store(tmp_path, 32, seed=7)


def make(path, threads=2, capacity=16 * REC):
    eng = FaultyEngine(cache_bytes=capacity, threads=threads)
    return eng, eng.add_store(path)


def drain(eng, limit=20000):
    """Poll until no read is queued or in flight (bounded, no timing assert)."""
    for _ in range(limit):
        m = eng.memory()
        if m["inflight_reads"] == 0 and m["queued_reads"] == 0:
            return
        time.sleep(0.0005)
    raise AssertionError("reads did not finish")


def test_disabled_trace_records_nothing(store):
    """AFN-019: tracing is opt-in; off (default or capacity 0) -> no events."""
    path, _ = store
    eng, s = make(path)
    for i in range(4):
        t = eng.request(s, i * REC, REC)
        eng.wait(t)
        eng.release(t)
    eng.mark(0, 1)
    ev, dropped = eng.trace_events()
    assert len(ev) == 0 and dropped == 0
    eng.enable_trace(8)
    eng.enable_trace(0)
    t = eng.request(s, 5 * REC, REC)
    eng.wait(t)
    eng.release(t)
    assert len(eng.trace_events()[0]) == 0
    eng.close()


def test_read_and_wait_events_match_counters(store):
    """AFN-019: one read event per miss (exact and predicted), ordered
    issue <= start <= ready, and one wait event per blocked wait, labelled
    with the request's layer and expert."""
    path, _ = store
    eng, s = make(path)
    eng.enable_trace(1000)
    eng.set_read_delay_us(2000)  # so waits block
    before = time.monotonic_ns()
    # Predicted P1 reads of records 8..11, then exact reads of 0..11: 8..11
    # are joins or hits, 0..7 misses; 0..3 requested twice (joins).
    for e in range(8, 12):
        eng.release(eng.request(s, e * REC, REC, priority=1, exact=False, layer=1, expert=e))
    tickets = [eng.request(s, e * REC, REC, layer=e % 3, expert=e) for e in range(12)]
    tickets += [eng.request(s, e * REC, REC, layer=e % 3, expert=e) for e in range(4)]
    for t in tickets:
        eng.wait(t)
    for t in tickets:
        eng.release(t)
    drain(eng)
    after = time.monotonic_ns()
    c = eng.counters()
    ev, dropped = eng.trace_events()
    reads, waits = ev[ev["kind"] == "read"], ev[ev["kind"] == "wait"]
    assert dropped == 0
    assert len(reads) == c["misses"] == 12
    assert len(waits) == c["waits_blocked"] > 0
    assert (reads["outcome"] == "published").all()
    assert (before <= reads["issue_ns"]).all() and (reads["end_ns"] <= after).all()
    assert (reads["issue_ns"] <= reads["start_ns"]).all()
    assert (reads["start_ns"] <= reads["end_ns"]).all()
    assert (waits["issue_ns"] <= waits["end_ns"]).all()
    assert (reads["bytes"] == REC).all()
    by_expert = {int(r["expert"]): r for r in reads}
    assert sorted(by_expert) == list(range(12))
    for e, r in by_expert.items():
        predicted = e >= 8
        assert bool(r["exact"]) is not predicted
        assert r["layer"] == (1 if predicted else e % 3)
        assert r["priority"] in ((0, 1) if predicted else (0,))
    assert set(waits["layer"]) <= {0, 1, 2}
    eng.close()


def test_ring_bound_drops_oldest(store):
    """AFN-019: the trace is bounded; the oldest events go and are counted."""
    path, _ = store
    eng, s = make(path, threads=1)
    eng.enable_trace(5)
    for e in range(12):
        eng.release(eng.request(s, e * REC, REC, expert=e))
    drain(eng)
    ev, dropped = eng.trace_events(clear=True)
    assert len(ev) == 5 and dropped == 7
    # One worker, equal priority and deadline: reads finish in issue order.
    assert ev["expert"].tolist() == list(range(7, 12))
    assert len(eng.trace_events()[0]) == 0
    eng.close()


def test_dropped_and_failed_reads_are_recorded(store):
    """A read cancelled while queued and a failed read each leave one event
    (nothing in flight is lost from the trace)."""
    path, _ = store
    eng, s = make(path, threads=1)
    eng.enable_trace(100)
    eng.hold(True)
    eng.cancel(eng.request(s, 0, REC, expert=0))
    eng.hold(False)
    eng.inject_fault("eio", 1)
    t = eng.request(s, REC, REC, expert=1)
    with pytest.raises(errors.StreamIOError):
        eng.wait(t)
    eng.release(t)
    reads = eng.trace_events()[0]
    reads = reads[reads["kind"] == "read"]
    assert reads["outcome"].tolist() == ["dropped", "error:io"]
    assert reads["start_ns"][0] == 0 and reads["priority"][0] == -1
    assert reads["start_ns"][1] > 0
    assert eng.counters()["misses"] == 2
    eng.close()


def test_graph_marks_follow_their_values(store):
    """mark_after records when the CPU stream computed its value, in graph
    order, without a host sync between the marks; the clock is the one of
    time.monotonic_ns (trace_clock_ns)."""
    path, _ = store
    eng, _ = make(path)
    eng.enable_trace(100)
    t_before = time.monotonic_ns()
    assert t_before <= se.trace_clock_ns() <= time.monotonic_ns()
    x = mx.ones((64, 64))
    a = eng.mark_after(x @ x, layer=0, tag=1)
    b = eng.mark_after(a @ a, layer=1, tag=2)
    y = b.sum()
    assert eng.trace_events()[0].size == 0  # lazy: nothing ran yet
    mx.eval(y)
    assert y.item() == 64**5  # (x @ x) @ (x @ x) summed: marks pass values through
    marks = eng.trace_events()[0]
    assert marks["kind"].tolist() == ["mark", "mark"]
    assert marks["layer"].tolist() == [0, 1] and marks["expert"].tolist() == [1, 2]
    assert t_before <= marks["issue_ns"][0] <= marks["issue_ns"][1] <= time.monotonic_ns()
    eng.close()


def test_raw_pread_reads_the_file_bytes(store):
    """AFN-019 roofline: raw_pread reads exactly the requested records,
    direct (aligned) and buffered (unaligned offsets and length)."""
    path, data = store
    batches = [[3 * REC, 0, 7 * REC], [REC], [31 * REC, 2 * REC]]
    from hebrus_mlx import _bench

    r = _bench.raw_pread(str(path), batches, REC, threads=3, direct=True, collect=True)
    want = b"".join(data[o : o + REC] for b in batches for o in b)
    assert r["data"] == want
    assert r["reads"] == 6 and r["bytes"] == 6 * REC and r["elapsed_ns"] > 0
    odd = [[5, 1000], [77777]]
    r = _bench.raw_pread(str(path), odd, 1234, threads=2, direct=False, collect=True)
    assert r["data"] == b"".join(data[o : o + 1234] for b in odd for o in b)
    assert r["direct"] is False


def test_trace_capacity_is_checked(store):
    path, _ = store
    eng, _ = make(path)
    for bad in (-1, 2**25):
        with pytest.raises(StreamRequestError, match="^capacity:"):
            eng.enable_trace(bad)
    eng.close()


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(length=1000), "length"),  # unaligned with direct
        (dict(batches=[]), "batches"),
        (dict(batches=[[0], []]), "batches"),
        (dict(batches=[[100]]), "batches"),  # unaligned offset with direct
        (dict(batches=[[32 * REC]]), "batches"),  # past the end
        (dict(path="/nonexistent/store.bin"), "path"),
        (dict(threads=0), "threads"),
    ],
)
def test_raw_pread_rejects_bad_input(store, kw, field):
    path, _ = store
    from hebrus_mlx import _bench

    args = dict(path=str(path), batches=[[0, REC]], length=REC, threads=2, direct=True)
    args.update(kw)
    with pytest.raises(StreamRequestError, match=f"^{field}:"):
        _bench.raw_pread(**args)
