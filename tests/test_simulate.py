"""Issue 15: `hebrus-mlx simulate` - the timing model on hand-computable cases, the arena replay
against the trace cache simulator, the shipped profiles and the validation path on a tiny run.

Provenance: every expected number is derived by hand in the test from the machine and routes it
builds (contract controls); the LRU replay is cross-checked against traces.cachesim, an
independent implementation; record sizes are derived from the codec layout by hand."""

import json
import re

import numpy as np
import pytest
from support.fault_injection import FaultyEngine
from support.trace_fixture import generate_demo_trace

from hebrus_mlx import cli
from hebrus_mlx.commands import simulate as SC
from hebrus_mlx.errors import UsageError
from hebrus_mlx.simulate import model as S
from hebrus_mlx.simulate import projection as P
from hebrus_mlx.simulate import run as C
from hebrus_mlx.simulate.run import PROFILES_DIR as S_PROFILES
from hebrus_mlx.traces import cachesim

R = 1_000_000  # bytes per record in the hand cases


def machine(**kw):
    d = dict(name="hand", ssd_gbps={1: 1.0, 8: 8.0}, layer_s=1e-3, pre_router=0.5, threads=8)
    d.update(kw)
    return S.Machine(**d)


def test_io_time_interpolates_bandwidth_by_queue_depth_and_adds_verify():
    m = machine()
    assert m.io_time(1, R) == pytest.approx(1e-3)  # 1 MB at 1 GB/s
    assert m.io_time(4, R) == pytest.approx(4e-3 / 4)  # QD4: 4 GB/s (linear between 1 and 8)
    assert m.io_time(16, R) == pytest.approx(16e-3 / 8)  # beyond 8 threads: QD8's 8 GB/s
    assert m.io_time(0.5, R) == pytest.approx(0.5e-3)  # fractional averages read at QD1
    assert m.io_time(0, R) == 0.0
    v = machine(verify_gbps=0.5)
    assert v.io_time(2, R) == pytest.approx(2 * R / 2e9 + 2 * R / 0.5e9 / 2)


def test_demand_paging_hand_case():
    """L=2, E=4, k=1. Layer 0 always expert 0, layer 1 alternates 1, 2; an LRU arena of 2 records:
    stream 0,5,0,6,0,5,0,6 -> misses 0,5,6,5,6 = 5 of 8: layer 0 misses 1/4 records per token,
    layer 1 4/4; 1 MB at 1 GB/s = 0.25 + 1.0 ms exposed; compute 2 x 1 ms."""
    topk = np.array([[[0], [1]], [[0], [2]], [[0], [1]], [[0], [2]]])
    rep = S.replay(topk, 4, 2, "lru")
    assert rep.hit_rate == pytest.approx(3 / 8)
    assert rep.demand_misses.tolist() == pytest.approx([0.25, 1.0])
    g = S.ModelGeometry("hand", 2, 4, 1, R)
    p = S.project(machine(), g, rep, cache_gb=0, capacity=2, policy="lru", prefetch="off")
    assert p.exposed_ms == pytest.approx(1.25)
    assert p.token_ms == pytest.approx(3.25)
    assert p.tok_s == pytest.approx(1000 / 3.25)
    assert p.bytes_per_token == pytest.approx(1.25 * R)


def test_previous_token_prefetch_hand_case():
    """L=2, k=1, 2 arena rows of which 1 is staging, layer 0 always expert 0, layer 1 always
    expert 1 (record 5). Token 0: both miss; record 5 may not take a second exact row while an
    exact one can be recycled, so record 0 goes. Token 1: layer 0's hint reads record 0 into the
    free row (a predicted read), its exact lookup then uses it (promoted: now 2 exact rows);
    record 5 is a hit (its hint too). Token 2: everything hits. Per token: demand [1/3, 1/3],
    predicted used and read [1/3, 0]. Exposed: layer 0 max(io(1/3), io(2/3) - 0.5 ms window)
    = 1/3 ms, layer 1 io(1/3) = 1/3 ms; compute 2 ms."""
    topk = np.array([[[0], [1]]] * 3)
    rep = S.replay_arena(topk, 4, 2, "previous", staging=1)
    assert rep.demand_misses.tolist() == pytest.approx([1 / 3, 1 / 3])
    assert rep.predicted_used.tolist() == pytest.approx([1 / 3, 0])
    assert rep.predicted_reads.tolist() == pytest.approx([1 / 3, 0])
    assert rep.hit_rate == pytest.approx(2 / 3) and rep.timely_recall == pytest.approx(1 / 3)
    assert rep.precision == 1.0 and rep.predicted_wasted == 0.0
    # hints: token 1 both (one read, one hit), token 2 both hits -> 4 lookups, 3 hits over 3 tokens
    assert (rep.prefetch_lookups, rep.prefetch_hits) == pytest.approx((4 / 3, 1.0))
    g = S.ModelGeometry("hand", 2, 4, 1, R)
    p = S.project(machine(), g, rep, cache_gb=0, capacity=2, policy="lru", prefetch="previous")
    assert p.exposed_ms == pytest.approx(2 / 3)
    assert p.token_ms == pytest.approx(2 + 2 / 3)


