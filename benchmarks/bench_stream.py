"""Streaming-engine benchmark on a synthetic expert store (issue 6).

Records have the real routed-expert geometry: gate|up|down of 2560x640 in
affine 4-bit, group 64 (uint32 weights + bf16 scales and biases), each record
4096-aligned (2,764,800 bytes, ~2.64 MiB). Every variant reads the same
decode-like list of records (per "layer", top-k distinct random experts, all
k known at once) from a cold store (posix_fadvise DONTNEED before each run):

  (a) raw     O_DIRECT pread, same record size and thread count, k-wide batches
  (b) engine  StreamEngine request/wait/release, same batches
  (b2) op     StreamEngine.gather() MLX op evaluated per layer (graph path)
  (b3) sha    (b) with SHA-256 verification of every record
  (b4) resolve  zero-copy resolve() into a slot arena + release_after
  (c') glu    resolve + a SwitchGLU (gather_qmm gate/up/down, fp32 x, one
              token) over the arena per layer: streamed MoE layers without
              the rest of the model; compared with the serial bound
              raw-I/O time + hot compute time (glu_hot: same graph, every
              record already resident)
  (c'') glu_pf  as glu, plus an oracle prefetch (P1) of the next layer's
              records when a layer starts: the ceiling for any predictor
  (d) mmap    the same bytes paged in through an mmap (lazy-loading path)

Prints GiB/s per run and the ratios engine/raw (target >= 0.9),
engine/mmap (target >= 2) and glu vs the serial compute + I/O bound (target
>= 0.9). Full-model streamed decode (issue 6 (c)) needs the model graph.

    python benchmarks/bench_stream.py [--store PATH] [--layers 6] [--experts 48]
"""

import argparse
import hashlib
import mmap
import os
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HIDDEN, INTER, GROUP, BITS = 2560, 640, 64, 4


def record_bytes():
    # One matrix: packed weights + bf16 scales + bf16 biases, three matrices.
    weights = HIDDEN * INTER * BITS // 8
    scales = HIDDEN * INTER // GROUP * 2
    n = 3 * (weights + 2 * scales)
    return (n + 4095) // 4096 * 4096


