"""Artifact benchmarks, printed side by side:

* PLE row lookup latency p50/p99, cold (posix_fadvise DONTNEED before each
  read) and warm, for 4 KiB and 64 KiB pages;
* digest verification cost per MiB (raw SHA-256, ExpertMajor verify_all,
  PLE verify_all);
* conversion throughput and peak RSS of `hebrus-mlx convert` on the tiny
  checkpoint (subprocess, ru_maxrss);
* bounded-memory conversion: the ~390 MiB expert-heavy bulk checkpoint
  (tests/support/convert_fixture.py) converted by `hebrus-mlx convert` in a child
  whose RLIMIT_DATA is capped well below the checkpoint size.

  python benchmarks/bench_artifact.py [--lookups 2000]
"""

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path.insert(0, TESTS)

from hebrus_mlx.artifact import constants as C  # noqa: E402
from hebrus_mlx.artifact import expert_major as em  # noqa: E402
from hebrus_mlx.artifact import ple_pages as pp  # noqa: E402

FAM = C.QWEN4EXP_DEMO


def _ple(root, page_bytes):
    g0 = pp.Geometry(FAM, 0, "f32")
    rpp = max(1, (page_bytes - C.PLE_PAGE_HEADER_BYTES) // g0.row_bytes)
    rng = np.random.default_rng(0)
    path = os.path.join(root, f"ple_{page_bytes}.hbpl")
    chunks = (
        rng.standard_normal((n, g0.width)).astype(np.float32)
        for n in [4096] * (g0.total_rows // 4096) + [g0.total_rows % 4096]
    )
    pp.publish(path, FAM, 0, "f32", chunks, rows_per_page=rpp)
    return path


def _lookups(path, n, cold):
    lat = []
    rng = np.random.default_rng(1)
    with pp.PleReader(path) as r:
        out = np.empty(r.geometry.width, np.float32)
        for row in rng.integers(0, r.geometry.total_rows, n):
            if cold:
                os.posix_fadvise(r.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter_ns()
            r.read_row_into(int(row), out)
            lat.append(time.perf_counter_ns() - t)
    lat = np.array(lat) / 1e3
    return np.percentile(lat, 50), np.percentile(lat, 99)


def _experts(root):
    g = em.Geometry(FAM, "affine4-g64")
    rng = np.random.default_rng(2)
    blank = {}
    for comp, part, dtype, shape, _, _ in g.layout:
        blank.setdefault(comp, {})[part] = rng.integers(0, 1 << 16, size=shape).astype(dtype)
    path = os.path.join(root, "experts.hbem")
    em.publish(
        path, FAM, "affine4-g64", ((l, e, blank) for l in range(FAM.num_hidden_layers) for e in range(FAM.num_experts))
    )
    return path


def _mib_s(fn, nbytes):
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    return nbytes / 2**20 / dt, 1e3 * dt / (nbytes / 2**20)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lookups", type=int, default=2000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        print(
            f"PLE row lookup ({FAM.name} table 0: {FAM.ple_rows[0]} rows x {FAM.ple_width} f32), {a.lookups} random rows"
        )
        print(
            f"{'page':>8} {'warm p50 us':>12} {'warm p99 us':>12} {'cold p50 us':>12} {'cold p99 us':>12} {'cold/warm p50':>14}"
        )
        for page_bytes in (4096, 65536):
            path = _ple(root, page_bytes)
            w50, w99 = _lookups(path, a.lookups, cold=False)
            c50, c99 = _lookups(path, a.lookups, cold=True)
            print(f"{page_bytes // 1024:>6}Ki {w50:12.1f} {w99:12.1f} {c50:12.1f} {c99:12.1f} {c50 / w50:14.1f}x")

        buf = os.urandom(64 << 20)
        rate, cost = _mib_s(lambda: hashlib.sha256(buf).digest(), len(buf))
        print("\nDigest verification")
        print(f"{'what':<28}{'MiB/s':>10}{'ms per MiB':>12}")
        print(f"{'raw sha256 (64 MiB)':<28}{rate:10.0f}{cost:12.3f}")
        ep = _experts(root)
        with em.ExpertMajorReader(ep) as r:
            rate, cost = _mib_s(r.verify_all, r.geometry.payload_bytes)
        print(f"{'ExpertMajor verify_all':<28}{rate:10.0f}{cost:12.3f}")
        with pp.PleReader(os.path.join(root, "ple_65536.hbpl")) as r:
            rate, cost = _mib_s(r.verify_all, r.geometry.payload_bytes)
        print(f"{'PLE verify_all (64 KiB)':<28}{rate:10.0f}{cost:12.3f}")

        from support.artifact_fixture import tiny_checkpoint

        hf = tiny_checkpoint(os.path.join(root, "hf"))
        src = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf))
        out = os.path.join(root, "art")
        code = (
            f"import sys, time, resource; sys.path.insert(0, {TESTS!r}); from support import families; "
            "from hebrus_mlx.convert import convert; t = time.perf_counter(); "
            "convert(sys.argv[1], sys.argv[2], quiet=True); "
            "print(time.perf_counter() - t, [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"
        )
        res = subprocess.run([sys.executable, "-c", code, hf, out], capture_output=True, text=True, check=True)
        dt, rss = res.stdout.split()
        print("\nConversion (tiny checkpoint, affine4-g64, includes admission of the temp dir)")
        print(
            f"source {src / 2**20:.2f} MiB in {float(dt):.2f} s = {src / 2**20 / float(dt):.2f} MiB/s, "
            f"peak RSS {int(rss) / 1024:.0f} MiB"
        )

        _bulk(root)


# VmHWM is the peak RSS of this process image; ru_maxrss would also carry the
# parent's high-water mark across fork/exec.
_BULK_CHILD = (
    "import resource, sys, time\n"
    "def hwm():\n"
    "    return int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])\n"
    "cap = int(sys.argv[1])\n"
    "from hebrus_mlx.commands.convert import main\n"
    "base = hwm()\n"
    "resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))\n"
    "t = time.perf_counter()\n"
    "rc = main(sys.argv[2:])\n"
    "print(time.perf_counter() - t, base, hwm(), file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def _bulk(root, cap=160 << 20):
    from support.convert_fixture import bulk_checkpoint

    hf = os.path.join(root, "bulk")
    size = bulk_checkpoint(hf)
    print(f"\nBounded-memory conversion (bulk checkpoint {size / 2**20:.0f} MiB, RLIMIT_DATA cap {cap >> 20} MiB)")
    print(f"{'profile':<12}{'s':>7}{'MiB/s':>8}{'base RSS MiB':>14}{'peak RSS MiB':>14}{'peak/ckpt':>11}")
    for flag in (["--dtype", "float32"], ["--dtype", "bfloat16"], ["--q-bits", "4"]):
        out = os.path.join(root, "bulk_out_" + flag[-1])
        res = subprocess.run(
            [sys.executable, "-c", _BULK_CHILD, str(cap), "--hf-path", hf, "--out", out, *flag],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            print(f"{flag[-1]:<12} failed: {res.stderr.strip().splitlines()[-1]}")
            continue
        dt, base, peak = res.stderr.strip().splitlines()[-1].split()
        dt, base, peak = float(dt), int(base) / 1024, int(peak) / 1024
        print(f"{flag[-1]:<12}{dt:7.2f}{size / 2**20 / dt:8.0f}{base:14.0f}{peak:14.0f}{peak * 2**20 / size:11.2f}")
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
