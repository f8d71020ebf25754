"""Pipeline parallelism over mx.distributed (issue 17): split planning, and 2/3 local ranks on the
ring backend giving the single process's tokens and logits bit for bit, surviving snapshot/
restore, and ending with a typed error when a rank dies or stalls."""

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hebrus_mlx.loader import DEMO_DIR
from hebrus_mlx.pipeline import local_hostfile
from hebrus_mlx.pipeline.split import PipelineSplitError, layer_bytes, parse_split, plan_split, stages
from hebrus_mlx.testing.processes import ROOT, child_env, cli_argv, server_argv

SCRIPT = Path(__file__).parent / "support" / "pipeline_script.py"


def _rank_env(hostfile, rank, **extra):
    """The environment of pipeline rank `rank` of the ranks named in `hostfile`."""
    return child_env(MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank), **extra)


# -- split planning (no MLX) --------------------------------------------------------------------------


def _brute(per_layer, first, last, budgets):
    n, size = len(per_layer), len(budgets)
    best = None
    for cuts in itertools.combinations(range(1, n), size - 1):
        bounds = (0, *cuts, n)
        ratio = 0.0
        for r in range(size):
            load = sum(per_layer[bounds[r] : bounds[r + 1]]) + (first if r == 0 else 0) + (last if r == size - 1 else 0)
            ratio = max(ratio, load / budgets[r])
        if best is None or ratio < best:
            best = ratio
    return best


@pytest.mark.parametrize("seed", range(6))
def test_plan_split_minimises_the_worst_rank(seed):
    rng = np.random.default_rng(seed)
    n, size = int(rng.integers(3, 9)), int(rng.integers(2, 4))
    per_layer = [int(x) for x in rng.integers(1, 100, n)]
    first, last = int(rng.integers(0, 80)), int(rng.integers(0, 80))
    budgets = [int(x) for x in rng.integers(400, 900, size)]
    counts = plan_split(per_layer, first, last, budgets)
    assert sum(counts) == n and all(c >= 1 for c in counts)
    bounds = np.cumsum([0] + counts)
    got = max(
        (sum(per_layer[bounds[r] : bounds[r + 1]]) + (first if r == 0 else 0) + (last if r == size - 1 else 0))
        / budgets[r]
        for r in range(size)
    )
    assert got == pytest.approx(_brute(per_layer, first, last, budgets))


def test_plan_split_refuses_what_does_not_fit_naming_the_rank():
    with pytest.raises(PipelineSplitError, match=r"rank 1 needs .* GiB"):
        plan_split([3 << 30] * 4, 0, 0, [7 << 30, 5 << 30])
    with pytest.raises(PipelineSplitError, match="rank 0 needs"):
        plan_split([1 << 30] * 4, 0, 0, [1 << 30, 8 << 30], override=[3, 1])


def test_plan_split_streams_what_does_not_fit_resident():
    per_layer, streamable = [5 << 30] * 4, [4 << 30] * 4
    with pytest.raises(PipelineSplitError):
        plan_split(per_layer, 0, 0, [8 << 30, 8 << 30])
    assert plan_split(per_layer, 0, 0, [8 << 30, 8 << 30], streamable=streamable) == [2, 2]
    assert plan_split(per_layer, 0, 0, [8 << 30, 8 << 30], override=[3, 1], streamable=streamable) == [3, 1]
    with pytest.raises(PipelineSplitError, match=r"rank 0 needs 4\.00 GiB resident \(experts and PLE pages streamed\)"):
        plan_split(per_layer, 1 << 30, 0, [1 << 30, 8 << 30], override=[3, 1], streamable=streamable)


@pytest.mark.parametrize(
    "text,err",
    [("4", "1 counts for 2 ranks"), ("3,x", "comma-separated"), ("8,0", "at least one layer"), ("5,4", "add up to 9")],
)
def test_parse_split_names_the_flag(text, err):
    with pytest.raises(PipelineSplitError, match="--pipeline-split") as e:
        parse_split(text, 8, 2)
    assert err in str(e.value)


