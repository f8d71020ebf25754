"""`hebrus-mlx qualify`: the machine profile and how load() uses it (AFN-013)."""

import json
import shutil
import subprocess
import sys

import pytest

from hebrus_mlx import kernels
from hebrus_mlx.profile import SCHEMA, ProfileError, read_profile, write_profile
from hebrus_mlx.qualify import NOT_QUALIFIED, qualify


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
        assert "passed" not in json.dumps(profile)
    assert profile["streaming"]["gpu_event"]["status"] == NOT_QUALIFIED
    pread = profile["io"]["pread"]
    if pread.get("status") == "measured":
        assert all(pread[f"qd{q}_GBps"] > 0 for q in (1, 8, 32)) and pread["sha256_vs_qd32"] > 0
    assert not list(tmp_path.iterdir())  # the probe file is removed
    # round trip, and load() switches on exactly what passed on Metal
    path = write_profile(profile, tmp_path / "p.json")
    assert read_profile(path) == profile
    assert kernels.configure(read_profile(path)) == set()


def test_bad_profile_is_typed_and_load_keeps_kernels_off(tmp_path, monkeypatch):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"schema": "other", "kernels": {"hc_mix": {"status": "passed", "device": "metal"}}}))
    with pytest.raises(ProfileError, match="profile.schema"):
        read_profile(bad)
    monkeypatch.setenv("HEBRUS_PROFILE", str(bad))
    from hebrus_mlx.utils import _apply_machine_profile

    with pytest.warns(UserWarning, match="kernels stay off"):
        assert _apply_machine_profile() == set()
    good = {"schema": SCHEMA, "kernels": {"hc_mix": {"status": "passed", "device": "metal"}}}
    write_profile(good, bad)
    assert _apply_machine_profile() == {"hc_mix"}
    assert kernels.enabled("hc_mix") == kernels.metal_available()
    kernels.configure(None)


@pytest.mark.parametrize("args,field", [(["--probe-mib", "0"], "--probe-mib"),
                                        (["--probe-dir", "/nonexistent/x"], "--probe-dir"),
                                        (["--store", "/nonexistent/x"], "--store")])
def test_cli_bad_input_exits_2_naming_the_field(args, field, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hebrus_mlx.cli", "qualify", "--out", str(tmp_path / "p.json"), *args],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and field in proc.stderr and "Traceback" not in proc.stderr
