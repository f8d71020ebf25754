"""`hebrus-mlx qualify`: measure what this machine can be trusted with and write a machine profile.

`load()` reads the profile and switches on only what passed *on this machine* (AFN-013). Checks:
- each Metal kernel against its ops path on the real device, and again under
  MTL_SHADER_VALIDATION=1 (clean = exit 0, no validation report); the same sources through the MSL
  emulator against a float64 oracle (everywhere; never counts as passed);
- GPU-event streaming vs CPU-stream streaming (not built yet: always "not qualified");
- MTLIO vs pread (only where the build has MTLIO; the A/B itself is benchmarks/bench_stream.py);
- SSD cold-read probe: record-sized O_DIRECT/F_NOCACHE reads at queue depth 1/8/32 (C threads), and
  the SHA-256 verify cost against that bandwidth.
Without Metal every device check is "not qualified on this machine" — never "passed".

The profile is JSON at $HEBRUS_PROFILE or ~/.cache/hebrus-mlx/profile.json, published atomically.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from .errors import UsageError
from .profile import SCHEMA, write_profile

NOT_QUALIFIED = "not qualified on this machine"
PASSED, FAILED = "passed", "failed"
TOLERANCE = {"hc_mix": 1e-5, "ple_gather": 0.0, "qsa_attention": 1e-5}
EMULATED_TOLERANCE = {"hc_mix": 1e-6, "ple_gather": 0.0, "qsa_attention": 2e-6}


# ---- kernel inputs (synthetic, the same for the device and the emulator) -------------------------


def _hc_case(rng):
    import numpy as np

    return (rng.standard_normal((1, 7, 4 * 128)).astype(np.float32) * 3,
            rng.standard_normal((1, 7, 4 * 128)).astype(np.float32), 4, 128)


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
    return q, k, v, idx, ok, D ** -0.5


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


def check_kernels_metal() -> dict:
    """Each kernel vs its ops path on this Metal device: {name: max abs diff}."""
    import mlx.core as mx
    import numpy as np

    from .kernels import hc_mix, ple_gather, qsa_attention

    rng = np.random.default_rng(0)
    up, normed, hc, hidden = _hc_case(rng)
    a, b = mx.array(up), mx.array(normed)
    out = {"hc_mix": float(mx.abs(hc_mix.metal(a, b, hc, hidden) - hc_mix.ops(a, b, hc, hidden)).max())}
    q, k, v, idx, ok, scale = _qsa_case(rng)
    got = qsa_attention.metal(*(mx.array(t)[None] for t in (q, k, v, idx, ok)), scale)[0]
    want = qsa_attention_ops(q, k, v, idx, ok, scale)
    out["qsa_attention"] = float(np.abs(np.array(got) - want).max())
    emb, history, n = _ple_embedding()
    rows, e = ple_gather.metal(emb, history, n)
    ref_rows, ref = ple_gather.ops(emb, history, n)
    out["ple_gather"] = float(max(mx.abs(rows - ref_rows).max().item(), mx.abs(e - ref).max().item()))
    return out


def qsa_attention_ops(q, k, v, idx, ok, scale):
    """The graph's own gather + online-softmax path on one sequence."""
    import mlx.core as mx
    import numpy as np

    from .models.qwen4exp import QSAAttention

    self = QSAAttention.__new__(QSAAttention)
    object.__setattr__(self, "n_kv_heads", k.shape[0])
    object.__setattr__(self, "scale", scale)
    out = QSAAttention._sparse_attention(self, *(mx.array(t)[None] for t in (q, k, v, idx, ok)))
    return np.array(out[0])


