"""Hostile or malformed input must end in one typed line naming the field (exit 2 at the CLI),
never a crash, a hang, a traceback or a read outside the directory the user named.

Provenance: every trace here is recorded by `generate --trace-out` on the shipped demo and then
altered by hand (re-signed with a recomputed digest: a buggy or hostile recorder, not a corrupt
file); every other input is written by the test itself.
"""

import io
import json
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from support.trace_fixture import generate_demo_trace

from hebrus_mlx.cli import main
from hebrus_mlx.testing.processes import cli_argv
from hebrus_mlx.traces.shards import write_shard

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _run(argv, stdin=None):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _one_line(rc, err, verb, *needles):
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (rc, err[-3000:])
    assert err.startswith(f"hebrus-mlx {verb}: error: "), err
    for n in needles:
        assert n in err, err
    return err


def _refused(verb, argv, *needles):
    rc, _, err = _run([verb, *argv])
    return _one_line(rc, err, verb, *needles)


def _refused_in_process(verb, argv, *needles, timeout=180, env=ENV):
    """The same check in a child process: a crash (signal) or a hang must fail the test, not kill it."""
    r = subprocess.run(cli_argv(verb, *argv), capture_output=True, cwd=ROOT, env=env, timeout=timeout)
    return _one_line(r.returncode, r.stderr.decode(errors="replace"), verb, *needles)


# ---- route traces ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace")
    generate_demo_trace(d, 4)
    return d


@pytest.fixture
def trace(recorded, tmp_path):
    d = tmp_path / "trace"
    shutil.copytree(recorded, d)
    return d