def test_a_prediction_never_displaces_an_exact_record():
    """One row (no staging): the row always holds an exact record, so every hint is dropped and
    the replay is demand paging: 6 misses of 6, no predicted reads."""
    topk = np.array([[[0], [1]]] * 3)
    rep = S.replay(topk, 4, 1, "clock", "previous")
    assert rep.demand_misses.tolist() == [1.0, 1.0]
    assert rep.predicted_reads.sum() == 0 and rep.prefetch_lookups == 0


def test_router_reuse_predictions_are_issued_ahead_and_wasted_ones_counted():
    """router-reuse:1 hints layer l+1's predicted set after layer l's exact reads. L=2, k=1,
    8 rows (staging min(1, 2) = 1). Layer 1's routes are 1, 2, 3; its predictions 1, 2, 0: token
    0's is used by layer 1 (timely), token 1's too, token 2's (record 4) is wasted and layer 1
    misses record 7. Layer 0 (expert 0) misses once. The window is one layer of compute."""
    topk = np.array([[[0], [1]], [[0], [2]], [[0], [3]]])
    pred = np.full((3, 2, 1), -1)
    pred[:, 1, 0] = [1, 2, 0]
    rep = S.replay(topk, 4, 8, "clock", "router-reuse:1", predicted=pred)
    assert rep.demand_misses.tolist() == pytest.approx([1 / 3, 1 / 3])
    assert rep.predicted_used.tolist() == pytest.approx([0, 2 / 3])
    assert rep.predicted_reads.tolist() == pytest.approx([0, 1.0])
    assert rep.precision == pytest.approx(2 / 3) and rep.predicted_wasted == pytest.approx(1 / 3)
    p = S.project(
        machine(),
        S.ModelGeometry("hand", 2, 4, 1, R),
        rep,
        cache_gb=0,
        capacity=8,
        policy="clock",
        prefetch="router-reuse:1",
    )
    # layer 0: io(1/3); layer 1: max(io(1/3), io(4/3) - 1 ms) = 1/3 ms
    assert p.exposed_ms == pytest.approx(2 / 3)
    with pytest.raises(UsageError, match="predicted sets"):
        S.replay(topk, 4, 8, "clock", "router-reuse:1")


