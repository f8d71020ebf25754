"""What machine a bench ran on: chip, memory, OS, MLX version and backend, and an SSD read probe
(record-sized random reads of the artifact's own expert store at several queue depths)."""

from __future__ import annotations

import hashlib
import mmap
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def chip() -> str:
    if platform.system() == "Darwin":
        return _sysctl("machdep.cpu.brand_string") or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int:
    if platform.system() == "Darwin":
        v = _sysctl("hw.memsize")
        if v and v.isdigit():
            return int(v)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def mlx_info() -> dict:
    import mlx.core as mx

    from ..machine_profile import compute_backend

    return {"mlx_version": mx.__version__, "backend": compute_backend(), "default_device": str(mx.default_device())}


def _open_direct(path: str):
    """O_DIRECT where the filesystem takes it (bypasses the page cache); else buffered."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError:
            pass
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):  # at least do not pretend the page cache is the disk
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd, False


def fast_check_rate(record_bytes: int = 2_764_800, repeats: int = 9) -> dict[str, object]:
    """GB/s of one core running the per-read fast check (XXH3-128, metal_ext/xxh3.cpp) over one
    record in cache: the picked SIMD backend and the portable scalar one, medians of interleaved
    runs. `qualify` records it beside its SHA-256 figure; {} without the compiled extension."""
    import statistics

    try:
        from .. import _hash
    except ImportError:
        return {}
    buf = os.urandom(record_bytes)
    times: dict[str, list] = {"auto": [], "scalar": []}
    for _ in range(repeats):
        for backend, t in times.items():
            t0 = time.perf_counter()
            _hash.xxh3_128(buf, backend=backend)
            t.append(time.perf_counter() - t0)
    rate = {b: record_bytes / statistics.median(t) / 1e9 for b, t in times.items()}
    return {
        "xxh3_128_GBps_one_thread": rate["auto"],
        "xxh3_128_backend": _hash.xxh3_backend(),
        "xxh3_128_scalar_GBps_one_thread": rate["scalar"],
    }


def ssd_probe(
    path: str,
    record_bytes: int,
    offsets: Sequence[int],
    queue_depths=(1, 2, 4, 8),
    reads: int = 256,
    trials: int = 3,
    seed: int = 0,
) -> dict:
    """GB/s of random record reads (from `offsets`) per queue depth: qd threads, each with one read
    in flight, `reads` reads per trial, the median of `trials` (the machine is shared and noisy);
    plus SHA-256 and XXH3-128 GB/s of one core (the engine checks every record by one of them:
    the fast check where the artifact has it). Reads are O_DIRECT when the
    filesystem allows it (recorded as `direct`); a store small enough for the device's cache reads
    faster than a large one would."""
    import statistics
    import threading

    rng = np.random.default_rng(seed)
    fd, direct = _open_direct(path)
    span = -(-record_bytes // 4096) * 4096
    local = threading.local()

    def read(off):
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, span)  # page-aligned, as O_DIRECT needs
        view, got = memoryview(buf), 0
        while got < span:
            n = os.preadv(fd, [view[got:]], off + got)
            if n <= 0:
                break
            got += n
        return got

    result: dict[str, object] = {
        "path": str(path),
        "record_bytes": int(record_bytes),
        "direct": direct,
        "reads": reads,
        "trials": trials,
        "gbps_by_qd": {},
    }
    try:
        for qd in queue_depths:
            with ThreadPoolExecutor(qd) as ex:
                list(ex.map(read, [int(offsets[0])] * qd))  # start the threads and their buffers
                rates = []
                for _ in range(trials):
                    picks = [int(offsets[i]) for i in rng.integers(0, len(offsets), reads)]
                    t0 = time.perf_counter()
                    total = sum(ex.map(read, picks))
                    rates.append(total / (time.perf_counter() - t0) / 1e9)
            result["gbps_by_qd"][str(qd)] = statistics.median(rates)
    finally:
        os.close(fd)
    block = os.urandom(1 << 22)
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        hashlib.sha256(block).digest()
        rates.append(len(block) / (time.perf_counter() - t0) / 1e9)
    result["sha256_gbps_per_core"] = statistics.median(rates)
    fast = fast_check_rate(len(block))
    if fast:
        result["xxh3_128_gbps_per_core"] = fast["xxh3_128_GBps_one_thread"]
        result["xxh3_128_backend"] = fast["xxh3_128_backend"]
    return result


def expert_store(model_dir) -> dict | None:
    """The artifact's expert store: path, record stride and record offsets (None: not an artifact)."""
    from pathlib import Path

    from ..artifact import constants as C
    from ..artifact.expert_major import Geometry

    man = Path(model_dir) / C.MANIFEST_NAME
    if not man.is_file():
        return None
    from ..artifact import untrusted

    m = untrusted.read_json(str(model_dir), C.MANIFEST_NAME)  # bounded, strict, no symlink (issue 22)
    store = next((s for s in m.get("stores", []) if s.get("role") == "experts"), None)
    if store is None:
        return None
    g = Geometry(C.family(m["family"]), store["codec"])
    return {
        "path": str(Path(model_dir) / store["path"]),
        "record_bytes": g.record_stride,
        "offsets": [g.record_offset(i) for i in range(g.count)],
        "records": g.count,
        "record_payload_bytes": g.record_bytes,
    }


