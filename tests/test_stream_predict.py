"""Tests for cross-layer route prediction (issue 13): hebrus_mlx/stream/predict.py, its hooks in
Streaming / StreamedSwitchGLU / the Qwen4Exp graph, and the engine's advisory read-ahead
(metal_ext/engine.cpp: staging rows, a prediction never displaces an exact record, a hit
promotes it).

Provenance: the reference for every streamed run is the same shipped demo artifact loaded resident
(ExpertMajorReader, not the engine); the predictors' candidates are checked against numpy top-k
of router probabilities the test computes from the model's own gate weights. Engine records are
synthetic bytes the test writes.
"""

import hashlib

import mlx.core as mx
import numpy as np
import pytest
from support.chunked_greedy import chunked_greedy
from support.stream_store import cache_gb

from hebrus_mlx import cli
from hebrus_mlx.commands import cli_args
from hebrus_mlx.errors import UsageError
from hebrus_mlx.loader import DEMO_DIR, load_model
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream import predict as P

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")

PREDICTORS = ["off", "previous", "router-reuse:1", "router-reuse:2", "hyper-reuse"]


def test_parse_prefetch_and_typed_errors():
    assert P.parse_prefetch("router-reuse:2") == P.PrefetchSpec("router-reuse", 2)
    assert P.parse_prefetch("hyper-reuse").name == "hyper-reuse"
    assert P.parse_prefetch("router-reuse").name == "router-reuse:1"
    for bad, field in (
        ("bogus", "prefetch"),
        ("hyper-reuse:2", "prefetch"),
        ("router-reuse:3", "prefetch"),
        ("router-reuse:x", "prefetch"),
        ("previous:2", "prefetch"),
    ):
        with pytest.raises(UsageError) as e:
            P.parse_prefetch(bad)
        assert e.value.field == field, bad
    with pytest.raises(UsageError, match="prefetch-budget"):
        P.parse_prefetch("hyper-reuse", budget=0)
    p = cli_args.ArgumentParser()
    cli_args.add_prefetch_argument(p)
    assert cli_args.prefetch_from_args(p.parse_args([])) is None
    assert cli_args.prefetch_from_args(p.parse_args(["--prefetch", "router-reuse:2"])).depth == 2
    with pytest.raises(UsageError) as e:  # refused by the flag's type (hebrus_mlx.flags)
        p.parse_args(["--prefetch-threshold", "1.5"])
    assert e.value.field == "--prefetch-threshold"


