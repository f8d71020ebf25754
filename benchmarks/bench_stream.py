"""Streaming-engine benchmark on a synthetic expert store (issue 6).

Records have the real routed-expert geometry: gate|up|down of 2560x640 in
affine 4-bit, group 64 (uint32 weights + bf16 scales and biases), each record
4096-aligned (2,764,800 bytes, ~2.64 MiB). Every variant reads the same
decode-like list of records (per "layer", top-k distinct random experts, all
k known at once) from a cold store (posix_fadvise DONTNEED before each run):

  (a) raw     O_DIRECT pread by a pool of C threads (raw_pread, no engine, no
              cache), same record size and thread count, k-wide batches
  (a') raw_py the same reads from a Python ThreadPoolExecutor (for comparison)
  (b) engine  StreamEngine request/wait/release, same batches
  (b2) op     StreamEngine.gather() MLX op evaluated per layer (graph path)
  (b3) sha    (b) with SHA-256 verification of every record (artifacts without fast digests)
  (b3') fast  (b) with the fast check, XXH3-128, of every record (what new artifacts use)
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
>= 0.9). The store has 512 records per layer as the real model does: how
sparsely the touched records lie decides whether the kernel's readahead
for the mapping helps (neighbours used later) or wastes bandwidth.

    python benchmarks/bench_stream.py [--store STEM] [--layers 6] [--experts 512]

(c) streamed decode, ``--decode``: a stack of --layers decoder layers over
a store with valid affine4 scales/biases, one lazy graph per token (per
layer: a Gated DeltaNet with the real model's dimensions -> router -> top-k
-> resolve -> SwitchGLU + shared expert -> residual; routes never leave the
graph, one mx.eval per token), cold store, arena of --rows records. The GDN
matters: in the real model the attention/GDN work between a layer's start
and its router is the window a layer-start prediction hides reads in.
Token inputs follow an AR(1) process so consecutive tokens share routes, as
real decode does (the overlap is printed). Per token it compares the streamed time with
the serial bound = hot compute (same graph, that token's records already in
the arena) + exact (missed) bytes per token / raw O_DIRECT bandwidth (C
threads, same records, same threads), without prefetch and with the
previous token's top-k prefetched as P1 when each layer starts
(StreamedSwitchGLU.layer_start's control); and writes a PNG timeline of one token's layer-by-layer reads,
exposed waits and compute to benchmarks/out/stream_decode_timeline.png,
drawn from the engine's trace of a normal run (per-read timestamps plus
in-graph marks; no host sync).

    python benchmarks/bench_stream.py --decode [--layers 6] [--experts 512]
        [--rows 30] [--tokens 16] [--wavefront both]

With ``--wavefront both`` every prefetch mode also runs with the decode wavefront
(``<mode>+wavefront``: each routed expert computed as its record lands, AFN-019 H4), interleaved
with the others; each line then also gives the engine's exposed wait per token.
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

from hebrus_mlx.simulate.synthetic_stack import (  # the stack simulate --validate --stack decode times too
    EXPAND,
    HIDDEN,
    DecodeStack,
    build_decode_store,
    drop_cache,
    glu_weights,
    make_mixers,
    part_bytes,
    record_bytes,
    switch_glu,
    token_inputs,
)


def run_raw(path, batches, rec, threads):
    """Seconds for the C-thread raw O_DIRECT reads (the roofline)."""
    import mlx.core  # noqa: F401  (loads libmlx for the extension)

    from hebrus_mlx import _bench

    return _bench.raw_pread(str(path), batches, rec, threads=threads)["elapsed_ns"] / 1e9


def run_raw_py(path, batches, rec, threads):
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


def run_engine(eng, store, batches, rec, digests=None, fast_digests=None):
    for batch in batches:
        tickets = [
            eng.request(
                store,
                off,
                rec,
                digest=None if digests is None else digests[off // rec],
                fast_digest=None if fast_digests is None else fast_digests[off // rec],
            )
            for off in batch
        ]
        for t in tickets:
            eng.wait(t)
            eng.release(t)


def sha_rates(rec, repeats=7):
    """(backend, GiB/s of the picked SHA-256 rounds, GiB/s of the portable
    rounds) hashing one cached record; medians of interleaved runs."""
    import mlx.core  # noqa: F401  (loads libmlx for the extension)

    from hebrus_mlx import _ext

    buf = os.urandom(rec)
    times = {False: [], True: []}
    for _ in range(repeats):
        for portable in (False, True):
            t0 = time.perf_counter()
            _ext.sha256(buf, portable=portable)
            times[portable].append(time.perf_counter() - t0)
    rate = {p: rec / 2**30 / statistics.median(t) for p, t in times.items()}
    return _ext.sha256_backend(), rate[False], rate[True]


def fast_rates(rec):
    """(backend, GiB/s of the picked XXH3-128 SIMD path, GiB/s of its scalar path), one record
    in cache (hebrus_mlx.bench.machine.fast_check_rate, what qualify records)."""
    from hebrus_mlx.bench.machine import fast_check_rate

    r = fast_check_rate(rec)
    return (
        r["xxh3_128_backend"],
        r["xxh3_128_GBps_one_thread"] * 1e9 / 2**30,
        r["xxh3_128_scalar_GBps_one_thread"] * 1e9 / 2**30,
    )


def run_gather_op(eng, table, batches, rec):
    import mlx.core as mx

    for batch in batches:
        idx = mx.array([off // rec for off in batch], dtype=mx.uint32)
        mx.eval(eng.gather(table, idx))


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


def storage_read_bytes():
    """Bytes this process caused to be fetched from storage (page-ins
    included), or None where /proc/self/io is missing."""
    try:
        with open("/proc/self/io") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("read_bytes"))
    except (OSError, StopIteration):
        return None


def run_mmap(path, batches, rec):
    """Touch each record through a read-only mapping, as a compute thread
    faulting in lazily loaded weights does. Returns the storage bytes the
    page-ins fetched (readahead included)."""
    before = storage_read_bytes()
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        sink = np.empty(rec, dtype=np.uint8)
        for batch in batches:
            for off in batch:
                sink[:] = np.frombuffer(mm, dtype=np.uint8, count=rec, offset=off)
        mm.close()
    after = storage_read_bytes()
    return None if before is None else after - before


def store_path(args):
    return args.store.replace(".bin", "") + f"_{args.layers}x{args.experts}.bin"


def run_decode(args):
    from hebrus_mlx.stream import engine as se

    rec = record_bytes()
    n = args.layers * args.experts
    path = store_path(args)
    build_decode_store(path, n, rec)
    hs = token_inputs(args.tokens)
    pb = part_bytes()
    mixers = make_mixers(args.layers)

    def stack(prefetch, rows=args.rows, wavefront=False):
        eng = se.StreamEngine(cache_bytes=rec, threads=args.threads, backend=args.backend)
        s = eng.add_store(path)
        aid, parts = eng.create_arena(pb, rows, EXPAND)
        table = eng.register_table(s, [i * rec for i in range(n)], [rec] * n, arena=aid)
        st = DecodeStack(
            eng, table, glu_weights(parts, rows), args.layers, args.experts, args.top_k, prefetch, mixers, wavefront
        )
        # Staging rows for predictions, as stream.streaming.Streaming sets them.
        if st.spec.kind != "off":
            eng.set_staging(aid, min(args.top_k * st.spec.depth, rows // 4))
        return st

    def streamed(mode):
        drop_cache(path)
        prefetch, wavefront = wave_mode(mode)
        st = stack(prefetch, wavefront=wavefront)
        times, routes = [], []
        for h in hs:
            t0 = time.perf_counter()
            routes.append(st.token(h))
            times.append(time.perf_counter() - t0)
        c = st.eng.counters()
        st.eng.close()
        return times, routes, c

    def hot():
        # Each token twice: the second pass finds every record in an arena
        # that holds a whole token (gather_qmm time does not depend on the
        # arena rows on CPU: 10 experts x 640x2560, 20/40/80 rows ~15 ms).
        st = stack(False, max(args.rows, args.layers * args.top_k))
        times, misses = [], 0
        for h in hs:
            snap = st.snapshot()
            st.token(h)
            st.restore(snap)
            m0 = st.eng.counters()["misses"]
            t0 = time.perf_counter()
            st.token(h)
            times.append(time.perf_counter() - t0)
            misses += st.eng.counters()["misses"] - m0
        st.eng.close()
        assert misses == 0, f"hot pass missed {misses} records"
        return times

    # Hot, off and on take turns (order reversed every round): load from
    # other jobs on this shared machine hits all three alike.
    # With --wavefront both, each prefetch mode also runs as "<mode>+wavefront" (AFN-019 H4).
    modes = args.prefetch_modes.split(",")
    if args.wavefront == "both":
        modes = [m + w for m in modes for w in ("", WAVE)]
    res, hot_runs = {}, []
    for r in range(args.rounds):
        order = ["hot", *modes]
        for mode in order if r % 2 == 0 else order[::-1]:
            if mode == "hot":
                hot_runs.append(statistics.median(hot()[1:]))
                continue
            times, routes, c = streamed(mode)
            res.setdefault(mode, []).append((statistics.median(times[1:]), routes, c))
    hot_t = statistics.median(hot_runs)
    routes = res[modes[0]][0][1]
    bw, bw_py = raw_bandwidth(path, routes, rec, args)

    toks = args.tokens
    overlap = [len(set(a) & set(b)) / args.top_k for p, q in zip(routes, routes[1:]) for a, b in zip(p, q)]
    print(
        f"(c) streamed decode: {args.layers} layers x {args.experts} experts, top-{args.top_k}, "
        f"record {rec / 2**20:.3f} MiB, arena {args.rows} rows, {toks} tokens, {args.threads} threads, "
        f"{args.rounds} rounds, backend {args.backend}; store {path}"
    )
    print(
        f"  previous-token route overlap {100 * np.mean(overlap):.0f}%; raw O_DIRECT {bw / 2**30:.3f} GiB/s "
        f"(C threads; Python pool {bw_py / 2**30:.3f} GiB/s, {bw_py / bw:.2f}x); "
        f"hot compute {hot_t * 1e3:.1f} ms/token"
    )
    c0 = res["off"][0][2] if "off" in res else res[modes[0]][0][2]
    miss_bytes = (c0["exact_bytes"]) / toks
    bound = hot_t + miss_bytes / bw
    print(
        f"  serial bound = hot compute + {miss_bytes / 2**20:.1f} MiB missed/token / raw bw "
        f"= {bound * 1e3:.1f} ms/token"
    )
    from hebrus_mlx.stream.predict import parse_prefetch

    ctrl = statistics.median([m for m, _, _ in res[modes[0]]])
    for pf in modes:
        t = statistics.median([m for m, _, _ in res[pf]])
        c = res[pf][0][2]
        same = all(r == routes for _, r, _ in res[pf])
        wait = statistics.median([c["exposed_wait_ns"] / 1e6 / toks for _, _, c in res[pf]])
        print(
            f"  prefetch {pf}: {t * 1e3:.1f} ms/token "
            f"(runs {' '.join(f'{m * 1e3:.1f}' for m, _, _ in res[pf])}), x{ctrl / t:.3f} vs {modes[0]}, "
            f"bound/streamed {bound / t:.3f}x; exposed wait {wait:.1f} ms/token; "
            f"predicted hits/joins {c['predicted_hits']}/{c['predicted_joins']}, "
            f"routes {'identical' if same else 'DIFFER'}"
        )
        print("    " + se.io_summary(c, parse_prefetch(wave_mode(pf)[0])))
    if not args.no_timeline:
        timeline(stack, hs, path, args)


WAVE = "+wavefront"


def wave_mode(mode):
    """(prefetch mode, wavefront) of a --decode mode label."""
    return (mode[: -len(WAVE)], True) if mode.endswith(WAVE) else (mode, False)


def raw_bandwidth(path, routes, rec, args):
    """Raw O_DIRECT bytes/s over the decode's records (cold, one k-wide
    batch per layer): (C threads, Python pool), medians of --rounds."""
    batches = [[(l * args.experts + e) * rec for e in r] for tok in routes for l, r in enumerate(tok)]
    total = len(batches) * args.top_k * rec
    c, py = [], []
    for _ in range(args.rounds):
        drop_cache(path)
        c.append(run_raw(path, batches, rec, args.threads))
        drop_cache(path)
        t0 = time.perf_counter()
        run_raw_py(path, batches, rec, args.threads)
        py.append(time.perf_counter() - t0)
    return total / statistics.median(c), total / statistics.median(py)


ROUTED, RESOLVED, COMPUTED = 0, 1, 2  # trace mark tags


class MarkedEngine:
    """StreamEngine proxy for the timeline: marks each layer's routes
    (router done), resolved rows (records ready) and released output
    (SwitchGLU computed) in the graph, so compute spans come from the engine
    trace without a host sync."""

    def __init__(self, eng):
        self._eng, self._layer = eng, -1

    def __getattr__(self, name):
        return getattr(self._eng, name)

    def resolve(self, table, indices, layer=-1, **kw):
        indices = self._eng.mark_after(indices, layer, ROUTED)
        rows, lease = self._eng.resolve(table, indices, layer=layer, **kw)
        self._layer = layer  # the graph is built layer by layer
        return self._eng.mark_after(rows, layer, RESOLVED), lease

    def release_after(self, value, lease):
        y = self._eng.release_after(value, lease)
        return self._eng.mark_after(y, self._layer, COMPUTED)


def token_trace(stack, hs, path, prefetch, tok):
    """Engine trace events of token `tok` in a normal (untraced until then)
    cold run: (events, token start ns, token end ns, dropped, the engine
    counters' exposed wait of that token in ns)."""
    drop_cache(path)
    st = stack(prefetch)
    for h in hs[:tok]:
        st.token(h)
    eng = st.eng
    st.eng = MarkedEngine(eng)
    eng.enable_trace(1 << 16)
    w0 = eng.counters()["exposed_wait_ns"]
    t0 = time.monotonic_ns()
    st.token(hs[tok])
    t1 = time.monotonic_ns()
    for _ in range(10000):  # let this token's unused prefetches land
        m = eng.memory()
        if m["inflight_reads"] == 0 and m["queued_reads"] == 0:
            break
        time.sleep(0.001)
    ev, dropped = eng.trace_events()
    waited = eng.counters()["exposed_wait_ns"] - w0
    eng.close()
    return ev, t0, t1, dropped, waited


def timeline(stack, hs, path, args):
    """PNG: one token's per-layer reads, exposed waits and compute, both
    prefetch modes, from the engine trace (AFN-019: no per-layer sync)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tok = min(len(hs) - 1, 4)
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    lanes = (
        ("predicted read", -0.3, "tab:orange"),
        ("exact read", -0.1, "tab:red"),
        ("exposed wait", 0.1, "black"),
        ("SwitchGLU compute", 0.3, "tab:blue"),
        ("GDN + router", 0.3, "tab:cyan"),
    )
    for ax, pf in zip(axes, (False, True)):
        ev, t0, t1, dropped, waited = token_trace(stack, hs, path, pf, tok)
        ms = lambda t: (np.asarray(t, np.float64) - t0) / 1e6  # noqa: E731
        reads = ev[(ev["kind"] == "read") & (ev["outcome"] == "published")]
        waits = ev[ev["kind"] == "wait"]
        marks = ev[ev["kind"] == "mark"]
        spans = {lane: [] for lane, _, _ in lanes}
        for r in reads:
            spans["exact read" if r["exact"] else "predicted read"].append(
                (r["layer"], r["start_ns"], r["end_ns"], r["issue_ns"])
            )
        for w in waits:
            spans["exposed wait"].append((w["layer"], w["issue_ns"], w["end_ns"], None))
        at = {(int(m["layer"]), int(m["expert"])): m["issue_ns"] for m in marks}
        for l in range(args.layers):
            if (l, RESOLVED) in at and (l, COMPUTED) in at:
                spans["SwitchGLU compute"].append((l, at[l, RESOLVED], at[l, COMPUTED], None))
            if (l - 1, COMPUTED) in at and (l, ROUTED) in at:
                spans["GDN + router"].append((l, at[l - 1, COMPUTED], at[l, ROUTED], None))
        for lane, dy, color in lanes:
            alpha = 0.35 if "read" in lane else 0.9
            for i, (l, a, b, issued) in enumerate(spans[lane]):
                if issued is not None:  # queued in the engine before a worker took it
                    ax.barh(l + dy, ms(a) - ms(issued), left=ms(issued), height=0.18, color=color, alpha=0.08)
                ax.barh(
                    l + dy,
                    max(ms(b) - ms(a), 0.05),
                    left=ms(a),
                    height=0.18,
                    color=color,
                    alpha=alpha,
                    label=lane if i == 0 else None,
                )
        wait_ms = float(np.sum(waits["end_ns"] - waits["issue_ns"])) / 1e6
        n_exact = int(reads["exact"].sum())
        ax.axvline(ms(t1), color="gray", lw=0.8, ls="--")
        ax.set_ylabel("layer")
        ax.set_yticks(range(args.layers))
        ax.invert_yaxis()
        ax.set_title(
            f"previous-token prefetch {'on' if pf else 'off'}: token {tok}, "
            f"{(t1 - t0) / 1e6:.1f} ms; {n_exact} exact + {len(reads) - n_exact} predicted "
            f"reads, exposed wait {wait_ms:.1f} ms (engine trace, no host sync"
            f"{f', {dropped} dropped' if dropped else ''})",
            fontsize=9,
        )
        ax.legend(fontsize=7, loc="upper right", ncol=3)
        print(
            f"  timeline prefetch {'on ' if pf else 'off'}: token {tok} {(t1 - t0) / 1e6:.1f} ms, "
            f"{n_exact} exact + {len(reads) - n_exact} predicted reads, "
            f"exposed wait {wait_ms:.1f} ms in {len(waits)} waits (counters {waited / 1e6:.1f} ms), "
            f"compute {sum(b - a for _, a, b, _ in spans['SwitchGLU compute']) / 1e6:.1f} ms"
        )
    axes[-1].set_xlabel("ms since the token's graph was built (dashed: eval returned; faint: queued in the engine)")
    fig.tight_layout()
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "stream_decode_timeline.png")
    fig.savefig(path, dpi=90)
    print(f"  timeline: {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--store", default="/tmp/hebrus_bench_experts.bin", help="path stem; the store is <stem>_<layers>x<experts>.bin"
    )
    p.add_argument("--layers", type=int, default=6, help="synthetic layers")
    p.add_argument(
        "--experts",
        type=int,
        default=512,
        help="records per layer (512 as in the real model: how sparse the "
        "touched records lie decides what readahead wins or wastes)",
    )
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--tokens", type=int, default=4, help="decode steps per run")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--sha",
        action="store_true",
        help="also time the engine's reads checked by SHA-256 and by the fast check (XXH3-128)",
    )
    p.add_argument("--decode", action="store_true", help="run part (c), streamed decode")
    p.add_argument("--rows", type=int, default=None, help="(c) arena rows (default layers*top_k/2)")
    p.add_argument(
        "--prefetch-modes",
        default="previous,off",
        help="(c) comma-separated --prefetch values timed A/B/B/A; the first is the control "
        "(off, previous, router-reuse:1, router-reuse:2)",
    )
    p.add_argument("--no-timeline", action="store_true", help="(c) skip the engine-trace timeline plot")
    p.add_argument(
        "--wavefront",
        choices=["off", "both"],
        default="off",
        help="(c) both: also run every prefetch mode with the decode wavefront (mode+wavefront)",
    )
    p.add_argument(
        "--backend",
        default="pread",
        help="engine read backend: pread, or mtlio on a macOS Metal build "
        "(arena rows only; run both to A/B, metal_ext/README.md)",
    )
    args = p.parse_args()
    from hebrus_mlx.stream import engine as se

    if args.backend not in se.backends():
        raise SystemExit(f"--backend {args.backend}: this build has {se.backends()}")
    if args.decode:
        if args.rows is None:
            args.rows = max(args.top_k, args.layers * args.top_k // 2)
        if args.tokens == 4:
            args.tokens = 16
        return run_decode(args)

    from hebrus_mlx.stream import engine as se

    if not se.available():
        raise SystemExit(se.unavailable_reason())
    rec = record_bytes()
    n = args.layers * args.experts
    args.store = store_path(args)
    build_decode_store(args.store, n, rec)
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

    digests = fast = None
    if args.sha:
        from hebrus_mlx import _hash

        with open(args.store, "rb") as f:
            digests, fast = {}, {}
            for off in sorted(o for b in batches for o in b):
                f.seek(off)
                data = f.read(rec)
                digests[off // rec] = hashlib.sha256(data).digest()
                fast[off // rec] = _hash.xxh3_128(data)

    pb = part_bytes()
    assert sum(pb) == rec, (pb, rec)

    def engine_run(kind):
        eng = se.StreamEngine(cache_bytes=cache, threads=args.threads, backend=args.backend)
        s = eng.add_store(args.store)
        table = eng.register_table(s, [i * rec for i in range(n)], [rec] * n)
        if kind in ("resolve", "glu", "glu_pf", "glu_hot"):
            rows = 4 * args.top_k
            aid, parts = eng.create_arena(pb, rows, EXPAND)
            table = eng.register_table(s, [i * rec for i in range(n)], [rec] * n, arena=aid)
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
            run_engine(eng, s, batches, rec, digests if kind == "sha" else None, fast if kind == "fast" else None)
        dt = time.perf_counter() - t0
        c = eng.counters()
        eng.close()
        return dt, c

    # Each round runs the variants back to back, A/B/B/A; the disk here
    # drifts by tens of percent within a minute, so the ratios below are
    # medians of per-round ratios and engine sits next to raw.
    variants = ["raw", "engine"] + (["sha", "fast"] if args.sha else [])
    variants += ["raw_py", "mmap", "op", "resolve", "glu", "glu_pf", "glu_hot"]
    times = {v: [] for v in variants}
    last = {}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]  # A/B/B/A
        for v in order:
            drop_cache(args.store)
            if v == "raw":
                dt = run_raw(args.store, batches, rec, args.threads)
            elif v == "raw_py":
                t0 = time.perf_counter()
                run_raw_py(args.store, batches, rec, args.threads)
                dt = time.perf_counter() - t0
            elif v == "mmap":
                t0 = time.perf_counter()
                paged = run_mmap(args.store, batches, rec)
                dt = time.perf_counter() - t0
            else:
                dt, last[v] = engine_run(v)
            times[v].append(dt)

    gib = total / 2**30
    load_after = os.getloadavg()
    print(
        f"record {rec} B ({rec / 2**20:.3f} MiB), {total // rec} cold reads "
        f"in batches of <= {args.top_k}, {args.threads} threads, "
        f"{args.rounds} rounds, backend {args.backend}, store {args.store}"
    )
    med = {v: statistics.median(ts) for v, ts in times.items()}

    def ratio(slow, fast):
        """How many times faster `fast` ran than `slow`, median per round."""
        return statistics.median(a / b for a, b in zip(times[slow], times[fast]))

    for v in variants:
        runs = " ".join(f"{gib / t:.3f}" for t in times[v])
        print(f"  {v:7s} median {gib / med[v]:.3f} GiB/s   runs [{runs}]")
    print(f"  engine/raw  {ratio('raw', 'engine'):.3f}x   (target >= 0.9; raw = C threads)")
    print(
        f"  raw_py/raw  {ratio('raw', 'raw_py'):.3f}x   (Python pool vs C threads; "
        f"engine/raw_py {ratio('raw_py', 'engine'):.3f}x)"
    )
    print(f"  op/raw      {ratio('raw', 'op'):.3f}x")
    print(f"  resolve/raw {ratio('raw', 'resolve'):.3f}x   (zero-copy graph op)")
    print(
        f"  engine/mmap {ratio('mmap', 'engine'):.3f}x   (target >= 2); the mapping paged in "
        + ("?" if paged is None else f"{paged / total:.2f}x")
        + " the bytes used (readahead, /sys/block/*/queue/read_ahead_kb)"
    )
    bound = med["raw"] + med["glu_hot"]
    steps = len(batches)
    print(
        f"  SwitchGLU per layer: hot compute {med['glu_hot'] / steps * 1e3:.1f} ms, "
        f"raw I/O {med['raw'] / steps * 1e3:.1f} ms, streamed {med['glu'] / steps * 1e3:.1f} ms, "
        f"with oracle prefetch {med['glu_pf'] / steps * 1e3:.1f} ms"
    )
    print(
        f"  glu vs serial bound (raw I/O + hot compute) {bound / med['glu']:.3f}x "
        f"(target >= 0.9); glu_pf {bound / med['glu_pf']:.3f}x; "
        f"I/O roofline alone {med['raw'] / med['glu_pf']:.3f}x"
    )
    if args.sha:
        backend, hw, portable = sha_rates(rec)
        fb, fhw, fport = fast_rates(rec)
        print(
            f"  verified/unverified: SHA-256 {ratio('engine', 'sha'):.3f}x, fast check (XXH3-128) "
            f"{ratio('engine', 'fast'):.3f}x   (engine reads checked vs the same reads unchecked, "
            f"median of per-round ratios; target >= 0.95; 1.0 = the check is free)"
        )
        print(
            f"  load average (1/5/15 min) {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f} "
            f"before, {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} after; "
            f"{os.cpu_count()} CPUs"
        )
        print(
            f"  SHA-256 alone on one record (in cache): {backend} {hw:.2f} GiB/s, "
            f"portable rounds {portable:.2f} GiB/s ({hw / portable:.1f}x)"
        )
        print(
            f"  XXH3-128 alone on one record (in cache): {fb} {fhw:.2f} GiB/s, "
            f"scalar {fport:.2f} GiB/s ({fhw / fport:.1f}x)"
        )
    c = last["engine"]
    print(
        f"  engine latency p50/p95/p99 ms: {c['latency_p50_ns'] / 1e6:.2f} / "
        f"{c['latency_p95_ns'] / 1e6:.2f} / {c['latency_p99_ns'] / 1e6:.2f}; "
        f"exposed wait {c['exposed_wait_ns'] / 1e9:.3f} s"
    )


if __name__ == "__main__":
    main()
