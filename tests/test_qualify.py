"""`hebrus-mlx qualify`: the machine profile and how load() uses it (AFN-013).

Provenance: profiles here are written by the tests (claims to be honoured or refused) or by qualify
on this machine; A/B decisions get injected measurements; nothing is produced by the code it checks
except the Linux run, whose sections are checked for being marked not qualified."""

import json
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx import kernels
from hebrus_mlx import machine_profile as prof
from hebrus_mlx import qualify as q
from hebrus_mlx.machine_profile import SCHEMA, ProfileError, read_profile, write_profile
from hebrus_mlx.qualify import FAILED, NO_GAIN, NOT_QUALIFIED, PASSED, qualify
from hebrus_mlx.stream import engine as se
from hebrus_mlx.testing.processes import cli_argv, flag_cases


@pytest.mark.skipif(not shutil.which("g++"), reason="no C++ compiler for the emulated kernels")
def test_profile_on_this_machine_marks_nothing_passed_without_metal(tmp_path):
    profile = qualify(probe_dir=str(tmp_path), record_bytes=64 * 1024, probe_mib=4)
    assert profile["schema"] == SCHEMA
    for name in kernels.KERNELS:
        entry = profile["kernels"][name]
        assert entry["emulated_ok"], entry
        if not kernels.metal_available():
            assert entry["status"] == NOT_QUALIFIED and entry["device"] == "emulator"
    if not kernels.metal_available():
        assert '"passed"' not in json.dumps(profile)  # no status says passed
        assert profile["streaming"]["gpu_event"]["status"] == NOT_QUALIFIED
        assert profile["io"]["mtlio_vs_pread"]["status"] == NOT_QUALIFIED
    pread = profile["io"]["pread"]
    if pread.get("status") == "measured":
        assert all(pread[f"qd{q}_GBps"] > 0 for q in (1, 8, 32)) and pread["sha256_vs_qd32"] > 0
        assert pread["page_cache"].startswith(("bypassed", "evicted")), pread["page_cache"]
        assert pread["sha256_engine_vs_qd32"] > 0 and pread["sha256_engine_backend"]
    cross = profile["io"]["sweep_crossover"]  # a disk measurement: on Linux too (stream.crossover)
    assert cross["status"] == "measured" and 0 < cross["crossover"] <= 1 and cross["sweep_ms_median"] > 0
    assert not list(tmp_path.iterdir())  # the probe file is removed
    # round trip, and load() switches on exactly what passed on Metal
    path = write_profile(profile, tmp_path / "p.json")
    assert read_profile(path) == profile
    assert kernels.configure(read_profile(path)) == set()
    assert prof.ignored_claims(profile) == []


def _claiming(machine, **entries):
    """A profile written on `machine` whose listed entries claim passed on Metal."""
    p = {"schema": SCHEMA, "machine": dict(machine), "kernels": {}, "streaming": {}, "io": {}}
    for dotted in entries.get("passed", ()):
        section, name = dotted.split(".")
        p[section][name] = {"status": PASSED, "device": "metal"}
    return p


@pytest.fixture
def metal_mac(monkeypatch):
    """This process seen as a Mac with Metal (the identity profile.passed compares with)."""
    here = dict(prof.this_machine(), metal=True)
    monkeypatch.setattr(prof, "this_machine", lambda: dict(here))
    return here


@pytest.mark.parametrize(
    "change,honoured",
    [
        ({}, True),
        ({"mlx": "0.0.1"}, False),  # another MLX: re-qualify
        ({"release": "other-os"}, False),  # another OS release (its Metal compiler)
        ({"machine": "other-arch"}, False),  # another machine
        ({"metal": False}, False),  # written where there was no Metal
    ],
)
def test_passed_honours_only_claims_written_on_this_machine(metal_mac, change, honoured):
    p = _claiming(dict(metal_mac, **change), passed=["kernels.hc_mix"])
    assert prof.passed(p, "kernels", "hc_mix") is honoured
    assert prof.ignored_claims(p) == ([] if honoured else ["kernels.hc_mix"])


@pytest.mark.parametrize(
    "entry",
    [
        {"status": PASSED, "device": "emulator"},
        {"status": NO_GAIN, "device": "metal"},
        {"status": FAILED, "device": "metal"},
        {"status": NOT_QUALIFIED},
        "passed",
    ],
)
def test_passed_refuses_entries_that_did_not_pass_on_metal(metal_mac, entry):
    p = _claiming(metal_mac)
    p["streaming"]["gpu_event"] = entry
    assert not prof.passed(p, "streaming", "gpu_event")


