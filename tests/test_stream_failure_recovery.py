"""A failed streamed step leaves the arena as it found it (no pinned slot, no open ticket), and the
retry on the same cache, or a fresh sequence, gives the tokens of a run that never failed.

Why it could fail: MLX stores a failed stream task's error and the main thread raises it at its
next enqueue, so an evaluation can stop building the step's graph after a resolve (which pins its
records when it runs) was queued but before its release_after was: those pins outlived the step
and the arena filled up on the retry ("arena 0 full"). Leases are now also released when the
lease dies unreleased (metal_ext/ops.cpp). And the P1 hint of the next step hung on the failed
step's routes, so that step evaluated the failed graph again; generate now forgets them on failure.
"""

import gc
import time

import mlx.core as mx
import pytest
from test_stream_engine_arena import experts, open_arena  # noqa: F401, F811 (the fixture)

from hebrus_mlx.stream import engine as se

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


def _idle(eng, timeout=5.0):
    """The engine's pins and tickets once whatever the failed evaluation queued has run."""
    gc.collect()
    end = time.monotonic() + timeout
    while True:
        m = eng.memory()
        if (m["pinned_slots"], m["tickets"]) == (0, 0) or time.monotonic() > end:
            return m["pinned_slots"], m["tickets"]
        time.sleep(0.02)
        gc.collect()


def test_resolve_queued_before_the_error_surfaced_is_released(experts):  # noqa: F811
    """A resolve the main thread queued before a failed read's error stopped the evaluation (its
    release_after never queued) does not keep its records pinned."""
    eng, table, _ = open_arena(experts, rows=6)
    for _ in range(3):
        eng.inject_fault("eio", 1)
        rows_b, lease_b = eng.resolve(table, mx.array([[0]]))
        # Queued after the failing resolve; a long chain before its release_after gives the
        # worker time to fail while the main thread still builds.
        rows_g, lease_g = eng.resolve(table, mx.depends(mx.array([[1, 2]]), rows_b))
        v = rows_g.astype(mx.float32)
        for _ in range(4000):
            v = v + 1.0
        outs = [eng.release_after(rows_b.astype(mx.float32), lease_b), eng.release_after(v, lease_g)]
        with pytest.raises(RuntimeError, match="I/O error"):
            mx.eval(*outs)
        del rows_b, lease_b, rows_g, lease_g, v, outs
        assert _idle(eng) == (0, 0)
    rows, lease = eng.resolve(table, mx.array([[1, 2, 3, 4, 5, 6]]))  # the whole arena
    mx.eval(eng.release_after(rows.astype(mx.float32), lease))
    assert _idle(eng) == (0, 0)


# -- the demo model, streamed at a 5% expert cache ------------------------------------------------

PROMPT = list(range(11, 31)) * 2 + [7, 40, 99, 3]
STEPS = 4


def _streamed(prefetch):
    """The demo model at a 5% cache, its experts read by a FaultyEngine; ``prefetch`` off or
    previous (the P1 hint: its reads fail too, silently, and the exact reads then fail the step)."""
    from support.fault_injection import FaultyEngine
    from test_stream_model import _cache_gb, _experts_store

    from hebrus_mlx.artifact import expert_major as em
    from hebrus_mlx.loader import DEMO_DIR, load_model
    from hebrus_mlx.stream import experts as SE
    from hebrus_mlx.stream.streaming import Streaming
    from hebrus_mlx.stream.switch import attach

    gb, rows = _cache_gb(str(DEMO_DIR))
    model = load_model(DEMO_DIR, expert_cache_gb=gb)
    path, fam, codec = _experts_store(str(DEMO_DIR))
    with em.ExpertMajorReader(path, fam, codec) as reader:
        eng = FaultyEngine(cache_bytes=1 << 16, threads=2)
        experts = SE.StreamedExperts(eng, reader, rows, prefetch_previous=prefetch == "previous")
    switches = attach([layer.mlp for layer in model.model.layers], experts)
    model.streaming = Streaming(eng, experts, switches, prefetch=prefetch, layers=model.model.layers)
    return model, eng


def _decode(model, cache, last, steps=STEPS):
    tokens = []
    for _ in range(steps):
        out = model(mx.array([[last]]), cache)
        last = int(mx.argmax(out[0, -1]).item())
        tokens.append(last)
    return tokens


def _greedy(model):
    from hebrus_mlx.generate import prefill

    cache = model.make_cache()
    prefill(model, mx.array(PROMPT[:-1]), cache)
    return _decode(model, cache, PROMPT[-1])


@pytest.fixture(scope="module", params=["off", "previous"])
def streamed(request):
    model, eng = _streamed(request.param)
    want = _greedy(model)
    yield model, eng, want
    model.streaming.close()


def _fail(eng, step):
    """Run ``step`` with every read failing (EIO); the typed error it raises."""
    from hebrus_mlx.stream import errors

    def typed():
        try:
            step()
        except Exception as e:  # a bare mx.eval raises the engine's tagged RuntimeError
            raise errors.translate(e) from e

    eng.inject_fault("eio", 1000)
    try:
        with pytest.raises(errors.StreamIOError, match="I/O error"):
            typed()
    finally:
        eng.inject_fault("eio", 0)


def test_failed_chunk_leaves_no_routes_for_the_hint(streamed):
    """A failed prefill chunk's routes (outputs of its partly unevaluated graph) are forgotten: the
    next step's P1 hint would evaluate that graph again, its resolves and their pins included (under
    load, a fresh sequence then failed with "arena 0 full")."""
    from hebrus_mlx.generate import prefill

    model, eng, want = streamed
    cache = model.make_cache()
    prefill(model, mx.array(PROMPT[:12]), cache)
    assert all(s._prev is not None for s in model.streaming.switches)
    _fail(eng, lambda: prefill(model, mx.array(PROMPT[12:-1]), cache))
    assert all(s._prev is None for s in model.streaming.switches)
    assert _idle(eng) == (0, 0)
    assert _greedy(model) == want


@pytest.mark.parametrize("split", [18, 6])
def test_prefill_eio_then_retry_gives_the_clean_tokens(streamed, split):
    """(a)+(b): a prefill chunk failing with EIO leaves no pin or ticket, the cache holds the chunks
    before it, and prefilling the rest on the same cache gives the greedy tokens of a run that never
    failed; (c) so does a fresh sequence."""
    from hebrus_mlx.generate import prefill

    model, eng, want = streamed
    cache = model.make_cache()
    prefill(model, mx.array(PROMPT[:split]), cache)
    _fail(eng, lambda: prefill(model, mx.array(PROMPT[split:-1]), cache))
    assert _idle(eng) == (0, 0)
    assert split <= cache.offset < len(PROMPT) - 1
    prefill(model, mx.array(PROMPT[cache.offset : -1]), cache)
    assert _decode(model, cache, PROMPT[-1]) == want
    assert _idle(eng) == (0, 0)
    assert _greedy(model) == want


def test_decode_eio_leaves_the_arena_as_it_was(streamed):
    """(b)+(c) for a decode step: pins and tickets back to none, then a fresh sequence gives the
    clean tokens."""
    from hebrus_mlx.generate import prefill

    model, eng, want = streamed
    cache = model.make_cache()
    prefill(model, mx.array(PROMPT[:-1]), cache)
    model.streaming.reset()
    _fail(eng, lambda: mx.eval(model(mx.array([[PROMPT[-1]]]), cache)))
    assert _idle(eng) == (0, 0)
    model.streaming.reset()
    assert _greedy(model) == want
    assert _idle(eng) == (0, 0)
