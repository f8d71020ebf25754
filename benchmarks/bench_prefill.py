"""Prefill sweep benchmark (issue 13): prefill tok/s with and without `--prefill-sweep`.

(1) Crossover, ``--crossover``: I/O only, cold store (posix_fadvise DONTNEED before every run).
    For a unique-expert fraction f of one layer, the slot path resolves f*E random records of the
    layer into the arena (the engine's per-record reads, SHA-256 verified, --threads readers) and
    the sweep reads the whole extent (stream.sweep ring, verified). Interleaved A/B/B/A, medians;
    prints the fraction where the sweep starts to win (``stream.sweep.CROSSOVER`` is set from it).

(2) Real-geometry stack (default): --layers decoder layers with the real dimensions (bench_stream's
    --decode stack: a Gated DeltaNet 2560 wide before the router, 512 experts top-10, 2560x640
    affine4-g64 routed experts, shared expert), prompts of --lengths tokens prefilled in chunks of
    --chunk through the production StreamedSwitchGLU / Streaming / PrefillSweep code over a store
    with valid scales and per-record SHA-256 digests, cold store per run; sweep off vs on,
    interleaved A/B/B/A, medians. The final hidden states of both modes must be bit-identical.

(3) ``--demo``: the shipped demo artifact streamed at --fraction of its records (generate's chunk
    cap), prefill tok/s off vs on (A/B/B/A, medians), last logits bit-identical.

(4) ``--demo --max-positions 16384``: the demo stops at 4,096 positions, so a random-weight model of
    its geometry with a longer context is written by transformers (save_pretrained) and converted
    by hebrus-mlx's converter (once, under --build-dir); off vs auto at 512/2K/8K, A/B/B/A, medians,
    each mode's last logits bit-identical to the resident model's at that mode's chunking.

    python benchmarks/bench_prefill.py --crossover
    python benchmarks/bench_prefill.py [--layers 3] [--lengths 512,2048,8192] [--rounds 2]
    python benchmarks/bench_prefill.py --demo [--lengths 512,2048,4096]
    python benchmarks/bench_prefill.py --demo --max-positions 16384 [--lengths 512,2048,8192]
"""

import argparse
import hashlib
import os
import statistics
import time

import numpy as np

from hebrus_mlx.simulate import synthetic_stack as B  # (store builder, stack pieces, cold-cache helper)


def digests(path, n, rec):
    """Per-record SHA-256 of the store, cached next to it (hashing GBs takes a while)."""
    side = path + ".sha256"
    if os.path.exists(side) and os.path.getsize(side) == 32 * n and os.path.getmtime(side) >= os.path.getmtime(path):
        with open(side, "rb") as f:
            data = f.read()
        return [data[32 * i : 32 * i + 32] for i in range(n)]
    out = []
    with open(path, "rb") as f:
        for _ in range(n):
            out.append(hashlib.sha256(f.read(rec)).digest())
    with open(side + ".tmp", "wb") as f:
        f.write(b"".join(out))
    os.replace(side + ".tmp", side)
    return out


def store_of(args):
    """(record bytes, path, digests) of the synthetic store: --store-layers layers (default --layers)
    of which the bench uses the first --layers (so one 4-layer store serves 1-4 layer runs)."""
    rec = B.record_bytes()
    held = max(args.store_layers or args.layers, args.layers)
    n = held * args.experts
    path = args.store + f"_{held}x{args.experts}.bin"
    B.build_decode_store(path, n, rec)
    return rec, path, digests(path, n, rec)