def test_a_claim_is_ignored_without_metal_now(metal_mac, monkeypatch):
    p = _claiming(metal_mac, passed=["kernels.hc_mix"])
    monkeypatch.setattr(prof, "this_machine", lambda: dict(metal_mac, metal=False))
    assert not prof.passed(p, "kernels", "hc_mix")


class FakeExt:
    """Records what configure asks of the extension."""

    def __init__(self):
        self.gpu_events = None

    def set_gpu_events(self, on):
        self.gpu_events = on

    def gpu_events_compiled(self):
        return True


def test_load_refuses_a_profile_claiming_what_this_machine_has_not_qualified(tmp_path, monkeypatch):
    """Linux (no Metal): a profile claiming every optional feature passed - even one stamped with
    this machine's identity - switches nothing on, and load() says so."""
    if kernels.metal_available():
        pytest.skip("this check is for a machine without Metal")
    claim = _claiming(prof.this_machine(), passed=["kernels.hc_mix", "streaming.gpu_event", "io.mtlio_vs_pread"])
    path = write_profile(claim, tmp_path / "p.json")
    monkeypatch.setenv("HEBRUS_PROFILE", str(path))
    from hebrus_mlx.loader import _apply_machine_profile

    with pytest.warns(UserWarning, match="not honoured"):
        assert _apply_machine_profile() == set()
    assert se.default_backend() == "pread"
    assert not (se._ext and se._ext.gpu_events_enabled())


@pytest.mark.parametrize(
    "compiled,backends,env,want",
    [
        (True, ["pread", "mtlio"], {}, {"gpu_event": True, "backend": "mtlio"}),
        (False, ["pread"], {}, {"gpu_event": False, "backend": "pread"}),  # the build lacks both
        (
            True,
            ["pread", "mtlio"],
            {"gpu_events": False, "mtlio": False},
            {"gpu_event": False, "backend": "pread"},
        ),  # switched off by GraphOptions
    ],
)
def test_stream_configure_switches_on_only_qualified_built_features(
    metal_mac, monkeypatch, compiled, backends, env, want
):
    fake = FakeExt()
    monkeypatch.setattr(se, "_ext", fake)
    monkeypatch.setattr(se, "gpu_events_compiled", lambda: compiled)
    monkeypatch.setattr(se, "backends", lambda: backends)
    from hebrus_mlx.models.options import GraphOptions

    try:
        p = _claiming(metal_mac, passed=["streaming.gpu_event", "io.mtlio_vs_pread"])
        assert se.configure(p, GraphOptions(**env)) == want and fake.gpu_events is want["gpu_event"]
        assert se.default_backend() == want["backend"]
        # a profile from another MLX promotes nothing
        assert se.configure(_claiming(dict(metal_mac, mlx="0.0.1"), passed=["streaming.gpu_event"])) == {
            "gpu_event": False,
            "backend": "pread",
        }
        assert fake.gpu_events is False
    finally:
        se._profile_backend = "pread"


def test_bad_profile_is_typed_and_load_keeps_kernels_off(tmp_path, monkeypatch, metal_mac):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"schema": "other", "kernels": {"hc_mix": {"status": "passed", "device": "metal"}}}))
    with pytest.raises(ProfileError, match="profile.schema"):
        read_profile(bad)
    monkeypatch.setenv("HEBRUS_PROFILE", str(bad))
    from hebrus_mlx.loader import _apply_machine_profile

    with pytest.warns(UserWarning, match="kernels stay off"):
        assert _apply_machine_profile() == set()
    write_profile(_claiming(metal_mac, passed=["kernels.hc_mix"]), bad, overwrite=True)  # not ours: issue 22
    assert _apply_machine_profile() == {"hc_mix"}
    assert kernels.enabled("hc_mix") == kernels.metal_available()
    kernels.configure(None)


def test_profile_is_published_atomically(tmp_path):
    """A profile the reader would refuse is never published: the old one stays, no temp is left."""
    path = write_profile({"schema": SCHEMA, "machine": {}}, tmp_path / "p.json")
    before = path.read_bytes()
    with pytest.raises(ProfileError, match="profile.schema"):
        write_profile({"schema": "hebrus-mlx/machine-profile/0"}, path)  # verify reads the synced temp back
    assert path.read_bytes() == before and [x.name for x in tmp_path.iterdir()] == ["p.json"]
    write_profile({"schema": SCHEMA, "machine": {"system": "x"}}, path)
    assert read_profile(path)["machine"] == {"system": "x"}