def test_stage_ownership_is_explicit():
    a, b = stages([3, 5])
    assert a.owns("model.embed_tokens.weight") and not b.owns("model.embed_tokens.weight")
    assert b.owns("lm_head.weight") and b.owns("model.hyper_connection_mixer.hc_norm.weight")
    assert a.owns("model.layers.2.mlp.gate.weight") and not a.owns("model.layers.3.mlp.gate.weight")
    with pytest.raises(PipelineSplitError, match="no pipeline owner"):
        a.owns("model.norm.weight")


def test_layer_bytes_account_for_every_stored_byte_of_the_demo():
    from hebrus_mlx.admission import admit

    m = json.loads((DEMO_DIR / "manifest.json").read_text())
    per_layer, first, last, streamable = layer_bytes(admit(str(DEMO_DIR)))
    dense = DEMO_DIR / "model.safetensors"
    header = 8 + int.from_bytes(dense.read_bytes()[:8], "little")
    stored = (
        dense.stat().st_size
        - header
        + sum((DEMO_DIR / s["path"]).stat().st_size for s in m["stores"] if s["role"] in ("experts", "ple"))
    )
    assert sum(per_layer) + first + last == stored
    ple = {s["layer"]: s["size"] for s in m["stores"] if s["role"] == "ple"}
    assert first > 0 and last > 0 and sorted(ple) == [0, 4]
    # Two GDN layers; only layer 0 holds a PLE table (its page store + its dense PLE tensors).
    raw = dense.read_bytes()
    tensors = json.loads(raw[8:header])
    ple_dense = sum(
        v["data_offsets"][1] - v["data_offsets"][0] for k, v in tensors.items() if k.startswith("model.layers.0.ple.")
    )
    assert per_layer[0] - per_layer[1] == ple[0] + ple_dense
    experts = (DEMO_DIR / "experts.hbem").stat().st_size // 8
    assert streamable == [experts + ple.get(i, 0) for i in range(8)]


# -- local ranks on the ring backend ----------------------------------------------------------------


def _free_port():
    import tempfile

    hosts = json.loads(local_hostfile(Path(tempfile.mkdtemp()) / "hosts.json", 1).read_text())
    return int(hosts[0][0].rsplit(":", 1)[1])