class SyntheticExperts:
    """What StreamedSwitchGLU / Streaming / PrefillSweep use of stream.experts.StreamedExperts, over
    the synthetic store: same arena (bf16 scales/biases widened to fp32 as the loader does), same
    verified record table."""

    def __init__(self, eng, path, layers, experts, top_k, rows, rec, dig):
        import mlx.core as mx

        from hebrus_mlx.stream.engine import P1

        self.engine, self.num_experts, self.num_layers, self.top_k, self.rows = eng, experts, layers, top_k, rows
        self.prefetch_previous, self.bits, self.group_size = False, B.BITS, B.GROUP
        self.store_path, self.part_bytes = path, B.part_bytes()
        self.expand = [False, True, True] * 3
        shapes = [(B.INTER, B.HIDDEN), (B.INTER, B.HIDDEN), (B.HIDDEN, B.INTER)]
        self.layout = []
        for comp, (o, i) in zip(("gate", "up", "down"), shapes):
            self.layout += [
                (comp, "weight", "uint32", (o, i * B.BITS // 32)),
                (comp, "scales", "uint16", (o, i // B.GROUP)),
                (comp, "biases", "uint16", (o, i // B.GROUP)),
            ]
        self.arena, parts = eng.create_arena(self.part_bytes, rows, self.expand)
        store = eng.add_store(path)
        n = layers * experts
        self.table = eng.register_table(store, [i * rec for i in range(n)], [rec] * n, dig[:n], arena=self.arena)
        self.weights = {}
        for buf, wide, (comp, part, _stored, shape) in zip(parts, self.expand, self.layout):
            dt = mx.float32 if wide else mx.uint32
            self.weights.setdefault(comp, {})[part] = buf.view(dt).reshape(rows, *shape)
        self._p1 = P1

    @property
    def max_chunk_tokens(self):
        return max(1, self.rows // self.top_k)

    def resolve(self, layer, indices, owner=0, generation=0):
        import mlx.core as mx

        rec = indices.astype(mx.uint32) + layer * self.num_experts
        return self.engine.resolve(self.table, rec, owner, generation, layer)

    def prefetch(self, layer, indices, priority=None, confidence=1.0):
        raise AssertionError("no prefetch in the prefill bench")


class PrefillStack:
    """bench_stream's decode stack, prefill-shaped: per layer GDN -> router -> top-k ->
    StreamedSwitchGLU (slot path or sweep, as Streaming decides) + shared expert -> residual."""

    def __init__(self, experts, mixers, layers, mode):
        import mlx.core as mx

        from hebrus_mlx.models.cache import LinearCache
        from hebrus_mlx.stream.streaming import Streaming
        from hebrus_mlx.stream.switch import StreamedSwitchGLU

        self.switches = [StreamedSwitchGLU(experts, l) for l in range(layers)]
        self.streaming = Streaming(experts.engine, experts, self.switches, prefetch="off")
        self.streaming.set_prefill_sweep(mode)
        self.mixers, self.layers, self.experts = mixers, layers, experts
        self.caches = [LinearCache() for _ in range(layers)]
        key = mx.random.key(3)
        self.routers = [
            mx.random.normal((B.HIDDEN, experts.num_experts), key=mx.random.split(key, layers)[l]) / B.HIDDEN**0.5
            for l in range(layers)
        ]
        mx.eval(self.routers)

    def chunk(self, x):
        import mlx.core as mx

        k = self.experts.top_k
        for l in range(self.layers):
            x = self.streaming.layer_start(l, x)
            gdn, shared = self.mixers[l]
            x = x + gdn(B.rms(x), self.caches[l])
            h = B.rms(x)
            logits = h @ self.routers[l]
            idx = mx.argpartition(-logits, k - 1, axis=-1)[..., :k].astype(mx.uint32)
            y = self.switches[l](h, idx)  # [1, T, k, hidden]
            x = x + shared(h) + y.mean(axis=-2)
        mx.eval(x, *[a for c in self.caches for a in c.arrays])
        return x

    def close(self):
        if self.streaming.sweep is not None:
            self.streaming.sweep.close()
        self.experts.engine.close()


def prompt_inputs(n, rho=0.9, seed=5):
    """[1, n, hidden] AR(1) hidden states: neighbouring positions share routes, as text does."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    h = rng.standard_normal(B.HIDDEN)
    out = np.empty((n, B.HIDDEN), np.float32)
    for i in range(n):
        h = rho * h + (1 - rho * rho) ** 0.5 * rng.standard_normal(B.HIDDEN)
        out[i] = h
    return mx.array(out)[None]


def run_stack(args):

    from hebrus_mlx.stream import engine as se

    rec, path, dig = store_of(args)
    mixers = B.make_mixers(args.layers)
    cap = args.chunk or args.rows // args.top_k
    modes = args.modes.split(",")

    def chunk_of(mode, length):
        # off: generate caps chunks at the arena; on: the same chunks, swept (bit-identical to off);
        # auto: with a ring generate prefills in --step chunks (past the arena: swept).
        return min(args.step, length) if mode == "auto" else cap

    def one(mode, length):
        chunk = chunk_of(mode, length)
        B.drop_cache(path)
        eng = se.StreamEngine(cache_bytes=rec, threads=args.threads, policy="clock")
        ex = SyntheticExperts(eng, path, args.layers, args.experts, args.top_k, args.rows, rec, dig)
        st = PrefillStack(ex, mixers, args.layers, mode)
        xs = prompt_inputs(length)
        t0 = time.perf_counter()
        outs = [st.chunk(xs[:, i : i + chunk]) for i in range(0, length, chunk)]
        dt = time.perf_counter() - t0
        c = eng.counters()
        sw = st.streaming.sweep.counters() if st.streaming.sweep is not None else None
        last = np.array(outs[-1])
        st.close()
        print(f"    run {mode} {length} tokens: {dt:.1f} s", flush=True)
        return dt, c, sw, last

    print(
        f"(2) real-geometry prefill: {args.layers} layers x {args.experts} experts top-{args.top_k}, "
        f"record {rec / 2**20:.3f} MiB, arena {args.rows} rows (chunk cap {cap} tokens), auto chunks "
        f"{args.step}, {args.threads} engine threads, {args.rounds} rounds A/B/B/A, cold store {path}"
    )
    for length in args.lengths:
        res = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                res[mode].append(one(mode, length))
        t = {m: statistics.median(x[0] for x in v) for m, v in res.items()}
        base = modes[0]
        for m in modes:
            c, sw = res[m][0][1], res[m][0][2]
            lookups = c["hits"] + c["joins"] + c["misses"]
            same = (
                ""
                if m == base or chunk_of(m, length) != chunk_of(base, length)
                else (
                    "; hidden states "
                    + ("identical" if all(np.array_equal(a[3], b[3]) for a in res[base] for b in res[m]) else "DIFFER")
                    + f" to {base}"
                )
            )
            swept = (
                ""
                if sw is None
                else (
                    f", {sw['read_bytes'] / 1e9:.2f} GB swept in {sw['sweeps']} extents "
                    f"(wait {sw['wait_ns'] / 1e9:.2f} s)"
                )
            )
            print(
                f"  {length:5d} tokens {m:4s} (chunk {chunk_of(m, length)}): {length / t[m]:.2f} tok/s (runs "
                f"{' '.join(f'{length / x[0]:.2f}' for x in res[m])}), x{t[base] / t[m]:.2f} vs {base}; slot reads "
                f"{c['exact_bytes'] / 1e9:.2f} GB (hit rate {100 * (c['hits'] + c['joins']) / max(lookups, 1):.0f}%, "
                f"wait {c['exposed_wait_ns'] / 1e9:.2f} s){swept}{same}"
            )


def run_crossover(args):
    """I/O only: slot-path resolve of f*E records of one layer vs the sweep of the whole extent
    (the measuring core is the package's, stream.crossover.measure, which `hebrus-mlx qualify` runs
    on an artifact's store)."""
    from hebrus_mlx.stream import crossover
    from hebrus_mlx.stream import engine as se

    rec, path, dig = store_of(args)
    fractions = [float(f) for f in args.fractions.split(",")]

    def make(rows):
        eng = se.StreamEngine(cache_bytes=rec, threads=args.threads, policy="clock")
        return eng, SyntheticExperts(eng, path, args.layers, args.experts, args.top_k, rows, rec, dig)

    r = crossover.measure(
        make, lambda: B.drop_cache(path), args.layers, fractions, passes=args.rounds, sweep_threads=args.sweep_threads
    )
    t_sweep = r["sweep_ms_median"] / 1e3
    ext = args.experts * rec
    print(
        f"(1) crossover, I/O only, cold: one layer = {args.experts} records x {rec / 2**20:.3f} MiB = "
        f"{ext / 2**30:.2f} GiB; sweep {t_sweep * 1e3:.0f} ms ({ext / 2**30 / t_sweep:.2f} GiB/s, "
        f"{args.sweep_threads} threads, runs {' '.join(f'{x:.0f}' for x in r['sweep_ms'])}); "
        f"slot path {args.threads} engine threads, {args.rounds} passes forward/backward"
    )
    for f, t in zip(r["fractions"], r["slot_ms_median"]):
        t /= 1e3
        k = max(1, round(f * args.experts))
        print(
            f"  f={f:.2f} ({k:3d} records): slot {t * 1e3:7.0f} ms ({k * rec / 2**30 / t:.2f} GiB/s), "
            f"sweep/slot {t_sweep / t:.2f}"
        )
    print(
        f"  crossover unique-expert fraction: {r['crossover']:.2f}"
        + (
            " (from here on the sweep reads the whole extent faster than the slot path reads this fraction)"
            if r["sweep_won"]
            else " (the slot path was faster at every fraction: auto sweeps only chunks the arena cannot take)"
        )
    )


def long_demo(root, max_positions):
    """The demo's geometry with ``max_position_embeddings = max_positions``: a random-weight
    checkpoint written by transformers' ``save_pretrained`` (seed 0, the demo's config.json otherwise
    unchanged, its tokenizer files), converted with the project's converter (affine4-g64 like the
    demo) under a family descriptor registered here. Built once under ``root``; returns the artifact."""
    import dataclasses
    import json
    import shutil

    from hebrus_mlx.artifact import constants as C
    from hebrus_mlx.loader import DEMO_DIR

    C.register_family(
        dataclasses.replace(
            C.QWEN4EXP_DEMO,
            name=f"qwen4exp-demo-{max_positions}",
            family_id=0xDE70 + max_positions // 1024,
            max_position_embeddings=max_positions,
        )
    )
    out = os.path.join(root, f"demo{max_positions}")
    art = os.path.join(out, "artifact")
    if os.path.exists(os.path.join(art, "manifest.json")):
        return art
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    from hebrus_mlx.convert import convert

    with open(os.path.join(DEMO_DIR, "config.json")) as f:
        cfg = json.load(f)
    for k in ("architectures", "transformers_version", "model_type", "dtype"):
        cfg.pop(k, None)
    cfg["max_position_embeddings"] = max_positions
    hf = os.path.join(out, "hf")
    torch.manual_seed(0)
    Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**cfg)).save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(os.path.join(DEMO_DIR, name), os.path.join(hf, name))
    convert(hf, art, q_bits=4, quiet=True, mtp=False)
    return art


def run_demo(args):
    import math

    import mlx.core as mx

    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact import expert_major as em
    from hebrus_mlx.loader import DEMO_DIR, load_model
    from hebrus_mlx.loading import plan

    if args.max_positions:
        return run_demo_long(args, long_demo(args.build_dir, args.max_positions))
    m = admit(str(DEMO_DIR))
    fam = m.family
    record = sum(2 * n if d == "uint16" else n for _, _, d, _, _, n in em.record_layout(fam, m.experts.codec))
    rows = max(math.ceil(args.fraction * fam.num_hidden_layers * fam.num_experts), fam.num_experts_per_tok)
    gb = (rows * record + record // 2) / plan.GIB
    exp = os.path.join(str(DEMO_DIR), "experts.hbem")
    models = {mode: load_model(DEMO_DIR, expert_cache_gb=gb, prefill_sweep=mode) for mode in ("off", "on", "auto")}
    chunk = models["off"].streaming.max_chunk_tokens
    chunks = {"off": chunk, "on": chunk, "auto": args.step}  # auto: generate's chunks with a ring
    print(
        f"(3) demo streamed at {100 * args.fraction:.0f}% ({rows} arena rows), chunk {chunk} tokens "
        f"(generate's cap), {args.rounds} rounds A/B/B/A, cold store per run"
    )
    for length in args.lengths:
        prompt = np.random.default_rng(length).integers(2, fam.vocab_size, length).tolist()
        res = {"off": [], "on": [], "auto": []}
        for r in range(args.rounds):
            for mode in ("off", "on", "auto") if r % 2 == 0 else ("auto", "on", "off"):
                model, c = models[mode], chunks[mode]
                B.drop_cache(exp)
                cache = model.make_cache()
                t0 = time.perf_counter()
                for i in range(0, length, c):
                    out = model(mx.array([prompt[i : i + c]]), cache)
                    mx.eval(out)
                res[mode].append((time.perf_counter() - t0, np.array(out[0, -1])))
        same = all(np.array_equal(a[1], b[1]) for a in res["off"] for b in res["on"])
        t = {k: statistics.median(x[0] for x in v) for k, v in res.items()}
        print(
            f"  {length:5d} tokens: off {length / t['off']:.1f} tok/s, on (same chunks) {length / t['on']:.1f} "
            f"tok/s x{t['off'] / t['on']:.2f}, last logits {'identical' if same else 'DIFFER'}; auto (chunks of "
            f"{min(args.step, length)}) {length / t['auto']:.1f} tok/s x{t['off'] / t['auto']:.2f}"
        )


def run_demo_long(args, art):
    """(4) the demo's geometry past 4,096 positions (``long_demo``), streamed at --fraction: off
    (generate's chunks, capped at the arena) vs auto (--step chunks, swept past the arena), A/B/B/A,
    cold store per run, medians. Exactness: each mode's last logits equal the resident model's at
    that mode's chunking, bit for bit (the resident runs are untimed)."""
    import math

    import mlx.core as mx

    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact import expert_major as em
    from hebrus_mlx.loader import load_model
    from hebrus_mlx.loading import plan

    m = admit(art)
    fam = m.family
    record = sum(2 * n if d == "uint16" else n for _, _, d, _, _, n in em.record_layout(fam, m.experts.codec))
    rows = max(math.ceil(args.fraction * fam.num_hidden_layers * fam.num_experts), fam.num_experts_per_tok)
    gb = (rows * record + record // 2) / plan.GIB
    exp = os.path.join(art, "experts.hbem")
    models = {mode: load_model(art, expert_cache_gb=gb, prefill_sweep=mode) for mode in ("off", "auto")}
    cap = models["off"].streaming.max_chunk_tokens
    assert models["auto"].streaming.sweep is not None, models["auto"].streaming.sweep_note
    resident = load_model(art)

    def prefill(model, prompt, chunk):
        cache = model.make_cache()
        t0 = time.perf_counter()
        for i in range(0, len(prompt), chunk):
            out = model(mx.array([prompt[i : i + chunk]]), cache)
            mx.eval(out)
        return time.perf_counter() - t0, np.array(out[0, -1])

    print(
        f"(4) demo geometry, random weights (transformers save_pretrained, converted affine4-g64), "
        f"max_position_embeddings {fam.max_position_embeddings}, streamed at {100 * args.fraction:.0f}% "
        f"({rows} arena rows): off in chunks of {cap} (generate's cap) vs auto in chunks of {args.step} "
        f"(crossover {models['auto'].streaming.crossover_source}), {args.rounds} rounds A/B/B/A, cold store per run"
    )
    for length in args.lengths:
        prompt = np.random.default_rng(length).integers(2, fam.vocab_size, length).tolist()
        chunks = {"off": cap, "auto": min(args.step, length)}
        res = {"off": [], "auto": []}
        for r in range(args.rounds):
            for mode in ("off", "auto") if r % 2 == 0 else ("auto", "off"):
                B.drop_cache(exp)
                sw = models[mode].streaming.sweep
                before = sw.counters()["sweeps"] if sw is not None else 0
                dt, last = prefill(models[mode], prompt, chunks[mode])
                swept = (sw.counters()["sweeps"] - before) if sw is not None else 0
                res[mode].append((dt, last, swept))
                print(f"    run {mode} {length}: {length / dt:.1f} tok/s, {swept} layer extents swept", flush=True)
        same = {}
        for mode in ("off", "auto"):
            ref = prefill(resident, prompt, chunks[mode])[1]
            same[mode] = all(np.array_equal(x[1], ref) for x in res[mode])
        t = {k: statistics.median(x[0] for x in v) for k, v in res.items()}
        print(
            f"  {length:5d} tokens: off {length / t['off']:.1f} tok/s (runs "
            f"{' '.join(f'{length / x[0]:.1f}' for x in res['off'])}), auto {length / t['auto']:.1f} tok/s (runs "
            f"{' '.join(f'{length / x[0]:.1f}' for x in res['auto'])}) x{t['off'] / t['auto']:.2f}; last logits vs "
            f"resident at the same chunks: off {'identical' if same['off'] else 'DIFFER'}, auto "
            f"{'identical' if same['auto'] else 'DIFFER'}; auto swept {res['auto'][0][2]} layer extents"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", default="/tmp/hebrus_bench_prefill", help="store path stem")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--experts", type=int, default=512)
    p.add_argument(
        "--store-layers",
        type=int,
        default=None,
        help="layers the store holds (default --layers; the bench uses the first --layers)",
    )
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--rows", type=int, default=512, help="slot arena rows (default: one layer's experts)")
    p.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="prefill chunk tokens (default rows // top-k, generate's cap for the slot path)",
    )
    p.add_argument("--lengths", default=None, help="prompt lengths (default 512,2048,8192; demo 512,2048,4096)")
    p.add_argument("--threads", type=int, default=8, help="engine reader threads")
    p.add_argument("--sweep-threads", type=int, default=4)
    p.add_argument(
        "--rounds", type=int, default=2, help="2 = A/B then B/A (--crossover: passes, forward then backward)"
    )
    p.add_argument("--modes", default="off,on,auto", help="(2) --prefill-sweep modes timed A/B/B/A, first = control")
    p.add_argument("--step", type=int, default=2048, help="(2) prefill_step_size of the auto runs (generate's default)")
    p.add_argument("--crossover", action="store_true", help="run (1) only")
    p.add_argument("--fractions", default="0.05,0.1,0.2,0.3,0.4,0.5,0.7,1.0", help="(1) unique-expert fractions")
    p.add_argument("--demo", action="store_true", help="run (3) only")
    p.add_argument("--fraction", type=float, default=0.05, help="(3) cache fraction of the demo's records")
    p.add_argument(
        "--max-positions",
        type=int,
        default=None,
        help="(4) with --demo: a random-weight model of "
        "the demo's geometry with this max_position_embeddings (e.g. 16384, for 8K prompts), off vs auto",
    )
    p.add_argument("--build-dir", default="/tmp/hebrus_bench_prefill_demo", help="(4) where that model is built once")
    args = p.parse_args()
    default = "512,2048,4096" if args.demo and not args.max_positions else "512,2048,8192"
    args.lengths = [int(x) for x in (args.lengths or default).split(",")]
    if args.crossover:
        return run_crossover(args)
    if args.demo:
        return run_demo(args)
    return run_stack(args)


if __name__ == "__main__":
    main()
