"""Route traces (issue 11, AFN-021): capture, schema/shards, replay-as-prefill parity with named
faults, export, the controls and the cache simulator.

Provenance: every reference here is independent of the code under test - the plain generation
path without capture (bit-identity), the resident model (streamed captures), a fresh causal
prefill (replay), hand-built shards (faults), brute-force optimal paging (Belady) and hand-made
rankings (scores). Models: the shipped demo artifact (8 layers, 64 experts top-4).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support.trace_fixture import generate_demo_trace

from hebrus_mlx.generate import generate_step, stream_generate
from hebrus_mlx.loader import DEMO_DIR, load
from hebrus_mlx.testing.processes import cli_argv
from hebrus_mlx.traces import cachesim
from hebrus_mlx.traces.capture import TraceRecorder
from hebrus_mlx.traces.eval import history_rankings, score
from hebrus_mlx.traces.export import export, read_export
from hebrus_mlx.traces.replay import replay
from hebrus_mlx.traces.schema import TraceError
from hebrus_mlx.traces.shards import read_trace, write_shard

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [317, 282, 1386, 265, 1494, 430, 925, 306, 258, 354, 40, 99]


@pytest.fixture(scope="module")
def demo():
    return load("demo")


def _run(model, tok, prompt, n, trace_dir=None, chunk=5, features=0, sampler=None, owner="local"):
    kw = {} if trace_dir is None else {"trace_out": trace_dir, "trace_features": features, "trace_owner": owner}
    rs = list(stream_generate(model, tok, prompt, max_tokens=n, prefill_step_size=chunk, sampler=sampler, **kw))
    return [r.token for r in rs], [np.array(r.logprobs) for r in rs]


def _record(model, tok, rec, max_tokens, chunk):
    """Decode PROMPT with `generate_step` into the trace recorder `rec`."""
    list(
        generate_step(
            mx.array(PROMPT),
            model,
            effective_vocab_size=tok.effective_vocab_size,
            max_tokens=max_tokens,
            prefill_step_size=chunk,
            trace=rec,
        )
    )


@pytest.fixture(scope="module")
def decoded(demo, tmp_path_factory):
    """Two real decode captures: greedy, and sampled at temp 0.8."""
    from hebrus_mlx.sample_utils import make_sampler

    model, tok = demo
    d = tmp_path_factory.mktemp("decoded")
    toks, _ = _run(model, tok, PROMPT, 24, d, owner="a")
    mx.random.seed(3)
    stoks, _ = _run(model, tok, PROMPT[:7], 24, d, sampler=make_sampler(temp=0.8), owner="b")
    return d, (toks, stoks)


# ---- capture --------------------------------------------------------------------------------------


def test_capture_is_bit_identical_and_records_fed_tokens(demo, tmp_path):
    model, tok = demo
    want = _run(model, tok, PROMPT, 20)
    got = _run(model, tok, PROMPT, 20, tmp_path, features=3)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(a, b)
    (seq,) = read_trace(tmp_path).sequences
    # Fed tokens: the prompt, then every sampled token but the last (it is never fed).
    assert seq.token_ids.tolist() == PROMPT + want[0][:-1]
    assert seq.positions.tolist() == list(range(len(PROMPT) + 19))
    assert seq.kinds.tolist() == [0] * (len(PROMPT) - 1) + [1] * 20
    assert seq.topk_ids.shape == (31, 8, 4)
    np.testing.assert_allclose(seq.topk_weights.sum(-1), 1.0, atol=1e-5)  # norm_topk_prob
    assert np.all(np.diff(seq.topk_weights, axis=-1) <= 0)  # rank order = weight desc
    assert seq.feature_positions.tolist() == list(range(0, 31, 3))
    assert seq.features.shape == (11, 8, 128) and np.isfinite(seq.features).all()


def test_capture_reads_back_once_per_step_not_per_layer(demo, tmp_path, monkeypatch):
    """Routes accumulate on the device: one host transfer per arrays group per step/chunk."""
    model, tok = demo
    rec = TraceRecorder.for_model(tmp_path, model, tok)
    commits = []
    orig = rec.commit
    monkeypatch.setattr(rec, "commit", lambda s: (commits.append(len(s.positions)), orig(s)))
    _record(model, tok, rec, max_tokens=6, chunk=4)
    rec.close()
    # 11 prompt tokens in chunks of 4 (4, 4, 3), then one commit per decode step.
    assert commits[:3] == [4, 4, 3] and commits[3:] == [1] * (len(commits) - 3)
    assert len(read_trace(tmp_path).sequences[0].positions) == sum(commits)


def test_streamed_capture_is_bit_identical_and_replays_exactly(demo, tmp_path):
    from hebrus_mlx.stream import engine as se

    if not se.available():
        pytest.skip("extension not built")
    from test_stream_model import _cache_gb

    from hebrus_mlx.loading.build_model import load_artifact_model

    model, tok = demo
    gb, _ = _cache_gb(str(DEMO_DIR))
    streamed = load_artifact_model(DEMO_DIR, expert_cache_gb=gb)
    assert streamed.streaming is not None and streamed.streaming.experts is not None
    streamed.source_path = DEMO_DIR
    chunk = streamed.streaming.max_chunk_tokens
    want = _run(streamed, tok, PROMPT, 16, chunk=chunk)
    got = _run(streamed, tok, PROMPT, 16, tmp_path, chunk=chunk)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(a, b)
    resident_tokens, _ = _run(model, tok, PROMPT, 16, chunk=chunk)
    assert got[0] == resident_tokens
    (res,) = replay(model, tok, read_trace(tmp_path), chunk=7)  # resident replay of a streamed capture
    assert res.ok and res.diagnosis is None


# ---- replay ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 6, 2048])
def test_replay_parity_on_real_decode(demo, decoded, chunk):
    model, tok = demo
    results = replay(model, tok, read_trace(decoded[0]), chunk=chunk)
    assert len(results) == 2 and all(r.decode_tokens >= 24 for r in results)
    for r in results:
        assert r.ok, (r.diagnosis, r.examples)
        assert r.mismatches_per_layer == [0] * 8 and r.max_weight_diff < 1e-5


def _rewrite(path, **change):
    """Re-sign a shard with altered tensors/header: a buggy recorder, not a corrupt file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        header = json.loads(f.metadata()["header"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    fn = change.pop("fn")
    fn(t, header)
    header["count"] = len(t["positions"])
    os.unlink(path)
    write_shard(path, t, header)


def _one_seq_trace(decoded, tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    src = read_trace(decoded[0])
    seq = next(s for s in src.sequences if s.owner == "a")
    for name in seq.shards:
        (d / name).write_bytes((decoded[0] / name).read_bytes())
    return d, d / seq.shards[0]


def test_replay_names_a_different_artifact(demo, decoded, tmp_path):
    model, tok = demo
    d, shard = _one_seq_trace(decoded, tmp_path)

    def other(t, h):
        h["identity"]["artifact_digest"] = "manifest:" + "0" * 64

    _rewrite(shard, fn=other)
    with pytest.raises(TraceError) as e:
        replay(model, tok, read_trace(d))
    assert e.value.field == "artifact_digest"


def test_replay_names_weights_that_are_not_the_artifact(demo, decoded):
    """Same digest, different router weights: parity fails from the first token."""
    model, tok = demo
    gate = model.model.layers[2].mlp.gate
    orig = gate.weight
    try:
        gate.weight = orig + mx.array(np.random.default_rng(0).normal(0, 0.5, orig.shape).astype(np.float32))
        results = replay(model, tok, read_trace(decoded[0]), chunk=8)
    finally:
        gate.weight = orig
    bad = [r for r in results if not r.ok]
    assert bad and all("different artifact" in r.diagnosis for r in bad)
    assert bad[0].mismatches_per_layer[2] > 0 and bad[0].mismatches_per_layer[:2] == [0, 0]


def test_replay_names_a_position_offset(demo, decoded, tmp_path):
    model, tok = demo
    d, shard = _one_seq_trace(decoded, tmp_path)
    _rewrite(
        shard, fn=lambda t, h: (t.__setitem__("positions", t["positions"] + 3), h.__setitem__("first_position", 3))
    )
    with pytest.raises(TraceError, match="starts at position 3: wrong position offset"):
        replay(model, tok, read_trace(d))


def test_replay_names_routes_recorded_one_position_off(demo, decoded, tmp_path):
    model, tok = demo
    d, shard = _one_seq_trace(decoded, tmp_path)

    def shift(t, h):  # routes of token p+1 recorded under token p
        t["topk_ids"] = np.concatenate([t["topk_ids"][1:], t["topk_ids"][-1:]])

    _rewrite(shard, fn=shift)
    (r,) = replay(model, tok, read_trace(d), chunk=8)
    assert not r.ok and "wrong position offset" in r.diagnosis and "shifted by +1" in r.diagnosis


def test_dropped_token_is_named(demo, decoded, tmp_path):
    model, tok = demo
    d, shard = _one_seq_trace(decoded, tmp_path)

    def drop(t, h):
        for k in t:
            t[k] = np.delete(t[k], 9, axis=0)

    _rewrite(shard, fn=drop)
    with pytest.raises(TraceError, match="dropped token .*position 8 is followed by 10"):
        read_trace(d)

    def renumber(t, h):  # a recorder that also renumbered: the history itself lost a token
        t["positions"] = np.arange(len(t["positions"]), dtype=np.int32)

    _rewrite(shard, fn=renumber)
    (r,) = replay(model, tok, read_trace(d), chunk=8)
    assert not r.ok and r.diagnosis.startswith("divergence from position 9")


def test_replay_parity_is_exact_on_tied_routes(demo, tmp_path):
    """AFN-001: with two pairs of layer-2 router rows duplicated (exactly equal probabilities), the
    recorded routes list tied experts by id and replay matches them exactly; the same trace with the
    tied experts swapped (what an equal-probability tolerance used to accept) is a mismatch on
    every row where both were routed."""
    model, tok = demo
    gate = model.model.layers[2].mlp.gate
    orig = gate.weight
    w = np.array(orig)
    w[40], w[3] = w[12], w[28]  # 12 == 40 (12 first) and 3 == 28 (3 first)
    try:
        gate.weight = mx.array(w)
        d = tmp_path / "tied"
        _run(model, tok, PROMPT, 16, d)
        (seq,) = read_trace(d).sequences
        rows = seq.topk_ids[:, 2].tolist()
        both = [r for r in rows if {12, 40} <= set(r) or {3, 28} <= set(r)]
        assert both  # the precondition: tied experts were routed together
        for r in both:
            for lo, hi in ((12, 40), (3, 28)):
                assert hi not in r or r.index(lo) < r.index(hi)
        (res,) = replay(model, tok, read_trace(d), chunk=4)
        assert res.ok and res.tied_per_layer[2] > 0, (res.diagnosis, res.examples)

        def swap(t, h):
            ids = t["topk_ids"]
            for lo, hi in ((12, 40), (3, 28)):
                pair = (ids[:, 2] == lo).any(-1) & (ids[:, 2] == hi).any(-1)
                layer2 = ids[pair, 2]
                ids[pair, 2] = np.where(layer2 == lo, hi, np.where(layer2 == hi, lo, layer2))

        assert len(seq.shards) == 1
        _rewrite(d / seq.shards[0], fn=swap)
        (res,) = replay(model, tok, read_trace(d), chunk=4)
        assert not res.ok and res.mismatches_per_layer[2] == len(both)
        assert res.mismatches_per_layer[:2] == [0, 0] and res.mismatches_per_layer[3:] == [0] * 5
    finally:
        gate.weight = orig


def test_crash_while_publishing_leaves_only_complete_shards(demo, tmp_path):
    from hebrus_mlx.artifact.atomic import Faults
    from hebrus_mlx.artifact.errors import PublishError

    model, tok = demo
    rec = TraceRecorder.for_model(tmp_path, model, tok, shard_tokens=4)
    _record(model, tok, rec, max_tokens=3, chunk=4)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert len(before) == 3  # 4 + 4 + 4 observations
    t = {"positions": np.arange(12, 13, dtype=np.int32)}
    for fault in ("fsync", "short_write", "rename"):
        with pytest.raises((PublishError, OSError)):
            write_shard(tmp_path / "x-000003.safetensors", t, {}, faults=Faults(**{fault: True}))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp, no partial shard
    assert read_trace(tmp_path).tokens == 12


def test_killed_capture_leaves_only_complete_shards(tmp_path):
    """SIGKILL in the middle of a capture: whatever is on disk reads back as complete shards."""
    import signal
    import time

    code = (
        "import mlx.core as mx; from hebrus_mlx import load; from hebrus_mlx.generate import generate_step;"
        "from hebrus_mlx.traces.capture import TraceRecorder; m, t = load('demo');"
        f"r = TraceRecorder.for_model({str(tmp_path)!r}, m, t, shard_tokens=1);"
        "[0 for _ in generate_step(mx.array([5, 6, 7]), m, effective_vocab_size=t.effective_vocab_size,"
        " max_tokens=100000, trace=r)]"
    )
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.time() + 60
        while len(list(tmp_path.glob("*.safetensors"))) < 12 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    ts = read_trace(tmp_path)  # dot-temps of an interrupted publish are ignored, never read
    (seq,) = ts.sequences
    assert ts.tokens >= 12 and seq.positions.tolist() == list(range(ts.tokens))


@pytest.mark.parametrize(
    "damage, field",
    [
        ("truncate", "partial or corrupt"),
        ("flip", "payload_sha256"),
        ("version", "schema_version"),
        ("counter", "counter regression"),
        ("start", "counter regression"),
        ("owner", "reused across owners"),
    ],
)
def test_reader_fails_closed(demo, tmp_path, damage, field):
    model, tok = demo
    rec = TraceRecorder.for_model(tmp_path, model, tok, shard_tokens=6)
    _record(model, tok, rec, max_tokens=2, chunk=6)
    shards = sorted(p for p in tmp_path.iterdir())
    assert len(shards) == 2
    p = shards[1]
    if damage == "truncate":
        p.write_bytes(p.read_bytes()[:-50])
    elif damage == "flip":
        b = bytearray(p.read_bytes())
        b[-3] ^= 1
        p.write_bytes(bytes(b))
    elif damage == "version":
        from safetensors.numpy import load_file, save

        data = save(
            load_file(str(p)), metadata={"schema": "hebrus-mlx.route-trace", "schema_version": "9", "header": "{}"}
        )
        p.write_bytes(data)
    elif damage == "counter":
        _rewrite(p, fn=lambda t, h: h.__setitem__("counter", 0))
    elif damage == "start":
        _rewrite(
            p, fn=lambda t, h: (h.__setitem__("first_position", 2), t.__setitem__("positions", t["positions"] - 4))
        )
    elif damage == "owner":
        _rewrite(p, fn=lambda t, h: h.__setitem__("owner", "someone-else"))
    with pytest.raises(TraceError, match=field):
        read_trace(tmp_path)
    # The CLI says the same in one line with exit 2.
    r = subprocess.run(
        cli_argv(
            "traces",
            "export",
            str(tmp_path),
            "--out",
            str(tmp_path.parent / "out"),
        ),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path.parent / "out").exists()


# ---- export ---------------------------------------------------------------------------------------


def test_export_is_deterministic_split_by_sequence_and_loads_without_hebrus(decoded, tmp_path):
    src = read_trace(decoded[0])
    export(decoded[0], tmp_path / "a", fractions=(0.5, 0.0, 0.5), shard_tokens=10, id_dtype="int16")
    export(decoded[0], tmp_path / "b", fractions=(0.5, 0.0, 0.5), shard_tokens=10, id_dtype="int16")
    files = sorted(os.listdir(tmp_path / "a"))
    assert files == sorted(os.listdir(tmp_path / "b"))
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert m["counts"]["tokens"] == src.tokens and m["num_experts"] == 64 and m["top_k"] == 4
    assert all(len(s["sha256"]) == 64 for s in m["shards"])
    member = {s["index"]: s["split"] for s in m["sequences"]}
    ex = read_export(tmp_path / "a")
    for sp, d in ex["splits"].items():
        assert {member[int(i)] for i in np.unique(d["sequence_ids"])} == {sp}  # no sequence in two splits
        assert d["topk_ids"].dtype == np.int16
    # The numpy-only loader in tools/ gives the same arrays, in a process without hebrus_mlx.
    code = (
        "import sys; sys.path.insert(0, 'tools'); from load_route_export import load_export; import numpy as np;"
        f"m, s = load_export({str(tmp_path / 'a')!r}); assert 'hebrus_mlx' not in sys.modules;"
        "print({k: [int(v['topk_ids'].astype(np.int64).sum()), len(v['token_ids'])] for k, v in s.items()})"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={"PATH": os.environ["PATH"]}
    )
    assert r.returncode == 0, r.stderr
    want = {k: [int(v["topk_ids"].astype(np.int64).sum()), len(v["token_ids"])] for k, v in ex["splits"].items()}
    assert eval(r.stdout) == want
    # Owner split: each owner entirely in one split.
    export(decoded[0], tmp_path / "c", split_by="owner")
    mc = json.loads((tmp_path / "c" / "manifest.json").read_text())
    owners = {}
    for s in mc["sequences"]:
        owners.setdefault(s["owner"], set()).add(s["split"])
    assert all(len(v) == 1 for v in owners.values())


def test_export_fails_closed_and_keeps_the_published_export(decoded, tmp_path):
    out = tmp_path / "out"
    export(decoded[0], out)
    shard = next(out.glob("*.safetensors"))
    good = shard.read_bytes()
    shard.write_bytes(good[:-10])
    with pytest.raises(TraceError, match="sha256"):
        read_export(out)
    shard.write_bytes(good)
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(dict(m, schema_version=2)))
    with pytest.raises(TraceError, match="unknown version 2"):
        read_export(out)
    (out / "manifest.json").write_text(json.dumps(dict(m, counts=dict(m["counts"], tokens=m["counts"]["tokens"] + 1))))
    with pytest.raises(TraceError, match="counts.tokens"):
        read_export(out)


# ---- controls and the cache simulator -------------------------------------------------------------


def test_scores_and_history_controls():
    truth = np.array([[[1, 2]], [[3, 4]]])  # N=2, L=1, k=2
    ranking = np.array([[[2, 9, 1]], [[5, 6, 7]]])
    s = score(ranking, truth, [1, 2, 3])
    assert s["recall"][1] == 0.25 and s["recall"][3] == 0.5 and s["precision"][3] == pytest.approx(1 / 3)
    assert s["exact_topk"] == 0.0
    # prev_token ranks the previous token's top-k first, in rank order.
    seq = np.array([[[3, 1]], [[0, 2]], [[3, 0]]])
    r = history_rankings([(None, seq)], 1, 4, 4)
    assert r["prev_token"][1, 0, :2].tolist() == [3, 1] and r["prev_token"][2, 0, :2].tolist() == [0, 2]
    assert r["lru"][2, 0, :2].tolist() in ([0, 2], [2, 0]) and r["lru"][2, 0, 2] in (1, 3)
    assert r["frequency"][0, 0].tolist() == [0, 1, 2, 3]  # nothing seen yet: ties by ID
    # token_frequency: counts per fed token ID (online here): token 7 was fed with {3, 1} before.
    r = history_rankings([(np.array([7, 8, 7]), seq)], 1, 4, 4)
    assert sorted(r["token_frequency"][2, 0, :2].tolist()) == [1, 3]
    assert r["token_frequency"][1, 0].tolist() == r["frequency"][1, 0].tolist()  # token 8 unseen


def _opt_hits(stream, cap):
    """Brute-force optimal demand paging (every eviction choice)."""
    best = 0

    def go(i, cache, hits):
        nonlocal best
        if i == len(stream):
            best = max(best, hits)
            return
        x = stream[i]
        if x in cache:
            return go(i + 1, cache, hits + 1)
        if len(cache) < cap:
            return go(i + 1, cache | {x}, hits)
        for y in cache:
            go(i + 1, (cache - {y}) | {x}, hits)

    go(0, frozenset(), 0)
    return best


def test_cache_simulator_policies():
    s = np.array([1, 2, 3, 1, 4, 1, 2, 5, 1, 2, 3, 4])
    assert cachesim.simulate("lru", s, 3).hits == 4  # 1 | 1 | 2 | 1
    assert cachesim.simulate("lfu", s, 3).hits == 4
    rng = np.random.default_rng(0)
    for _ in range(20):
        st = rng.integers(0, 6, 14)
        cap = int(rng.integers(1, 5))
        opt = cachesim.simulate("belady", st, cap).hits
        assert opt == _opt_hits(st.tolist(), cap)
        for pol in ("lru", "clock", "lfu"):
            assert cachesim.simulate(pol, st, cap).hits <= opt
    # CLOCK with a single slot is LRU; a cache holding everything misses only cold.
    assert cachesim.simulate("clock", s, 1).hits == cachesim.simulate("lru", s, 1).hits
    for pol in cachesim.POLICIES:
        assert cachesim.simulate(pol, s, 5).misses == 5
    rows = cachesim.sweep(np.array([[[0, 1]], [[0, 1]], [[2, 3]]]), 4, [50, 100], record_bytes=10)
    r50 = {r["policy"]: r for r in rows if r["percent"] == 50}
    assert r50["belady"]["hit_rate"] == pytest.approx(2 / 6) and r50["lru"]["bytes_per_token"] == pytest.approx(40 / 3)
    with pytest.raises(ValueError, match="fewer than top_k"):
        cachesim.sweep(np.zeros((2, 8, 4), int), 64, [0.5], 1)


def test_cli_generate_trace_and_eval(tmp_path):
    from hebrus_mlx.cli import main

    d = tmp_path / "tr"
    generate_demo_trace(d, 6)
    (seq,) = read_trace(d).sequences
    assert seq.sampling["temp"] == 0.0 and seq.kinds[-1] == 1
    assert main(["traces", "replay", str(d)]) == 0
    assert (
        main(
            [
                "traces",
                "eval",
                str(d),
                "--cache-sim",
                "--budgets",
                "4,8",
                "--cache-sizes",
                "10,50",
                "--json",
                str(tmp_path / "e.json"),
            ]
        )
        == 0
    )
    e = json.loads((tmp_path / "e.json").read_text())
    assert e["controls"]["random"]["recall"]["8"] is not None and len(e["cache_sim"]) == 8
    assert main(["generate", "--model", "demo", "-p", "x", "--trace-out", str(d), "--trace-features", "-1"]) == 2
    assert main(["traces", "replay", str(tmp_path / "missing")]) == 2
    assert main(["traces", "eval", str(d), "--budgets", "0"]) == 2
