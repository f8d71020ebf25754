"""Tests for the fixed-page (PLE) path of hebrus_mlx/stream/engine.py.

Provenance: the page store is written by the test from a seeded RNG and the
expected rows are sliced from those bytes with the affine rule of AFN-003
(contract control); digests come from hashlib (independent cross-check).
"""

import hashlib

import mlx.core as mx
import numpy as np
import pytest
from support.fault_injection import FaultyEngine

from hebrus_mlx.stream import engine as se

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")

PAGE, HEADER, ROW, RPP, PAGES = 4096, 64, 40, 100, 20


@pytest.fixture
def pages(tmp_path):
    rng = np.random.default_rng(9)
    data = rng.integers(0, 256, PAGE * PAGES, dtype=np.uint8).tobytes()
    path = tmp_path / "ple.bin"
    path.write_bytes(data)
    digests = [hashlib.sha256(data[p * PAGE : (p + 1) * PAGE]).digest() for p in range(PAGES)]
    return path, data, digests


def expected_row(data, r):
    p, slot = divmod(r, RPP)
    start = p * PAGE + HEADER + slot * ROW
    return data[start : start + ROW]


def open_pages(pages, **kw):
    path, _, digests = pages
    eng = FaultyEngine(cache_bytes=8 * PAGE, threads=2, **kw)
    table = eng.register_table(eng.add_store(path), [p * PAGE for p in range(PAGES)], [PAGE] * PAGES, digests)
    return eng, table


def test_rows_come_from_deduplicated_verified_pages(pages):
    """AFN-003/AFN-019 H1: 16 rows per token, each unique page read once,
    rows copied from the verified snapshot, ids computed in the graph."""
    _, data, _ = pages
    eng, table = open_pages(pages)
    tokens = mx.array([[3, 17, 3, 250], [999, 1, 2, 1500]])
    row_ids = (tokens * 7 + 11) % (RPP * PAGES)  # a stand-in n-gram hash
    early = eng.prefetch(table, row_ids.reshape(-1) // RPP, priority=se.P0, exact=True)
    mx.async_eval(early)
    out = eng.gather_rows(table, row_ids, RPP, ROW, HEADER, layer=0)
    mx.eval(out, early)
    ids = np.array(row_ids)
    assert out.shape == (2, 4, ROW)
    for i, r in np.ndenumerate(ids):
        assert np.array(out[i]).tobytes() == expected_row(data, int(r)), r
    c = eng.counters()
    unique_pages = len(set((ids // RPP).reshape(-1).tolist()))
    assert c["misses"] == unique_pages and c["predicted_bytes"] == 0
    assert c["exact_bytes"] == unique_pages * PAGE
    assert eng.memory()["pinned_slots"] == 0


def test_corrupt_page_publishes_no_row(pages):
    """AFN-003: a page failing its digest yields an error and no row; the
    retry reads a fresh snapshot."""
    _, data, _ = pages
    eng, table = open_pages(pages)
    eng.inject_fault("digest", 1)
    bad = eng.gather_rows(table, mx.array([5, 250]), RPP, ROW, HEADER)
    with pytest.raises(RuntimeError, match="SHA-256 mismatch"):
        mx.eval(bad)
    m = eng.memory()
    assert m["pinned_slots"] == 0 and m["tickets"] == 0
    ok = eng.gather_rows(table, mx.array([5, 250]), RPP, ROW, HEADER)
    assert np.array(ok[1]).tobytes() == expected_row(data, 250)


def test_bad_geometry_is_refused_before_io(pages):
    """Bad input -> typed error naming the field, before any read."""
    eng, table = open_pages(pages)
    with pytest.raises(se.StreamError, match="rows_per_page"):
        eng.gather_rows(table, mx.array([0]), RPP, ROW, PAGE)
    assert eng.counters()["requests"] == 0