def _resign(path, fn):
    """Alter a shard's tensors/header with `fn` and sign it again (digest recomputed)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        header = json.loads(f.metadata()["header"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    fn(t, header)
    os.unlink(path)
    write_shard(path, t, header)


def _first_shard(d):
    return sorted(d.glob("*.safetensors"))[0]


@pytest.mark.parametrize("verb", [["replay"], ["eval", "--prefill-step-size", "8"]])
def test_out_of_vocabulary_token_id_is_refused_not_a_crash(trace, verb):
    """An ID past the embedding table used to be gathered unchecked (SIGSEGV in replay and eval)."""
    _resign(_first_shard(trace), lambda t, h: t["token_ids"].__setitem__(1, 1 << 30))
    _refused_in_process("traces", [verb[0], str(trace), "--model", "demo", *verb[1:]], "token_ids", str(1 << 30))


@pytest.mark.parametrize("verb", ["replay", "eval", "export"])
def test_fifo_named_like_a_shard_is_refused_not_read(trace, tmp_path, verb):
    os.mkfifo(trace / "zz-000000.safetensors")
    extra = {"replay": ["--model", "demo"], "eval": [], "export": ["--out", str(tmp_path / "out")]}[verb]
    _refused_in_process("traces", [verb, str(trace), *extra], "zz-000000.safetensors", "not a regular file", timeout=60)
    assert not (tmp_path / "out").exists()


def _negative_token(t, h):
    t["token_ids"][0] = -5


def _unknown_kind(t, h):
    t["kinds"][0] = 7


def _features_wrong_shape(t, h):
    n = len(t["positions"])
    t["feature_positions"] = t["positions"][:1].copy()
    t["features"] = np.zeros((1, 3, n), np.float32)


def _features_alone(t, h):
    t["features"] = np.zeros((0, 8, 64), np.float32)


def _unknown_tensor(t, h):
    t["extra"] = np.zeros(1, np.int32)


@pytest.mark.parametrize(
    "damage, field",
    [
        (_negative_token, "token_ids: negative token ID -5"),
        (_unknown_kind, "kinds: unknown kind 7"),
        (_features_wrong_shape, ".features: shapes"),
        (_features_alone, ".features: present without"),
        (_unknown_tensor, ".extra: not a tensor"),
    ],
)
def test_shard_with_bad_values_is_refused(trace, tmp_path, damage, field):
    shard = _first_shard(trace)
    _resign(shard, damage)
    _refused("traces", ["export", str(trace), "--out", str(tmp_path / "out")], shard.name, field)
    assert not (tmp_path / "out").exists()


def test_export_manifest_path_outside_the_export_is_refused(trace, tmp_path):
    from hebrus_mlx.traces.export import export

    out = tmp_path / "out"
    export(trace, out)
    m = json.loads((out / "manifest.json").read_text())
    victim = tmp_path / "victim.safetensors"
    shard = out / m["shards"][0]["file"]
    victim.write_bytes(shard.read_bytes())  # a valid shard outside OUT, digest and all
    os.unlink(shard)
    m["shards"][0]["file"] = "../victim.safetensors"
    (out / "manifest.json").write_text(json.dumps(m))
    _refused(
        "traces", ["eval", str(out), "--split", m["shards"][0]["split"]], "manifest.shards[0].file", "plain file name"
    )


@pytest.mark.parametrize(
    "entry, field",
    [("not-an-object", "manifest.shards[0]: not an object"), ({"file": 3}, "manifest.shards[0].file: expected str")],
)
def test_export_manifest_bad_shard_entry_is_refused(trace, tmp_path, entry, field):
    from hebrus_mlx.traces.export import export

    out = tmp_path / "out"
    export(trace, out)
    m = json.loads((out / "manifest.json").read_text())
    m["shards"][0] = entry
    (out / "manifest.json").write_text(json.dumps(m))
    _refused("traces", ["eval", str(out)], field)


# ---- raw prompts and held-out text ----------------------------------------------------------------

RAW = ["--model", "demo", "--ignore-chat-template", "-m", "2", "--verbose", "false"]


def _stdin(monkeypatch, data: bytes):
    stream = io.BytesIO(data)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(stream))
    return stream


@pytest.mark.parametrize("verb", ["generate", "cache-prompt"])
def test_non_utf8_prompt_is_refused(verb, monkeypatch, tmp_path):
    """Undecodable bytes on stdin, and undecodable argv bytes (lone surrogates), on the raw path."""
    extra = ["--prompt-cache-file", str(tmp_path / "c.safetensors")] if verb == "cache-prompt" else ["-m", "2"]
    argv = [a for a in RAW if verb == "generate" or a not in ("-m", "2")] + extra
    _stdin(monkeypatch, b"def f(x):\n\xff\xfe return x\n")
    _refused(verb, [*argv, "-p", "-"], "--prompt", "stdin is not UTF-8", "byte 10")
    _refused(verb, [*argv, "-p", "def \udcff(x):"], "--prompt", "not valid UTF-8")
    assert not (tmp_path / "c.safetensors").exists()


def test_stdin_prompt_is_read_with_a_bound(monkeypatch):
    """`-p -` reads at most MAX_STDIN_PROMPT_BYTES + 1 bytes, then refuses naming the limit."""
    from hebrus_mlx.commands import cli_args

    monkeypatch.setattr(cli_args, "MAX_STDIN_PROMPT_BYTES", 1000)
    stream = _stdin(monkeypatch, b"a" * 5000)
    _refused("generate", [*RAW, "-p", "-"], "--prompt", "more than", "MAX_STDIN_PROMPT_BYTES")
    assert stream.tell() == 1001  # the limit and one byte past it, never the rest
    _stdin(monkeypatch, b"def f(x):")
    assert _run(["generate", *RAW, "-p", "-"])[0] == 0  # within the bound: read as before


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"text": "a\\udc80b"}', "lone UTF-16 surrogate"),
        ("[" * 100_000, "nested deeper than"),
        ('{"text": "a", "text": "b"}', "duplicate JSON key"),
    ],
    ids=["surrogate", "nested", "duplicate"],
)
def test_perplexity_jsonl_hostile_line_is_refused(tmp_path, line, needle):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "fine"}\n' + line + "\n")
    _refused("perplexity", ["--model", "demo", "--data-path", str(p)], "--data-path", f"{p}:2", needle)


# ---- simulate --profile and bench --against -------------------------------------------------------


def _shipped_profile():
    from hebrus_mlx.simulate.run import PROFILES_DIR

    return json.loads((PROFILES_DIR / "m5-pro-48gb.json").read_text())


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layer_ms": float("nan")}, "layer_ms: must be a finite number"),
        ({"verify_extra": -1.0}, "verify_extra: must be a finite number in [0, 100]"),
        ({"acceptance": 2.0}, "acceptance: must be a finite number in [0, 0.999]"),
        ({"reserve_gb": -8}, "reserve_gb:"),
        ({"threads": 10**9}, "threads: must be an integer in [1, 1024]"),
        ({"ssd_gbps": {"1": 9.5, "x": 3}}, "ssd_gbps: queue depth 'x'"),
        ({"predictor_overhead": [0.1]}, "predictor_overhead: must be an object"),
        ({"synthetic_routes": {"tokens": 10**9, "reuse": 0.5, "skew": 0.2}}, "synthetic_routes.tokens"),
        ({"synthetic_routes": {"tokens": 400, "warm": 400, "reuse": 0.5, "skew": 0.2}}, "synthetic_routes.warm"),
        ({"synthetic_routes": {"tokens": 400, "reuse": float("inf"), "skew": 0.2}}, "synthetic_routes.reuse"),
    ],
    ids=["nan", "negative", "acceptance", "reserve", "threads", "qd", "overhead", "tokens", "warm", "inf"],
)
def test_simulate_hostile_profile_value_is_refused(tmp_path, change, field):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({**_shipped_profile(), **change}))
    _refused("simulate", ["--profile", str(p), "--quiet"], "--profile", f"{p}: {field}")


def _bench_json(**change):
    run = {"config": "plain", "prompt_tokens": 8, "requested": 4, "tokens": [1, 2, 3, 4]}
    d = {"schema": "hebrus-mlx.bench", "version": 1, "artifact_digest": "manifest:" + "0" * 64, "runs": [run]}
    return {**d, **change}


@pytest.mark.parametrize(
    "content, field",
    [
        ([1, 2], "(top level): not a JSON object"),
        ({"schema": "hebrus-mlx.qualify-report", "version": 1}, "schema: expected 'hebrus-mlx.bench'"),
        (_bench_json(version=2), "version: this build reads version 1"),
        (_bench_json(artifact_digest=None), "artifact_digest"),
        (_bench_json(runs={"a": 1}), "runs: expected a list"),
        (_bench_json(runs=["x"]), "runs[0]: not an object"),
        (_bench_json(runs=[{"config": "a", "prompt_tokens": 8, "requested": 4, "tokens": ["1"]}]), "runs[0].tokens"),
        (_bench_json(runs=[{"config": "a", "prompt_tokens": 8, "tokens": []}]), "runs[0].requested"),
    ],
    ids=["list", "schema", "version", "digest", "runs", "run", "tokens", "requested"],
)
def test_bench_against_malformed_file_is_refused_before_measuring(tmp_path, monkeypatch, content, field):
    from hebrus_mlx.commands import bench as command

    def measured(*a, **k):
        raise AssertionError("the bench ran before --against was checked")

    monkeypatch.setattr(command, "run_bench", measured)
    f = tmp_path / "old.json"
    f.write_text(json.dumps(content))
    out = tmp_path / "o"
    _refused("bench", ["--model", "demo", "--against", str(f), "--out", str(out)], "--against", f"{f}: {field}")
    assert not out.exists()


# ---- server signals -------------------------------------------------------------------------------


def test_sighup_stops_the_server_gracefully(tmp_path):
    """SIGHUP (the terminal closed) takes SIGTERM's path: requests cancelled, exit 0, no traceback.
    Before, its default action killed the process at once (exit -1)."""
    import signal

    from hebrus_mlx.testing.processes import server_port, start_server

    log = tmp_path / "stderr.txt"
    proc = start_server(log, "--shutdown-timeout", "3", log_level="INFO")
    try:
        server_port(proc, log, 120)
        proc.send_signal(signal.SIGHUP)
        rc = proc.wait(60)
        text = log.read_text()
        assert rc == 0, (rc, text[-3000:])
        assert f"signal {int(signal.SIGHUP)}: stopping" in text and "Traceback" not in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()


# ---- qualify --report ------------------------------------------------------------------------------


@pytest.mark.parametrize("report", ["/proc/self/r.json", "/proc/1/r.json"], ids=["proc-self", "proc-1"])
def test_qualify_report_into_an_unwritable_place_is_refused_before_measuring(tmp_path, monkeypatch, report):
    """The report's directory exists but nothing can be created in it (even as root): refused
    before any probe runs, naming the path the user gave (not the publisher's temp name)."""
    from hebrus_mlx import qualify

    def measured(*a, **k):
        raise AssertionError("qualify measured before --report was checked")

    monkeypatch.setattr(qualify, "qualify", measured)
    err = _refused("qualify", ["--report", report, "--out", str(tmp_path / "p.json")], "--report", report)
    assert ".tmp-" not in err and not (tmp_path / "p.json").exists()


def test_qualify_probe_smaller_than_one_record_is_refused(tmp_path):
    _refused("qualify", ["--probe-mib", "1", "--record-kib", "2704", "--out", str(tmp_path / "p.json")], "--probe-mib")


# ---- chat commands --------------------------------------------------------------------------------


def test_chat_unknown_or_malformed_commands_are_refused_not_sent(monkeypatch, capsys):
    """`/reset now`, `/unknown` and `q extra` were sent to the model as text; now each is one
    [ERROR] line and the session goes on. `//text` sends `/text`."""
    from support.verb_loading import patch_load_from_args

    from hebrus_mlx import load
    from hebrus_mlx.commands import chat

    demo = load("demo")
    sent = []

    def stream(model, tok, ids, *a, **k):
        sent.append(tok.decode(ids))
        return iter(())

    patch_load_from_args(monkeypatch, lambda *a, **k: demo)
    monkeypatch.setattr(chat, "stream_with_cache", stream)
    monkeypatch.setattr("sys.stdin", io.StringIO("/reset now\n/unknown\nq extra\n/exit please\n//etc/hosts\nq\n"))
    assert chat.main(["--model", "demo", "--max-tokens", "2", "--verbose", "false"]) == 0
    out = capsys.readouterr().out.splitlines()
    errors = [line[line.index("[ERROR]") :] for line in out if "[ERROR]" in line]  # after the ">> " prompt
    assert [e.split(".")[0] for e in errors] == [
        "[ERROR] /reset takes no arguments",
        "[ERROR] unknown command /unknown",
        "[ERROR] q takes no arguments",
        "[ERROR] /exit takes no arguments",
    ]
    assert len(sent) == 1 and "/etc/hosts" in sent[0] and "//etc" not in sent[0]
    assert not any(w in sent[0] for w in ("/reset now", "/unknown", "q extra"))


# ---- server requests ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    from test_server_fields import _serve

    from hebrus_mlx import load
    from hebrus_mlx.serve.app import App
    from hebrus_mlx.serve.worker import ServerDefaults, Worker

    worker = Worker(lambda: load("demo"), 1 << 30, ServerDefaults())
    port, stop = _serve(App(worker, "demo"))
    try:
        yield {"port": port}
    finally:
        stop()
        worker.stop()


U = {"role": "user", "content": "hi"}
CALL = {"type": "function_call", "name": "f", "call_id": "c1", "arguments": "{}"}


@pytest.mark.parametrize(
    "items, param",
    [
        ([U, {"type": "reasoning", "content": "abc"}], "input[1].content"),  # was a 500
        ([U, {"type": "reasoning", "summary": {"text": "x"}}], "input[1].summary"),  # was a 500
        ([U, dict(CALL, arguments="not json")], "input[1].arguments"),  # named messages[1].tool_calls[0]...
        ([U, dict(CALL, arguments="[1, 2]")], "input[1].arguments"),
        ([U, {"type": "function_call_output", "call_id": "nope", "output": "x"}], "input[1].call_id"),  # accepted
        ([U, CALL, {"type": "function_call_output", "call_id": "c2", "output": "x"}], "input[2].call_id"),
    ],
    ids=["reasoning-content", "reasoning-summary", "arguments-json", "arguments-list", "unknown-call", "other-call"],
)
def test_responses_bad_item_is_a_400_naming_the_responses_field(served, items, param):
    from test_server_fields import _raw

    status, _, body = _raw(served, "POST", "/v1/responses", {"input": items, "max_output_tokens": 2})
    assert status == 400 and body["error"]["param"] == param, (status, body)
    assert "messages[" not in body["error"]["message"], body


def test_responses_function_call_output_answering_a_call_is_accepted(served):
    from test_server_fields import _raw

    items = [U, CALL, {"type": "function_call_output", "call_id": "c1", "output": "3"}]
    status, _, body = _raw(served, "POST", "/v1/responses", {"input": items, "max_output_tokens": 2})
    assert status == 200, body


@pytest.mark.parametrize(
    "bias, needle",
    [({"1" * 5000: 1}, "is not a token ID"), ({"01": 1, "1": 2}, "name the same token 1")],
    ids=["past-int-string-limit", "same-token"],
)
def test_logit_bias_bad_keys_are_a_400(served, bias, needle):
    from test_server_fields import _raw

    body = {"messages": [U], "max_tokens": 2, "logit_bias": bias}
    status, _, r = _raw(served, "POST", "/v1/chat/completions", body)
    assert status == 400 and r["error"]["param"] == "logit_bias" and needle in r["error"]["message"], (status, r)


def test_non_ascii_api_key_is_refused_at_start_up(tmp_path):
    """No client can send a non-ASCII key in an HTTP header: refuse it before loading (exit 2).
    In a child process: a server that starts anyway must fail the test (timeout), not hang it."""
    env = {k: v for k, v in ENV.items() if k != "HEBRUS_MLX_API_KEY"}
    argv = ["--model", "demo", "--port", "0"]
    _refused_in_process("server", [*argv, "--api-key", "clé-secrète"], "--api-key", "ASCII", timeout=60, env=env)
    f = tmp_path / "key"
    f.write_text("clé\n")
    _refused_in_process("server", [*argv, "--api-key-file", str(f)], "--api-key-file", "ASCII", timeout=60, env=env)
