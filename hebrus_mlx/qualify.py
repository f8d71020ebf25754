"""`hebrus-mlx qualify`: measure what this machine can be trusted with and write a machine profile.

`load()` reads the profile and switches on only what passed *on this machine* (AFN-013; see
`profile.passed`: same OS release, architecture and MLX, Metal present). Sections:
- kernels: each Metal kernel against its ops path on the real device, and again in a child of its
  own under MTL_SHADER_VALIDATION=1 reporting to stderr (clean = exit 0, no validation report
  naming the kernel, same diff); a kernel whose compile or launch raises fails alone and the rest
  of qualify goes on; the same sources through the MSL emulator against a float64 oracle
  (everywhere; never counts as passed);
- streaming.gpu_event: GPU-event streaming vs CPU-stream streaming on the streamed demo model,
  interleaved A/B/B/A: identical greedy tokens in every run, promoted only if its median tok/s
  beats the CPU stream by MIN_GAIN;
- io.mtlio_vs_pread: the MTLIO backend vs pread resolving the expert store's records into the
  arena, A/B/B/A, fresh engine (cold arena) and unread records per run: identical arena bytes
  (both digest-verified by the engine), kept only if its median GB/s wins by MIN_GAIN;
- io.pread: SSD cold-read probe, record-sized reads at queue depth 1/8/32 with the page cache
  bypassed (O_DIRECT / F_NOCACHE) or evicted first, and the SHA-256 verify cost against that
  bandwidth (hashlib and the engine's own implementation);
- io.sweep_crossover: the prefill sweep's crossover on the artifact's expert store (cold per-record
  reads of a fraction of one layer vs the whole-extent sweep, stream.crossover), which the loader's
  `--prefill-sweep auto` uses for stores of that geometry on that file system. A disk measurement:
  it holds on Linux too.
Without Metal every device section is "not qualified on this machine" — never "passed"; Linux runs
the emulated kernels and the pread probe.

The profile is JSON at $HEBRUS_PROFILE or ~/.cache/hebrus-mlx/profile.json, published atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .machine_profile import FAILED, NOT_QUALIFIED, PASSED, SCHEMA, this_machine

NO_GAIN = "no gain"  # correct, but not faster here: stays off
MIN_GAIN = 1.02  # a promoted path must beat the default's median by 2% (noise must not promote)
TOLERANCE = {"hc_mix": 1e-5, "ple_gather": 0.0, "qsa_attention": 1e-5}
EMULATED_TOLERANCE = {"hc_mix": 1e-6, "ple_gather": 0.0, "qsa_attention": 2e-6}


# ---- kernel inputs (synthetic, the same for the device and the emulator) -------------------------


def _hc_case(rng):
    import numpy as np

    return (
        rng.standard_normal((1, 7, 4 * 128)).astype(np.float32) * 3,
        rng.standard_normal((1, 7, 4 * 128)).astype(np.float32),
        4,
        128,
    )


def _qsa_case(rng, L=3, hq=4, hkv=2, D=64, S=97, r=4, keep=8):
    """Random q/k/v; per query `keep` random complete groups in chronological order, then its tail."""
    import numpy as np

    q = rng.standard_normal((hq, L, D)).astype(np.float32)
    k = rng.standard_normal((hkv, S, D)).astype(np.float32)
    v = rng.standard_normal((hkv, S, D)).astype(np.float32)
    W = keep * r + r - 1
    idx = np.zeros((L, W), np.int32)
    ok = np.zeros((L, W), bool)
    for i in range(L):
        pos = S - L + i
        complete = (pos + 1) // r
        groups = np.sort(rng.choice(complete, size=min(keep, complete), replace=False))
        toks = (groups[:, None] * r + np.arange(r)).reshape(-1)
        tail = np.arange(complete * r, pos + 1)
        sel = np.concatenate([toks, tail])
        idx[i, : len(sel)] = sel
        ok[i, : len(sel)] = True
    return q, k, v, idx, ok, D**-0.5


def _ple_embedding():
    """An NGramEmbedding with the shipped demo's PLE geometry and a random table."""
    import mlx.core as mx

    from .models.qwen4exp import ModelArgs, NGramEmbedding

    cfg = json.loads((Path(__file__).parent / "demo" / "model" / "config.json").read_text())
    args = ModelArgs.from_dict(cfg)
    emb = NGramEmbedding(args, 0)
    emb.ngram_embedding.weight = mx.random.normal(emb.ngram_embedding.weight.shape, key=mx.random.key(0))
    ids = mx.random.randint(0, args.vocab_size, (1, 40), key=mx.random.key(1)).astype(mx.int64)
    eos = args.eos_id
    ids[0, 5] = eos
    ids[0, 6] = eos
    history = mx.concatenate([mx.full((1, args.ngram_size - 1), eos, dtype=mx.int64), ids], axis=1)
    return emb, history, 40