# ---- A/B/B/A decisions with injected measurements --------------------------------------------------


def test_abba_interleaves_the_arms():
    calls = []
    res = q.run_abba(lambda: calls.append("A") or (1.0, "x"), lambda: calls.append("B") or (2.0, "x"), 2)
    assert calls == ["A", "B", "B", "A", "A", "B", "B", "A"] and res["identical"]
    assert res["a"] == [1.0] * 4 and res["b"] == [2.0] * 4


@pytest.mark.parametrize(
    "a,b,identical,status,decision",
    [
        ([10, 10, 10, 10], [11, 11, 10.9, 11], True, PASSED, "new"),  # +10%: promoted
        ([10, 10, 10, 10], [10.1, 10.1, 10.1, 10.1], True, NO_GAIN, "old"),  # +1% is noise: stays off
        ([10, 10, 10, 10], [9, 9, 9, 9], True, NO_GAIN, "old"),
        ([10, 10, 10, 10], [20, 20, 20, 20], False, FAILED, "old"),  # faster but different: refused
        ([10, 10, 10, 10], [10.1, 40, 10.1, 10.1], True, NO_GAIN, "old"),  # one outlier run: medians, not means
    ],
)
def test_decide_ab(a, b, identical, status, decision):
    e = q.decide_ab(a, b, identical, "old", "new", "x")
    assert e["status"] == status and e["decision"] == decision and e["device"] == "metal"
    assert e["old_x"] == a and e["new_x"] == b


def _as_metal_mac(monkeypatch, compiled=True, mtlio=True):
    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    monkeypatch.setattr(se, "gpu_events_compiled", lambda: compiled)
    monkeypatch.setattr(se, "backends", lambda: ["pread", "mtlio"] if mtlio else ["pread"])


@pytest.mark.parametrize(
    "b_tokens,b_rate,status",
    [
        ([1, 2, 3], 12.0, PASSED),
        ([1, 2, 4], 12.0, FAILED),  # one different token: never promoted, however fast
        ([1, 2, 3], 10.0, NO_GAIN),
    ],
)
def test_gpu_event_section_decides_on_tokens_and_speed(monkeypatch, b_tokens, b_rate, status):
    _as_metal_mac(monkeypatch)
    arms = []

    def measure(gpu):
        arms.append(gpu)
        return (b_rate, b_tokens) if gpu else (10.0, [1, 2, 3])

    e = q.gpu_event_section("demo", rounds=2, tokens=3, measure=measure)
    assert arms == [False, True, True, False] * 2
    assert e["status"] == status and e["decision"] == ("gpu_event" if status == PASSED else "cpu_stream")
    assert e["identical"] is (b_tokens == [1, 2, 3])


def test_gpu_event_section_not_qualified_without_the_path(monkeypatch):
    _as_metal_mac(monkeypatch, compiled=False)
    e = q.gpu_event_section("demo", 1, 3, measure=lambda gpu: pytest.fail("must not measure"))
    assert e["status"] == NOT_QUALIFIED and "HEBRUS_METAL_EVENTS" in e["reason"]


@pytest.mark.parametrize("bad_run,mtlio_rate,status", [(None, 2.0, PASSED), (None, 1.0, NO_GAIN), (2, 2.0, FAILED)])
def test_mtlio_section_compares_every_run_with_pread_bytes(monkeypatch, bad_run, mtlio_rate, status):
    _as_metal_mac(monkeypatch)
    seen = []

    def measure(i, backend):
        seen.append(backend)
        return (mtlio_rate if backend == "mtlio" else 1.0), ("bad" if i == bad_run else f"ok{i}")

    e = q.mtlio_section("demo", rounds=1, measure=measure, reference=lambda i: f"ok{i}")
    assert seen == ["pread", "mtlio", "mtlio", "pread"] and e["status"] == status


def test_mtlio_section_runs_the_real_resolve_measurement(monkeypatch):
    """The A/B plumbing with the real arena measurement (both arms pread here: no MTLIO on this
    build): every run reads records no other run read, and its bytes match a later pread resolve."""
    _as_metal_mac(monkeypatch)
    m, plan, reused = q._record_plan("demo", per_run=10, runs=4)
    flat = [(layer, e) for batch in plan for layer, es in batch for e in es]
    assert len(flat) == len(set(flat)) == 40 and not reused
    rows = max(len(e) for batch in plan for _, e in batch)
    e = q.mtlio_section("demo", rounds=1, measure=lambda i, backend: q.measure_resolve(m, plan[i], "pread", rows))
    assert e["identical"] and e["status"] in (PASSED, NO_GAIN) and all(r > 0 for r in e["pread_GBps"])


