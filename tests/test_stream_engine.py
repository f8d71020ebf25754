"""Tests for hebrus_mlx/stream/engine.py (C++ engine in metal_ext/).

Provenance: every expected byte string is sliced from the synthetic store
file the test itself wrote from a seeded RNG (contract control), and the
pure-Python ReferenceEngine (os.preadv + hashlib) is an independent
cross-check of the C++ read path and SHA-256.
"""

import hashlib
import random
import threading

import mlx.core as mx
import numpy as np
import pytest
from support.fault_injection import FaultyEngine

from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream import errors as E
from hebrus_mlx.testing.stream_reference import ReferenceEngine

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")

REC = 3 * 4096  # aligned record size used by most tests


@pytest.fixture
def store(tmp_path):
    """A file of random bytes plus a table of aligned and unaligned records."""
    rng = np.random.default_rng(1234)
    data = rng.integers(0, 256, size=64 * REC + 5000, dtype=np.uint8).tobytes()
    path = tmp_path / "store.bin"
    path.write_bytes(data)
    aligned = [(i * REC, REC) for i in range(64)]
    odd = [(int(o), int(n)) for o, n in zip(rng.integers(0, 60 * REC, 16), rng.integers(1, 3 * REC, 16))]
    return path, data, aligned, odd


def make(capacity=16 * REC, threads=2, **kw):
    return FaultyEngine(cache_bytes=capacity, threads=threads, **kw)


def wait_until(pred, limit=20000):
    """Poll an engine state (no timing assertion; bounded iterations)."""
    import time

    for _ in range(limit):
        if pred():
            return True
        time.sleep(0.0005)
    return False


def assert_clean(eng):
    m = eng.memory()
    assert m["pinned_slots"] == 0 and m["tickets"] == 0, m
    assert m["allocated"] <= m["capacity"]


