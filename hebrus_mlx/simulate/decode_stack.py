"""`hebrus-mlx simulate --validate --stack decode`: the simulator against the real-geometry decode
stack (`synthetic_stack.py`, the one `benchmarks/bench_stream.py --decode` times), where I/O dominates a token.

The stack is synthetic_stack's (DecodeStack: per layer a Gated DeltaNet with Qwen3.8-Flash-Next's
dimensions -> router over 512 experts -> top-10 -> resolve from a cold store of 2560x640 affine4
records -> SwitchGLU + shared expert; one lazy graph per token). This module measures this
machine (the SSD by queue depth on that store's records with the bench's probe, or the probe of
the machine profile `hebrus-mlx qualify` wrote; compute per layer and the part of it before the
router on the stack with every record cached), records the stack's routes and each predictor's
hinted sets in a pass of their own, predicts every (arena rows x predictor) run, then times the
runs (interleaved with a compute run, each from a cold store and an empty arena) and prints both.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from ..errors import UsageError
from . import model as S


class _Recorder:
    """StreamEngine proxy that keeps the indices of every prefetch (the hinted sets)."""

    def __init__(self, eng):
        self._eng = eng
        self.hints: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self._eng, name)

    def prefetch(self, table, indices, priority=1, layer=-1, **kw):
        self.hints.append((layer, indices))
        return self._eng.prefetch(table, indices, priority=priority, layer=layer, **kw)


class Stack:
    """bench_stream's decode stack on one store, built per run like its `stack()`."""

    def __init__(self, bs, store: str, layers: int, experts: int, top_k: int, tokens: int, threads: int):
        self.bs, self.layers, self.experts, self.top_k, self.threads = bs, layers, experts, top_k, threads
        self.rec = bs.record_bytes()
        self.n = layers * experts
        self.path = store.replace(".bin", "") + f"_{layers}x{experts}.bin"
        bs.build_decode_store(self.path, self.n, self.rec)
        self.hs = bs.token_inputs(tokens)
        self.mixers = bs.make_mixers(layers)

    def make(self, prefetch: str, rows: int):
        from ..stream import engine as se

        bs = self.bs
        eng = se.StreamEngine(cache_bytes=self.rec, threads=self.threads)
        s = eng.add_store(self.path)
        aid, parts = eng.create_arena(bs.part_bytes(), rows, bs.EXPAND)
        table = eng.register_table(s, [i * self.rec for i in range(self.n)], [self.rec] * self.n, arena=aid)
        st = bs.DecodeStack(
            eng, table, bs.glu_weights(parts, rows), self.layers, self.experts, self.top_k, prefetch, self.mixers
        )
        if st.spec.kind != "off":  # the loader's staging rows (stream.streaming.Streaming)
            eng.set_staging(aid, min(self.top_k * st.spec.depth, rows // 4))
        return st

    def run(self, prefetch: str, rows: int):
        """A cold run: (seconds per token, routes [T, L, k], engine counters)."""
        self.bs.drop_cache(self.path)
        st = self.make(prefetch, rows)
        times, routes = [], []
        try:
            for i, h in enumerate(self.hs):
                t0 = time.perf_counter()
                routes.append(st.token(h))
                times.append(time.perf_counter() - t0)
                if i == 0:
                    c0 = st.eng.counters()
            c1 = st.eng.counters()
            # Tokens 1.. only (token 0 fills the empty arena; the replay warms on it too).
            c = {
                k: v - c0[k]
                for k, v in c1.items()
                if isinstance(v, (int, float)) and isinstance(c0.get(k), (int, float))
            }
        finally:
            st.eng.close()
        return times, np.array(routes, np.int64), c

    def record(self, prefetch: str):
        """Routes and the hinted sets of one run ([T, L, k] and [T, L, k] with -1 where the
        predictor hinted nothing for that (token, target layer))."""
        import mlx.core as mx

        st = self.make(prefetch, self.layers * self.top_k * 2)
        rec = _Recorder(st.eng)
        st.eng = rec
        routes, pred = [], np.full((len(self.hs), self.layers, self.top_k), -1, np.int64)
        try:
            for t, h in enumerate(self.hs):
                rec.hints = []
                routes.append(st.token(h))
                for layer, idx in rec.hints:
                    ids = np.array(mx.array(idx)).reshape(-1).astype(np.int64) - layer * self.experts
                    ids = ids[(ids >= 0) & (ids < self.experts)][: self.top_k]
                    pred[t, layer, : len(ids)] = ids
        finally:
            st.eng = rec._eng
            st.eng.close()
        return np.array(routes, np.int64), pred

    def pre_router(self, rows: int) -> float:
        """The fraction of a hot token's layer time before the routers (GDN + router, each layer
        evaluated on its own), median over three tokens."""
        import mlx.core as mx

        st = self.make("off", rows)
        fr = []
        try:
            for h in self.hs[:4]:
                snap = st.snapshot()
                st.token(h)  # every record of this token now in the arena
                st.restore(snap)
                x, t_route, t_all = h, 0.0, time.perf_counter()
                for l in range(st.layers):
                    t0 = time.perf_counter()
                    x2, hh, idx = st._route(l, x)
                    mx.eval(x2, hh, idx)
                    t_route += time.perf_counter() - t0
                    rows_, lease = st.eng.resolve(st.table, idx + l * st.experts, layer=l)
                    x = st._experts(l, x2, hh, rows_, lease)
                    mx.eval(x)
                fr.append(t_route / (time.perf_counter() - t_all))
                st.restore(snap)
        finally:
            st.eng.close()
        return statistics.median(fr[1:])

    def hot(self, rows: int, tokens: int = 4, prefetch: str = "off") -> float:
        """bench_stream's hot(): each token twice, the second pass timed with every record of it
        already in an arena of `rows` rows (gather_qmm's cost on the CPU grows with the arena's
        rows, so compute is measured at the run's size; an ahead predictor's router per layer is
        compute too); mean over tokens 1..tokens-1."""
        st = self.make(prefetch, rows)
        times = []
        try:
            for h in self.hs[:tokens]:
                snap = st.snapshot()
                st.token(h)
                st.restore(snap)
                c0 = st.eng.counters()
                t0 = time.perf_counter()
                st.token(h)
                times.append(time.perf_counter() - t0)
                c1 = st.eng.counters()
                read = sum(c1[x] - c0[x] for x in ("exact_misses", "predicted_reads"))
                if read:  # then it timed reads too: no compute run (see _hot_rows)
                    raise RuntimeError(f"all-cached run at {rows} rows ({prefetch}) read {read} records")
        finally:
            st.eng.close()
        return statistics.mean(times[1:])

    def probe(self, seed: int) -> dict:
        """calibrate.engine_probe on this store through the stack's own engine and arena layout."""
        import mlx.core as mx

        from . import calibrate as K

        st = self.make("off", 16)

        def resolve(layer, ids):
            rows_, lease = st.eng.resolve(
                st.table, mx.array((np.asarray(ids) + layer * self.experts).astype(np.uint32)), layer=layer
            )
            mx.eval(st.eng.release_after(rows_, lease))

        try:
            out = K.engine_probe(
                resolve,
                self.layers,
                self.experts,
                self.rec,
                batches=4,
                seed=seed,
                drop=lambda: self.bs.drop_cache(self.path),
            )
        finally:
            st.eng.close()
        st = self.make("off", max(16, 2 * self.top_k))
        st.eng.enable_trace(1 << 14)

        def hint(layer, ids):
            ids = (np.asarray(ids) + layer * self.experts).astype(np.uint32)
            mx.eval(st.eng.prefetch(st.table, mx.array(ids), priority=1, layer=layer))

        try:
            self.bs.drop_cache(self.path)  # the runs read a cold store
            out["hints"] = K.hint_probe(
                hint, lambda: st.eng.trace_events(clear=True)[0], self.layers, self.experts, self.top_k, 4, seed
            )
        finally:
            st.eng.close()
        return out


def machine_from_probe(probe: dict, layer_s: float, pre_router: float, threads: int, source: str) -> S.Machine:
    return S.Machine(
        name="this machine (measured)",
        ssd_gbps={int(q): float(v) for q, v in probe["gbps_by_qd"].items()},
        layer_s=layer_s,
        pre_router=pre_router,
        threads=threads,
        verify_gbps=None,
        check="off",
        read_cpu_us=float(probe.get("cpu_us_per_record", 0.0)),
        assumptions=[
            f"reads: {source}",
            "compute: the stack with every record cached, same rounds",
            "no record checks on this stack (its table has no digests)",
        ],
    )


def _hot_rows(rows: int, token_records: int, top_k: int, prefetch: str) -> int:
    """Arena rows for an all-cached run: at least `rows` and enough that a token's records fit
    beside the loader's staging rows for `prefetch` (min(top_k * depth, rows // 4)). A predictor's
    hinted sets are other records than the token's (the previous token's routes, or an ahead
    router's guesses), so they need rows of their own too (at 50 rows router-reuse:1's timed pass
    read 12-22 records again, +25% "compute"; previous read 5)."""
    kind, depth = S.prefetch_kind(prefetch)
    need = token_records * (1 if kind == "off" else 2)
    n = max(rows, need)
    while kind != "off" and n - min(top_k * max(depth, 1), n // 4) < need:
        n += 1
    return n


def validate_decode(args) -> dict:
    from . import calibrate as K

    load0, clock0 = K.load_average(), K.cpu_clock()
    from . import synthetic_stack as bs

    rows_list = [int(x) for x in args.rows.split(",")]
    modes = [m.strip() for m in args.prefetch_modes.split(",") if m.strip()]
    for m in modes:
        if m == "hyper-reuse":
            raise UsageError("--prefetch-modes", "the decode stack has no hyper-connections (hyper-reuse: --model)")
        S.prefetch_kind(m)
    # 512 experts top-10 is the real geometry; a test may shrink the store (experts, top_k).
    L, E, k = args.layers, getattr(args, "experts", 512), getattr(args, "top_k", 10)
    if min(rows_list) < k or max(rows_list) > L * E:
        raise UsageError("--rows", f"arena rows must be in [{k}, {L * E}] for --stack decode")
    stack = Stack(bs, args.store, L, E, k, args.gen_tokens, 8)
    # Routes and hinted sets, recorded once (they do not depend on the arena).
    routes, _ = stack.record("off")
    preds: dict[str, np.ndarray] = {}
    for m in modes:
        if S.prefetch_kind(m)[0] == "ahead":
            r, preds[m] = stack.record(m)
            if not np.array_equal(r, routes):
                raise UsageError("--stack", f"routes differ between prefetch off and {m}")
    # Each run starts cold: the replay warms on token 0 and counts tokens 1.. (as the timing).
    warm, topk = routes[:1], routes[1:]
    configs = [(r, m) for r in rows_list for m in modes]
    geom = S.ModelGeometry("bench_stream --decode", L, E, k, stack.rec)
    # A round: the reads probed through the engine, then per arena size its compute runs (every
    # record cached, same rows, per predictor) next to its streamed runs; sizes and runs in
    # reverse order every other round (A B B A).
    # A hot token needs its L x k records resident. With a predictor the loader keeps staging rows
    # for predictions (exact records hold at most rows - staging), so the all-cached run needs that
    # many more rows, or its timed pass reads records again and is no compute run.
    hot_rows = {(r, m): _hot_rows(r, L * k, k, m) for r in rows_list for m in modes}
    rounds = []
    for rnd in range(args.repeats):
        got = {"pre": stack.pre_router(max(rows_list[0], L * k)), "probe": stack.probe(rnd)}
        order = [(r, m) for r in rows_list for m in [f"hot:{x}" for x in modes] + modes]
        for r, m in order if rnd % 2 == 0 else order[::-1]:
            if m.startswith("hot:"):
                got[r, m] = stack.hot(hot_rows[r, m[4:]], prefetch=m[4:])
            else:
                times, rts, c = stack.run(m, r)
                if not np.array_equal(rts, routes):
                    raise UsageError("--stack", "a streamed run's routes differ from the recorded ones")
                got[r, m] = (statistics.mean(times[1:]), c)
            if not args.quiet:
                print(f"  round {rnd + 1}/{args.repeats}: rows {r} {m} done", file=sys.stderr, flush=True)
        rounds.append(got)
    out = []
    T = len(topk)
    source = rounds[0]["probe"]["source"] + " (probed in each round; the median shown)"
    # The replay needs no timing but how a hint batch lands (probed in each round, not taken from
    # the runs): a hint that landed before the batch's next one is evictable by it.
    batch_landed = statistics.median(g["probe"].get("hints", {}).get("batch_landed", 0.0) for g in rounds)
    for r, m in configs:
        rep = S.replay(topk, E, r, "clock", m, warm, predicted=preds.get(m), batch_landed=batch_landed)
        ratios, pred_s, meas_s = [], [], []
        for got in rounds:
            hot, pre = got[r, f"hot:{m}"], got["pre"]
            mach = machine_from_probe(got["probe"], hot / L, pre, 8, source)
            p = S.project(mach, geom, rep, cache_gb=r * stack.rec / S.GIB, capacity=r, policy="clock", prefetch=m)
            t, _ = got[r, m]
            pred_s.append(p.tok_s)
            meas_s.append(1.0 / t)
            ratios.append(p.tok_s * t)
        cs = [g[r, m][1] for g in rounds]
        cnt = {
            x: statistics.median(c[x] for c in cs) / T
            for x in ("exact_misses", "predicted_reads", "predicted_hits", "predicted_joins", "exposed_wait_ns")
        }
        lookups = [c["hits"] + c["joins"] + c["misses"] for c in cs]
        hit = (
            statistics.median((c["hits"] + c["joins"]) / n for c, n in zip(cs, lookups) if n) if any(lookups) else None
        )
        mb = statistics.median((c["exact_bytes"] + c["predicted_bytes"]) for c in cs) / T / 1e6
        spread = (max(meas_s) - min(meas_s)) / 2 / statistics.median(meas_s) if len(meas_s) > 1 else 0.0
        comp = statistics.median(g[r, f"hot:{m}"] for g in rounds)
        # The counters' side (exposed wait, recall) from the median inputs, not the last round's.
        med = dict(rounds[0]["probe"])
        med["gbps_by_qd"] = {
            q: statistics.median(g["probe"]["gbps_by_qd"][q] for g in rounds) for q in med["gbps_by_qd"]
        }
        med["cpu_us_per_record"] = statistics.median(g["probe"]["cpu_us_per_record"] for g in rounds)
        pre_med = statistics.median(g["pre"] for g in rounds)
        p = S.project(
            machine_from_probe(med, comp / L, pre_med, 8, source),
            geom,
            rep,
            cache_gb=r * stack.rec / S.GIB,
            capacity=r,
            policy="clock",
            prefetch=m,
        )
        out.append(
            K.validation_row(f"rows={r},prefetch={m}", r, pred_s, meas_s, ratios, rep, p, spread, cnt, m, comp, hit, mb)
        )
    hot = statistics.median(g[rows_list[0], f"hot:{modes[0]}"] for g in rounds)
    pre = statistics.median(g["pre"] for g in rounds)
    probe = dict(rounds[0]["probe"])
    probe["gbps_by_qd"] = {
        q: statistics.median(g["probe"]["gbps_by_qd"][q] for g in rounds) for q in probe["gbps_by_qd"]
    }
    probe["cpu_us_per_record"] = statistics.median(g["probe"]["cpu_us_per_record"] for g in rounds)
    probe["batch_landed"] = batch_landed
    machine = machine_from_probe(probe, hot / L, pre, 8, source)
    load1 = K.load_average()
    return {
        "machine": machine.to_dict(),
        "probe": probe,
        "probe_source": source,
        "compute_ms_per_token": hot * 1e3,
        "runs": out,
        "worst": max(abs(x["ratio"] - 1) for x in out),
        "repeats": args.repeats,
        "token_records": L * k,
        "stack": f"bench_stream --decode: {L} layers x {E} experts top-{k}, {stack.rec:,} B records, "
        f"{args.gen_tokens} tokens per cold run, store {stack.path}",
        "load_average": [load0, load1],
        "own_load": K.own_load(clock0),
        "command": K.command_line(args),
        "timing": "tok/s = 1 / the mean time of tokens 1.. of each cold run (token 0 fills the empty arena)",
    }
