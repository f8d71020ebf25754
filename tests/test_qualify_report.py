"""`hebrus-mlx qualify --report FILE` and the simulator reading it (issue 25).

Provenance: the report is written by qualify on this machine (the demo artifact, this disk); the
checks compare it with what this test computes itself (the prompt's text from the tokenizer, the
user/host/tmp names from the OS) or with what a separate program (the simulator's arena replay)
predicts from it. Nothing here is a stored result."""

import getpass
import json
import os
import socket
import subprocess
import sys

import pytest

from hebrus_mlx import qualify_report as QR
from hebrus_mlx.machine_profile import NOT_QUALIFIED
from hebrus_mlx.stream import engine as se

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "hebrus_mlx.cli", *args], capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qualify-report")
    out = tmp / "r.json"
    proc = _cli(
        "qualify",
        "--out",
        str(tmp / "p.json"),
        "--report",
        str(out),
        "--tokens",
        "12",
        "--rounds",
        "1",
        "--probe-dir",
        str(tmp),
        "--probe-mib",
        "4",
        "--record-kib",
        "64",
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tmp, out


def _prompt_text():
    from hebrus_mlx.bench.harness import prompt_ids
    from hebrus_mlx.loader import load

    _, tok = load("demo")
    return tok.decode(prompt_ids(tok, QR.PROMPT_TOKENS, 0))


def test_report_names_no_path_user_host_or_prompt(report):
    tmp, out = report
    words = [
        str(tmp),
        str(tmp.resolve()),
        getpass.getuser(),
        socket.gethostname(),
        str(os.path.expanduser("~")),
        "The quick brown fox",
    ]
    prompt = _prompt_text()
    assert len(prompt) > 20
    words += [prompt, prompt[:24].strip()]
    for f in (out, QR.summary_path(out)):
        text = f.read_text()
        for w in words:
            if w == getpass.getuser() or w == socket.gethostname():
                import re

                assert not re.search(rf"(?<![A-Za-z0-9_]){re.escape(w)}(?![A-Za-z0-9_])", text), (f.name, w)
            else:
                assert w not in text, (f.name, w)


def test_report_sections(report):
    _, out = report
    r = json.loads(out.read_text())
    assert r["schema"] == QR.SCHEMA
    ident = r["identity"]
    assert ident["backend"] == "cpu" and ident["build"]["extension"] and "node" not in ident
    for name, e in r["kernels"].items():  # Linux: the device sections say so, as qualify does
        assert e["status"] == NOT_QUALIFIED and e["emulated_ok"], name
    assert r["streaming"]["gpu_event"]["status"] == NOT_QUALIFIED
    ssd = r["ssd"]
    assert ssd["status"] == "measured" and ssd["record_bytes"] == r["artifact"]["record_bytes"] == 16384
    assert all(ssd[f"qd{q}_GBps"] > 0 for q in (1, 8, 32)) and ssd["page_cache"].startswith(("bypassed", "evicted"))
    h = r["hashes"]
    assert h["sha256_GBps_one_thread"] > 0 and h["sha256_engine_GBps_one_thread"] > 0
    assert h["fast_check"]["status"] in ("measured", QR.NOT_AVAILABLE)
    d = r["decode"]
    assert d["tokens_identical"] and d["resident"]["status"] == "measured" and d["resident"]["layer_ms"] > 0
    assert d["all_cached"]["layer_ms"] > 0
    assert len(d["streamed"]) == 2 and d["streamed"][0]["arena_rows"] < d["streamed"][1]["arena_rows"]
    for s in d["streamed"]:
        assert 0 <= s["hit_rate"] <= 1 and s["exposed_wait_ms_per_token"] >= 0 and s["decode_tok_s_p50"] > 0
    L, k = r["artifact"]["num_layers"], r["artifact"]["top_k"]
    assert len(d["routes"]["prompt"]) == QR.PROMPT_TOKENS and len(d["routes"]["decode"]) == d["gen_tokens"] - 1
    assert all(len(t) == L and all(len(x) == k for x in t) for t in d["routes"]["decode"])
    md = QR.summary_path(out).read_text()
    assert "## Decode" in md and "hit rate" in md and NOT_QUALIFIED in md


def test_simulate_validate_replays_the_reported_runs(report):
    """The report's routes through the simulator's arena at the runs' arena rows give the hit rate
    the engine counted during those runs (a wrong route, row count or warm-up would not)."""
    _, out = report
    proc = _cli("simulate", "--validate", "--report", str(out), "--json", str(out.parent / "v.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "validation against a qualify report" in proc.stdout
    v = json.loads((out.parent / "v.json").read_text())
    assert len(v["runs"]) == 2
    for run in v["runs"]:
        assert run["predicted_tok_s"] > 0 and run["measured_tok_s"] > 0
        assert abs(run["predicted_hit_rate"] - run["measured_hit_rate"]) < 0.1, run
    assert v["runs"][0]["predicted_hit_rate"] < v["runs"][1]["predicted_hit_rate"]
    assert all(len(run["ratios_by_round"]) == 2 for run in v["runs"])  # paired with its round's compute


def test_simulate_profile_projects_from_the_report(report):
    _, out = report
    r = json.loads(out.read_text())
    proc = _cli(
        "simulate",
        "--profile",
        str(out),
        "--family",
        "qwen4exp-demo",
        "--cache-gb",
        "0.001,0.004",
        "--draft-depths",
        "0",
        "--json",
        str(out.parent / "proj.json"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    proj = json.loads((out.parent / "proj.json").read_text())
    m = proj["machine"]
    assert m["ssd_gbps"] == {str(q): r["ssd"][f"qd{q}_GBps"] for q in (1, 8, 32)}
    assert m["layer_ms"] == pytest.approx(r["decode"]["all_cached"]["layer_ms"])
    # Both measured check rates reach the profile: SHA-256 (older artifacts, --check sha256) and the
    # fast check (XXH3-128), which the demo streams with.
    assert r["artifact"]["read_check"] == "xxh3-128"
    assert m["fast_check_gbps"] == pytest.approx(r["hashes"]["fast_check"]["xxh3_128_GBps_one_thread"])
    assert m["verify_gbps"] == pytest.approx(r["hashes"]["sha256_engine_GBps_one_thread"])
    # The compute was measured on the demo: the real family's projection takes the chip profile's
    # compute, labelled, and keeps the report's measured SSD and check rates.
    from hebrus_mlx.simulate import report as SR

    real = SR.check_family(SR.machine_profile(r, "r.json"), "qwen3.8-flash-next")
    stem, chip = SR.chip_profile(real)
    assert real["layer_ms"] == chip["layer_ms"] and real["compute_from"] == stem
    assert real["ssd_gbps"] == {str(q): r["ssd"][f"qd{q}_GBps"] for q in (1, 8, 32)}
    assert any(s.startswith(f"compute: the shipped {stem} profile") for s in real["sources"])
    proc = _cli("simulate", "--profile", str(out), "--cache-gb", "8", "--draft-depths", "0")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    prof = SR.machine_profile(r, "r.json", layer_ms=0.7)  # that family's compute given: taken as is
    assert SR.check_family(prof, "qwen3.8-flash-next") is prof
    assert prof["layer_ms"] == 0.7 and any("--layer-ms 0.7" in s for s in prof["sources"])


@pytest.mark.parametrize(
    "args,field",
    [
        (["qualify", "--report-cache-gb", "1"], "--report-cache-gb"),
        (["qualify", "--report", "R", "--report-cache-gb", "1"], "--report-cache-gb"),
        (["qualify", "--report", "R", "--report-cache-gb", "0,x"], "--report-cache-gb"),
        (["qualify", "--report", "/nonexistent/dir/r.json"], "--report"),
        (["simulate", "--report", "R"], "--report"),
        (["simulate", "--validate", "--report", "/nonexistent/r.json"], "--report"),
        (["simulate", "--validate", "--report", "NOTREPORT"], "--report"),
    ],
)
def test_bad_report_input_exits_2_naming_the_field(tmp_path, args, field):
    (tmp_path / "NOTREPORT").write_text(json.dumps({"schema": "something else"}))
    args = [
        str(tmp_path / "r.json") if a == "R" else str(tmp_path / "NOTREPORT") if a == "NOTREPORT" else a for a in args
    ]
    if args[0] == "qualify":
        args += ["--out", str(tmp_path / "p.json")]
    proc = _cli(*args)
    assert proc.returncode == 2 and field in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "r.json").exists()


def test_help_lists_the_report_flags():
    for verb in ("qualify", "simulate"):
        proc = _cli(verb, "--help")
        assert proc.returncode == 0 and "--report" in proc.stdout, proc.stderr[-500:]


def test_scrub_replaces_paths_and_whole_names_only():
    words = QR.secrets(["/data/alice/models/x"])
    got = QR.scrub(
        {"a": "read /data/alice/models/x/experts.hbem", "/data/alice/models/x": 1, "b": ["cpu_stream"]},
        words + ["alice", "cpu"],
    )
    assert "alice" not in json.dumps(got) and got["b"] == ["cpu_stream"]


def test_fast_check_section_reads_the_rate_where_the_build_has_it(monkeypatch):
    from hebrus_mlx.bench import machine

    monkeypatch.delattr(machine, "fast_check_rate", raising=False)
    assert QR.fast_check_rates(4096) == {"status": QR.NOT_AVAILABLE}
    monkeypatch.setattr(machine, "fast_check_rate", lambda n: {"xxh3_128_GBps_one_thread": 9.5}, raising=False)
    assert QR.fast_check_rates(4096) == {"xxh3_128_GBps_one_thread": 9.5, "status": "measured"}


def test_qualify_records_the_fast_check_rate_beside_sha256(report):
    """Issue 23 §1: the per-read fast check's rate (XXH3-128, one core) goes into qualify's machine
    profile (io.pread, beside SHA-256, against the probed read rate) and into the report's hashes,
    measured whenever the build has the check."""
    from hebrus_mlx.artifact import fast_check as FC

    if FC.xxh3_128() is None:
        pytest.skip("the build has no XXH3-128")
    tmp, out = report
    pread = json.loads((tmp / "p.json").read_text())["io"]["pread"]
    assert pread["xxh3_128_GBps_one_thread"] > 0 and pread["xxh3_128_scalar_GBps_one_thread"] > 0
    from hebrus_mlx import _hash

    assert pread["xxh3_128_backend"] == _hash.xxh3_backend()
    assert pread["xxh3_128_vs_qd32"] == pytest.approx(pread["xxh3_128_GBps_one_thread"] / pread["qd32_GBps"])
    assert pread["sha256_GBps_one_thread"] > 0  # the publication digest's rate stays beside it
    fc = json.loads(out.read_text())["hashes"]["fast_check"]
    assert fc["status"] == "measured" and fc["xxh3_128_GBps_one_thread"] > 0 and fc["xxh3_128_backend"]