def _engine_counts(topk, E, rows, policy, prefetch, tmp_path, pred=None, one_by_one=False):
    """The same routes driven through the real StreamEngine arena (one layer at a time, hints
    landed before the next request, as the replay assumes). `one_by_one`: each hint its own
    prefetch op, landed before the next hint of the batch is requested (batch_landed=1)."""
    import time

    import mlx.core as mx

    T, L, k = topk.shape
    rec = 4096
    path = tmp_path / "store.bin"
    path.write_bytes(bytes(L * E * rec))
    eng = FaultyEngine(cache_bytes=rec, threads=2, policy=policy)
    # The readers are held while a prefetch op issues its hints, so they are all still in flight
    # (not evictable) until it returns, as the replay assumes; a read delay alone raced under load
    # (one CI-like run under a busy machine read 113 predicted records against the replay's 112).
    st = eng.add_store(str(path))
    aid, _ = eng.create_arena([rec], rows)
    table = eng.register_table(st, [i * rec for i in range(L * E)], [rec] * (L * E), arena=aid)
    if prefetch != "off":
        eng.set_staging(aid, min(k, rows // 4))

    def idle():  # every predicted read published (then it is evictable, as the replay assumes)
        for _ in range(5000):
            c = eng.counters()
            if c["predicted_bytes"] == c["predicted_reads"] * rec:
                return
            time.sleep(0.001)
        raise AssertionError("predicted reads did not land")

    def hints(ids, layer):
        for batch in [ids[i : i + 1] for i in range(len(ids))] if one_by_one else [ids]:
            eng.hold(True)
            try:
                mx.eval(eng.prefetch(table, mx.array(batch.astype(np.uint32)), priority=1, layer=layer))
            finally:
                eng.hold(False)
            idle()

    for t in range(T):
        for l in range(L):
            if prefetch == "previous" and t > 0:
                hints(topk[t - 1, l] + l * E, l)
            rows_, lease = eng.resolve(table, mx.array((topk[t, l] + l * E).astype(np.uint32))[None], layer=l)
            mx.eval(rows_)  # pinned
            if pred is not None and l + 1 < L:  # router-reuse:1, while layer l's rows are pinned
                ids = np.where(pred[t, l + 1] < 0, 2**32 - 1, pred[t, l + 1] + (l + 1) * E)  # -1: skipped
                hints(ids, l + 1)
            mx.eval(eng.release_after(rows_, lease))
    c = eng.counters()
    eng.close()
    return c


@pytest.mark.parametrize(
    "policy, prefetch", [("clock", "off"), ("clock", "previous"), ("lru", "previous"), ("clock", "router-reuse:1")]
)
def test_arena_replay_matches_the_engine_record_for_record(policy, prefetch, tmp_path):
    """The replay's arena against metal_ext's: same routes, same rows, same policy and staging ->
    the same exact misses, predicted reads and predicted hits (an independent implementation:
    the C++ engine)."""
    rng = np.random.default_rng(7)
    T, L, E, k = 40, 3, 12, 3
    topk = np.zeros((T, L, k), np.int64)
    for l in range(L):
        prev = rng.choice(E, k, replace=False)
        for t in range(T):
            keep = [e for e in prev if rng.random() < 0.5]
            rest = [e for e in rng.permutation(E) if e not in keep][: k - len(keep)]
            topk[t, l] = prev = np.array(keep + rest)
    # a noisy predictor: each routed expert kept with probability 0.6, else a random other one
    pred = np.where(rng.random(topk.shape) < 0.6, topk, rng.integers(0, E, topk.shape))
    pred = np.array([[list(dict.fromkeys(r)) + [-1] * (k - len(set(r))) for r in tok] for tok in pred])
    predicted_reads = 0
    for rows in (5, 12, 20):
        ahead = prefetch.startswith("router-reuse")
        c = _engine_counts(topk, E, rows, policy, prefetch, tmp_path, pred if ahead else None)
        rep = S.replay(topk, E, rows, policy, prefetch, predicted=pred if ahead else None)
        assert round(rep.demand_misses.sum() * T) == c["exact_misses"], (rows, c)
        assert round(rep.predicted_reads.sum() * T) == c["predicted_reads"], (rows, c)
        assert round(rep.predicted_hits * T) == c["predicted_hits"] + c["predicted_joins"], (rows, c)
        assert c["exact_misses"] > 0
        predicted_reads += c["predicted_reads"]
    assert (prefetch == "off") == (predicted_reads == 0)


@pytest.mark.parametrize("prefetch", ["previous", "router-reuse:1"])
def test_hints_that_land_within_their_batch_are_displaced_by_it_as_in_the_engine(prefetch, tmp_path):
    """Issue 23 §3: the old replay held a hint batch in flight while it was issued, so a later hint
    of the batch never displaced an earlier one. When each hint has landed (is released and
    evictable) before the next is requested, the engine lets the later hints displace it: in an
    arena smaller than one token's records (5 rows < 3 layers x 3) the old replay under-counts the
    engine's reads ahead (and misses others); with batch_landed=1 it matches them record for record."""
    rng = np.random.default_rng(11)
    T, L, E, k = 40, 3, 12, 3
    topk = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(T)])
    pred = np.where(rng.random(topk.shape) < 0.7, topk, rng.integers(0, E, topk.shape))
    pred = np.array([[list(dict.fromkeys(r)) + [-1] * (k - len(set(r))) for r in tok] for tok in pred])
    ahead = prefetch.startswith("router-reuse")
    differs = False
    for rows in (5, 12):
        c = _engine_counts(topk, E, rows, "clock", prefetch, tmp_path, pred if ahead else None, one_by_one=True)
        rep = S.replay(topk, E, rows, "clock", prefetch, predicted=pred if ahead else None, batch_landed=1.0)
        got = (round(rep.demand_misses.sum() * T), round(rep.predicted_reads.sum() * T), round(rep.predicted_hits * T))
        assert got == (c["exact_misses"], c["predicted_reads"], c["predicted_hits"] + c["predicted_joins"]), (rows, c)
        old = S.replay(topk, E, rows, "clock", prefetch, predicted=pred if ahead else None)
        if rows < L * k:
            # the old replay drops the hints the engine reads (and so counts other misses)
            assert round(old.predicted_reads.sum() * T) < c["predicted_reads"]
            assert round(old.demand_misses.sum() * T) != c["exact_misses"]
            differs = True
    assert differs


