"""Tests for hebrus_mlx/stream/ple.py: PLE rows streamed from the demo
artifact's page stores.

Provenance: the reference is the same artifact loaded resident by the
artifact loader (pages read and verified by PleReader: Python pread +
hashlib), an independent read path; prompts are seeded random ids
(contract control).
"""

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream.ple import StreamedNGramTable, attach_ple
from hebrus_mlx.utils import DEMO_DIR, load_model

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


def _run(model, ids, chunk):
    cache, outs = model.make_cache(), []
    for i in range(0, len(ids), chunk):
        out = model(mx.array([ids[i:i + chunk]]), cache)
        mx.eval(out)
        outs.append(np.array(out))
    return outs


@pytest.mark.parametrize("chunk,pages", [(6, 256), (1, 18)])
def test_streamed_ple_bit_identical_to_resident(chunk, pages):
    """AFN-003/AFN-019: prefill chunks and single-token decode with PLE rows
    from verified page snapshots give logits bitwise equal to resident PLE;
    the pages are requested as exact P0 reads from the token ids before the
    layer runs (the gather joins or hits them), each page read whole and
    verified. (gather_rows does not wait for in-flight lookahead reads to
    drain when the cache is full, so the cache must hold one call's pages
    of every table: 18 here, the whole demo store.)"""
    ids = np.random.default_rng(2).integers(2, 4000, 24).tolist()
    want = _run(load_model(DEMO_DIR), ids, chunk)
    model = load_model(DEMO_DIR)
    page = 65536
    eng = attach_ple(model, str(DEMO_DIR), se.StreamEngine(cache_bytes=pages * page, threads=2))
    assert isinstance(model.model.layers[0].ple.ple_embedding.ngram_embedding, StreamedNGramTable)
    got = _run(model, ids, chunk)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    c, mem = eng.counters(), eng.memory()
    assert c["errors"] == 0 and c["predicted_bytes"] == 0
    assert c["exact_bytes"] == c["misses"] * page
    assert c["hits"] + c["joins"] > c["misses"] > 0
    assert mem["pinned_slots"] == 0 and mem["tickets"] == 0


def test_corrupt_ple_page_fails_cleanly():
    """AFN-010: a page failing its digest fails the step with the engine's
    message, pins nothing, and the next sequence matches resident."""
    ids = [5, 77, 300, 9]
    want = _run(load_model(DEMO_DIR), ids, 4)
    model = load_model(DEMO_DIR)
    eng = attach_ple(model, str(DEMO_DIR), se.StreamEngine(cache_bytes=1 << 22, threads=2, testing=True))
    # Every read fails (the lookahead read alone may absorb a single fault).
    eng.inject_fault("digest", 1000)
    with pytest.raises(RuntimeError, match="SHA-256 mismatch"):
        _run(model, ids, 4)
    eng.inject_fault("digest", 0)
    assert eng.memory()["pinned_slots"] == 0 and eng.counters()["errors"] >= 1
    np.testing.assert_array_equal(_run(model, ids, 4)[0], want[0])