def _metal_checks() -> dict:
    """{kernel: zero-argument check -> max abs diff vs its ops path on this Metal device}. The inputs
    are drawn here, in the emulator's order, so each check runs (or fails) on its own."""
    import mlx.core as mx
    import numpy as np

    from .kernels import hc_mix, ple_gather, qsa_attention

    rng = np.random.default_rng(0)
    up, normed, hc, hidden = _hc_case(rng)
    qsa = _qsa_case(rng)

    def check_hc():
        a, b = mx.array(up), mx.array(normed)
        return mx.abs(hc_mix.metal(a, b, hc, hidden) - hc_mix.ops(a, b, hc, hidden)).max().item()

    def check_qsa():
        q, k, v, idx, ok, scale = qsa
        got = qsa_attention.metal(*(mx.array(t)[None] for t in (q, k, v, idx, ok)), scale)[0]
        return np.abs(np.array(got) - qsa_attention_ops(q, k, v, idx, ok, scale)).max()

    def check_ple():
        emb, history, n = _ple_embedding()
        rows, e = ple_gather.metal(emb, history, n)
        ref_rows, ref = ple_gather.ops(emb, history, n)
        return max(mx.abs(rows - ref_rows).max().item(), mx.abs(e - ref).max().item())

    return {"hc_mix": check_hc, "qsa_attention": check_qsa, "ple_gather": check_ple}


def check_kernels_metal(names=None) -> dict:
    """Each kernel (of `names`, default all) vs its ops path on this Metal device: {name: max abs
    diff}, or {name: "<error>"} for a kernel whose compile or launch raised; the others still run."""
    out = {}
    for name, check in _metal_checks().items():
        if names is not None and name not in names:
            continue
        try:
            out[name] = float(check())
        except Exception as e:  # noqa: BLE001  (one kernel's compile/launch error fails that kernel only)
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _qsa_graph(q, k, v, idx, ok, scale):
    """The graph's own gather + online-softmax path on batched MLX inputs."""
    from .models.qwen4exp import QSAAttention

    self = QSAAttention.__new__(QSAAttention)
    object.__setattr__(self, "n_kv_heads", k.shape[1])
    object.__setattr__(self, "scale", scale)
    return QSAAttention.sparse_attention(self, q, k, v, idx, ok)


def qsa_attention_ops(q, k, v, idx, ok, scale):
    """The graph's own gather + online-softmax path on one sequence."""
    import mlx.core as mx
    import numpy as np

    return np.array(_qsa_graph(*(mx.array(t)[None] for t in (q, k, v, idx, ok)), scale)[0])