def test_reads_ahead_in_flight_hold_their_rows_through_the_exact_requests():
    """A read ahead still in flight at its layer's exact requests is not evictable (the engine
    indexes only ready, unpinned slots): an exact lookup of it joins it (the engine's
    predicted_joins, late recall). Hand case: 2 layers, top-1, 4 rows (1 staging row), a perfect
    router-reuse:1 predictor, every token new experts: each token layer 0 misses, its hint of layer
    1's expert is read, and layer 1's lookup is served by it: landed (a predicted hit) or still in
    flight (a join)."""
    T = 4
    topk = np.array([[[t % 4], [(t + 1) % 4]] for t in range(T)])
    pred = np.array([[[-1], [(t + 1) % 4]] for t in range(T)])
    landed = S.replay(topk, 4, 4, "clock", "router-reuse:1", predicted=pred)
    flying = S.replay(topk, 4, 4, "clock", "router-reuse:1", predicted=pred, landed=0.0)
    half = S.replay(topk, 4, 4, "clock", "router-reuse:1", predicted=pred, landed=0.5)
    for r in (landed, flying, half):
        assert r.predicted_hits == 1.0 and r.demand_misses.tolist() == [1.0, 0.0]
    assert landed.predicted_joins is None and flying.predicted_joins == 1.0 and half.predicted_joins == 0.5
    # in an arena smaller than a token's records with reads in flight: no row is lost or doubled
    rng = np.random.default_rng(5)
    topk = np.stack([np.stack([rng.choice(12, 3, replace=False) for _ in range(3)]) for _ in range(30)])
    for landed_frac in (0.0, 0.5):
        r = S.replay(topk, 12, 5, "clock", "previous", landed=landed_frac)
        assert 0 <= r.predicted_joins <= r.predicted_hits and r.demand_misses.sum() <= 9
    with pytest.raises(UsageError, match="landed"):
        S.replay(topk, 12, 5, "clock", "previous", landed=1.5)
    with pytest.raises(UsageError, match="batch_landed"):
        S.replay(topk, 12, 5, "clock", "previous", batch_landed=-0.1)


def test_warm_prefix_is_replayed_but_not_counted():
    topk = np.array([[[0], [1]]] * 2)
    assert S.replay(topk, 4, 2, "lru").hit_rate == pytest.approx(0.5)
    assert S.replay(topk, 4, 2, "lru", warm=topk).hit_rate == 1.0
    assert S.replay(topk, 4, 2, "lru", "previous", warm=topk).hit_rate == 1.0


def test_arena_replay_without_prediction_equals_cachesim_lru():
    rng = np.random.default_rng(3)
    topk = np.stack([np.stack([rng.choice(16, 3, replace=False) for _ in range(4)]) for _ in range(60)])
    stream = cachesim.access_stream(topk, 16)
    for cap in (3, 8, 20, 64):
        mine = S.replay_with_prefetch(topk, 16, cap, "off")
        ref = cachesim.simulate("lru", stream, cap)
        assert mine.demand_misses.sum() * len(topk) == pytest.approx(ref.misses)
        assert S.replay(topk, 16, cap, "lru").hit_rate == pytest.approx(ref.hit_rate)


def test_speculative_steps_and_union():
    """Acceptance 0.5, depth 1: (1 - 0.25) / 0.5 = 1.5 tokens per verify step; with no misses a
    step costs compute x (1 + 0.15)."""
    topk = np.array([[[0]], [[0]], [[1]], [[2]]])
    assert S.union_factor(topk, 1) == pytest.approx(3 / 4)  # windows {0,0} -> 1, {1,2} -> 2
    assert S.union_factor(topk, 0) == 1.0
    g = S.ModelGeometry("hand", 1, 4, 1, R)
    rep = S.replay(topk, 4, 4, "lru", warm=topk)  # everything cached
    p = S.project(
        machine(),
        g,
        rep,
        cache_gb=0,
        capacity=4,
        policy="lru",
        prefetch="off",
        draft_depth=1,
        acceptance=0.5,
        union=0.75,
    )
    assert p.token_ms == pytest.approx(1.0 * 1.15 / 1.5)


def test_real_geometry_comes_from_the_artifact_format():
    from hebrus_mlx.artifact import constants as K

    g = S.geometry_of_family(K.QWEN38_FLASH_NEXT)
    m, h = 640, 2560  # moe_intermediate_size, hidden: 4-bit weights + bf16 scales and biases per 64
    per = m * h // 2 + 2 * m * (h // 64) * 2
    assert (g.num_layers, g.num_experts, g.top_k, g.record_bytes) == (48, 512, 10, 3 * per) == (48, 512, 10, 2764800)


def test_expert_width_sizes_records_like_the_format():
    """Issue 23 §2/§3: a record at B bits is B*n/8 packed bytes plus a bf16 scale and bias per 64
    weights; for the widths the format registers it is the format's own stride."""
    from hebrus_mlx.artifact import constants as K
    from hebrus_mlx.artifact.expert_major import Geometry

    f = K.QWEN38_FLASH_NEXT
    n = 3 * 640 * 2560
    for b in (2, 3, 4, 6, 8):
        rec, stride = S.expert_record_bytes(f, f"affine{b}-g64")
        assert rec == n * b // 8 + n // 64 * 4 and stride % 4096 == 0 and stride - rec < 4096
    for name in ("affine4-g64", "affine8-g64"):  # registered: the same as the artifact's layout
        assert S.expert_record_bytes(f, name) == (Geometry(f, name).record_bytes, Geometry(f, name).record_stride)
        assert S.expert_codec(name) is K.CODECS[name]
    assert S.compute_scale(f, None, "affine2-g64") is None
    assert S.compute_scale(f, 9.3, "affine4-g64") == pytest.approx(1.0)


