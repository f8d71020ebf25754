"""Issue 23 §3: the simulator's calibration terms (record checks, landing of predicted reads, peer
gains, reader CPU time), its recommendations (runtime flags only) and the engine read probe.

Provenance: every expected number is derived by hand here from the machine and replay each test
builds; the probe is checked against the engine's injected read delay (an independent clock)."""

import time

import numpy as np
import pytest

from hebrus_mlx import cli
from hebrus_mlx.errors import UsageError
from hebrus_mlx.simulate import calibrate as K
from hebrus_mlx.simulate import model as S
from hebrus_mlx.simulate import projection as P
from hebrus_mlx.simulate import run as C

R = 1_000_000


def machine(**kw):
    d = dict(name="hand", ssd_gbps={1: 1.0, 8: 8.0}, layer_s=1e-3, pre_router=0.5, threads=8)
    d.update(kw)
    return S.Machine(**d)


def test_the_check_the_readers_pay_is_chosen():
    """1 MB at 1 GB/s = 1 ms; SHA-256 at 0.5 GB/s adds 2 ms, the fast check at 10 GB/s 0.1 ms."""
    m = machine(verify_gbps=0.5, fast_check_gbps=10.0)
    m.check = "sha256"
    assert m.io_time(1, R) == pytest.approx(3e-3)
    m.check = "fast"
    assert m.io_time(1, R) == pytest.approx(1.1e-3)
    m.check = "off"
    assert m.io_time(1, R) == pytest.approx(1e-3)
    m.check = "crc"
    with pytest.raises(UsageError, match="check"):
        m.io_time(1, R)


def _replay(demand, used, reads, hits):
    L = len(demand)
    return S.Replay(
        10, np.array(demand, float), np.array(used, float), np.array(reads, float), L * 4, predicted_hits=hits
    )


def test_predicted_reads_land_when_the_disk_has_served_them():
    """router-reuse:1, window = 1 layer = 1 ms. Layer 0: 2 predicted reads (2 MB at QD2: 2/(2 GB/s)
    = 1 ms) land in time; layer 1: 8 reads at QD8 take 1 ms at 8 GB/s: also in time; with 16 reads
    (2 ms) half land. The engine's timely recall = landed predicted hits / (predicted hits + exact
    misses): layer 1 used 4 of its 16, 2 of them late -> timely (6 - 2) / (6 + 4), late 2 / 10."""
    m = machine(ssd_gbps={1: 1.0, 2: 2.0, 8: 8.0})
    assert S.landed_fraction(m, 2, R, 1e-3) == 1.0
    assert S.landed_fraction(m, 16, R, 1e-3) == pytest.approx(0.5)
    g = S.ModelGeometry("hand", 2, 64, 4, R)
    rep = _replay([2, 2], [2, 4], [2, 16], hits=6)
    p = S.project(m, g, rep, cache_gb=0, capacity=8, policy="clock", prefetch="router-reuse:1")
    assert p.timely_recall == pytest.approx(4 / 10) and p.late_recall == pytest.approx(2 / 10)
    off = S.project(m, g, rep, cache_gb=0, capacity=8, policy="clock", prefetch="off")
    assert off.timely_recall is None and off.late_recall is None


def test_a_peer_gain_applies_to_prefetch_off_and_cannot_hide_more_than_the_exposed_reads():
    base = S.Projection(8, 10, "clock", "off", 0, 0.0, 1e3 / 50, 50.0, 40.0, 10.0, 0.7, 1e8)
    g = S.with_gain(base, "router-reuse:2", 1.11, "slotstream")
    assert g.token_ms == pytest.approx(50 / 1.11) and g.prefetch == "router-reuse:2"
    assert g.exposed_ms == pytest.approx(10 - (50 - 50 / 1.11))
    capped = S.with_gain(base, "router-reuse:2", 2.0, "x")  # 25 ms would hide more than the 10 ms exposed
    assert capped.token_ms == pytest.approx(40.0) and capped.exposed_ms == pytest.approx(0.0)
    assert "capped at x1.25" in capped.basis