def check_kernels_emulated() -> dict:
    """The same kernel sources through the MSL emulator vs float64 oracles: {name: max abs diff}."""
    import mlx.core as mx
    import numpy as np

    from .kernels import hc_mix, ple_gather, qsa_attention

    rng = np.random.default_rng(0)
    up, normed, hc, hidden = _hc_case(rng)
    u = up.astype(np.float64)
    oracle = ((1 / (1 + np.exp(-u))).reshape(1, 7, hc, hidden) * normed.reshape(1, 7, hc, hidden)).mean(-2)
    out = {"hc_mix": float(np.abs(hc_mix.emulate(up, normed, hc, hidden) - oracle).max())}
    q, k, v, idx, ok, scale = _qsa_case(rng)
    rep = q.shape[0] // k.shape[0]
    want = np.zeros((q.shape[1], q.shape[0] * q.shape[2]))
    for h in range(q.shape[0]):
        for i in range(q.shape[1]):
            sel = idx[i][ok[i]]
            s = k[h // rep, sel].astype(np.float64) @ q[h, i].astype(np.float64) * scale
            p = np.exp(s - s.max())
            want[i, h * q.shape[2]:(h + 1) * q.shape[2]] = p / p.sum() @ v[h // rep, sel].astype(np.float64)
    out["qsa_attention"] = float(np.abs(qsa_attention.emulate(q, k, v, idx, ok, scale) - want).max())
    emb, history, n = _ple_embedding()
    ref_rows, ref = ple_gather.ops(emb, history, n)
    rows, e = ple_gather.emulate(np.array(history[0]), np.array(emb._multipliers), np.array(emb._head_sizes),
                                 np.array(emb._head_offsets), np.array(emb.ngram_embedding.weight), n,
                                 emb.heads_per_ngram, emb.eos)
    out["ple_gather"] = float(max(np.abs(rows - np.array(ref_rows[0])).max(), np.abs(e - np.array(ref[0])).max()))
    del mx
    return out


def _shader_validation_clean() -> dict:
    """Re-run the device kernel checks in a child with MTL_SHADER_VALIDATION=1."""
    env = dict(os.environ, MTL_SHADER_VALIDATION="1")
    proc = subprocess.run([sys.executable, "-m", "hebrus_mlx.qualify", "--kernels-child"], env=env,
                          capture_output=True, text=True, timeout=600)
    reported = "validation" in proc.stderr.lower()
    return {"clean": proc.returncode == 0 and not reported, "returncode": proc.returncode,
            "stderr_tail": proc.stderr[-400:]}


def kernels_section(emulate: bool = True) -> dict:
    from . import kernels

    section = {}
    emulated = {}
    if emulate:
        try:
            emulated = check_kernels_emulated()
        except Exception as e:  # noqa: BLE001  (a missing compiler is recorded, not fatal)
            emulated = {name: f"emulator unavailable: {e}" for name in kernels.KERNELS}
    device = {}
    validation = None
    if kernels.metal_available():
        device = check_kernels_metal()
        validation = _shader_validation_clean()
    for name in kernels.KERNELS:
        entry = {"emulated_max_abs_diff": emulated.get(name),
                 "emulated_ok": isinstance(emulated.get(name), float) and emulated[name] <= EMULATED_TOLERANCE[name]}
        if name in device:
            ok = device[name] <= TOLERANCE[name] and validation["clean"]
            entry.update(status=PASSED if ok else FAILED, device="metal", max_abs_diff=device[name],
                         shader_validation=validation)
        else:
            entry.update(status=NOT_QUALIFIED, device="emulator" if emulate else None,
                         reason="no Metal device: emulation checks the source, not Apple's compiler")
        section[name] = entry
    return section


# ---- I/O probes --------------------------------------------------------------------------------------


def cold_read_probe(path: Path, record_bytes: int, reads: int = 64, depths=(1, 8, 32)) -> dict:
    """Record-sized O_DIRECT (F_NOCACHE on macOS) random reads at each queue depth, GB/s."""
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
        offsets = [rnd.randrange(slots) * record for _ in range(max(reads, qd))]
        batches = [offsets[i : i + qd] for i in range(0, len(offsets), qd)]
        r = raw_pread(str(path), batches, record, threads=qd, direct=True)
        out[f"qd{qd}_GBps"] = r["bytes"] / r["elapsed_ns"]
        out["direct"] = bool(r["direct"])
    return out


def sha256_cost(record_bytes: int, rounds: int = 32) -> dict:
    buf = os.urandom(record_bytes)
    t0 = time.perf_counter()
    for _ in range(rounds):
        hashlib.sha256(buf).digest()
    return {"sha256_GBps_one_thread": record_bytes * rounds / (time.perf_counter() - t0) / 1e9}


def io_section(probe_dir: Optional[str], record_bytes: int, probe_mib: int, store: Optional[str]) -> dict:
    from .stream import engine

    section = {}
    if not engine.available():
        return {"pread": {"status": NOT_QUALIFIED, "reason": engine.unavailable_reason()}}
    tmp = None
    try:
        if store:
            path = Path(store)
        else:
            fd, tmp = tempfile.mkstemp(prefix="hebrus-probe-", dir=probe_dir)
            with os.fdopen(fd, "wb") as f:
                chunk = os.urandom(1 << 20)
                for _ in range(probe_mib):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            path = Path(tmp)
        probe = cold_read_probe(path, record_bytes)
        sha = sha256_cost(probe["record_bytes"])
        probe.update(sha)
        probe["sha256_vs_qd32"] = sha["sha256_GBps_one_thread"] / probe["qd32_GBps"]
        probe["status"] = "measured"
        section["pread"] = probe
    finally:
        if tmp:
            os.unlink(tmp)
    if "mtlio" in engine.backends():
        section["mtlio_vs_pread"] = {"status": "not measured by qualify yet",
                                     "how": "benchmarks/bench_stream.py A/B on this SSD; keep pread unless MTLIO wins"}
    else:
        section["mtlio_vs_pread"] = {"status": NOT_QUALIFIED, "reason": "this build has no MTLIO backend"}
    return section


def qualify(probe_dir=None, record_bytes=2704 * 1024, probe_mib=128, store=None, emulate=True) -> dict:
    import mlx.core as mx

    from . import kernels

    return {
        "schema": SCHEMA,
        "created_unix": int(time.time()),
        "machine": {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
                    "mlx": mx.__version__, "metal": kernels.metal_available()},
        "kernels": kernels_section(emulate),
        "streaming": {"gpu_event": {"status": NOT_QUALIFIED,
                                    "reason": "the GPU-event eval_gpu path is not built; streamed ops run on the CPU stream"}},
        "io": io_section(probe_dir, record_bytes, probe_mib, store),
    }


def main(argv=None):
    p = argparse.ArgumentParser(prog="hebrus-mlx qualify", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="profile path (default $HEBRUS_PROFILE or ~/.cache/hebrus-mlx/profile.json)")
    p.add_argument("--probe-dir", default=None, help="directory on the SSD the model lives on (probe file)")
    p.add_argument("--store", default=None, help="read an existing file (e.g. an artifact's experts.hbem) instead")
    p.add_argument("--record-kib", type=int, default=2704, help="read size (default: one real expert record)")
    p.add_argument("--probe-mib", type=int, default=128)
    p.add_argument("--no-emulate", action="store_true")
    p.add_argument("--kernels-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.kernels_child:
        print(json.dumps(check_kernels_metal()))
        return 0
    for field in ("record_kib", "probe_mib"):
        if getattr(a, field) < 1:
            raise UsageError("--" + field.replace("_", "-"), f"must be >= 1, got {getattr(a, field)}")
    if a.probe_dir and not Path(a.probe_dir).is_dir():
        raise UsageError("--probe-dir", f"{a.probe_dir!r} is not a directory")
    if a.store and not Path(a.store).is_file():
        raise UsageError("--store", f"{a.store!r} is not a file")
    profile = qualify(a.probe_dir, a.record_kib * 1024, a.probe_mib, a.store, not a.no_emulate)
    path = write_profile(profile, a.out)
    print(json.dumps(profile, indent=1))
    print(f"profile written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from .cli import run

    sys.exit(run("qualify", main))