def build_store(path, n_records, rec):
    size = n_records * rec
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    rng = np.random.default_rng(0)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for _ in range(n_records):
            f.write(rng.integers(0, 256, rec, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_raw(path, batches, rec, threads):
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    local = threading.local()

    def read(off):
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, rec)  # page-aligned for O_DIRECT
        view, got = memoryview(buf), 0
        while got < rec:
            got += os.preadv(fd, [view[got:]], off + got)

    try:
        with ThreadPoolExecutor(threads) as pool:
            for batch in batches:
                list(pool.map(read, batch))
    finally:
        os.close(fd)


def run_engine(eng, store, batches, rec, digests=None):
    for batch in batches:
        tickets = [
            eng.request(store, off, rec,
                        digest=None if digests is None else digests[off // rec])
            for off in batch
        ]
        for t in tickets:
            eng.wait(t)
            eng.release(t)


def run_gather_op(eng, table, batches, rec):
    import mlx.core as mx

    for batch in batches:
        idx = mx.array([off // rec for off in batch], dtype=mx.uint32)
        mx.eval(eng.gather(table, idx))




def part_bytes():
    w = HIDDEN * INTER * BITS // 8
    sb = HIDDEN * INTER // GROUP * 2  # bf16
    return [w, sb, sb] * 3


def glu_weights(parts, rows):
    import mlx.core as mx

    shapes = [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    out = []
    for c, (o, i) in enumerate(shapes):
        w = parts[3 * c].view(mx.uint32).reshape(rows, o, i * BITS // 32)
        sc = parts[3 * c + 1].view(mx.bfloat16).reshape(rows, o, i // GROUP)
        b = parts[3 * c + 2].view(mx.bfloat16).reshape(rows, o, i // GROUP)
        out.append((w, sc, b))
    return out


def switch_glu(x, weights, rows):
    import mlx.core as mx

    def proj(k, h):
        w, sc, b = weights[k]
        return mx.gather_qmm(h, w, sc, b, rhs_indices=rows, transpose=True,
                             group_size=GROUP, bits=BITS)

    g = proj(0, x)
    return proj(2, g * mx.sigmoid(g) * proj(1, x))


def run_resolve(eng, table, batches, rec, weights=None, prefetch=False):
    import mlx.core as mx

    x = mx.random.normal((1, 1, 1, HIDDEN))
    mx.eval(x)
    idxs = [mx.array([off // rec for off in b], dtype=mx.uint32)[None] for b in batches]
    for i, idx in enumerate(idxs):
        if prefetch and i + 1 < len(idxs):
            mx.async_eval(eng.prefetch(table, idxs[i + 1], priority=1))
        rows, lease = eng.resolve(table, idx, layer=i)
        y = rows if weights is None else switch_glu(x, weights, rows)
        mx.eval(eng.release_after(y, lease))


def run_mmap(path, batches, rec):
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        sink = np.empty(rec, dtype=np.uint8)
        for batch in batches:
            for off in batch:
                sink[:] = np.frombuffer(mm, dtype=np.uint8, count=rec, offset=off)
        mm.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", default="/tmp/hebrus_bench_experts.bin")
    p.add_argument("--layers", type=int, default=6, help="synthetic layers")
    p.add_argument("--experts", type=int, default=48, help="records per layer")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--tokens", type=int, default=4, help="decode steps per run")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sha", action="store_true", help="also time SHA-256 verify")
    args = p.parse_args()

    from hebrus_mlx.stream import engine as se

    if not se.available():
        raise SystemExit(se.unavailable_reason())
    rec = record_bytes()
    n = args.layers * args.experts
    build_store(args.store, n, rec)
    rng = random.Random(0)
    batches = []
    for _ in range(args.tokens):
        for layer in range(args.layers):
            experts = rng.sample(range(args.experts), args.top_k)
            batches.append([(layer * args.experts + e) * rec for e in experts])
    # Distinct records per run so no variant gets cache hits.
    seen = set()
    batches = [[o for o in b if not (o in seen or seen.add(o))] for b in batches]
    batches = [b for b in batches if b]
    total = sum(len(b) for b in batches) * rec
    cache = 4 * args.top_k * rec

    digests = None
    if args.sha:
        with open(args.store, "rb") as f:
            digests = [hashlib.sha256(f.read(rec)).digest() for _ in range(n)]

    pb = part_bytes()
    assert sum(pb) == rec, (pb, rec)

    def engine_run(kind):
        eng = se.StreamEngine(cache_bytes=cache, threads=args.threads)
        s = eng.add_store(args.store)
        table = eng.register_table(s, [i * rec for i in range(n)], [rec] * n)
        if kind in ("resolve", "glu", "glu_pf", "glu_hot"):
            rows = 4 * args.top_k
            aid, parts = eng.create_arena(pb, rows)
            table = eng.register_table(s, [i * rec for i in range(n)], [rec] * n,
                                       arena=aid)
            weights = None if kind == "resolve" else glu_weights(parts, rows)
            todo = batches
            if kind == "glu_hot":
                # Same graph and arena size, every layer's records resident:
                # compute (and op overhead) without I/O. gather_qmm cost on
                # CPU grows with the arena rows, so the size must match.
                todo = [batches[0]] * len(batches)
                run_resolve(eng, table, todo[:1], rec, weights)
            t0 = time.perf_counter()
            run_resolve(eng, table, todo, rec, weights, prefetch=kind == "glu_pf")
            dt = time.perf_counter() - t0
            c = eng.counters()
            eng.close()
            return dt, c
        t0 = time.perf_counter()
        if kind == "op":
            run_gather_op(eng, table, batches, rec)
        else:
            run_engine(eng, s, batches, rec, digests if kind == "sha" else None)
        dt = time.perf_counter() - t0
        c = eng.counters()
        eng.close()
        return dt, c

    variants = ["raw", "engine", "op", "resolve", "glu", "glu_pf", "glu_hot", "mmap"]
    variants += ["sha"] if args.sha else []
    times = {v: [] for v in variants}
    last = {}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]  # A/B/B/A
        for v in order:
            drop_cache(args.store)
            if v == "raw":
                t0 = time.perf_counter()
                run_raw(args.store, batches, rec, args.threads)
                dt = time.perf_counter() - t0
            elif v == "mmap":
                t0 = time.perf_counter()
                run_mmap(args.store, batches, rec)
                dt = time.perf_counter() - t0
            else:
                dt, last[v] = engine_run(v)
            times[v].append(dt)

    gib = total / 2**30
    print(f"record {rec} B ({rec / 2**20:.3f} MiB), {total // rec} cold reads "
          f"in batches of <= {args.top_k}, {args.threads} threads, "
          f"{args.rounds} rounds, store {args.store}")
    med = {v: statistics.median(ts) for v, ts in times.items()}
    for v in variants:
        runs = " ".join(f"{gib / t:.3f}" for t in times[v])
        print(f"  {v:7s} median {gib / med[v]:.3f} GiB/s   runs [{runs}]")
    print(f"  engine/raw  {med['raw'] / med['engine']:.3f}x   (target >= 0.9)")
    print(f"  op/raw      {med['raw'] / med['op']:.3f}x")
    print(f"  resolve/raw {med['raw'] / med['resolve']:.3f}x   (zero-copy graph op)")
    print(f"  engine/mmap {med['mmap'] / med['engine']:.3f}x   (target >= 2)")
    bound = med["raw"] + med["glu_hot"]
    steps = len(batches)
    print(f"  SwitchGLU per layer: hot compute {med['glu_hot'] / steps * 1e3:.1f} ms, "
          f"raw I/O {med['raw'] / steps * 1e3:.1f} ms, streamed {med['glu'] / steps * 1e3:.1f} ms, "
          f"with oracle prefetch {med['glu_pf'] / steps * 1e3:.1f} ms")
    print(f"  glu vs serial bound (raw I/O + hot compute) {bound / med['glu']:.3f}x "
          f"(target >= 0.9); glu_pf {bound / med['glu_pf']:.3f}x; "
          f"I/O roofline alone {med['raw'] / med['glu_pf']:.3f}x")
    if args.sha:
        print(f"  sha/engine  {med['engine'] / med['sha']:.3f}x")
    c = last["engine"]
    print(f"  engine latency p50/p95/p99 ms: {c['latency_p50_ns'] / 1e6:.2f} / "
          f"{c['latency_p95_ns'] / 1e6:.2f} / {c['latency_p99_ns'] / 1e6:.2f}; "
          f"exposed wait {c['exposed_wait_ns'] / 1e9:.3f} s")


if __name__ == "__main__":
    main()
