"""Issue 15: `hebrus-mlx bench` mechanics - configurations routed by signature (unknown keys
refused), the interleaved A/B/B/A schedule, per-run metrics from engine counters, refusal on
different tokens or artifacts, JSON + markdown (+ PNG) written, the machine record.

Provenance: expected schedules, metric values and refusals are derived by hand in each test from
the inputs it builds (contract controls); the end-to-end run checks the bench's counters against
the streamed/resident distinction (a resident run reads no expert byte, a streamed one does)."""

import json
import os
import re
import shutil

import pytest

from hebrus_mlx import cli
from hebrus_mlx.bench import harness as H
from hebrus_mlx.bench import machine as M
from hebrus_mlx.errors import UsageError
from hebrus_mlx.testing.processes import flag_cases


def test_parse_ab_is_the_cross_product_and_refuses_bad_specs():
    c = H.parse_ab(["expert-cache-gb=8,16", "prefetch=off,previous"])
    assert c == [
        {"expert-cache-gb": "8", "prefetch": "off"},
        {"expert-cache-gb": "8", "prefetch": "previous"},
        {"expert-cache-gb": "16", "prefetch": "off"},
        {"expert-cache-gb": "16", "prefetch": "previous"},
    ]
    assert H.parse_ab([]) == [{}]
    for bad in (["expert-cache-gb"], ["=1,2"], ["a=1,,2"], ["a=1", "a=2"]):
        with pytest.raises(UsageError) as e:
            H.parse_ab(bad)
        assert e.value.field == "--ab"
    assert H.parse_value("none") is None and H.parse_value("8") == 8 and H.parse_value("0.5") == 0.5
    assert H.parse_value("mtp") == "mtp"


def test_schedule_is_interleaved_abba_with_equal_counts():
    assert H.schedule(2, 4) == [0, 1, 1, 0, 0, 1, 1, 0]
    assert H.schedule(3, 2) == [0, 1, 2, 2, 1, 0]
    s = H.schedule(4, 5)
    assert all(s.count(i) == 5 for i in range(4))
    with pytest.raises(UsageError):
        H.schedule(2, 0)


def test_options_go_where_the_code_accepts_them_and_unknown_keys_are_refused():
    s = H.split_config({"expert-cache-gb": "0.5", "prefill-step-size": "64"})
    assert s.load == {"expert_cache_gb": 0.5} and s.generate == {"prefill_step_size": 64}

    def old_load(path_or_name, dtype=None, expert_cache_gb=None):  # a loader without a prefetch option
        pass

    s = H.split_config({"prefetch": "off"}, old_load)
    assert s.adapt == {"prefetch": "off"} and s.load == {}
    with pytest.raises(UsageError, match="unknown option 'warp-speed'") as e:
        H.split_config({"warp-speed": "9"})
    assert e.value.field == "--ab"

    # An option that lands later in load() / generate (e.g. draft-model, prefetch) is routed by
    # signature with no change to the bench.
    def load(path_or_name, dtype=None, expert_cache_gb=None, prefetch=None):
        pass

    def gen(prompt, model, *, draft_model=None, num_draft_tokens=None, max_tokens=1):
        pass

    s = H.split_config({"prefetch": "router-reuse:2", "draft-model": "mtp", "num-draft-tokens": "3"}, load, (gen,))
    assert s.load == {"prefetch": "router-reuse:2"} and s.adapt == {}
    assert s.generate == {"draft_model": "mtp", "num_draft_tokens": 3}


def _run(config, tokens, p=8, n=4):
    return {"config": config, "tokens": tokens, "prompt_tokens": p, "requested": n}


def test_refuses_different_greedy_tokens_naming_the_configurations_and_position():
    H.check_tokens([_run("a", [1, 2, 3, 4]), _run("b", [1, 2, 3, 4]), _run("b", [9, 9], p=16)])
    with pytest.raises(H.NotComparableError) as e:
        H.check_tokens([_run("a", [1, 2, 3, 4]), _run("b", [1, 2, 7, 4])])
    assert e.value.field == "tokens" and "[b]" in e.value.message and "at token 2" in e.value.message