def test_projection_follows_the_expert_width():
    """Fewer bits per expert: smaller records (more in the same cache, fewer MB read per token)
    and less compute (bandwidth-bound decode): every width projects faster than the next wider
    one; without the profile's dense_gb compute stays put (said so)."""
    rows = SC.project_widths("m5-pro-48gb", (2, 3, 4, 6, 8), cache_gb="8", draft_depths="0", memo=MEMO)
    assert [r["expert_bits"] for r in rows] == [2, 3, 4, 6, 8]
    for a, b in zip(rows, rows[1:]):
        assert a["record_bytes"] < b["record_bytes"]
        assert a["compute_ms_per_token"] < b["compute_ms_per_token"]
        assert a["default_mb_per_token"] < b["default_mb_per_token"]
        assert a["default_tok_s"] > b["default_tok_s"] and a["best_tok_s"] > b["best_tok_s"]
    four = rows[2]
    assert four["compute_scale"] == pytest.approx(1.0) and "ASSUMPTION: memory-bandwidth-bound" in four["compute_note"]
    # Dense weights at 3 bits: less compute and more room for the cache than at 4.
    d3 = SC.project_widths("m5-pro-48gb", (4,), dense_bits=3, draft_depths="0", memo=MEMO)[0]
    d4 = SC.project_widths("m5-pro-48gb", (4,), draft_depths="0", memo=MEMO)[0]
    assert d3["compute_ms_per_token"] < d4["compute_ms_per_token"] and d3["cache_budget_gb"] > d4["cache_budget_gb"]


def _simulate_profile(tmp_path, profile, *args):
    """`simulate` of the profile dict `profile` (written to p.json) at an 8 GB cache without drafts,
    plus `args`: it must exit 0; returns its --json report."""
    p, out = tmp_path / "p.json", tmp_path / "o.json"
    p.write_text(json.dumps(profile))
    rc = cli.main(
        ["simulate", "--profile", str(p), "--cache-gb", "8", "--draft-depths", "0", *args, "--json", str(out)]
    )
    assert rc == 0
    return json.loads(out.read_text())


def test_a_profile_without_dense_gb_keeps_compute_and_says_so(tmp_path, capsys):
    d = C.load_profile("m5-pro-48gb")
    del d["dense_gb"]
    res = _simulate_profile(tmp_path, d, "--expert-bits", "2,4", "--quiet")
    assert "NOT scaled with the width" in capsys.readouterr().out
    assert len({c["rows"][0]["compute_ms"] for c in res["by_codec"]}) == 1


MEMO = P.Memo()  # routes and replays shared by the width tests


def test_shipped_profiles_cite_their_figures_and_say_what_is_assumed():
    names = sorted(p.stem for p in C.PROFILES_DIR.glob("*.json"))
    assert names == ["m5-max-128gb", "m5-pro-48gb", "m5-pro-64gb"]
    for n in names:
        d = C.load_profile(n)
        m = S.Machine.from_dict(d)
        assert m.ssd_gbps == {1: 9.5, 8: 17.3}
        assert any("peers.md" in s for s in d["sources"])
        assert any(a.startswith("ASSUMPTION") for a in d["assumptions"])
        assert "projection" in d["status"]