def profile_probe(store_path, record_bytes: int, profile_path=None) -> tuple | None:
    """(probe, source) from the machine profile `hebrus-mlx qualify` wrote, in ssd_probe's shape,
    when it stands for this store: written on this machine (same OS release, architecture, MLX),
    a measured pread probe of records of this size (4 KiB aligned) and, if the profile names the
    file it probed, this store's file system. None otherwise (then the caller probes)."""
    from ..machine_profile import IDENTITY, read_profile, this_machine
    from ..machine_profile import profile_path as default_path

    path = profile_path or default_path()
    prof = read_profile(path)
    if prof is None:
        return None
    here = this_machine()  # the identity profile.passed() checks for kernel claims
    wrote = prof.get("machine") if isinstance(prof.get("machine"), dict) else {}
    pread = (prof.get("io") or {}).get("pread") if isinstance(prof.get("io"), dict) else None
    if any(wrote.get(k) != here[k] for k in IDENTITY) or not isinstance(pread, dict):
        return None
    # Record-sized reads: within 10% of this store's record the GB/s are the same reads (qualify
    # takes the size in whole KiB); a probe of another size (a demo's 16 KiB records) is not.
    if pread.get("status") != "measured" or not 0.9 <= float(pread.get("record_bytes", 0)) / record_bytes <= 1.1:
        return None
    probed = pread.get("store") or pread.get("path")
    if probed:
        try:
            if os.stat(probed).st_dev != os.stat(store_path).st_dev:
                return None
        except OSError:
            return None
    qd = {k[2:-5]: float(v) for k, v in pread.items() if k.startswith("qd") and k.endswith("_GBps")}
    if not qd or not all(q.isdigit() for q in qd):
        return None
    when = prof.get("created_unix")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when)) if isinstance(when, (int, float)) else "unknown"
    source = f"machine profile {path} (hebrus-mlx qualify, written {stamp})"
    probe = {
        "path": probed or "(qualify's probe file)",
        "record_bytes": int(pread["record_bytes"]),
        "direct": bool(pread.get("direct")),
        "gbps_by_qd": dict(sorted(qd.items(), key=lambda x: int(x[0]))),
        "sha256_gbps_per_core": pread.get("sha256_GBps_one_thread"),
        "xxh3_128_gbps_per_core": pread.get("xxh3_128_GBps_one_thread"),
        "source": source,
        "profile_created_unix": when,
    }
    return probe, source


def record(model_dir=None, probe: bool = True, reuse_profile: bool = True) -> dict:
    """The machine record of a bench or simulate run. The SSD probe comes from the machine profile
    when it stands for this machine and store (`profile_probe`), else it is run now."""
    out = {
        "chip": chip(),
        "memory_gb": memory_bytes() / (1 << 30),
        "os": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    out.update(mlx_info())
    if probe and model_dir is not None:
        st = expert_store(model_dir)
        if st is not None:
            got = profile_probe(st["path"], st["record_bytes"]) if reuse_profile else None
            if got is not None:
                out["ssd_probe"] = got[0]
            else:
                out["ssd_probe"] = ssd_probe(st["path"], st["record_bytes"], st["offsets"])
                out["ssd_probe"]["source"] = "probed now on the artifact's expert store"
    return out