def test_refuses_different_artifacts_and_incomparable_results():
    H.check_artifacts({"a": "manifest:1", "b": "manifest:1"})
    with pytest.raises(H.NotComparableError) as e:
        H.check_artifacts({"a": "manifest:1", "b": "manifest:2"})
    assert e.value.field == "artifact"
    a = {"artifact_digest": "manifest:1", "runs": [_run("x", [1, 2])]}
    H.compare_results(a, {"artifact_digest": "manifest:1", "runs": [_run("y", [1, 2])]})
    with pytest.raises(H.NotComparableError, match="artifact"):
        H.compare_results(a, {"artifact_digest": "manifest:2", "runs": [_run("y", [1, 2])]})
    with pytest.raises(H.NotComparableError, match="tokens"):
        H.compare_results(a, {"artifact_digest": "manifest:1", "runs": [_run("y", [1, 3])]})


def test_io_metrics_from_counter_deltas():
    counters = [  # (engine counter, value in the snapshot before, value after)
        ("hits", 10, 40),
        ("joins", 0, 10),
        ("misses", 5, 15),
        ("exact_bytes", 1000, 5000),
        ("predicted_bytes", 0, 1000),
        ("exposed_wait_ns", 0, 8_000_000),
        ("exact_read_ns", 0, 32_000_000),
        ("predicted_hits", 0, 10),
        ("predicted_joins", 0, 2),
        ("exact_misses", 2, 10),
        ("predicted_reads", 0, 16),
    ]
    before, after = ({name: row[i] for name, *row in counters} for i in range(2))
    m = H.io_metrics(before, after, tokens=4, record_bytes=None)
    assert m["expert_bytes_per_token"] == (4000 + 1000) / 4
    assert m["hit_rate"] == pytest.approx(40 / 50)  # (30 hits + 10 joins) / (30 + 10 + 10)
    assert m["exposed_wait_ms_per_token"] == pytest.approx(2.0)
    assert m["hidden_fraction"] == pytest.approx(0.75)
    # The engine's definition (stream.engine.prediction_stats): predicted hits over predicted hits +
    # predicted joins + exact misses; a predicted read's own miss is not in the denominator.
    assert m["timely_recall"] == pytest.approx(10 / (10 + 2 + 8))
    assert m["late_recall"] == pytest.approx(2 / (10 + 2 + 8))
    assert m["precision"] == pytest.approx(12 / 16)
    assert m["engine_counters"]["exact_misses"] == 8
    resident = H.io_metrics(None, None, 4, None)
    assert resident["expert_bytes_per_token"] == 0.0 and resident["hit_rate"] is None


def test_io_metrics_report_expert_and_ple_reads_apart():
    """Expert records and PLE pages share one engine; with the engine's store kinds the bench
    reports each apart (the expert column no longer counts PLE pages)."""
    before = {"hits": 0, "joins": 0, "misses": 0, "exact_bytes": 0, "predicted_bytes": 0, "exposed_wait_ns": 0,
              "exact_read_ns": 0, "reads_by_store": {0: 1, 1: 2}, "bytes_by_store": {0: 100, 1: 64},
              "exposed_wait_ns_by_store": {0: 0, 1: 0}}  # fmt: skip
    after = dict(before, exact_bytes=5000 + 128 * 4, exposed_wait_ns=9_000_000, exact_read_ns=1)
    after.update(
        reads_by_store={0: 5, 1: 18},
        bytes_by_store={0: 5100, 1: 64 + 128 * 4},
        exposed_wait_ns_by_store={0: 8e6, 1: 1e6},
    )
    m = H.io_metrics(before, after, tokens=4, record_bytes=None, kinds={0: "experts", 1: "ple"})
    assert m["expert_bytes_per_token"] == 5000 / 4
    assert m["ple_bytes_per_token"] == 128 and m["ple_reads_per_token"] == 4
    assert m["ple_exposed_wait_ms_per_token"] == pytest.approx(0.25)
    assert H.io_metrics(before, after, 4, None)["expert_bytes_per_token"] == (5000 + 512) / 4  # no kinds: one sum