def test_cli_bad_prefetch_is_one_line(capsys):
    assert cli.main(["generate", "--prefetch", "router-reuse:9", "-m", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefetch" in err[0] and "depth" in err[0]


def test_candidates_are_top_budget_by_probability_with_threshold():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(64), size=1).astype(np.float32)
    got = np.array(P.candidates(mx.array(probs), 6, 0.0))
    np.testing.assert_array_equal(got, np.argsort(-probs[0])[:6])
    cut = float(np.sort(probs[0])[::-1][2])  # the third most probable passes, the fourth does not
    got = np.array(P.candidates(mx.array(probs), 6, cut))
    np.testing.assert_array_equal(got[:3], np.argsort(-probs[0])[:3])
    assert (got[3:] == 0xFFFFFFFF).all()


def _cache_gb(model_rows_fraction):
    return cache_gb(DEMO_DIR, model_rows_fraction)[0]


def _greedy(model, prompt, steps, chunk):
    """(tokens, last-row logits of the prefill and of each step)."""
    tokens, logits = chunked_greedy(model, prompt, steps, chunk)
    return tokens, [out[-1] for out in logits[len(logits) - steps - 1 :]]


@pytest.fixture(scope="module")
def resident_run():
    model = load_model(DEMO_DIR)
    prompt = np.random.default_rng(3).integers(2, model.args.vocab_size, 7).tolist()
    return prompt, _greedy(model, prompt, 16, 4)


@pytest.mark.parametrize("fraction", [0.05, 0.2], ids=["5pct", "20pct"])
@pytest.mark.parametrize("prefetch", PREDICTORS)
def test_every_predictor_is_bit_identical_to_resident(prefetch, fraction, resident_run):
    """Tokens and last-position logits equal the resident run for every predictor and cache
    size; the ahead predictors really issue reads from the graph, and exact requests use them."""
    prompt, (want_tokens, want_logits) = resident_run
    model = load_model(DEMO_DIR, expert_cache_gb=_cache_gb(fraction), prefetch=prefetch)
    st = model.streaming
    assert st.prefetch.name == P.parse_prefetch(prefetch).name
    assert st.max_chunk_tokens >= 4
    tokens, logits = _greedy(model, prompt, 16, 4)  # the resident run's chunking
    assert tokens == want_tokens
    for a, b in zip(logits, want_logits):
        np.testing.assert_array_equal(a, b)
    c = st.engine.counters()
    assert c["errors"] == 0 and st.engine.memory()["pinned_slots"] == 0
    if prefetch == "off":
        assert c["predicted_reads"] == 0
    elif prefetch != "previous" or fraction == 0.05:
        # (At 20% the previous token's experts are still cached: its hints read nothing.)
        assert c["predicted_reads"] > 0
        # At least some predictions were used by the exact reads they anticipated.
        assert c["predicted_hits"] + c["predicted_joins"] > 0
    line = se.io_summary(c, st.prefetch)
    assert f"prefetch {st.prefetch.name}: timely recall" in line and "precision" in line


def test_default_predictor_is_bit_identical_to_off(resident_run):
    """The loader's default read-ahead (no --prefetch) is stream.predict.DEFAULT, really predicts,
    and gives the same tokens and logits as prefetch off (and as the resident run) at 5%."""
    prompt, (want_tokens, want_logits) = resident_run
    runs = {}
    for prefetch in (None, "off"):
        model = load_model(DEMO_DIR, expert_cache_gb=_cache_gb(0.05), prefetch=prefetch)
        st = model.streaming
        runs[prefetch] = _greedy(model, prompt, 16, 4), st.prefetch.name, st.engine.counters()
        st.engine.close()
    (tokens, logits), name, c = runs[None]
    assert name == P.parse_prefetch(P.DEFAULT).name and c["predicted_reads"] > 0
    (off_tokens, off_logits), off_name, off_c = runs["off"]
    assert off_name == "off" and off_c["predicted_reads"] == 0
    assert tokens == off_tokens == want_tokens
    for a, b in zip(logits, off_logits):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs /proc")
@pytest.mark.parametrize("prefetch", ["router-reuse:1", "hyper-reuse"])
def test_a_dropped_or_closed_predicting_model_leaves_no_thread(prefetch):
    """The engine's reader threads go with the model: closed explicitly, or dropped after decoding
    with a predictor - by reference counting alone (the cyclic GC is off here), so no reference
    cycle through the predictor (which holds the decoder layers) keeps an engine and its threads
    alive until some later collection."""
    import gc
    import os

    tids = lambda: set(os.listdir("/proc/self/task"))  # noqa: E731
    # MLX starts threads of its own on first use and keeps them for the process (the default
    # stream's scheduler thread on the first eval, a 4-thread I/O pool on the first mx.load, which
    # loading the dense weights does): start them before the baseline.
    mx.eval(mx.load(str(DEMO_DIR / "model.safetensors")))
    for close in (True, False):
        before = tids()
        gc.disable()
        try:
            model = load_model(DEMO_DIR, expert_cache_gb=_cache_gb(0.05), prefetch=prefetch)
            assert len(tids() - before) >= 8  # the engine's readers are running
            _greedy(model, [5, 6, 7], 3, 4)
            assert model.streaming.engine.counters()["predicted_reads"] > 0
            if close:
                model.streaming.engine.close()
                assert tids() - before == set()
            del model
            assert tids() - before == set(), f"close={close}"
        finally:
            gc.enable()


def test_router_reuse_predicts_the_target_layers_own_router(monkeypatch):
    """router-reuse:D issues, for layer l+D, the top-k of layer l+D's gate applied to layer l's
    MoE input (recomputed here with numpy from the captured input and the gate weights)."""
    model = load_model(DEMO_DIR, expert_cache_gb=_cache_gb(0.2), prefetch="router-reuse:2")
    st = model.streaming
    seen = {}
    real = st.switches[0].predict_after_resolve
    inputs = {}

    orig = st.before_router

    def spy_before(layer, streams, x):
        inputs[layer] = x
        return orig(layer, streams, x)

    def spy_predict(self_layer):
        def f(target, cands):
            seen[self_layer] = (target, cands)
            return type(real.__self__).predict_after_resolve(st.switches[self_layer], target, cands)

        return f

    monkeypatch.setattr(st, "before_router", spy_before)
    for i, sw in enumerate(st.switches):
        monkeypatch.setattr(sw, "predict_after_resolve", spy_predict(i))
    cache = model.make_cache()
    mx.eval(model(mx.array([[5, 6, 7]]), cache))
    assert not seen  # prefill chunks are not predicted
    mx.eval(model(mx.array([[9]]), cache))
    L = len(model.model.layers)
    assert sorted(seen) == list(range(L - 2))
    for layer, (target, cands) in seen.items():
        assert target == layer + 2
        x = np.array(inputs[layer], dtype=np.float32).reshape(-1)
        w = np.array(model.model.layers[target].mlp.gate.weight, dtype=np.float32)
        logits = w @ x
        want = np.argsort(-logits, kind="stable")[: model.args.num_experts_per_tok]
        np.testing.assert_array_equal(np.sort(np.array(cands)), np.sort(want))


def test_resident_experts_refuse_a_predictor():
    with pytest.raises(UsageError, match="prefetch"):
        load_model(DEMO_DIR, prefetch="hyper-reuse")
    with pytest.raises(UsageError, match="prefetch"):  # only the PLE pages stream
        load_model(DEMO_DIR, ple_cache_gb=4 * 65536 / 2**30, prefetch="router-reuse:1")
    assert load_model(DEMO_DIR, ple_cache_gb=4 * 65536 / 2**30, prefetch="off").streaming.prefetch is None


# -- engine: advisory read-ahead ------------------------------------------------------------------


def _arena_engine(tmp_path, rows, n=8, record=4096, policy="lru"):
    blob = bytes(np.random.default_rng(1).integers(0, 256, n * record, dtype=np.uint8))
    path = tmp_path / "recs.bin"
    path.write_bytes(blob)
    eng = se.StreamEngine(cache_bytes=1 << 16, threads=2, policy=policy)
    aid, _ = eng.create_arena([record], rows)
    digests = [hashlib.sha256(blob[i * record : (i + 1) * record]).digest() for i in range(n)]
    table = eng.register_table(eng.add_store(path), [i * record for i in range(n)], [record] * n, digests, arena=aid)
    return eng, aid, table


def _exact(eng, table, ids):
    rows, lease = eng.resolve(table, mx.array(ids, mx.uint32))
    mx.eval(eng.release_after(rows, lease))


def _settle(eng):
    for _ in range(2000):
        if eng.memory()["inflight_reads"] == 0 and eng.memory()["queued_reads"] == 0:
            return
        import time

        time.sleep(0.001)


def test_prediction_never_displaces_an_exact_record(tmp_path):
    eng, aid, table = _arena_engine(tmp_path, rows=4)
    _exact(eng, table, [0, 1, 2, 3])  # every row holds an exact record
    eng.reset_counters()
    mx.eval(eng.prefetch(table, mx.array([4, 5], mx.uint32)))
    _settle(eng)
    c = eng.counters()
    assert c["predicted_reads"] == 0 and c["evictions"] == 0
    _exact(eng, table, [0, 1, 2, 3])
    assert eng.counters()["exact_misses"] == 0  # all four still cached
    eng.close()


def test_staging_rows_hold_predictions_and_a_hit_promotes(tmp_path):
    eng, aid, table = _arena_engine(tmp_path, rows=4)
    eng.set_staging(aid, 1)
    _exact(eng, table, [0, 1, 2])
    _exact(eng, table, [3])  # over its share: recycles the oldest exact row (0), not the free one
    mx.eval(eng.prefetch(table, mx.array([5], mx.uint32)))
    _settle(eng)
    eng.reset_counters()
    mx.eval(eng.prefetch(table, mx.array([6], mx.uint32)))  # displaces prediction 5, not an exact record
    _settle(eng)
    _exact(eng, table, [1, 2, 3, 6])
    c = eng.counters()
    assert c["predicted_reads"] == 1 and c["predicted_hits"] == 1 and c["exact_misses"] == 0
    # 6 is exact now: the next exact miss recycles an exact row and the staging row is free again.
    _exact(eng, table, [7])
    mx.eval(eng.prefetch(table, mx.array([0], mx.uint32)))
    _settle(eng)
    assert eng.counters()["predicted_reads"] == 2
    with pytest.raises(Exception, match="staging"):
        eng.set_staging(aid, 4)
    eng.close()


@pytest.mark.parametrize("policy, evicted", [("lru", 1), ("clock", 0)])
def test_clock_gives_a_second_chance_where_lru_keeps_recency(tmp_path, policy, evicted):
    """Records 0, 1, 2 loaded in that order, then hit 1, 0, 2 (every reference bit set): LRU
    evicts the least recent (1); CLOCK's hand clears all three bits and takes the first on the
    ring (0). The survivor is then a hit, the victim a miss."""
    eng, aid, table = _arena_engine(tmp_path, rows=3, policy=policy)
    for i in (0, 1, 2):
        _exact(eng, table, [i])
    for i in (1, 0, 2):
        _exact(eng, table, [i])
    _exact(eng, table, [3])
    eng.reset_counters()
    _exact(eng, table, [evicted])
    assert eng.counters()["exact_misses"] == 1
    eng.reset_counters()
    _exact(eng, table, [2])  # never the victim under either policy
    assert eng.counters()["exact_misses"] == 0
    eng.close()