def test_reader_cpu_time_and_predictor_compute_are_paid_by_the_token():
    """2 layers x 1 ms compute, +10% for the predictor; 3 reads per token x 100 us of reader CPU."""
    m = machine(read_cpu_us=100.0, predictor_overhead={"router-reuse:1": 0.1}, ssd_gbps={1: 1e6})
    g = S.ModelGeometry("hand", 2, 64, 4, R)
    rep = _replay([1, 1], [0, 0], [0, 1], hits=0)
    p = S.project(m, g, rep, cache_gb=0, capacity=8, policy="clock", prefetch="router-reuse:1")
    assert p.compute_ms == pytest.approx(2.2)
    assert p.read_cpu_ms == pytest.approx(0.3)
    assert p.token_ms == pytest.approx(2.2 + 0.3 + p.exposed_ms)


def test_with_a_draft_model_an_ahead_predictor_reads_like_prefetch_off():
    """The runtime predicts in one-token forwards only (stream.predict.Predictor)."""
    rng = np.random.default_rng(0)
    topk = np.stack([np.stack([rng.choice(16, 2, replace=False) for _ in range(3)]) for _ in range(30)])
    pred = S.synthetic_predictions(topk, 16, 0.8, 2, 1)
    g = S.ModelGeometry("hand", 3, 16, 2, R)
    rows = S.sweep(
        machine(),
        g,
        topk[10:],
        [0.0075],
        ("clock",),
        ("off", "router-reuse:1"),
        (0, 2),
        0.5,
        topk[:10],
        {"router-reuse:1": pred},
    )
    by = {(r.prefetch, r.draft_depth): r for r in rows}
    assert by["router-reuse:1", 2].tok_s == by["off", 2].tok_s
    assert by["router-reuse:1", 0].tok_s != by["off", 0].tok_s


def test_only_runtime_flags_are_recommended():
    mk = lambda pol, pf, tok, gb=8, d=0: S.Projection(gb, 10, pol, pf, d, 0.0, tok, 1e3 / tok, 1, 1, 0.5, 1)  # noqa: E731
    rows = [
        mk("lru", "off", 30.0),
        mk("belady", "off", 40.0),
        mk("clock", "off", 20.0),
        mk("clock", "previous", 21.0),
        mk("clock", "router-reuse:1", 20.99),
        mk("clock", "router-reuse:1", 21.0, gb=16),
    ]
    best = P.recommend(rows)
    # clock only; within 0.5% of 21.0 the default predictor at the smaller cache wins
    assert (best.policy, best.prefetch, best.cache_gb) == ("clock", "router-reuse:1", 8)
    assert (
        P.flags(mk("clock", "hyper-reuse", 1, 12, 2))
        == "--expert-cache-gb 12 --prefetch hyper-reuse --draft-model mtp --num-draft-tokens 2"
    )