def _check_sha256():
    """tools/check_sha256.py (the cross-arch known-answer driver)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "check_sha256.py"
    spec = importlib.util.spec_from_file_location("check_sha256", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sha256_matches_hashlib():
    """AFN-003: page/record digests are SHA-256; C++ vs the FIPS 180-2
    vectors and hashlib on random buffers (incremental updates across arena
    parts are covered by the arena tests and tools/check_sha256.py)."""
    NIST = _check_sha256().NIST
    assert se._ext.sha256_backend() in ("sha-ni", "armv8", "portable")
    for msg, want in NIST:
        for portable in (False, True):
            assert se._ext.sha256(msg, portable=portable).hex() == want
    rng = random.Random(7)
    for n in list(range(0, 130)) + [191, 4095, 4096, 4097, 100_003]:
        b = rng.randbytes(n)
        want = hashlib.sha256(b).digest()
        # Both the dispatched (SHA-NI / ARMv8 where present) and the
        # portable rounds.
        assert se._ext.sha256(b) == want == se._ext.sha256(b, portable=True), n


def test_sha256_armv8_path_under_qemu():
    """Issue 10: the ARMv8 SHA-2 instruction rounds (the Apple-silicon /
    arm64 path) are cross-compiled and run under qemu-aarch64 against the
    NIST vectors and hashlib - when the cross toolchain is installed."""
    check_sha256 = _check_sha256()
    try:
        backend, bad = check_sha256.check("aarch64")
    except check_sha256.ToolchainMissing as e:
        pytest.skip(str(e))
    assert backend == "armv8" and bad == []


def test_every_engine_error_code_has_a_named_class():
    """Issue 10: the C++ error table (engine.h HEBRUS_ERROR_CODES, exported
    as _ext.error_codes) is the one list; every code but "ok" maps to a
    distinct named StreamError class and Python knows no other name."""
    from hebrus_mlx.stream.errors import BY_NAME, StreamError

    codes = se._ext.error_codes()
    assert codes.pop(0) == "ok"
    assert sorted(codes.values()) == sorted(BY_NAME)
    classes = [BY_NAME[name] for name in codes.values()]
    assert len(set(classes)) == len(classes)
    assert all(issubclass(cls, StreamError) and cls is not StreamError for cls in classes)


def test_engine_matches_reference_byte_identical(store):
    """AFN-019/AFN-003: every published record is one verified snapshot,
    byte-identical to the reference (preadv) and to the file."""
    path, data, aligned, odd = store
    ref = ReferenceEngine()
    rs = ref.add_store(path)
    rng = random.Random(3)
    for direct in (True, False):
        eng = make(capacity=24 * REC, threads=3, direct=direct)
        s = eng.add_store(path)
        recs = aligned + odd
        order = [rng.choice(recs) for _ in range(120)]
        tickets = []
        for off, n in order:
            d = hashlib.sha256(data[off : off + n]).digest()
            tickets.append(eng.request(s, off, n, priority=rng.randrange(3), digest=d))
            if len(tickets) == 6:
                for t in tickets:
                    info = eng.ticket_info(t)
                    o2, n2 = info["offset"], info["length"]
                    got = eng.read(t)
                    assert got == data[o2 : o2 + n2]
                    assert got == ref.read(ref.request(rs, o2, n2))
                    eng.release(t)
                tickets = []
        for t in tickets:
            eng.cancel(t)
        assert_clean(eng)
        c = eng.counters()
        assert c["misses"] + c["joins"] + c["hits"] == c["requests"] == 120
        eng.close()


def test_gather_op_matches_reference(store):
    """AFN-019: the graph op waits only for the records its indices name and
    returns the same bytes as the reference gather."""
    path, data, aligned, _ = store
    eng, ref = make(capacity=6 * REC), ReferenceEngine()
    offs, lens = [o for o, _ in aligned], [n for _, n in aligned]
    digests = [hashlib.sha256(data[o : o + n]).digest() for o, n in aligned]
    t_eng = eng.register_table(eng.add_store(path), offs, lens, digests)
    t_ref = ref.register_table(ref.add_store(path), offs, lens, digests)
    # Indices come from an unevaluated graph: no read-back before gather.
    idx = (mx.arange(10) * 7) % 64
    idx = mx.stack([idx, idx[::-1]])
    out = eng.gather(t_eng, idx)
    pre = eng.prefetch(t_eng, mx.array([60, 61]), priority=se.P2)
    mx.eval(out, pre)
    assert out.shape == (2, 10, REC) and out.dtype == mx.uint8
    assert mx.array_equal(out, ref.gather(t_ref, idx)).item()
    assert np.array(out[0, 1]).tobytes() == data[7 * REC : 8 * REC]
    assert pre.item() == 2
    assert_clean(eng)


def test_priority_order_and_deadlines(store):
    """AFN-019 queue discipline: P0 before P1 before P2; earlier deadline
    first within a class; a P0 joiner lifts a queued P2 read."""
    path, data, aligned, _ = store
    eng = make(threads=1)
    s = eng.add_store(path)
    # One read slot; a worker checks the record it read after giving the slot
    # back, so completions follow the read order only when each read outlasts
    # the check before it: a margin, not a timing check.
    eng.set_read_delay_us(50_000)
    eng.hold(True)
    rec = iter(aligned)
    p2 = eng.request(s, *next(rec), priority=se.P2, exact=False)
    p1_late = eng.request(s, *next(rec), priority=se.P1, exact=False, deadline_ns=200)
    p1_early = eng.request(s, *next(rec), priority=se.P1, exact=False, deadline_ns=100)
    p0 = eng.request(s, *next(rec), priority=se.P0)
    lifted = eng.request(s, *next(rec), priority=se.P2, exact=False)
    joiner = eng.request(s, eng.ticket_info(lifted)["offset"], REC, priority=se.P0)
    assert eng.ticket_info(joiner)["kind"] == "joined"
    eng.hold(False)
    for t in (p2, p1_late, p1_early, p0, lifted, joiner):
        eng.wait(t)
    seq = {t: eng.ticket_info(t)["complete_seq"] for t in (p2, p1_late, p1_early, p0, lifted, joiner)}
    assert seq[lifted] == seq[joiner]
    assert max(seq[p0], seq[lifted]) < seq[p1_early] < seq[p1_late] < seq[p2]
    c = eng.counters()
    assert c["joins"] == 1 and c["misses"] == 5
    assert c["exact_bytes"] == 2 * REC and c["predicted_bytes"] == 3 * REC
    assert c["deadline_misses"] == 2  # deadlines 100 and 200 ns are long past
    for t in seq:
        eng.release(t)
    assert_clean(eng)


def test_p2_leaves_a_worker_for_exact_reads(store):
    """AFN-019: P2 only uses spare bandwidth: with two workers at most one
    runs speculative reads, so a later exact miss overtakes queued P2 reads
    (its exposed wait is booked to its layer)."""
    path, _, aligned, _ = store
    eng = make(threads=2)
    s = eng.add_store(path)
    eng.set_read_delay_us(100_000)  # margin for a loaded machine, not a timing check
    spec = [eng.request(s, *aligned[i], priority=se.P2, exact=False) for i in range(3)]
    assert wait_until(lambda: eng.memory()["inflight_reads"] == 1)
    p0 = eng.request(s, *aligned[10], layer=4)
    eng.wait(p0)
    for t in spec:
        eng.wait(t)
    seq = {t: eng.ticket_info(t)["complete_seq"] for t in spec + [p0]}
    assert seq[p0] < seq[spec[1]] and seq[p0] < seq[spec[2]]
    assert eng.counters()["exposed_wait_ns_by_layer"][4] > 0
    for t in spec + [p0]:
        eng.release(t)
    assert_clean(eng)


def test_predicted_records_serving_exact_requests_are_counted(store):
    """AFN-019 timely recall: an exact request served by a prediction that
    already landed is a predicted hit; one still in flight a predicted join;
    each record counts once."""
    path, _, aligned, _ = store
    eng = make()
    s = eng.add_store(path)
    eng.release(eng.request(s, *aligned[0], priority=se.P1, exact=False))
    assert wait_until(lambda: eng.memory()["resident"] == REC)  # published
    eng.hold(True)
    eng.release(eng.request(s, *aligned[1], priority=se.P2, exact=False))
    exact = [eng.request(s, *aligned[i]) for i in (0, 1, 0)]
    eng.hold(False)
    for t in exact:
        eng.wait(t)
        eng.release(t)
    c = eng.counters()
    assert (c["predicted_hits"], c["predicted_joins"]) == (1, 1)
    assert c["predicted_bytes"] == REC and c["exact_bytes"] == REC
    assert_clean(eng)


def test_join_in_flight_reads_once(store):
    """AFN-019: a second request for an in-flight record joins it."""
    path, data, aligned, _ = store
    eng = make()
    s = eng.add_store(path, digest_id="store-sha256:abc")
    eng.hold(True)
    a = eng.request(s, *aligned[5], layer=3, expert=5)
    b = eng.request(s, *aligned[5], priority=se.P1, exact=False)
    eng.hold(False)
    assert eng.read(a) == eng.read(b) == data[5 * REC : 6 * REC]
    info = eng.ticket_info(a)
    assert (info["store_digest"], info["layer"], info["expert"]) == ("store-sha256:abc", 3, 5)
    c = eng.counters()
    assert (c["misses"], c["joins"], c["exact_bytes"]) == (1, 1, REC)
    eng.release(a), eng.release(b)
    assert_clean(eng)


def test_cancel_releases_exactly_once(store):
    """AFN-019: cancellation releases ownership exactly once; a queued read
    nobody wants is dropped; waiting on it is a clear error."""
    path, _, aligned, _ = store
    eng = make()
    s = eng.add_store(path)
    eng.hold(True)
    t = eng.request(s, *aligned[0])
    assert eng.cancel(t) is True
    assert eng.cancel(t) is False and eng.release(t) is False
    with pytest.raises(E.TicketCancelledError):
        eng.wait(t)
    eng.hold(False)
    assert eng.memory()["slots_in_use"] == 0
    assert eng.counters()["exact_bytes"] == 0
    assert_clean(eng)


def test_stale_generation_never_publishes(store):
    """AFN-019/AFN-010: a stale generation may finish reading but never
    publishes into its (recycled) slot; the next owner gets its own bytes."""
    path, data, aligned, _ = store
    eng = make(capacity=REC, threads=2)
    s = eng.add_store(path)
    eng.set_read_delay_us(300_000)  # keeps the read in flight across the bump
    old = eng.request(s, *aligned[1], owner=7, generation=0)
    assert wait_until(lambda: eng.memory()["inflight_reads"] == 1)
    slot = eng.ticket_info(old)["slot"]
    assert eng.advance_generation(7, 1) == 1
    with pytest.raises(E.StaleGenerationError):
        eng.wait(old)
    with pytest.raises(E.StaleGenerationError):
        eng.request(s, *aligned[1], owner=7, generation=0)
    eng.set_read_delay_us(0)
    # The cache has one record of room: the old read still owns its slab, so
    # the new owner waits for memory only after the stale read drains.
    assert wait_until(lambda: eng.counters()["stale_drops"] == 1)
    new = eng.request(s, *aligned[2], owner=7, generation=1)
    info = eng.ticket_info(new)
    assert info["slot"] == slot and info["slot_generation"] > 0
    assert eng.read(new) == data[2 * REC : 3 * REC]
    eng.release(new), eng.release(old)
    again = eng.request(s, *aligned[1], owner=7, generation=1)
    assert eng.ticket_info(again)["kind"] == "miss"  # nothing was published
    assert eng.read(again) == data[REC : 2 * REC]
    eng.release(again)
    assert_clean(eng)


@pytest.mark.parametrize(
    "kind,err", [("eio", E.StreamIOError), ("short_read", E.ShortReadError), ("digest", E.DigestMismatchError)]
)
def test_fault_clear_error_no_leak_next_ok(store, kind, err):
    """AFN-003/AFN-010: an injected fault gives a typed error naming the
    record, publishes nothing, leaks no slot, and the next request succeeds."""
    path, data, aligned, _ = store
    eng = make()
    s = eng.add_store(path)
    off, n = aligned[9]
    d = hashlib.sha256(data[off : off + n]).digest()
    eng.inject_fault(kind, 1)
    eng.hold(True)
    t = eng.request(s, off, n, digest=d)
    j = eng.request(s, off, n, digest=d)  # joined waiter fails too
    eng.hold(False)
    for tk in (t, j):
        with pytest.raises(err, match=f"offset {off}"):
            eng.read(tk)
        assert eng.release(tk) is True
    assert eng.memory()["slots_in_use"] == 0
    assert eng.counters()["errors"] == 1
    assert_clean(eng)
    t = eng.request(s, off, n, digest=d)
    assert eng.ticket_info(t)["kind"] == "miss"
    assert eng.read(t) == data[off : off + n]
    eng.release(t)
    # Through the graph op: eval raises, nothing stays pinned, next eval ok.
    off, n = aligned[11]
    d = hashlib.sha256(data[off : off + n]).digest()
    tab = eng.register_table(s, [off], [n], [d])
    eng.inject_fault(kind, 1)
    bad = eng.gather(tab, mx.array([0]))
    with pytest.raises(RuntimeError, match=f"offset {off}"):
        mx.eval(bad)
    assert_clean(eng)
    good = eng.gather(tab, mx.array([0, 0]))
    mx.eval(good)
    assert np.array(good[1]).tobytes() == data[off : off + n]
    assert_clean(eng)


def test_cancelled_ticket_in_graph_op(store):
    """AFN-019: a cancelled ticket cannot be consumed by a graph op."""
    path, _, aligned, _ = store
    eng = make()
    s = eng.add_store(path)
    t = eng.request(s, *aligned[0])
    eng.cancel(t)
    with pytest.raises(E.TicketCancelledError):
        eng.load([t])
    ok = eng.request(s, *aligned[0])
    with pytest.raises(E.StreamRequestError, match="once"):
        eng.load([ok, ok])
    arr = eng.load([ok])
    mx.eval(arr)
    assert eng.release(ok) is False  # the op released it, exactly once
    assert_clean(eng)


def test_threaded_stress_never_publishes_wrong_bytes(store):
    """AFN-019: concurrent cancels, releases and generation bumps on a
    small cache never publish wrong bytes or leak a slot."""
    path, data, aligned, _ = store
    eng = make(capacity=6 * REC, threads=3)
    s = eng.add_store(path)
    eng.set_read_delay_us(300)
    errors = []

    def worker(owner, seed):
        rng = random.Random(seed)
        gen = 0
        for _ in range(400):
            off, n = rng.choice(aligned[:12])
            try:
                t = eng.request(
                    s, off, n, owner=owner, generation=gen, priority=rng.randrange(3), exact=rng.random() < 0.5
                )
            except (E.CacheFullError, E.StaleGenerationError):
                continue
            r = rng.random()
            try:
                if r < 0.25:
                    eng.cancel(t)
                    continue
                if r < 0.35:
                    gen += 1
                    eng.advance_generation(owner, gen)
                got = eng.read(t)
                if got != data[off : off + n]:
                    errors.append((off, n))
            except (E.StaleGenerationError, E.TicketCancelledError):
                pass
            finally:
                eng.release(t)

    threads = [threading.Thread(target=worker, args=(o % 2, o)) for o in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert_clean(eng)
    assert wait_until(lambda: eng.memory()["inflight_reads"] == 0)


def test_bounded_cache_memory_stays_flat(store):
    """AFN-019: a bounded cache holds its byte budget over many requests."""
    path, data, aligned, odd = store
    eng = make(capacity=4 * REC, threads=2)
    s = eng.add_store(path)
    rng = random.Random(11)
    peak = []
    for i in range(600):
        off, n = rng.choice(aligned + odd)
        t = eng.request(s, off, n, exact=i % 3 == 0)
        assert eng.read(t) == data[off : off + n]
        eng.release(t)
        m = eng.memory()
        peak.append(m["allocated"])
        assert m["allocated"] <= 4 * REC and m["slots_in_use"] <= 4 * REC // 4096
    assert max(peak[300:]) <= 4 * REC
    c = eng.counters()
    assert c["evictions"] > 0 and c["latency_samples"] == c["misses"]
    assert c["latency_p50_ns"] <= c["latency_p95_ns"] <= c["latency_p99_ns"]
    assert_clean(eng)


def test_slabs_are_mlx_allocated(store):
    """Issue 6: the slab cache lives in MLX-allocated memory (so MLX's
    memory accounting and, on Apple, unified-memory buffers cover it) and
    is returned when the engine goes. Control: mx.get_active_memory()."""
    path, data, aligned, _ = store
    mx.synchronize()
    base = mx.get_active_memory()
    eng = make(capacity=4 * REC, threads=2)
    s = eng.add_store(path)
    for off, n in aligned[:6]:  # more records than slabs: pooled and evicted
        t = eng.request(s, off, n)
        assert eng.read(t) == data[off : off + n]
        eng.release(t)
    held = mx.get_active_memory() - base
    assert eng.memory()["allocated"] == 4 * REC
    # Each slab is one MLX buffer (with up to 4096 bytes of alignment slack). MLX's active memory
    # is process-wide: a thread an earlier test left finishing may allocate or free a few hundred
    # bytes meanwhile (seen once in CI: +1024), so one page of tolerance: all four slabs are
    # counted, and no fifth one exists.
    assert 4 * REC <= held <= 4 * (REC + 4096) + 4096, held
    eng.close()
    del eng
    assert mx.get_active_memory() - base < REC  # every slab returned


def test_cache_full_is_clean_and_policies(store):
    """AFN-019: a full cache refuses before changing state; the scored
    policy evicts the lowest stall-per-byte record, LRU the oldest."""
    path, _, aligned, _ = store
    for policy, survivor in (("lru", 1), ("score", 0)):
        eng = make(capacity=2 * REC, policy=policy)
        s = eng.add_store(path)
        a = eng.request(s, *aligned[0])
        b = eng.request(s, *aligned[1], exact=False)
        eng.wait(a), eng.wait(b)
        before = eng.memory()
        with pytest.raises(E.CacheFullError):
            eng.request(s, *aligned[2])
        assert eng.memory() == before
        eng.release(a), eng.release(b)
        eng.set_hint(s, *aligned[1], p_use=0.0)  # B was a wrong prediction
        eng.release(eng.request(s, *aligned[2]))  # evicts one of A/B
        t = eng.request(s, *aligned[survivor])
        assert eng.ticket_info(t)["kind"] == "hit", policy
        eng.release(t)
        eng.close()


def test_bad_requests_name_the_field(store):
    """Bad input -> typed error naming the field, before any allocation."""
    path, _, aligned, _ = store
    eng = make()
    s = eng.add_store(path)
    for kw, field in [
        (dict(length=0), "length"),
        (dict(priority=3), "priority"),
        (dict(store=9), "store"),
        (dict(digest=b"x"), "digest"),
        (dict(fast_digest=bytes(32)), "fast_digest"),
        (dict(digest=bytes(32), fast_digest=bytes(16)), "not both"),
        (dict(confidence=2.0), "confidence"),
    ]:
        args = dict(store=s, offset=0, length=REC) | kw
        with pytest.raises(E.StreamRequestError, match=field):
            eng.request(args.pop("store"), args.pop("offset"), args.pop("length"), **args)
    with pytest.raises(E.StreamRequestError, match="path"):
        eng.add_store(path.parent / "missing.bin")
    assert eng.memory()["allocated"] == 0
    # The runtime engine has no test hooks at all (they live in hebrus_mlx._testing).
    plain = se.StreamEngine(cache_bytes=REC)
    assert not any(hasattr(plain, h) for h in ("inject_fault", "hold", "set_read_delay_us"))


def test_io_summary_line():
    """AFN-019 metrics: bytes, hit rate (hits + joins), exposed wait and
    hidden fraction = 1 - exposed wait / exact read time (hand values)."""
    parts = [  # (counters, the text they give in the line)
        (
            dict(exact_bytes=2_000_000, predicted_bytes=1_000_000, wasted_bytes=500_000),
            "0.003 GB read (0.001 GB predicted, 0.001 GB wasted)",
        ),
        (dict(hits=2, joins=1, misses=3), "hit rate 50.0%"),
        (dict(exposed_wait_ns=250_000_000), "exposed wait 0.250 s"),
        (dict(hidden_fraction=0.75), "hidden 75%"),
        (dict(latency_p50_ns=1e6, latency_p99_ns=4e6), "p50/p99 1.00/4.00 ms"),
    ]
    line = se.io_summary({k: v for counters, _ in parts for k, v in counters.items()})
    for _, text in parts:
        assert text in line, (text, line)