def _launch(tmp_path, n, model, mode, split=None, timeout=60, env_extra=None, wait=120, reap=False):
    """Start n ranks; wait for all (or, with `reap`, for rank 0, then kill the rest: a rank stalled
    on purpose never ends by itself). Returns (out file, [(rc, stdout, stderr)], seconds)."""
    hostfile = local_hostfile(tmp_path / f"hosts{n}.json", n)
    out = tmp_path / f"{mode}{n}.npz"
    args = [sys.executable, str(SCRIPT), str(model), str(out), mode] + ([split] if split else [])
    procs = []
    for rank in range(n):
        env = _rank_env(hostfile, rank, PIPELINE_TIMEOUT=str(timeout), **(env_extra or {}))
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    t0 = time.monotonic()
    results = []
    for i, p in enumerate(procs):
        if reap and i > 0:
            p.kill()
        try:
            o, e = p.communicate(timeout=max(1, wait - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank hung past {wait}s") from None
        results.append((p.returncode, o, e))
    return out, results, time.monotonic() - t0


def _single(model, prompt_len=13, max_tokens=12):
    import mlx.core as mx

    from hebrus_mlx.generate import generate_step
    from hebrus_mlx.loader import load_model

    m = load_model(model)
    prompt = mx.array([(7 * i + 3) % 97 + 4 for i in range(prompt_len)], dtype=mx.int32)
    toks, lps = [], []
    for t, lp in generate_step(
        prompt, m, effective_vocab_size=m.args.vocab_size, max_tokens=max_tokens, prefill_step_size=5
    ):
        toks.append(t)
        lps.append(np.array(lp))
    return m, np.array(toks), np.stack(lps)


@pytest.mark.parametrize("n,split", [(2, None), (3, "3,3,2")])
def test_demo_pipeline_equals_single_process_bitwise(tmp_path, n, split):
    _, tokens, logprobs = _single(DEMO_DIR)
    out, results, _ = _launch(tmp_path, n, DEMO_DIR, "generate", split)
    assert all(rc == 0 for rc, _, _ in results), results
    got = np.load(out)
    assert got["tokens"].tolist() == tokens.tolist()
    assert np.array_equal(got["logprobs"], logprobs)  # bit for bit, -inf rows included


def test_streamed_stages_equal_resident_and_read_only_their_own_layers(tmp_path):
    _, tokens, logprobs = _single(DEMO_DIR)
    out, results, _ = _launch(tmp_path, 2, DEMO_DIR, "stream", "3,5")
    assert all(rc == 0 for rc, _, _ in results), results
    got = np.load(out)
    assert got["tokens"].tolist() == tokens.tolist()
    assert np.array_equal(got["logprobs"], logprobs)
    for rank, own in enumerate(([0, 1, 2], [3, 4, 5, 6, 7])):
        seen = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert seen["reads"] > 0 and seen["expert_layers"] and set(seen["expert_layers"]) <= set(own), seen


@pytest.fixture(scope="module")
def tiny_artifact_dir(tmp_path_factory):
    from support.artifact_fixture import tiny_artifact

    return tiny_artifact(str(tmp_path_factory.mktemp("pipe")), dtype="float32")[1]


def test_tiny_checkpoint_pipeline_and_restore_equal_single_process(tmp_path, tiny_artifact_dir):
    import mlx.core as mx

    from hebrus_mlx.loader import load_model

    out, results, _ = _launch(tmp_path, 2, tiny_artifact_dir, "restore")
    assert all(rc == 0 for rc, _, _ in results), results
    got = np.load(out)
    m = load_model(tiny_artifact_dir)
    cache = m.make_cache()
    want = [np.array(m(mx.array([row], dtype=mx.int32), cache)) for row in ([5, 9, 13, 2, 7], [3, 3, 8], [11])]
    assert np.array_equal(got["a"], want[0])
    assert np.array_equal(got["b1"], want[1]) and np.array_equal(got["b2"], want[1])
    assert np.array_equal(got["c"], want[2])  # continues from the restored state, not from b twice


def test_killed_rank_is_a_typed_error_on_rank_0(tmp_path):
    _, results, elapsed = _launch(tmp_path, 2, DEMO_DIR, "kill", timeout=30, wait=60)
    rc0, out0, err0 = results[0]
    assert results[1][0] == 7
    assert rc0 == 0 and "TYPED PipelineError" in out0 and "rank 0 lost its link" in out0, (out0, err0)
    assert elapsed < 30


def test_rank_killed_before_the_final_counters_is_a_typed_error_on_rank_0(tmp_path):
    """A peer gone during a collective outside the forward loop (here the counters `finish` gathers)
    was a RuntimeError traceback on rank 0; now a PipelineError naming the rank and the step."""
    _, results, _ = _launch(tmp_path, 2, DEMO_DIR, "kill_at_finish", timeout=30, wait=90)
    rc0, out0, err0 = results[0]
    assert results[1][0] == 7
    assert rc0 == 0 and "TYPED PipelineError" in out0, (out0, err0[-3000:])
    assert "rank 0 lost its link during the final counters" in out0 and "Traceback" not in err0, (out0, err0)


def test_stalled_rank_ends_the_run_within_the_timeout(tmp_path):
    _, results, elapsed = _launch(tmp_path, 2, DEMO_DIR, "stall", timeout=3, wait=60, reap=True)
    rc0, _, err0 = results[0]
    assert rc0 == 3, err0
    lines = [line for line in err0.splitlines() if line.strip()]
    assert lines[-1].startswith("hebrus-mlx: error: PipelineError: pipeline: rank 0 waited more than 3 s")
    assert elapsed < 45


def _text(stdout):
    # The generated text sits between the two "==========" lines (the stats below differ: timings).
    return stdout.split("==========\n")[1]


def test_cli_under_mlx_launch_prints_the_single_process_text():
    # mlx.launch takes --verbose (and -p) for itself, so the launched command keeps the defaults.
    cmd = ["generate", "--model", "demo", "--prompt", "def fibonacci(n):", "--ignore-chat-template", "-m", "16"]
    env = child_env()
    single = subprocess.run(cli_argv(*cmd), env=env, capture_output=True, text=True, timeout=120)
    launch = [
        "mlx.launch",
        "--backend",
        "ring",
        "-n",
        "2",
        "--starting-port",
        str(_free_port()),
        "--python",
        sys.executable,
        "-m",
        "hebrus_mlx.cli",
    ]
    launched = subprocess.run([*launch, *cmd], env=env, capture_output=True, text=True, timeout=120)
    assert single.returncode == 0 and launched.returncode == 0, launched.stderr
    assert _text(launched.stdout) == _text(single.stdout)  # only rank 0 prints, in the same shape
    assert launched.stdout.count("==========") == 2
    assert "Rank 0: layers 0-3, peak memory" in launched.stdout and "Rank 1: layers 4-7" in launched.stdout

    bad = subprocess.run(
        [*launch, *cmd, "--pipeline-split", "9,1"], env=env, capture_output=True, text=True, timeout=120
    )
    # mlx.launch itself exits 0 whatever its ranks return; each rank printed one line.
    assert (
        bad.stderr.count("hebrus-mlx generate: error: --pipeline-split: counts add up to 10, the model has 8 layers")
        == 2
    ), bad.stderr
    assert "Traceback" not in bad.stderr


# -- server under a distributed launch -------------------------------------------------------------


def _server_ranks(tmp_path, n=2, extra=()):
    """Start `hebrus-mlx server` as n ranks (rank 0 serves HTTP on a free port). Returns (procs, port)."""
    hostfile = local_hostfile(tmp_path / "server-hosts.json", n)
    procs = []
    for rank in range(n):
        procs.append(
            subprocess.Popen(
                server_argv(*extra),
                cwd=ROOT,
                env=_rank_env(hostfile, rank),
                stdout=subprocess.PIPE,
                stderr=open(tmp_path / f"server{rank}.err", "w"),
                text=True,
            )
        )
    deadline, line = time.monotonic() + 90, ""
    while time.monotonic() < deadline and "listening on" not in line:
        line = procs[0].stdout.readline()
        if not line and procs[0].poll() is not None:
            raise AssertionError((tmp_path / "server0.err").read_text())
    return procs, int(line.rsplit(":", 1)[1])


def _post(port, body, timeout=60):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    status, data = r.status, r.read().decode()
    conn.close()
    if body.get("stream"):
        events = [json.loads(x[6:]) for x in data.split("\n\n") if x.startswith("data: {")]
        return status, events
    return status, json.loads(data)


def _get(port, path):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    data = json.loads(conn.getresponse().read())
    conn.close()
    return data


def _reap(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


PROMPT = "def fibonacci(n):"


def _single_text(max_tokens):
    from hebrus_mlx import load, stream_generate

    model, tok = load("demo")
    return "".join(r.text for r in stream_generate(model, tok, tok.encode(PROMPT), max_tokens=max_tokens))


def test_server_under_a_launch_equals_one_process_and_reuses_prefixes_across_ranks(tmp_path):
    procs, port = _server_ranks(tmp_path, extra=("--pipeline-timeout", "30"))
    try:
        want = _single_text(12)
        status, r = _post(port, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
        assert status == 200 and r["choices"][0]["text"] == want, r
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # The same prompt again, streamed: its prefix is restored on every rank, not recomputed.
        status, events = _post(
            port,
            {
                "prompt": PROMPT,
                "max_tokens": 12,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert status == 200 and "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # A longer prompt continues from the first reply's snapshot (prompt + 12 tokens), then
        # differs: exact only if rank 1 restored its layers' share of that same snapshot.
        longer = PROMPT + want + "\n"
        from hebrus_mlx import load, stream_generate

        model, tok = load("demo")
        want2 = "".join(x.text for x in stream_generate(model, tok, tok.encode(longer), max_tokens=8))
        status, r = _post(port, {"prompt": longer, "max_tokens": 8, "temperature": 0})
        assert status == 200 and r["choices"][0]["text"] == want2, r
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(tok.encode(PROMPT)) + 12
        # A dead rank: this request and the next end with a 503 naming the pipeline, no hang.
        procs[1].kill()
        procs[1].wait(10)
        for _ in range(2):
            t0 = time.monotonic()
            status, r = _post(port, {"prompt": PROMPT, "max_tokens": 4})
            assert status == 503 and r["error"]["message"].startswith("PipelineError: "), r
            assert time.monotonic() - t0 < 30
        assert procs[0].poll() is None  # still serving (errors), never hung
        health = _get(port, "/health")
        assert health["pipeline"] == {"ranks": [[0, 3], [4, 7]], "down": True}
    finally:
        _reap(procs)
    assert "pipeline down" in (tmp_path / "server0.err").read_text()


def test_server_with_a_stalled_rank_answers_503_then_exits(tmp_path):
    import signal

    procs, port = _server_ranks(tmp_path, extra=("--pipeline-timeout", "3"))
    try:
        status, _ = _post(port, {"prompt": PROMPT, "max_tokens": 2})
        assert status == 200
        os.kill(procs[1].pid, signal.SIGSTOP)  # alive but silent
        t0 = time.monotonic()
        status, r = _post(port, {"prompt": PROMPT, "max_tokens": 4})
        assert status == 503 and "waited more than 3 s" in r["error"]["message"], r
        assert time.monotonic() - t0 < 20
        assert procs[0].wait(20) == 3
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
        _reap(procs)
    err = (tmp_path / "server0.err").read_text()
    assert "pipeline stalled" in err and "PipelineError: pipeline: rank 0 waited more than 3 s" in err


def test_bench_under_a_launch_runs_the_harness_on_rank_0(tmp_path):
    from hebrus_mlx import load, stream_generate
    from hebrus_mlx.bench.harness import _NoStop, prompt_ids

    hostfile = local_hostfile(tmp_path / "bench-hosts.json", 2)
    procs = []
    for rank in range(2):
        procs.append(
            subprocess.Popen(
                cli_argv(
                    "bench",
                    "--model",
                    "demo",
                    "-p",
                    "24",
                    "-g",
                    "10",
                    "-n",
                    "1",
                    "--warmup",
                    "0",
                    "--no-probe",
                    "--no-plot",
                    "--quiet",
                    "--ab",
                    "draft-model=none,ngram",
                    "--out",
                    str(tmp_path / "out"),
                ),
                cwd=ROOT,
                env=_rank_env(hostfile, rank),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    model, tok = load("demo")
    want = [int(r.token) for r in stream_generate(model, _NoStop(tok), prompt_ids(tok, 24, 0), max_tokens=10)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[1][0] == ""  # only rank 0 prints
    assert "Rank 0: layers 0-3" in outs[0][0] and "Rank 1: layers 4-7" in outs[0][0]
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    # Plain and prompt-lookup decoding through the pipeline: the single process's greedy tokens.
    assert {r["config"] for r in result["runs"]} == {"draft-model=none", "draft-model=ngram"}
    assert all(r["tokens"] == want for r in result["runs"]), (want, result["runs"])
    assert [row["rank"] for row in result["pipeline"]] == [0, 1] and result["pipeline"][1]["forwards"] > 0


# -- a rank reads (and verifies) only its own dense tensors ------------------------------------------


def _copy_demo(tmp_path):
    import shutil

    dst = tmp_path / "demo"
    shutil.copytree(DEMO_DIR, dst)
    return dst


def _tensor_range(path, name):
    raw = (path / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def _flip(path, name):
    begin, end = _tensor_range(path, name)
    f = path / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[(begin + end) // 2] ^= 0x01
    f.write_bytes(bytes(raw))


def test_stage_reads_only_its_own_dense_ranges(monkeypatch):
    import hashlib

    from hebrus_mlx.admission import admit
    from hebrus_mlx.loading import build_model as LA

    m = admit(str(DEMO_DIR))
    raw = (DEMO_DIR / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    # The shipped digests are the SHA-256 of each tensor's bytes (computed here independently).
    for name, e in header.items():
        b, c = e["data_offsets"]
        assert m.dense_digests[name] == hashlib.sha256(raw[8 + header_len + b : 8 + header_len + c]).hexdigest()

    dense = os.path.realpath(DEMO_DIR / "model.safetensors")
    reads, real_pread = [], os.pread

    def counting(fd, n, offset):
        data = real_pread(fd, n, offset)
        if os.path.realpath(f"/proc/self/fd/{fd}") == dense:
            reads.append((offset, offset + len(data)))
        return data

    def whole(*a):
        raise AssertionError("a stage read the whole dense file")

    monkeypatch.setattr(os, "pread", counting)
    monkeypatch.setattr(LA, "_load_hashed", whole)
    base = 8 + header_len
    for st in stages([3, 5]):
        reads.clear()
        model = LA.load_artifact_model(m, stage=st)
        owned = sorted(
            (base + e["data_offsets"][0], base + e["data_offsets"][1]) for k, e in header.items() if st.owns(k)
        )
        assert sorted(reads) == sorted([(0, 8)] + owned)  # the length prefix, then its tensors, once each
        assert sum(b - a for a, b in reads) < len(raw) - base  # the other rank's tensors stayed unread
        assert model.model.layers[st.start] is not None


def test_a_flipped_byte_fails_only_the_rank_that_owns_it(tmp_path, capsys):
    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact.errors import DigestError
    from hebrus_mlx.loading.build_model import load_artifact_model

    first, last = stages([3, 5])
    path = _copy_demo(tmp_path)
    _flip(path, "lm_head.weight")  # the last rank's
    m = admit(str(path))
    clean = dict(tree_flatten_params(load_artifact_model(admit(str(DEMO_DIR)), stage=first)))
    got = dict(tree_flatten_params(load_artifact_model(m, stage=first)))
    assert got.keys() == clean.keys() and all(np.array_equal(np.array(got[k]), np.array(clean[k])) for k in got)
    with pytest.raises(DigestError) as e:
        load_artifact_model(m, stage=last)
    assert str(e.value).splitlines() == ["tensors.lm_head.weight.sha256: digest mismatch in model.safetensors"]

    _flip(path, "lm_head.weight")  # back
    _flip(path, "model.layers.1.mlp.gate.weight")  # the first rank's
    m = admit(str(path))
    with pytest.raises(DigestError, match=r"^tensors\.model\.layers\.1\.mlp\.gate\.weight\.sha256: digest mismatch"):
        load_artifact_model(m, stage=first)
    load_artifact_model(m, stage=last)
    # A single process checks the whole-file digest, as before.
    with pytest.raises(DigestError, match="dense store digest mismatch"):
        load_artifact_model(m)


def tree_flatten_params(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def test_older_artifact_without_digests_reads_the_whole_file_and_says_so(tmp_path, capsys):
    from hebrus_mlx.admission import admit
    from hebrus_mlx.loading.build_model import load_artifact_model

    path = _copy_demo(tmp_path)
    man = json.loads((path / "manifest.json").read_text())
    for rec in man["tensors"].values():
        del rec["sha256"]
    (path / "manifest.json").write_text(json.dumps(man))
    m = admit(str(path))
    assert m.dense_digests is None
    load_artifact_model(m, stage=stages([3, 5])[1])
    assert (
        "rank 1: model.safetensors has no per-tensor digests (an older artifact): this stage reads and "
        "verifies the whole file" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "edit,field,message",
    [
        (
            lambda t: t["lm_head.weight"].update(sha256="ab" * 31),
            "manifest.tensors.lm_head.weight.sha256",
            "hex SHA-256",
        ),
        (
            lambda t: t["lm_head.weight"].update(sha256="AB" * 32),
            "manifest.tensors.lm_head.weight.sha256",
            "hex SHA-256",
        ),
        (lambda t: t["lm_head.weight"].pop("sha256"), "manifest.tensors.lm_head.weight.sha256", "all or none"),
        (lambda t: t["lm_head.weight"].update(crc=1), "manifest.tensors.lm_head.weight.crc", "unknown inventory field"),
    ],
)
def test_admission_checks_per_tensor_digests_strictly(tmp_path, edit, field, message):
    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact.errors import AdmissionError

    path = _copy_demo(tmp_path)
    man = json.loads((path / "manifest.json").read_text())
    edit(man["tensors"])
    (path / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(AdmissionError) as e:
        admit(str(path))
    assert e.value.field == field and message in str(e.value)


def test_converter_writes_per_tensor_digests(tiny_artifact_dir):
    import hashlib

    from hebrus_mlx.admission import admit

    m = admit(str(tiny_artifact_dir))
    raw = (Path(tiny_artifact_dir) / "model.safetensors").read_bytes()
    base = 8 + int.from_bytes(raw[:8], "little")
    assert m.dense_digests is not None and set(m.dense_digests) == set(m.tensors)
    for name, rec in m.tensors.items():
        b, e = rec["data_offsets"]
        assert m.dense_digests[name] == hashlib.sha256(raw[base + b : base + e]).hexdigest()


# -- speculative decoding through the pipeline ----------------------------------------------------------

SPEC_TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "def fibonacci(n):\n    if n < 2:"
)


def test_speculative_decoding_through_two_ranks_equals_one_process(tmp_path):
    from hebrus_mlx import load, stream_generate
    from hebrus_mlx.speculative import SpeculativeStats

    drafts = ["ngram", "mtp", str(DEMO_DIR)]  # prompt lookup, the MTP head, a draft model directory
    model, tok = load("demo")
    ids = tok.encode(SPEC_TEXT)
    env = {"DRAFT": ",".join(drafts), "PROMPT_IDS": ",".join(map(str, ids)), "MAX_TOKENS": "24"}
    out, results, _ = _launch(tmp_path, 2, DEMO_DIR, "spec", env_extra=env)
    assert all(rc == 0 for rc, _, _ in results), results
    got = np.load(out)
    plain = [r.token for r in stream_generate(model, tok, ids, max_tokens=24)]
    width = model.args.hc_count * model.args.hidden_size * 4
    for i, draft in enumerate(drafts):
        stats = SpeculativeStats()
        single = [
            r.token
            for r in stream_generate(
                model,
                tok,
                ids,
                max_tokens=24,
                draft_model=draft,
                num_draft_tokens=3,
                governor=None,
                speculative_stats=stats,
            )
        ]
        assert got[f"tokens{i}"].tolist() == plain == single, draft
        # The same drafts (fixed block size: no timing-driven governor), accepted and rolled back
        # alike: verify and rollback ran across the ranks.
        assert got[f"stats{i}"].tolist() == [stats.drafted, stats.accepted, stats.reruns], draft
        assert stats.drafted > 0
        hidden = int(got[f"hidden_bytes{i}"])
        if draft == "mtp":
            # The final pre-mixer state of every row came back with the logits: 4 bytes x hc x hidden per row.
            assert hidden > 0 and hidden % width == 0
        else:
            assert hidden == 0
        if draft == "ngram":
            assert stats.reruns > 0  # a rejected suffix was rolled back on both ranks


def test_pipeline_load_applies_graph_options_and_the_machine_profile(monkeypatch):
    """One load route: under mlx.launch, `--graph` reaches the stage's graph and the machine profile
    is applied (AFN-013), as `load` does; a world of one rank runs the same load in this process."""
    from hebrus_mlx import machine_profile
    from hebrus_mlx.commands.verb_flags import build_parser, load_or_serve
    from hebrus_mlx.pipeline import stage as stage_module

    reads = []
    real = machine_profile.read_profile
    monkeypatch.setattr(machine_profile, "read_profile", lambda *a, **k: reads.append(1) or real(*a, **k))
    monkeypatch.setattr(stage_module, "terminate_as_error", lambda: None)  # no SIGTERM handler in pytest
    args = build_parser().parse_args(["--graph", "join_projections=off,dense_sdpa=off"])
    pipe, model, tok = load_or_serve(DEMO_DIR, args)
    assert pipe.size == 1 and reads == [1]
    assert (model.local.options.join_projections, model.local.options.dense_sdpa) == (False, False)
    assert model.tokenizer_vocab_size == tok.effective_vocab_size
    plain = load_or_serve(DEMO_DIR, build_parser().parse_args([]))[1]
    assert (plain.local.options.join_projections, plain.local.options.dense_sdpa) == (True, True)
