"""A slot is one verified snapshot (issue 10): the engine's de-duplication
key includes the record's expected SHA-256, so a request that carries a
digest is never served bytes that were published without checking that
digest (by a digest-less request or one expecting other bytes).

Provenance: the store is random bytes written by the test; expected digests
are hashlib's over the test's own copy of those bytes (contract control).
The corruption is made on disk by the test after the first read.
"""

import hashlib

import pytest
from support.fault_injection import FaultyEngine
from support.stream_store import REC, flip_byte, random_store

from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream.errors import DigestMismatchError

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


@pytest.fixture
def store(tmp_path):
    return random_store(tmp_path, 8, seed=10)


def make():
    # direct=False: the corrupted-store case must read what the test wrote
    # through the page cache, on any filesystem.
    return FaultyEngine(cache_bytes=8 * REC, threads=1, direct=False)


def corrupt(path, offset):
    flip_byte(path, offset)


def test_digest_request_is_not_served_an_unverified_slot(store):
    """A digest-less request publishes a record; the store is then corrupted.
    A request carrying the record's (true) digest must not hit that slot: it
    reads again and the corrupt bytes are refused, typed."""
    path, data = store
    eng = make()
    s = eng.add_store(path)
    t = eng.request(s, REC, REC)  # no digest: fills a slot unverified
    assert eng.read(t) == data[REC : 2 * REC]
    eng.release(t)
    corrupt(path, REC + 7)
    want = hashlib.sha256(data[REC : 2 * REC]).digest()
    t = eng.request(s, REC, REC, digest=want)
    assert eng.ticket_info(t)["kind"] == "miss"
    with pytest.raises(DigestMismatchError):
        eng.read(t)
    eng.release(t)
    eng.close()


def test_digest_request_does_not_join_an_unverified_read(store):
    """The same while the digest-less read is still queued: the digest
    request must not join it (it would be served unverified bytes)."""
    path, data = store
    eng = make()
    s = eng.add_store(path)
    eng.hold(True)
    a = eng.request(s, 0, REC)
    b = eng.request(s, 0, REC, digest=hashlib.sha256(b"other bytes").digest())
    assert eng.ticket_info(b)["kind"] == "miss"
    eng.hold(False)
    assert eng.read(a) == data[:REC]
    with pytest.raises(DigestMismatchError):
        eng.read(b)
    eng.release(a), eng.release(b)
    eng.close()


def test_different_digests_are_different_snapshots(store):
    """A slot verified against digest A never serves a request expecting
    digest B (one of them is wrong about the store: that one fails)."""
    path, data = store
    eng = make()
    s = eng.add_store(path)
    good = hashlib.sha256(data[:REC]).digest()
    t = eng.request(s, 0, REC, digest=good)
    assert eng.read(t) == data[:REC]
    eng.release(t)
    t = eng.request(s, 0, REC, digest=hashlib.sha256(b"x").digest())
    with pytest.raises(DigestMismatchError):
        eng.read(t)
    eng.release(t)
    # The same digest again is a hit on the verified slot.
    t = eng.request(s, 0, REC, digest=good)
    assert eng.ticket_info(t)["kind"] == "hit" and eng.read(t) == data[:REC]
    eng.release(t)
    eng.close()


# ---- the fast digest domain (XXH3-128, docs/INTEGRITY.md): the same property ------------------
def _xxh3(b):
    import xxhash  # the independent oracle (test extra)

    return xxhash.xxh3_128(b).digest()


def test_fast_request_is_not_served_a_slot_checked_in_another_domain(store):
    """A record read and published unverified, then SHA-256-verified; the store is then corrupted.
    A request carrying the record's (true) XXH3-128 must not hit either slot: it reads again and
    the corrupt bytes are refused. Its own domain's slot serves it afterwards only if verified."""
    path, data = store
    eng = make()
    s = eng.add_store(path)
    rec = data[2 * REC : 3 * REC]
    for kw in ({}, {"digest": hashlib.sha256(rec).digest()}):
        t = eng.request(s, 2 * REC, REC, **kw)
        assert eng.read(t) == rec
        eng.release(t)
    corrupt(path, 2 * REC + 11)
    t = eng.request(s, 2 * REC, REC, fast_digest=_xxh3(rec))
    info = eng.ticket_info(t)
    assert info["kind"] == "miss" and info["check"] == "xxh3-128" and info["has_digest"]
    with pytest.raises(DigestMismatchError, match="XXH3-128 mismatch"):
        eng.read(t)
    eng.release(t)
    eng.close()


def test_sha_request_is_not_served_a_fast_verified_slot(store):
    """The other way round: a slot verified by XXH3-128 never serves a SHA-256 request (or a
    digest-less one); the same fast digest again is a hit."""
    path, data = store
    eng = make()
    s = eng.add_store(path)
    rec = data[3 * REC : 4 * REC]
    t = eng.request(s, 3 * REC, REC, fast_digest=_xxh3(rec))
    assert eng.read(t) == rec
    eng.release(t)
    for kw in ({"digest": hashlib.sha256(rec).digest()}, {}):
        t = eng.request(s, 3 * REC, REC, **kw)
        assert eng.ticket_info(t)["kind"] == "miss", kw
        assert eng.read(t) == rec
        eng.release(t)
    t = eng.request(s, 3 * REC, REC, fast_digest=_xxh3(rec))
    assert eng.ticket_info(t)["kind"] == "hit" and eng.read(t) == rec
    eng.release(t)
    assert eng.counters()["misses"] == 3
    eng.close()


def test_fast_request_does_not_join_a_read_of_another_domain(store):
    """While a digest-less and a SHA-256 read of the record are queued, a fast request with a
    wrong digest starts its own read and fails alone; the others are served."""
    path, data = store
    eng = make()
    s = eng.add_store(path)
    eng.hold(True)
    a = eng.request(s, 0, REC)
    b = eng.request(s, 0, REC, digest=hashlib.sha256(data[:REC]).digest())
    c = eng.request(s, 0, REC, fast_digest=_xxh3(b"other bytes"))
    assert [eng.ticket_info(t)["kind"] for t in (a, b, c)] == ["miss"] * 3
    eng.hold(False)
    assert eng.read(a) == eng.read(b) == data[:REC]
    with pytest.raises(DigestMismatchError, match="XXH3-128"):
        eng.read(c)
    for t in (a, b, c):
        eng.release(t)
    eng.close()
