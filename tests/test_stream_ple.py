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
from support.fault_injection import FaultyEngine

from hebrus_mlx.artifact import ple_pages
from hebrus_mlx.loader import DEMO_DIR, load_model
from hebrus_mlx.loading.plan import plan_ple
from hebrus_mlx.loading.settings import StreamSettings
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream.ple import StreamedNGramTable, attach_ple
from hebrus_mlx.stream.switch import StreamedSwitchGLU

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


def _run(model, ids, chunk):
    cache, outs = model.make_cache(), []
    for i in range(0, len(ids), chunk):
        out = model(mx.array([ids[i : i + chunk]]), cache)
        mx.eval(out)
        outs.append(np.array(out))
    return outs


@pytest.mark.parametrize("chunk,pages", [(6, 256), (1, 18)])
def test_streamed_ple_bit_identical_to_resident(chunk, pages):
    """AFN-003/AFN-019: prefill chunks and single-token decode with PLE rows
    from verified page snapshots give logits bitwise equal to resident PLE;
    the pages are requested as exact P0 reads from the token ids before the
    layer runs (the gather joins or hits them), each page read whole and
    verified. (18 pages is the whole demo store; the wave path under a
    small cache is covered by the load() test below.)"""
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
    eng = attach_ple(model, str(DEMO_DIR), FaultyEngine(cache_bytes=1 << 22, threads=2))
    # Every read fails (the lookahead read alone may absorb a single fault).
    eng.inject_fault("digest", 1000)
    with pytest.raises(RuntimeError, match="XXH3-128 mismatch"):  # the demo's pages carry fast checks
        _run(model, ids, 4)
    eng.inject_fault("digest", 0)
    assert eng.memory()["pinned_slots"] == 0 and eng.counters()["errors"] >= 1
    np.testing.assert_array_equal(_run(model, ids, 4)[0], want[0])


def _prefill_decode(model, ids, n):
    """Prefill ids[:n] in one call, then feed the rest one token at a time."""
    cache, outs = model.make_cache(), []
    for part in [ids[:n]] + [[t] for t in ids[n:]]:
        out = model(mx.array([part]), cache)
        mx.eval(out)
        outs.append(np.array(out))
    return outs


def test_load_streams_experts_and_ple_bit_identical(monkeypatch):
    """AFN-003/AFN-019 (issue 6): load() with expert_cache_gb and
    ple_cache_gb streams both through one engine - the PLE page stores are
    never read into memory (PleReader.read_page refused) and only the PLE
    tables and routed experts are left out of the strict load - and a 9-token
    prefill + 6 decode steps give logits bitwise equal to the resident load.
    The PLE cache holds 2 pages of 64 KiB, fewer than one prefill call
    needs, so gather_rows works in waves (waiting for lookahead reads)."""
    ids = np.random.default_rng(3).integers(2, 4000, 15).tolist()
    want = _prefill_decode(load_model(DEMO_DIR), ids, 9)

    def refuse(*a, **k):
        raise AssertionError("PLE page read outside the engine")

    monkeypatch.setattr(ple_pages.PleReader, "read_page", refuse)
    model = load_model(DEMO_DIR, expert_cache_gb=0.001, ple_cache_gb=2 * 65536 / 2**30)
    assert isinstance(model.model.layers[0].ple.ple_embedding.ngram_embedding, StreamedNGramTable)
    assert isinstance(model.model.layers[0].mlp.switch_mlp, StreamedSwitchGLU)
    assert model.streaming.experts.engine is model.streaming.engine
    got = _prefill_decode(model, ids, 9)
    assert len(got) == len(want) == 7
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    c, mem = model.streaming.engine.counters(), model.streaming.engine.memory()
    assert c["errors"] == 0 and c["evictions"] > 0
    assert mem["capacity"] < 3 * 65536 + (1 << 20) and mem["pinned_slots"] == 0 and mem["tickets"] == 0


def test_plan_ple_fields():
    """Contract control: the PLE plan stays resident when the tables fit,
    streams whole pages when forced or when they do not, and a budget below
    one page is a ValueError naming the field."""
    assert plan_ple(100, 10, 10, available=1000, reserve=500) is None
    assert plan_ple(100, 10, 10, available=1000, reserve=500, ple_cache_gb=25 / 2**30) == 20
    assert plan_ple(1000, 10, 100, available=1000, reserve=500) == 500
    with pytest.raises(ValueError, match="ple_cache_gb"):
        plan_ple(100, 10, 10, 1000, 500, ple_cache_gb=5 / 2**30)
    with pytest.raises(ValueError, match="ple_cache_gb"):
        StreamSettings(ple_cache_gb=0)  # the range: checked once, where the settings are made
    with pytest.raises(ValueError, match="available memory"):
        plan_ple(1000, 10, 100, available=1000, reserve=995)