def test_a_failed_gpu_event_host_task_fails_and_rolls_back_the_step(monkeypatch):
    """rollback_on_error checks the GPU-event error slot after the step: a task's failure (tagged
    in C++) rolls the cache back and is raised typed, even though evaluation itself returned."""
    from hebrus_mlx.stream.errors import ShortReadError
    from hebrus_mlx.stream.rollback import rollback_on_error

    class Slot:
        def check_gpu_event_errors(self):
            raise RuntimeError("short read of record 3 [stream:short_read]")

    class Cache:
        restored = None

        def restore(self, snap):
            self.restored = snap

    monkeypatch.setattr(se, "_ext", Slot())
    cache = Cache()
    with pytest.raises(ShortReadError, match="short read of record 3"):
        with rollback_on_error(cache, "snap"):
            pass
    assert cache.restored == "snap"


@pytest.mark.parametrize(
    "args,field",
    flag_cases(
        ("--probe-mib", "0"),
        ("--rounds", "0"),
        ("--tokens", "0"),
        ("--artifact", "/nonexistent/x"),
        ("--probe-dir", "/nonexistent/x"),
        ("--store", "/nonexistent/x"),
    ),
)
def test_cli_bad_input_exits_2_naming_the_field(args, field, tmp_path):
    proc = subprocess.run(
        cli_argv("qualify", "--out", str(tmp_path / "p.json"), *args),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and field in proc.stderr and "Traceback" not in proc.stderr


# ---- kernels on a (faked) Metal device ----------------------------------------------------------

BANNER = "Metal GPU Validation Enabled\n"  # printed on every validated run: not a report


def _fake_metal_kernels(monkeypatch, raising=(), reported=(), slower=()):
    """A Mac as far as qualify's kernel section sees it: each kernel's `metal` is its ops path, or
    raises as a Metal compile error does (`raising`); the validation child runs in-process and its
    stderr carries Metal's banner plus, for kernels in `reported`, a report line in the form Metal
    writes with MTL_SHADER_VALIDATION_REPORT_TO_STDERR=1."""
    from hebrus_mlx.kernels import hc_mix, ple_gather, qsa_attention

    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    # Timing on a fake device means nothing: each kernel is "faster" unless named in `slower`.
    monkeypatch.setattr(
        q,
        "kernel_speed",
        lambda name: {"faster": name not in slower, "median_ratio": 0.9 if name in slower else 1.5, "reason": "fake"},
    )
    for module in (hc_mix, ple_gather, qsa_attention):
        name = module.NAME
        if name in raising:

            def fail(*a, _name=name, **k):
                raise RuntimeError(f"[metal::Device] Unable to build metal library from source for {_name}")

            monkeypatch.setattr(module, "metal", fail)
        elif module is qsa_attention:

            def sparse(*arrays_and_scale):
                *arrays, scale = arrays_and_scale
                return mx.array(q.qsa_attention_ops(*(np.array(t[0]) for t in arrays), scale))[None]

            monkeypatch.setattr(module, "metal", sparse)
        else:
            monkeypatch.setattr(module, "metal", module.ops)
    children = []

    def run(argv, env, **kwargs):
        names = argv[argv.index("--kernels-child") + 1 :] or list(kernels.KERNELS)
        children.append((names, env.get("MTL_SHADER_VALIDATION"), env.get("MTL_SHADER_VALIDATION_REPORT_TO_STDERR")))
        stderr = BANNER + "".join(
            f'Invalid device load at offset 69632, executing kernel function: "custom_kernel_hebrus_{name}_float"\n'
            for name in names
            if name in reported
        )
        diffs = {n: d for n, d in q.check_kernels_metal().items() if n in names}
        return subprocess.CompletedProcess(argv, 0, json.dumps(diffs) + "\n", stderr)

    monkeypatch.setattr(q.subprocess, "run", run)
    return children


def test_a_kernel_that_fails_to_compile_fails_alone_and_qualify_goes_on(monkeypatch):
    """One kernel's compile/launch error is that kernel's FAILED entry (with the error); the other
    kernels still run and pass, and the streaming and I/O sections still run."""
    children = _fake_metal_kernels(monkeypatch, raising={"qsa_attention"})
    monkeypatch.setattr(q, "gpu_event_section", lambda *a: {"status": "ran"})
    monkeypatch.setattr(q, "handoff_section", lambda *a: {"status": "ran"})
    monkeypatch.setattr(q, "io_section", lambda *a: {"pread": {"status": "ran"}})
    profile = q.qualify(emulate=False)
    section = profile["kernels"]
    assert section["qsa_attention"]["status"] == FAILED
    assert "Unable to build metal library" in section["qsa_attention"]["error"]
    assert section["hc_mix"]["status"] == PASSED and section["ple_gather"]["status"] == PASSED
    assert profile["streaming"]["gpu_event"] == {"status": "ran"} and profile["io"]["pread"] == {"status": "ran"}
    assert sorted(c[0] for c in children) == [["hc_mix"], ["ple_gather"]] and all(c[1:] == ("1", "1") for c in children)


def test_shader_validation_fails_only_the_kernel_a_report_names(monkeypatch):
    """Metal's "Validation Enabled" banner is on every validated run's stderr and is not a report;
    a report line naming one kernel's function fails that kernel only."""
    _fake_metal_kernels(monkeypatch, reported={"ple_gather"})
    section = q.kernels_section(emulate=False)
    assert section["hc_mix"]["status"] == PASSED and section["qsa_attention"]["status"] == PASSED
    assert section["ple_gather"]["status"] == FAILED
    assert section["ple_gather"]["shader_validation"]["reports"][0].startswith("Invalid device load")
    assert q.validation_reports(BANNER, "hc_mix") == []


def test_a_correct_kernel_is_promoted_only_when_faster(monkeypatch):
    """AFN-013/016: correct and clean is not enough: a kernel that does not beat the ops path here
    (median of interleaved runs, by MIN_GAIN) is NO_GAIN and stays off; an incorrect kernel is never
    timed."""
    _fake_metal_kernels(monkeypatch, slower={"qsa_attention"})
    section = q.kernels_section(emulate=False)
    assert section["hc_mix"]["status"] == PASSED and section["hc_mix"]["speed"]["faster"]
    assert section["qsa_attention"]["status"] == NO_GAIN and "ops path stays" in section["qsa_attention"]["reason"]
    timed = []
    monkeypatch.setattr(q, "kernel_speed", lambda name: timed.append(name) or pytest.fail("timed"))
    monkeypatch.setattr(q, "check_kernels_metal", lambda: {n: 1.0 for n in kernels.KERNELS})  # far off
    section = q.kernels_section(emulate=False)
    assert all(e["status"] == FAILED for e in section.values()) and timed == []


def test_a_timing_failure_fails_that_kernel_only(monkeypatch):
    _fake_metal_kernels(monkeypatch)

    def speed(name):
        if name == "ple_gather":
            raise RuntimeError("command buffer timed out")
        return {"faster": True, "reason": "fake"}

    monkeypatch.setattr(q, "kernel_speed", speed)
    section = q.kernels_section(emulate=False)
    assert section["ple_gather"]["status"] == FAILED and "timing failed" in section["ple_gather"]["reason"]
    assert section["hc_mix"]["status"] == PASSED


@pytest.mark.parametrize("ops_ms,kernel_ms,faster", [(3.0, 1.0, True), (1.0, 1.0, False), (1.0, 2.0, False)])
def test_kernel_speed_compares_medians_of_interleaved_runs(monkeypatch, ops_ms, kernel_ms, faster):
    """The decision is the medians' ratio against MIN_GAIN; the arms run A/B/B/A (times injected:
    the verdict must not depend on this machine's speed)."""
    order = []

    def call_ms(fn, calls):
        order.append(fn())
        return {"ops": ops_ms, "kernel": kernel_ms}[order[-1]]

    monkeypatch.setattr(q, "_call_ms", call_ms)
    r = q.kernel_speed("k", rounds=2, cases={"k": (lambda: "kernel", lambda: "ops", "shape")})
    assert order == ["ops", "kernel", "kernel", "ops"] * 2
    assert r["faster"] is faster and r["median_ratio"] == pytest.approx(ops_ms / kernel_ms)
    assert r["ops_ms"] == [pytest.approx(ops_ms)] * 4 and r["kernel_ms"] == [pytest.approx(kernel_ms)] * 4
