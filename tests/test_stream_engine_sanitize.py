"""Sanitizer run of the C++ engine core (metal_ext/engine.cpp) without
Python or MLX: metal_ext/tests/engine_stress.cpp races requests, cancels,
releases and generation bumps under ThreadSanitizer and ASan+UBSan.

Provenance: the stress driver writes its own random store and compares
every delivered record with those bytes (contract control).
"""

import shutil
import subprocess
from pathlib import Path

import pytest

EXT = Path(__file__).resolve().parents[1] / "metal_ext"
CXX = shutil.which("g++") or shutil.which("clang++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
def test_engine_stress_under_sanitizers(tmp_path):
    """AFN-019: concurrent cancellation and stale generations never deliver
    wrong bytes, leak a pin, race (TSan) or touch freed memory (ASan+UBSan)."""
    sources = [
        str(EXT / "tests" / "engine_stress.cpp"),
        str(EXT / "engine.cpp"),
        str(EXT / "sha256.cpp"),
        str(EXT / "sha256_armv8.cpp"),
        str(EXT / "xxh3.cpp"),
        str(EXT / "testing" / "faults.cpp"),
    ]
    builds = {}
    # Both builds at once: the compile dominates this test's time.
    for name, flags in (("thread", ["-O1"]), ("address,undefined", ["-O0"])):
        exe = tmp_path / ("stress_" + name.replace(",", "_"))
        cmd = [
            CXX,
            "-std=c++20",
            *flags,
            f"-fsanitize={name}",
            "-fno-sanitize-recover=all",
            "-DHEBRUS_TESTING=1",
            f"-I{EXT}",
            *sources,
            "-o",
            str(exe),
            "-lpthread",
        ]
        builds[name] = (exe, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
    for name, (exe, proc) in builds.items():
        err = proc.communicate()[1]
        if proc.returncode != 0 and "cannot find" in err and "san" in err:
            pytest.skip(f"{name} sanitizer runtime missing")
        assert proc.returncode == 0, err
        run = subprocess.run([str(exe), str(tmp_path / f"{exe.name}.bin")], capture_output=True, text=True)
        assert run.returncode == 0 and "wrong=0" in run.stdout, (name, run.stdout + run.stderr)