def test_projection_prints_labelled_columns_and_runtime_flags(capsys, tmp_path):
    import json

    d = C.load_profile("m5-pro-48gb")
    d["synthetic_routes"].update(tokens=60, warm=30)  # a short trace: the test checks the output, not numbers
    (tmp_path / "p.json").write_text(json.dumps(d))
    rc = cli.main(
        [
            "simulate",
            "--profile",
            str(tmp_path / "p.json"),
            "--cache-gb",
            "8",
            "--policies",
            "clock,lru",
            "--draft-depths",
            "0,1",
            "--quiet",
            "--check",
            "sha256",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert P.COLUMNS in out and "SHA-256 at 2 GB/s per reader core" in out
    rec = next(line for line in out.splitlines() if line.startswith("recommended: "))
    assert rec.startswith("recommended: --expert-cache-gb 8 --prefetch ") and "lru" not in rec
    assert "runtime defaults (--expert-cache-gb 8 --prefetch router-reuse:1" in out
    assert "comparison only (no flag selects policy lru)" in out


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--check", "fast", "--profile", "PROFILE_NO_FAST"], "--check"),
        (["--predictors", "oracle"], "--predictors"),
        (["--table", "/tmp/x.md", "--profile", "m5-pro-64gb"], "--table"),
        (["--draft-depths", "-1", "--cache-gb", "8"], "--draft-depths"),
        (["--codec", "affine5-g64", "--cache-gb", "8"], "--codec"),
    ],
)
def test_bad_projection_input_is_one_typed_line(argv, field, capsys, tmp_path):
    import json

    d = C.load_profile("m5-pro-48gb")
    d.pop("fast_check_gbps")
    (tmp_path / "p.json").write_text(json.dumps(d))
    argv = [str(tmp_path / "p.json") if a == "PROFILE_NO_FAST" else a for a in argv]
    rc = cli.main(["simulate", "--quiet", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"hebrus-mlx simulate: error: {field}:"), err


def test_the_engine_probe_times_the_engines_own_reads(tmp_path):
    """A real StreamEngine whose reads take 20 ms (injected, well above a busy machine's scheduling
    noise): one record per batch reads at ~R / 20 ms, never faster, four at once (8 threads) at
    ~4x that; hits are subtracted, every probed record was a miss."""
    import mlx.core as mx
    from support.fault_injection import FaultyEngine

    L, E, rec = 2, 24, 4096
    path = tmp_path / "store.bin"
    path.write_bytes(bytes(L * E * rec))
    eng = FaultyEngine(cache_bytes=rec, threads=8)
    eng.set_read_delay_us(20000)
    st = eng.add_store(str(path))
    aid, _ = eng.create_arena([rec], 16)
    table = eng.register_table(st, [i * rec for i in range(L * E)], [rec] * (L * E), arena=aid)

    def resolve(layer, ids):
        rows, lease = eng.resolve(table, mx.array((np.asarray(ids) + layer * E).astype(np.uint32)), layer=layer)
        mx.eval(eng.release_after(rows, lease))

    try:
        p = K.engine_probe(resolve, L, E, rec, queue_depths=(1, 4), batches=3)
        c = eng.counters()
    finally:
        eng.close()
    assert c["exact_misses"] == 1 + 3 * (1 + 4)  # the warm-up record and every batch: misses
    one = rec / 20e-3 / 1e9
    assert 0.25 * one < p["gbps_by_qd"]["1"] <= 1.05 * one
    assert p["gbps_by_qd"]["4"] > 1.5 * p["gbps_by_qd"]["1"]  # the reads overlap on the threads
    assert p["cpu_us_per_record"] >= 0


def test_the_quiet_note_says_busy():
    assert "BUSY" in K.quiet_note((9.0, 0, 0), (8.0, 0, 0), cores=2)
    assert ": quiet" in K.quiet_note((0.3, 0, 0), (0.9, 0, 0), cores=2)
    # The end load includes the validation's own runs: what they kept busy is not another process's.
    assert ": quiet" in K.quiet_note((0.3, 0, 0), (1.6, 0, 0), cores=2, own=1.4)
    assert "BUSY" in K.quiet_note((0.3, 0, 0), (1.6, 0, 0), cores=2, own=0.2)
    assert "BUSY" in K.quiet_note((1.6, 0, 0), (1.6, 0, 0), cores=2, own=1.4)  # busy before they started


def test_own_load_counts_this_process_cpu():
    """own_load is this process's CPU seconds over wall seconds, whatever share of a core a loaded
    machine gives the busy loop (a bound like > 0.5 failed under load); and idling adds no load."""
    start = K.cpu_clock()
    t0, c0 = time.monotonic(), time.process_time()
    while time.process_time() - c0 < 0.2:  # 0.2 s of this process's CPU, however long that takes
        pass
    got = K.own_load(start)
    wall = time.monotonic() - t0
    assert got == pytest.approx((time.process_time() - c0) / wall, rel=0.2, abs=0.02)
    assert got > 0
    idle = K.cpu_clock()
    time.sleep(0.2)
    assert K.own_load(idle) < got


def test_every_recommendable_setting_is_a_flag_generate_accepts():
    """Issue 23 §3: simulate recommends only settings the runtime exposes: each --prefetch value it
    may print, each draft depth and cache size parse through `hebrus-mlx generate`'s own parser
    and prefetch spec; the policies no flag selects are never in a recommendation."""
    import shlex

    from hebrus_mlx.commands.cli_args import prefetch_from_args
    from hebrus_mlx.commands.verb_flags import build_parser

    parser = build_parser()
    for pf in P.RUNTIME_PREFETCH:
        for d in (0, 1, 3):
            p = S.Projection(30.5, 10, P.RUNTIME_POLICY, pf, d, 0.5, 1.0, 1.0, 1, 1, 0.5, 1)
            args = parser.parse_args(["--model", "demo", "-p", "x"] + shlex.split(P.flags(p)))
            assert args.expert_cache_gb == pytest.approx(30.5) and prefetch_from_args(args).name == pf
            assert (args.draft_model, args.num_draft_tokens) == (("mtp", d) if d else (None, None))
    rows = [
        S.Projection(8, 10, pol, "off", 0, 0.0, tok, 1e3 / tok, 1, 1, 0.5, 1)
        for pol, tok in (("lru", 50.0), ("lfu", 60.0), ("belady", 70.0), ("clock", 10.0))
    ]
    assert P.recommend(rows).policy == "clock" and P.exposed_settings(rows) == [rows[-1]]


def test_the_validation_line_prints_its_spread(capsys):
    """The last line: worst, then min/median/max of pred/meas per run and per round, and the worst
    over arenas that hold at least one token's records (the replay is least exact below)."""

    def run(rows, ratio, rounds):
        return {
            "config": f"rows={rows}",
            "rows": rows,
            "predicted_tok_s": 1.0,
            "measured_tok_s": 1.0,
            "spread": 0.1,
            "ratio": ratio,
            "ratios_by_round": rounds,
            "predicted_hit_rate": 0.5,
            "measured_hit_rate": 0.5,
            "predicted_exposed_ms": 1.0,
            "measured_exposed_ms": 1.0,
        }

    v = {
        "machine": {"pre_router": 0.5, "ssd_gbps": {"1": 1.0}},
        "compute_ms_per_token": 10.0,
        "repeats": 3,
        "runs": [run(8, 1.30, [1.2, 1.3, 1.4]), run(64, 0.90, [0.8, 0.9, 1.0]), run(128, 1.05, [1.0, 1.05, 1.1])],
        "worst": 0.30,
        "token_records": 32,
        "load_average": [(1.0, 1.0, 1.0), (2.0, 2.0, 2.0)],
    }
    C.print_validation(v)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("validation: worst |predicted/measured - 1| = 30.0% over 3 runs (")
    assert "per run 0.90/1.05/1.30, per round 0.80/1.05/1.40" in last
    assert last.endswith("; arenas of at least one token's 32 records: worst 10.0% over 2 runs")


def test_the_hint_probe_counts_reads_landed_before_their_batchs_next_request():
    """calibrate.hint_probe on hand-made trace events: batches of 3 hinted records, where the first
    read of each batch is published before the second is requested and the second is not before
    the third: half the consecutive pairs landed. Exact reads and other kinds are ignored."""
    from hebrus_mlx.stream.engine import TRACE_DTYPE

    pending = []

    def hint(layer, ids):
        ev = np.zeros(len(ids) + 1, TRACE_DTYPE)
        ev["kind"] = "read"
        ev["issue_ns"] = [0, 10, 20, 5]
        ev["end_ns"] = [5, 30, 40, 6]
        ev["exact"][-1] = True  # an exact read in between: not a hint
        pending.append(ev)

    def reads():
        out = np.concatenate(pending) if pending else np.zeros(0, TRACE_DTYPE)
        pending.clear()
        return out

    got = K.hint_probe(hint, reads, layers=2, experts=6, batch=3, batches=4)
    assert got["pairs"] == 8 and got["batch_landed"] == 0.5