def test_summary_is_median_and_half_range():
    s = H.summarize([10.0, 12.0, 11.0, None])
    assert s == {"median": 11.0, "min": 10.0, "max": 12.0, "n": 3, "spread": pytest.approx(1 / 11)}
    assert H.summarize([None]) is None


def test_machine_record_and_ssd_probe(tmp_path):
    path = tmp_path / "store.bin"
    path.write_bytes(os.urandom(16 * 8192))
    r = M.ssd_probe(str(path), 8192, [i * 8192 for i in range(16)], queue_depths=(1, 2), reads=16, trials=1)
    assert set(r["gbps_by_qd"]) == {"1", "2"} and all(v > 0 for v in r["gbps_by_qd"].values())
    assert isinstance(r["direct"], bool) and r["sha256_gbps_per_core"] > 0
    rec = M.record(None, probe=False)
    for key in ("chip", "memory_gb", "os", "mlx_version", "backend", "cpus"):
        assert rec[key], key
    assert rec["backend"] in ("cpu", "metal")


def test_machine_record_carries_the_fast_check_rate(tmp_path, monkeypatch):
    """Issue 23 §1: the bench machine record's SSD probe carries the per-read fast check's rate
    (XXH3-128, one core) beside SHA-256, both when probed now and when taken from the machine
    profile qualify wrote on this machine."""
    from hebrus_mlx.artifact import fast_check as FC
    from hebrus_mlx.machine_profile import this_machine

    if FC.xxh3_128() is None:
        pytest.skip("the build has no XXH3-128")
    path = tmp_path / "store.bin"
    path.write_bytes(os.urandom(16 * 8192))
    r = M.ssd_probe(str(path), 8192, [i * 8192 for i in range(16)], queue_depths=(1,), reads=16, trials=1)
    assert r["xxh3_128_gbps_per_core"] > 0 and r["xxh3_128_backend"] and r["sha256_gbps_per_core"] > 0
    here = this_machine()
    prof = {
        "machine": {k: here[k] for k in ("system", "release", "machine", "mlx")},
        "io": {
            "pread": {
                "status": "measured",
                "record_bytes": 8192,
                "qd1_GBps": 1.0,
                "qd32_GBps": 2.0,
                "sha256_GBps_one_thread": 0.5,
                "xxh3_128_GBps_one_thread": 7.25,
            }
        },
    }
    from hebrus_mlx import machine_profile

    p = tmp_path / "profile.json"
    p.write_text(json.dumps(prof))
    monkeypatch.setattr(machine_profile, "read_profile", lambda path=None: prof)
    probe, _ = M.profile_probe(str(path), 8192, p)
    assert probe["xxh3_128_gbps_per_core"] == 7.25 and probe["sha256_gbps_per_core"] == 0.5