def check_kernels_emulated() -> dict:
    """The same kernel sources through the MSL emulator vs float64 oracles: {name: max abs diff}."""
    import mlx.core as mx
    import numpy as np

    from .kernels import ple_gather

    # The one product use of the test oracles: qualify's opt-in check of the shipped MSL sources.
    from .testing import kernel_emulation as emu

    rng = np.random.default_rng(0)
    up, normed, hc, hidden = _hc_case(rng)
    u = up.astype(np.float64)
    oracle = ((1 / (1 + np.exp(-u))).reshape(1, 7, hc, hidden) * normed.reshape(1, 7, hc, hidden)).mean(-2)
    out = {"hc_mix": float(np.abs(emu.hc_mix(up, normed, hc, hidden) - oracle).max())}
    q, k, v, idx, ok, scale = _qsa_case(rng)
    rep = q.shape[0] // k.shape[0]
    want = np.zeros((q.shape[1], q.shape[0] * q.shape[2]))
    for h in range(q.shape[0]):
        for i in range(q.shape[1]):
            sel = idx[i][ok[i]]
            s = k[h // rep, sel].astype(np.float64) @ q[h, i].astype(np.float64) * scale
            p = np.exp(s - s.max())
            want[i, h * q.shape[2] : (h + 1) * q.shape[2]] = p / p.sum() @ v[h // rep, sel].astype(np.float64)
    out["qsa_attention"] = float(np.abs(emu.qsa_attention(q, k, v, idx, ok, scale) - want).max())
    emb, history, n = _ple_embedding()
    ref_rows, ref = ple_gather.ops(emb, history, n)
    rows, e = emu.ple_gather(
        np.array(history[0]),
        np.array(emb._multipliers),
        np.array(emb._head_sizes),
        np.array(emb._head_offsets),
        np.array(emb.ngram_embedding.weight),
        n,
        emb.heads_per_ngram,
        emb.eos,
    )
    out["ple_gather"] = float(max(np.abs(rows - np.array(ref_rows[0])).max(), np.abs(e - np.array(ref[0])).max()))
    del mx
    return out


# One line per shader-validation report, as Metal writes them to stderr with
# MTL_SHADER_VALIDATION_REPORT_TO_STDERR=1, e.g.
#   Invalid device load at offset 69632, executing kernel function: "custom_kernel_hebrus_qsa_attention_..."
# (MLX names a custom kernel's function custom_kernel_<name>...). The "Metal GPU Validation Enabled"
# banner, printed on every validated run, is not a report.
VALIDATION_REPORT = re.compile(r'^.*\bInvalid\b.*executing kernel function:? *"([^"]+)".*$', re.MULTILINE)


def validation_reports(stderr: str, name: str) -> list:
    """The shader-validation report lines in `stderr` that name kernel `name`'s Metal function."""
    return [
        m.group(0).strip()
        for m in VALIDATION_REPORT.finditer(stderr)
        if m.group(1).startswith(f"custom_kernel_hebrus_{name}")
    ]


def _shader_validation_clean(name: str) -> dict:
    """Re-run one kernel's device check in a child under shader validation (reports to stderr, which
    Metal only does when asked at launch): clean = exit 0, no validation report naming this
    kernel, and still within its tolerance. A child per kernel, so one kernel's crash is its own."""
    env = dict(os.environ, MTL_SHADER_VALIDATION="1", MTL_SHADER_VALIDATION_REPORT_TO_STDERR="1")
    proc = subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.qualify", "--kernels-child", name],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    reports = validation_reports(proc.stderr, name)
    try:
        diff = json.loads(proc.stdout.strip().splitlines()[-1]).get(name)
    except (ValueError, IndexError, AttributeError):
        diff = None
    within = isinstance(diff, float) and diff <= TOLERANCE[name]
    return {
        "clean": proc.returncode == 0 and not reports and within,
        "returncode": proc.returncode,
        "max_abs_diff": diff,
        "reports": reports[:5],
        "stderr_tail": proc.stderr[-400:],
    }


def _speed_cases() -> dict:
    """{kernel: (kernel_fn, ops_fn, shapes)} at the real model's decode shapes (one token: 4
    hyper-connection streams of 2560; QSA 16 query / 2 KV heads of 256 over 2,048 selected keys at
    an 8K context). PLE gather keeps the demo's table geometry (a 320M-row table is not built)."""
    import mlx.core as mx
    import numpy as np

    from .kernels import hc_mix, ple_gather, qsa_attention

    rng = np.random.default_rng(1)
    hc, hidden = 4, 2560
    a = mx.array(rng.standard_normal((1, 1, hc * hidden)).astype(np.float32))
    b = mx.array(rng.standard_normal((1, 1, hc * hidden)).astype(np.float32))
    q, k, v, idx, ok, scale = (
        mx.array(t)[None] if not isinstance(t, float) else t
        for t in _qsa_case(rng, L=1, hq=16, hkv=2, D=256, S=8192, r=4, keep=511)
    )
    emb, history, n = _ple_embedding()
    return {
        "hc_mix": (lambda: hc_mix.metal(a, b, hc, hidden), lambda: hc_mix.ops(a, b, hc, hidden), "1x1x4x2560"),
        "qsa_attention": (
            lambda: qsa_attention.metal(q, k, v, idx, ok, scale),
            lambda: _qsa_graph(q, k, v, idx, ok, scale),
            "decode, 16/2 heads x 256, 2,047 selected keys of 8,192",
        ),
        "ple_gather": (
            lambda: ple_gather.metal(emb, history, n),
            lambda: ple_gather.ops(emb, history, n),
            "the demo's PLE geometry, 40 tokens",
        ),
    }


def _call_ms(fn, calls: int) -> float:
    import mlx.core as mx

    mx.eval(fn())  # compiled and warm
    t = time.perf_counter()
    for _ in range(calls):
        mx.eval(fn())
    return (time.perf_counter() - t) * 1e3 / calls


def kernel_speed(name: str, rounds: int = 5, calls: int = 20, cases: dict | None = None) -> dict:
    """A kernel against its ops path at the real model's shapes: ms per call of each, interleaved
    A/B/B/A (A = ops, B = kernel), medians; the kernel is faster only if its median beats the ops
    path's by MIN_GAIN. Correctness is checked apart (check_kernels_metal)."""
    kernel, ops, shapes = (cases or _speed_cases())[name]
    res = run_abba(lambda: (1e3 / _call_ms(ops, calls), None), lambda: (1e3 / _call_ms(kernel, calls), None), rounds)
    ops_ms = [1e3 / r for r in res["a"]]
    kernel_ms = [1e3 / r for r in res["b"]]
    ratio = statistics.median(ops_ms) / statistics.median(kernel_ms)
    faster = ratio >= MIN_GAIN
    return {
        "shapes": shapes,
        "order": "ABBA",
        "rounds": rounds,
        "ops_ms": ops_ms,
        "kernel_ms": kernel_ms,
        "median_ratio": ratio,
        "min_gain": MIN_GAIN,
        "faster": faster,
        "reason": f"kernel {ratio:.3f}x the ops path (median of interleaved runs; needs >= {MIN_GAIN})",
    }


def kernels_section(emulate: bool = True, speed: Callable | None = None) -> dict:
    """Each kernel: emulated against float64, and on a Metal device checked against its ops path
    and timed against it. A kernel passes (and `load` turns it on) only when it is correct within
    tolerance, clean under shader validation **and** faster than the ops path here (AFN-013/016);
    correct but not faster: no_gain, the ops path stays."""
    from . import kernels

    speed = speed or kernel_speed
    section = {}
    emulated = {}
    if emulate:
        try:
            emulated = check_kernels_emulated()
        except Exception as e:  # noqa: BLE001  (a missing compiler is recorded, not fatal)
            emulated = {name: f"emulator unavailable: {e}" for name in kernels.KERNELS}
    device = check_kernels_metal() if kernels.metal_available() else {}
    for name in kernels.KERNELS:
        entry = {
            "emulated_max_abs_diff": emulated.get(name),
            "emulated_ok": isinstance(emulated.get(name), float) and emulated[name] <= EMULATED_TOLERANCE[name],
        }
        if isinstance(device.get(name), str):
            entry.update(status=FAILED, device="metal", error=device[name])
        elif name in device:
            validation = _shader_validation_clean(name)
            ok = device[name] <= TOLERANCE[name] and validation["clean"]
            entry.update(device="metal", max_abs_diff=device[name], shader_validation=validation)
            if not ok:
                entry.update(status=FAILED, reason="not within tolerance or not clean under shader validation")
            else:
                try:
                    timing = speed(name)
                except Exception as e:  # noqa: BLE001  (a timing failure keeps the ops path, named)
                    entry.update(status=FAILED, reason=f"timing failed: {type(e).__name__}: {e}")
                else:
                    entry.update(
                        speed=timing,
                        status=PASSED if timing["faster"] else NO_GAIN,
                        reason=("correct and " if timing["faster"] else "correct but not faster: ops path stays; ")
                        + timing["reason"],
                    )
        else:
            entry.update(
                status=NOT_QUALIFIED,
                device="emulator" if emulate else None,
                reason="no Metal device: emulation checks the source, not Apple's compiler",
            )
        section[name] = entry
    return section


# ---- A/B/B/A decisions ---------------------------------------------------------------------------


def ab_order(rounds: int) -> list:
    """Interleaved A/B/B/A per round: drift (thermals, caches, other load) hits both arms alike."""
    return ["A", "B", "B", "A"] * rounds


def run_abba(measure_a: Callable, measure_b: Callable, rounds: int) -> dict:
    """Each measure returns (value, output); value is a rate (higher is better), output what must be
    identical between and within the arms (tokens, record digests)."""
    vals, outs = {"A": [], "B": []}, {"A": [], "B": []}
    for arm in ab_order(rounds):
        v, o = (measure_a if arm == "A" else measure_b)()
        vals[arm].append(v)
        outs[arm].append(o)
    first = outs["A"][0]
    return {"a": vals["A"], "b": vals["B"], "identical": all(o == first for arm in "AB" for o in outs[arm])}


def decide_ab(
    a: list, b: list, identical: bool, a_name: str, b_name: str, unit: str, min_gain: float = MIN_GAIN
) -> dict:
    """The profile entry for "promote B over the default A": passed only if B's outputs are
    identical to A's and B's median beats A's by `min_gain`."""
    med_a, med_b = statistics.median(a), statistics.median(b)
    ratio = med_b / med_a if med_a > 0 else float("inf") if med_b > 0 else 1.0
    entry = {
        "device": "metal",
        "order": "ABBA",
        "rounds": len(a) // 2,
        f"{a_name}_{unit}": a,
        f"{b_name}_{unit}": b,
        "median_ratio": ratio,
        "min_gain": min_gain,
        "identical": identical,
    }
    if not identical:
        entry.update(status=FAILED, decision=a_name, reason=f"{b_name} output differs from {a_name}")
    elif ratio >= min_gain:
        entry.update(status=PASSED, decision=b_name, reason=f"identical, median {ratio:.3f}x {a_name}")
    else:
        entry.update(
            status=NO_GAIN,
            decision=a_name,
            reason=f"identical but median {ratio:.3f}x {a_name} < {min_gain}: {a_name} stays",
        )
    return entry


# ---- I/O probes --------------------------------------------------------------------------------------


def _evict(path: Path) -> str:
    """Drop the file's clean pages from the page cache where the OS allows it; how (for the record)."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return "evicted (posix_fadvise DONTNEED)"
        finally:
            os.close(fd)
    return "not evicted"


def cold_read_probe(path: Path, record_bytes: int, reads: int = 64, depths=(1, 8, 32)) -> dict:
    """Record-sized O_DIRECT (F_NOCACHE on macOS) random reads at each queue depth, GB/s. Where the
    filesystem refuses O_DIRECT the file is evicted from the page cache before each depth."""
    import random

    import mlx.core  # noqa: F401 (loads libmlx before the extension)

    from ._bench import raw_pread

    align = 4096
    record = (record_bytes + align - 1) // align * align
    size = path.stat().st_size
    slots = size // record
    if slots < 1:
        raise ValueError(f"probe file {path} is smaller than one record ({record} bytes)")
    rnd = random.Random(0)
    out = {"record_bytes": record, "file_bytes": size}
    for qd in depths:
        evicted = _evict(path)
        offsets = [rnd.randrange(slots) * record for _ in range(max(reads, qd))]
        batches = [offsets[i : i + qd] for i in range(0, len(offsets), qd)]
        r = raw_pread(str(path), batches, record, threads=qd, direct=True)
        out[f"qd{qd}_GBps"] = r["bytes"] / r["elapsed_ns"]
        out["direct"] = bool(r["direct"])
        out["page_cache"] = (
            "bypassed (O_DIRECT)"
            if r["direct"] and platform.system() == "Linux"
            else "bypassed (F_NOCACHE; pages cached before may still hit)"
            if r["direct"]
            else evicted
        )
    return out


def sha256_cost(record_bytes: int, rounds: int = 32) -> dict:
    """One-thread SHA-256 GB/s of hashlib and of the engine's own implementation (what verify runs)."""
    buf = os.urandom(record_bytes)
    t0 = time.perf_counter()
    for _ in range(rounds):
        hashlib.sha256(buf).digest()
    out = {"sha256_GBps_one_thread": record_bytes * rounds / (time.perf_counter() - t0) / 1e9}
    from .stream import engine

    if engine.available():
        ext = engine.native()
        t0 = time.perf_counter()
        for _ in range(rounds):
            ext.sha256(buf)
        out["sha256_engine_GBps_one_thread"] = record_bytes * rounds / (time.perf_counter() - t0) / 1e9
        out["sha256_engine_backend"] = ext.sha256_backend()
    return out


def _write_probe_file(probe_dir: str | None, mib: int) -> str:
    fd, tmp = tempfile.mkstemp(prefix="hebrus-probe-", dir=probe_dir)
    if platform.system() == "Darwin":
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)  # the written pages are not kept cached
    with os.fdopen(fd, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(mib):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def pread_probe(probe_dir: str | None, record_bytes: int, probe_mib: int, store: str | None) -> dict:
    """The `io.pread` entry (schema stable; `bench` reuses it as the machine's SSD record):
    record_bytes, file_bytes, qd{1,8,32}_GBps, direct, page_cache, sha256_GBps_one_thread,
    sha256_vs_qd32, sha256_engine_GBps_one_thread, sha256_engine_backend, sha256_engine_vs_qd32,
    xxh3_128_GBps_one_thread, xxh3_128_backend, xxh3_128_scalar_GBps_one_thread, xxh3_128_vs_qd32,
    status "measured"."""
    tmp = None
    try:
        path = Path(store) if store else Path(tmp := _write_probe_file(probe_dir, probe_mib))
        probe = cold_read_probe(path, record_bytes)
    finally:
        if tmp:
            os.unlink(tmp)
    probe.update(sha256_cost(probe["record_bytes"]))
    probe["sha256_vs_qd32"] = probe["sha256_GBps_one_thread"] / probe["qd32_GBps"]
    from .bench.machine import fast_check_rate  # the per-read fast check (XXH3-128), beside SHA-256

    probe.update(fast_check_rate(probe["record_bytes"]))
    if "xxh3_128_GBps_one_thread" in probe:
        probe["xxh3_128_vs_qd32"] = probe["xxh3_128_GBps_one_thread"] / probe["qd32_GBps"]
    if "sha256_engine_GBps_one_thread" in probe:
        probe["sha256_engine_vs_qd32"] = probe["sha256_engine_GBps_one_thread"] / probe["qd32_GBps"]
    probe["status"] = "measured"
    return probe


def _record_plan(artifact: str, per_run: int, runs: int, seed: int = 0):
    """(layer, [experts]) batches, `per_run` records each (top-k distinct experts of one layer), no
    record repeated across the runs while the store has enough; and whether any repeats."""
    import random

    from .admission import admit
    from .loader import resolve_model_path

    m = admit(str(resolve_model_path(artifact)))
    L, E = m.family.num_hidden_layers, m.family.num_experts
    k = min(per_run, E)
    pairs = [(layer, e) for layer in range(L) for e in range(E)]
    random.Random(seed).shuffle(pairs)
    plan, i, reused = [], 0, False
    for _ in range(runs):
        by_layer: dict = {}
        while sum(len(v) for v in by_layer.values()) < k:
            if i == len(pairs):
                i, reused = 0, True
            layer, e = pairs[i]
            i += 1
            if e not in by_layer.setdefault(layer, []):
                by_layer[layer].append(e)
        plan.append(sorted(by_layer.items()))
    return m, plan, reused


def measure_resolve(manifest, batches, backend: str, rows: int) -> tuple:
    """Resolve `batches` [(layer, experts)] into a fresh engine's arena with `backend` (cold arena,
    every record digest-verified by the engine): (GB/s, SHA-256 of the resolved arena rows)."""
    import mlx.core as mx
    import numpy as np

    from .stream.engine import StreamEngine
    from .stream.experts import StreamedExperts

    eng = StreamEngine(cache_bytes=64 << 20, threads=8, backend=backend, nocache=platform.system() == "Darwin")
    try:
        from .artifact.expert_major import ExpertMajorReader

        reader = ExpertMajorReader(manifest.file(manifest.experts), manifest.family, manifest.experts.expert_codec)
        try:
            record = reader.geometry.record_bytes
        finally:
            reader.close()
        ex = StreamedExperts.from_artifact(manifest, rows=rows, engine=eng)
        digest, nbytes, elapsed = hashlib.sha256(), 0, 0.0
        for layer, experts in batches:
            t0 = time.perf_counter()
            got, lease = ex.resolve(layer, mx.array(experts, dtype=mx.uint32))
            mx.eval(got)
            elapsed += time.perf_counter() - t0
            for r in np.array(got).tolist():
                for comp in sorted(ex.weights):
                    for part in sorted(ex.weights[comp]):
                        digest.update(np.array(ex.weights[comp][part][r]).tobytes())
            mx.eval(eng.release_after(mx.array(0.0), lease))
            nbytes += len(experts) * record
        return nbytes / elapsed / 1e9, digest.hexdigest()
    finally:
        eng.close()


def mtlio_section(
    artifact: str, rounds: int, measure: Callable | None = None, reference: Callable | None = None
) -> dict:
    """io.mtlio_vs_pread: promote MTLIO only if it wins here (public measurements found no
    repeatable MTLIO win). Every run resolves records no earlier run read, so the arms compare
    each run's arena bytes with a pread resolve of the same records made after the timed runs.
    measure(run, backend) -> (GB/s, digest); reference(run) -> digest (injectable for tests)."""
    from . import kernels
    from .stream import engine

    if "mtlio" not in engine.backends():
        return {"status": NOT_QUALIFIED, "reason": "this build has no MTLIO backend (macOS Metal builds only)"}
    if not kernels.metal_available():
        return {"status": NOT_QUALIFIED, "reason": "no Metal device"}
    reused = None
    if measure is None or reference is None:
        m, plan, reused = _record_plan(artifact, per_run=10, runs=4 * rounds)
        rows = max(len(e) for batch in plan for _, e in batch)
        measure = measure or (lambda i, backend: measure_resolve(m, plan[i], backend, rows))
        reference = reference or (lambda i: measure_resolve(m, plan[i], "pread", rows)[1])
    digests = []

    def arm(backend):
        rate, digest = measure(len(digests), backend)
        digests.append(digest)
        return rate, None

    res = run_abba(lambda: arm("pread"), lambda: arm("mtlio"), rounds)
    identical = all(d == reference(i) for i, d in enumerate(digests))
    entry = decide_ab(res["a"], res["b"], identical, "pread", "mtlio", "GBps")
    entry.update(artifact=str(artifact), records_reused=reused)
    return entry


def sweep_crossover_section(artifact: str, rounds: int, fractions=None) -> dict:
    """io.sweep_crossover: the unique-expert fraction of one layer above which the prefill sweep's
    whole-extent read beats the slot path's per-record reads, on the artifact's own expert store,
    cold (stream.crossover.measure: 2 * rounds passes, forward then backward, medians). The engine
    and the sweep run as the loader builds them (8 reader threads, the sweep's 4). The loader
    honours it for stores of this geometry on this file system (stream.crossover.from_profile)."""
    from .admission import admit
    from .loader import resolve_model_path
    from .stream import crossover
    from .stream.engine import StreamEngine
    from .stream.experts import StreamedExperts

    m = admit(str(resolve_model_path(artifact)))
    store = Path(m.file(m.experts)).resolve()
    how = []

    def make(rows):
        eng = StreamEngine(cache_bytes=64 << 20, threads=8, policy="clock", nocache=platform.system() == "Darwin")
        try:
            return eng, StreamedExperts.from_artifact(m, rows=rows, engine=eng)
        except BaseException:
            eng.close()
            raise

    def evict():
        how.append(_evict(store))

    entry = crossover.measure(
        make, evict, m.family.num_hidden_layers, fractions or crossover.FRACTIONS, passes=2 * rounds
    )
    entry.update(
        status=crossover.MEASURED,
        store=str(store),
        artifact=str(artifact),
        page_cache=how[-1] if how else None,
        reason=(
            "the sweep reads the whole extent faster than the slot path reads this fraction of it"
            if entry["sweep_won"]
            else "the slot path was faster at every fraction: auto sweeps only chunks the arena cannot take"
        ),
    )
    return entry


def io_section(
    probe_dir: str | None, record_bytes: int, probe_mib: int, store: str | None, artifact: str = "demo", rounds: int = 2
) -> dict:
    from .stream import engine

    if not engine.available():
        reason = engine.unavailable_reason()
        return {
            "pread": {"status": NOT_QUALIFIED, "reason": reason},
            "mtlio_vs_pread": {"status": NOT_QUALIFIED, "reason": reason},
            "sweep_crossover": {"status": NOT_QUALIFIED, "reason": reason},
        }
    return {
        "pread": pread_probe(probe_dir, record_bytes, probe_mib, store),
        "mtlio_vs_pread": mtlio_section(artifact, rounds),
        "sweep_crossover": sweep_crossover_section(artifact, rounds),
    }


# ---- streaming: GPU events vs the CPU stream ---------------------------------------------------------


def measure_streamed_decode(model, tokenizer, prompt, tokens: int, gpu_events: bool) -> tuple:
    """Greedy decode on the streamed model with the streamed ops on the GPU stream (GPU events) or the
    CPU stream: (tok/s, tokens)."""
    from .generate import stream_generate
    from .stream.engine import native

    ext = native()
    ext.set_gpu_events(gpu_events)
    try:
        out, tps = [], 0.0
        for r in stream_generate(model, tokenizer, prompt, max_tokens=tokens):
            out.append(r.token)
            tps = r.generation_tps
        return tps, out
    finally:
        ext.set_gpu_events(False)


def _streamed_demo(artifact: str):
    """(model, tokenizer) with every routed expert streamed through an arena that holds them all."""
    from .loader import load, resolve_model_path

    path = resolve_model_path(artifact)
    experts = sum(p.stat().st_size for p in Path(path).glob("experts*.hbem"))
    return load(str(path), expert_cache_gb=4 * experts / 2**30 + 0.01)


def gpu_event_section(artifact: str, rounds: int, tokens: int, measure: Callable | None = None) -> dict:
    """streaming.gpu_event: identical greedy tokens and A/B/B/A tok/s against the CPU stream."""
    from . import kernels
    from .stream import engine

    if not kernels.metal_available():
        return {"status": NOT_QUALIFIED, "reason": "no Metal device: streamed ops run on the CPU stream"}
    if not engine.gpu_events_compiled():
        return {
            "status": NOT_QUALIFIED,
            "reason": "this build has no GPU-event path (CMake -DHEBRUS_METAL_EVENTS=ON on a Mac)",
        }
    if measure is None:
        model, tok = _streamed_demo(artifact)
        prompt = "The quick brown fox"
        measure_streamed_decode(model, tok, prompt, tokens, False)  # warm the arena and the kernels

        def measure(gpu):
            return measure_streamed_decode(model, tok, prompt, tokens, gpu)

    res = run_abba(lambda: measure(False), lambda: measure(True), rounds)
    entry = decide_ab(res["a"], res["b"], res["identical"], "cpu_stream", "gpu_event", "tok_s")
    entry.update(artifact=str(artifact), tokens=tokens)
    return entry


# ---- the GPU <-> host hand-off per streamed layer ----------------------------------------------------


def _chain_ms(step, n: int, rounds: int) -> float:
    """Median ms of evaluating a chain of n ``step`` ops (each consuming the last)."""
    import mlx.core as mx

    times = []
    for _ in range(rounds + 1):  # the first run warms up
        x = mx.zeros((16,), mx.float32)
        mx.eval(x)
        t = time.perf_counter()
        for _ in range(n):
            x = step(x)
        mx.eval(x)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[1:])


def event_round_trip(n: int = 64, rounds: int = 5) -> dict:
    """ms per op of a chain of host tasks the device waits for (metal_ext host_roundtrip: no I/O)
    over a chain of trivial device ops: what one streamed layer's hand-off costs before any read.
    On a Metal device with GPU events on, the GPU -> host -> GPU event round trip; on the CPU
    backend a CPU-stream task."""
    from .stream.engine import native

    ext = native()

    plain = _chain_ms(lambda x: x + 1, n, rounds)
    host = _chain_ms(ext.host_roundtrip, n, rounds)
    return {"ops": n, "rounds": rounds, "plain_ms": plain, "host_ms": host, "per_op_ms": max(host - plain, 0.0) / n}


def _burn(procs: int):
    """``procs`` child processes spinning a core each (the host under load); stop with .kill()."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(procs)]


def handoff_section(
    artifact: str, rounds: int, tokens: int, measure: Callable | None = None, round_trip: Callable | None = None
) -> dict:
    """streaming.handoff: one empty event round trip, the same under load (every core busy), and a
    streamed layer with every record resident against the resident layer (decode ms per token over
    the layers): the hand-off the simulator charges per streamed layer (Machine.handoff_ms).
    Measured on whatever backend runs: only a Metal device's figures stand for a Mac's."""
    from . import kernels
    from .stream import engine

    if not engine.available():
        return {"status": NOT_QUALIFIED, "reason": engine.unavailable_reason()}
    metal = kernels.metal_available()
    gpu = metal and engine.gpu_events_compiled()
    round_trip = round_trip or event_round_trip
    if gpu:
        engine.native().set_gpu_events(True)
    try:
        quiet = round_trip()
        burners = _burn(os.cpu_count() or 1)
        try:
            loaded = round_trip()
        finally:
            for b in burners:
                b.kill()
                b.wait()
    finally:
        if gpu:
            engine.native().set_gpu_events(False)
    if measure is None:
        from .loader import load

        streamed, tok = _streamed_demo(artifact)
        resident, _ = load(str(artifact))
        prompt = "The quick brown fox"

        def measure(which):
            model = streamed if which == "streamed" else resident
            return measure_streamed_decode(model, tok, prompt, tokens, gpu and which == "streamed")

        measure("streamed")  # warm the arena: every record resident from here on
    res = run_abba(lambda: measure("resident"), lambda: measure("streamed"), rounds)
    med_r, med_s = statistics.median(res["a"]), statistics.median(res["b"])
    layers = _layers(artifact)
    per_layer = max(1e3 / med_s - 1e3 / med_r, 0.0) / layers if med_r > 0 and med_s > 0 else None
    return {
        "status": "measured",
        "device": "metal" if gpu else "cpu",
        "gpu_events": gpu,
        "event_round_trip_ms": quiet["per_op_ms"],
        "event_round_trip_loaded_ms": loaded["per_op_ms"],
        "resident_tok_s": res["a"],
        "streamed_all_resident_tok_s": res["b"],
        "identical": res["identical"],
        "layers": layers,
        "handoff_ms": per_layer,
        "reason": (
            "GPU-event host tasks on a Metal device"
            if gpu
            else "CPU backend: host tasks run on the compute stream; not a Mac's hand-off"
        ),
    }


def _layers(artifact: str) -> int:
    from .admission import admit
    from .loader import resolve_model_path

    return admit(str(resolve_model_path(artifact))).family.num_hidden_layers


def qualify(
    probe_dir=None,
    record_bytes=2704 * 1024,
    probe_mib=128,
    store=None,
    emulate=True,
    artifact="demo",
    rounds=2,
    tokens=32,
) -> dict:
    return {
        "schema": SCHEMA,
        "created_unix": int(time.time()),
        "machine": this_machine(),
        "kernels": kernels_section(emulate),
        "streaming": {
            "gpu_event": gpu_event_section(artifact, rounds, tokens),
            "handoff": handoff_section(artifact, rounds, tokens),
        },
        "io": io_section(probe_dir, record_bytes, probe_mib, store, artifact, rounds),
    }


if __name__ == "__main__":  # _shader_validation_clean's child, one kernel under shader validation
    if len(sys.argv) != 3 or sys.argv[1] != "--kernels-child" or sys.argv[2] not in TOLERANCE:
        sys.exit(f"usage: python -m hebrus_mlx.qualify --kernels-child {{{','.join(sorted(TOLERANCE))}}}")
    print(json.dumps(check_kernels_metal([sys.argv[2]])))