def test_projection_on_a_profile_runs_and_picks_the_best(capsys):
    rc = cli.main(
        [
            "simulate",
            "--profile",
            "m5-pro-64gb",
            "--cache-gb",
            "8,28",
            "--policies",
            "clock",
            "--draft-depths",
            "0",
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("PROJECTION for M5 Pro 64 GB")
    best = re.search(r"recommended: --expert-cache-gb (\d+) --prefetch \S+ -> ([\d.]+) tok/s", out)
    assert best and best.group(1) == "28"  # a larger cache with the same compute cannot be slower here
    assert "SYNTHETIC routes" in out and "ASSUMPTION" in out


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--profile", "nope"], "--profile"),
        (["--policies", "fifo", "--cache-gb", "8"], "policy"),
        (["--acceptance", "1.5"], "--acceptance"),
        (["--family", "nope"], "--family"),
        (["--validate", "--prefetch-modes", "off,sometimes"], "--prefetch-modes"),
        (["--validate", "--stack", "decode", "--prefetch-modes", "hyper-reuse"], "--prefetch-modes"),
        (["--validate", "--stack", "decode", "--gen-tokens", "1"], "--gen-tokens"),
        (["--profile", "machine", "--layer-ms", "1"], "--profile"),
        (["--expert-bits", "7"], "--expert-bits"),
        (["--expert-bits", "2", "--codec", "affine2-g32"], "--expert-bits"),
        (["--expert-bits", "two"], "--expert-bits"),
        (["--dense-bits", "9"], "--dense-bits"),
        (["--codec", "affine7-g64"], "--codec"),
    ],
)
def test_bad_simulate_input_is_one_typed_line(argv, field, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HEBRUS_PROFILE", str(tmp_path / "no-profile.json"))
    rc = cli.main(["simulate", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"hebrus-mlx simulate: error: {field}:"), err


def test_profile_file_errors_name_the_field(tmp_path):
    p = tmp_path / "m.json"
    p.write_text(json.dumps({"name": "x", "layer_ms": 1}))
    with pytest.raises(UsageError, match="ssd_gbps"):
        S.Machine.from_dict(C.load_profile(str(p)))


def test_validate_on_a_tiny_run(capsys, tmp_path):
    """The validation path end to end: routes and the engine Predictor's hinted sets recorded on
    the resident demo, the bench's streamed runs at two arena sizes for three predictors,
    predicted vs measured, the final line."""
    rc = cli.main(
        [
            "simulate",
            "--validate",
            "--model",
            "demo",
            "--rows",
            "8,128",
            "--prompt-tokens",
            "8",
            "--gen-tokens",
            "6",
            "--repeats",
            "1",
            "--quiet",
            "--prefetch-modes",
            "off,previous,hyper-reuse",
            "--json",
            str(tmp_path / "v.json"),
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    m = re.match(r"validation: worst \|predicted/measured - 1\| = ([\d.]+)% over (\d+) runs \(", out[-1])
    assert m and m.group(2) == "6"
    v = json.loads((tmp_path / "v.json").read_text())
    rows = [r["rows"] for r in v["runs"]]  # the arena rows the loader gave (>= the stored-record count)
    assert rows[0] == rows[1] == rows[2] >= 8 and rows[3] == rows[4] == rows[5] >= 128
    for r in v["runs"]:
        assert r["predicted_tok_s"] > 0 and r["measured_tok_s"] > 0
    # 8 rows < one token's 8 layers x 4 experts: demand paging never hits; 128 rows hold the run.
    assert v["runs"][0]["predicted_hit_rate"] == 0.0 and v["runs"][0]["measured_hit_rate"] == 0.0
    assert v["runs"][3]["predicted_hit_rate"] > 0.5
    # hyper-reuse hints the next layer from the engine's own Predictor: some are read and used
    assert v["runs"][5]["predicted_timely_recall"] > 0 and v["runs"][5]["measured_timely_recall"] > 0


def test_simulate_reads_a_recorded_route_trace(tmp_path, capsys):
    """A trace captured by `generate --trace-out` (hebrus_mlx.traces) drives the projection; a trace
    of another geometry is refused naming --trace."""
    trace = tmp_path / "trace"
    generate_demo_trace(trace, 12)
    capsys.readouterr()
    assert (
        cli.main(
            [
                "simulate",
                "--family",
                "qwen4exp-demo",
                "--trace",
                str(trace),
                "--cache-gb",
                "0.001",
                "--policies",
                "lru",
                "--draft-depths",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"routes: trace {trace}" in out and "qwen4exp-demo (8 layers, 64 experts top-4, 16,384 B records)" in out
    assert cli.main(["simulate", "--trace", str(trace), "--cache-gb", "8"]) == 2
    assert "--trace: recorded with 64 experts per layer" in capsys.readouterr().err


def _qualify_profile(tmp_path, monkeypatch, record_bytes, **machine):
    """A machine profile in the shape `hebrus-mlx qualify` writes (its io section measured by
    qualify's own probe on a small file), published where profile.read_profile looks."""
    import platform

    import mlx.core as mx

    from hebrus_mlx import machine_profile as profile
    from hebrus_mlx import qualify

    path = tmp_path / "profile.json"
    monkeypatch.setenv("HEBRUS_PROFILE", str(path))
    ident = {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "mlx": mx.__version__,
        "metal": False,
    }
    ident.update(machine)
    io = qualify.io_section(str(tmp_path), record_bytes, 16, None)
    profile.write_profile({"schema": profile.SCHEMA, "created_unix": 1764547200, "machine": ident, "io": io}, path)
    return io["pread"]


def test_bench_machine_record_reuses_the_qualify_probe_when_it_matches(tmp_path, monkeypatch):
    from hebrus_mlx.bench import machine as M

    store = tmp_path / "experts.bin"
    store.write_bytes(bytes(8 * 16384))
    pread = _qualify_profile(tmp_path, monkeypatch, 16384)
    probe, source = M.profile_probe(store, 16384)
    assert probe["gbps_by_qd"] == {"1": pread["qd1_GBps"], "8": pread["qd8_GBps"], "32": pread["qd32_GBps"]}
    assert probe["sha256_gbps_per_core"] == pread["sha256_GBps_one_thread"]
    assert "hebrus-mlx qualify, written 2025-12-01T00:00:00Z" in source and str(tmp_path) in source
    assert M.profile_probe(store, 2_764_800) is None  # another record size: not these reads
    _qualify_profile(tmp_path, monkeypatch, 16384, mlx="0.0.1")
    assert M.profile_probe(store, 16384) is None  # written under another MLX: not this machine


def test_bench_record_probes_when_no_profile_stands_for_the_store(tmp_path, monkeypatch):
    from hebrus_mlx.bench import machine as M

    monkeypatch.setenv("HEBRUS_PROFILE", str(tmp_path / "none.json"))
    monkeypatch.setattr(
        M, "expert_store", lambda d: {"path": str(tmp_path / "s.bin"), "record_bytes": 4096, "offsets": [0, 4096]}
    )
    (tmp_path / "s.bin").write_bytes(bytes(8192))
    calls = []
    monkeypatch.setattr(M, "ssd_probe", lambda *a, **k: calls.append(a) or {"gbps_by_qd": {"1": 1.0}})
    rec = M.record(tmp_path)
    assert calls and rec["ssd_probe"]["source"] == "probed now on the artifact's expert store"
    _qualify_profile(tmp_path, monkeypatch, 4096)
    calls.clear()
    rec = M.record(tmp_path)
    assert not calls and rec["ssd_probe"]["source"].startswith("machine profile")
    assert M.record(tmp_path, reuse_profile=False)["ssd_probe"]["source"].startswith("probed now") and calls


def test_projection_from_the_qualify_profile(tmp_path, monkeypatch, capsys):
    pread = _qualify_profile(tmp_path, monkeypatch, 2_764_800 // 64)
    assert cli.main(["simulate", "--profile", "machine", "--cache-gb", "8"]) == 2
    assert "--layer-ms:" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "simulate",
                "--profile",
                "machine",
                "--layer-ms",
                "1.0",
                "--cache-gb",
                "8",
                "--policies",
                "clock",
                "--draft-depths",
                "0",
                "--json",
                str(tmp_path / "p.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("PROJECTION for this machine (qualify profile)")
    m = json.loads((tmp_path / "p.json").read_text())["machine"]
    assert m["ssd_gbps"] == {"1": pread["qd1_GBps"], "8": pread["qd8_GBps"], "32": pread["qd32_GBps"]}
    assert m["layer_ms"] == 1.0


def test_machine_profile_describes_the_runtime_on_this_cpu(tmp_path, monkeypatch, capsys):
    """On the CPU device `--profile machine` is the runtime as it runs here: the wavefront on, the
    experts' share measured (one expert's compute at each width), compute not scaled by bytes, and
    a read-ahead predictor replayed when its recall is given."""
    _qualify_profile(tmp_path, monkeypatch, 2_764_800 // 64)
    out = tmp_path / "p.json"
    args = ["simulate", "--profile", "machine", "--layer-ms", "100", "--expert-bits", "2,4", "--cache-gb", "8"]
    args += ["--policies", "clock", "--draft-depths", "0", "--quiet", "--json", str(out)]
    assert cli.main(args + ["--predictor-recall", "router-reuse:1=0.6/0.7"]) == 0
    res = json.loads(out.read_text())
    assert res["machine"]["wavefront"] is True
    shares = [x for x in res["profile"]["sources"] if x.startswith("experts' share of a layer")]
    assert len(shares) == 2 and all("measured now" in x for x in shares)
    by_codec = {c["codec"]: c for c in res["by_codec"]}
    assert by_codec["affine2-g64"]["compute_scale"] is None  # compute-bound: the same --layer-ms at each width
    for c in by_codec.values():
        assert all(r["compute_ms"] == pytest.approx(48 * 100.0) for r in c["rows"] if r["prefetch"] == "off")
    modes = {r["prefetch"] for r in res["rows"]}
    assert "router-reuse:1" in modes and "off" in modes
    ahead = next(r for r in res["rows"] if r["prefetch"] == "router-reuse:1")
    off = next(r for r in res["rows"] if r["prefetch"] == "off")
    assert ahead["hit_rate"] > off["hit_rate"]  # predicted records that landed count as hits
    capsys.readouterr()
    for bad in ("router-reuse:1", "router-reuse:1=1.5", "router-reuse:1=0.5/0", "router-reuse:1=x", "foo=0.5"):
        assert cli.main(args + ["--predictor-recall", bad]) == 2
        assert "--predictor-recall" in capsys.readouterr().err


def test_a_profile_file_with_a_bad_runtime_setting_is_refused(tmp_path, capsys):
    base = json.loads((S_PROFILES / "m5-pro-48gb.json").read_text())
    for key, value in (("wavefront", "yes"), ("expert_ms", -1.0), ("expert_ms", "fast")):
        path = tmp_path / "p.json"
        path.write_text(json.dumps({**base, key: value}))
        assert cli.main(["simulate", "--profile", str(path), "--cache-gb", "8", "--quiet"]) == 2
        assert key in capsys.readouterr().err


def test_decode_stack_validation_plumbing(tmp_path, monkeypatch, capsys):
    """--stack decode end to end on a shrunken store (2 layers of 8 experts, top-2, 3 tokens): the
    routes recorded once equal every streamed run's, each (rows x predictor) run has a prediction
    and a measurement, and the reads are probed through the stack's own engine."""
    import argparse

    from hebrus_mlx.simulate import decode_stack as D

    args = argparse.Namespace(
        rows="2",
        prefetch_modes="off,router-reuse:1",
        layers=2,
        experts=8,
        top_k=2,
        store=str(tmp_path / "experts.bin"),
        gen_tokens=3,
        repeats=1,
        quiet=True,
        stack="decode",
        prompt_tokens=32,
    )
    v = D.validate_decode(args)
    assert [r["config"] for r in v["runs"]] == ["rows=2,prefetch=off", "rows=2,prefetch=router-reuse:1"]
    assert v["probe_source"].startswith("the engine's own reads of this store")
    for r in v["runs"]:
        assert r["predicted_tok_s"] > 0 and r["measured_tok_s"] > 0 and r["compute_ms_per_token"] > 0
        # 2 rows, top-2: each layer evicts the other's records (nothing hits); no staging row
        # (2 // 4 = 0) and both rows pinned when layer 0 hints layer 1: every hint is dropped.
        assert r["predicted_hit_rate"] == 0.0 == r["measured_hit_rate"]
        assert r["predicted_mb_per_token"] == pytest.approx(r["measured_mb_per_token"])
    C.print_validation(v)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.match(r"validation: worst \|predicted/measured - 1\| = [\d.]+% over 2 runs \(", last)


def test_the_decode_stacks_all_cached_run_fits_a_token_beside_the_staging_rows():
    """Issue 23 §3: with a predictor the loader keeps min(top_k * depth, rows // 4) staging rows,
    so 40 rows (4 layers x top-10) hold only 30 exact records and the 'all-cached' run read the
    rest again (its compute came out above the streamed run's token time). The predictor's hints
    are other records than the token's and need rows too: at 50 rows it still read 5-22 records;
    rows for two tokens' records beside the staging rows read none (Stack.hot checks it)."""
    from hebrus_mlx.simulate import decode_stack as D

    assert D._hot_rows(20, 40, 10, "off") == 40
    # A predictor's hints are other records than the token's: room for both.
    assert D._hot_rows(20, 40, 10, "previous") == 90 == D._hot_rows(40, 40, 10, "previous")
    assert D._hot_rows(20, 40, 10, "router-reuse:1") == 90  # 90 - min(10, 90 // 4) = 80
    assert D._hot_rows(20, 40, 10, "router-reuse:2") == 100  # 100 - min(20, 100 // 4) = 80
    assert D._hot_rows(160, 40, 10, "previous") == 160
    for m in ("previous", "router-reuse:1", "router-reuse:2"):
        n = D._hot_rows(10, 40, 10, m)
        depth = max(S.prefetch_kind(m)[1], 1)
        assert n - min(10 * depth, n // 4) >= 80 > (n - 1) - min(10 * depth, (n - 1) // 4)


def test_synthetic_predictions_have_the_stated_recall_and_only_wrong_fills():
    routes = S.synthetic_routes(300, 3, 64, 4, reuse=0.5, skew=0.2, seed=1)
    for recall in (0.0, 0.5, 1.0):
        p = S.synthetic_predictions(routes, 64, recall, 6, seed=2)
        assert p.shape == (300, 3, 6)
        hits = total = 0
        for t in range(300):
            for l in range(3):
                row = [int(e) for e in p[t, l]]
                assert len(set(row)) == 6 and all(0 <= e < 64 for e in row)
                true = set(int(e) for e in routes[t, l])
                hits += len(true & set(row))
                total += len(true)
        assert abs(hits / total - recall) < 0.04, (recall, hits / total)


def test_profile_ahead_predictors_are_projected_and_checked(tmp_path, capsys):
    """A profile's synthetic_predictors add the ahead predictors to the sweep; a perfect one
    hides more misses than previous-token hints, and a bad entry is refused naming it."""
    d = C.load_profile("m5-pro-48gb")
    d["synthetic_routes"].update(tokens=120, warm=60)
    d["synthetic_predictors"] = {"router-reuse:1": 1.0}
    res = _simulate_profile(tmp_path, d, "--policies", "clock", "--predictors", "synthetic")
    rows = {r["prefetch"]: r for r in res["rows"]}
    assert set(rows) == {"off", "previous", "router-reuse:1"}
    assert rows["router-reuse:1"]["exposed_ms"] < rows["previous"]["exposed_ms"]
    d["synthetic_predictors"] = {"previous": 0.5}
    p = tmp_path / "p.json"
    p.write_text(json.dumps(d))
    capsys.readouterr()
    assert cli.main(["simulate", "--profile", str(p), "--cache-gb", "8", "--predictors", "synthetic"]) == 2
    assert "synthetic_predictors.previous" in capsys.readouterr().err