def test_bench_end_to_end_writes_json_markdown_png(tmp_path, capsys):
    """Two configurations (resident, streamed through a 32-record arena) interleaved A B B A: the
    streamed one reads expert bytes and reports a hit rate, the resident one reads none; tokens
    identical; the outputs are written."""
    out = tmp_path / "out"
    rc = cli.main(
        [
            "bench",
            "--model",
            "demo",
            "-p",
            "8",
            "-g",
            "4",
            "-n",
            "2",
            "--ab",
            "expert-cache-gb=none,0.0005",
            "--no-probe",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    assert res["order"] == ["expert-cache-gb=none", "expert-cache-gb=0.0005"] * 1 + [
        "expert-cache-gb=0.0005",
        "expert-cache-gb=none",
    ]
    assert res["tokens_identical"] and len({tuple(r["tokens"]) for r in res["runs"]}) == 1
    assert res["artifact_digest"].startswith("manifest:")
    by = {s["config"]: s["metrics"] for s in res["summary"]}
    assert by["expert-cache-gb=none"]["expert_bytes_per_token"]["median"] == 0.0
    assert by["expert-cache-gb=0.0005"]["expert_bytes_per_token"]["median"] > 0
    assert by["expert-cache-gb=0.0005"]["hit_rate"] is not None
    assert by["expert-cache-gb=none"]["hit_rate"] is None
    for s in by.values():
        assert s["decode_tok_s"]["median"] > 0 and s["ttft_s"]["median"] > 0 and s["peak_memory_gb"]["median"] > 0
    md = (out / "bench.md").read_text()
    assert md.count("| expert-cache-gb=") == 2 and "decode tok/s" in md
    assert res["machine"]["mlx_version"]
    streamed_tl = [t for t in res["timelines"] if t["config"] == "expert-cache-gb=0.0005"]
    assert streamed_tl and [r["token"] for r in streamed_tl[0]["rows"]] == [1, 2, 3]  # decode tokens
    from hebrus_mlx.bench.report import have_matplotlib

    if have_matplotlib():
        assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "no PNG: matplotlib is not installed" in capsys.readouterr().out


def test_bench_refuses_two_artifacts_before_loading(tmp_path, capsys):
    from hebrus_mlx.loader import DEMO_DIR

    other = tmp_path / "other"
    shutil.copytree(DEMO_DIR, other)
    man = json.loads((other / "manifest.json").read_text())
    man["conversion"]["note"] = "changed"
    (other / "manifest.json").write_text(json.dumps(man))
    rc = cli.main(["bench", "--ab", f"model=demo,{other}", "--no-probe", "--quiet", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert re.match(r"hebrus-mlx bench: error: artifact: configurations run different artifacts", err[0])
    assert not (tmp_path / "o").exists()


def test_bench_refuses_when_a_configuration_changes_the_tokens(monkeypatch):
    """A configuration that claims exactness but changes greedy output is refused (the run is
    perturbed here to stand in for a broken speed feature)."""
    from hebrus_mlx.bench import run as B

    real = H.run_once

    def perturbed(model, tok, prompt, n, gen_kwargs, **kw):
        r = real(model, tok, prompt, n, gen_kwargs, **kw)
        if gen_kwargs.get("prefill_step_size") == 3:
            r["tokens"] = r["tokens"][:-1] + [r["tokens"][-1] + 1]
        return r

    monkeypatch.setattr(H, "run_once", perturbed)
    with pytest.raises(H.NotComparableError, match="prefill-step-size=3"):
        B.run_bench(
            "demo", [8], [3], H.parse_ab(["prefill-step-size=64,3"]), repeats=1, warmup=0, probe=False, timeline=False
        )


@pytest.mark.parametrize(
    "argv, field",
    flag_cases(
        ("-p", "0", "--prompt-tokens"),
        ("-g", "x", "--gen-tokens"),
        ("-r", "0", "--repeats"),
        ("-n", "0", "--repeats"),
        ("--ab", "nope=1,2"),
        ("--ab", "expert-cache-gb"),
    ),
)
def test_bad_bench_input_is_one_typed_line(argv, field, capsys, tmp_path):
    rc = cli.main(["bench", "--no-probe", "--quiet", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"hebrus-mlx bench: error: {field}:"), err


def test_speculative_option_plugs_in_and_reports_acceptance(tmp_path):
    """draft-model reaches generate by signature; the MTP configuration reports its acceptance and
    its greedy tokens equal the plain run's (else the bench would refuse)."""
    from hebrus_mlx.bench import run as B

    # 12 tokens: the block-size governor starts with plain steps and first drafts at its 8th step.
    res = B.run_bench(
        "demo", [8], [12], H.parse_ab(["draft-model=none,mtp"]), repeats=1, warmup=0, probe=False, timeline=False
    )
    by = {s["config"]: s["metrics"] for s in res["summary"]}
    assert by["draft-model=none"]["acceptance"] is None
    acc = by["draft-model=mtp"]["acceptance"]["median"]
    assert 0.0 <= acc <= 1.0 and by["draft-model=mtp"]["tokens_per_step"]["median"] >= 1.0
