"""Expert-cache policy in the engine vs the trace simulator's bound (issue 13).

Demo model, greedy decode of a fixed prompt: the resident run records the native routes (Capture);
the trace simulator (hebrus_mlx.traces.cachesim) replays them under LRU / CLOCK / LFU / Belady at
each cache size; then the streamed model decodes the same tokens through the engine once per
engine policy (lru, clock, score) with read-ahead off (demand paging, as the simulator), order
reversed every round. Prints exact hit rate (1 - exact misses / exact lookups) and ms/token per
policy and size; exits 1 if any streamed run's tokens differ from the resident run's.

    python benchmarks/bench_cache_policy.py [--percents 5,10,20,50] [--tokens 64] [--rounds 2]
"""

import argparse
import functools
import math
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from hebrus_mlx.admission import admit
from hebrus_mlx.artifact import expert_major as em
from hebrus_mlx.loader import DEMO_DIR, load_model
from hebrus_mlx.loading import build_model as artifact_loading
from hebrus_mlx.loading import plan
from hebrus_mlx.models.qwen4exp import Capture
from hebrus_mlx.stream.engine import StreamEngine
from hebrus_mlx.traces import cachesim

ENGINE_POLICIES = ("lru", "clock", "score")


def _engine(policy, *a, **k):
    return StreamEngine(*a, **{**k, "policy": policy})


def decode(model, prompt, tokens, routes=None):
    """Greedy tokens and per-token seconds; the engine's counters restart after the prefill
    (count decode only, as the simulator does)."""
    cache = model.make_cache()
    for i in range(0, len(prompt), 4):  # chunks that fit a 5% arena, the same for every run
        out = model(mx.array([prompt[i : i + 4]]), cache)
        mx.eval(out)
    if model.streaming is not None:
        model.streaming.engine.reset_counters()
    toks, times = [], []
    for _ in range(tokens):
        t = int(np.array(out[0, -1]).argmax())
        toks.append(t)
        cap = Capture(hidden=False) if routes is not None else None
        t0 = time.perf_counter()
        out = model(mx.array([[t]]), cache, capture=cap) if cap else model(mx.array([[t]]), cache)
        mx.eval(out)
        times.append(time.perf_counter() - t0)
        if cap:
            routes.append([np.array(cap.routes[layer]).reshape(-1) for layer in sorted(cap.routes)])
    return toks, times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--percents", default="5,10,20,50")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    m = admit(str(DEMO_DIR))
    fam = m.family
    L, E, K = fam.num_hidden_layers, fam.num_experts, fam.num_experts_per_tok
    record = sum(2 * n if d == "uint16" else n for _, _, d, _, _, n in em.record_layout(fam, m.experts.codec))
    prompt = np.random.default_rng(11).integers(2, 4000, args.prompt_tokens).tolist()
    routes = []
    want, _ = decode(load_model(DEMO_DIR), prompt, args.tokens, routes)
    stream = cachesim.access_stream(np.array(routes), E)
    real = artifact_loading.StreamEngine
    ok = True
    print(
        f"demo model: {args.tokens} greedy decode tokens after a {args.prompt_tokens}-token prompt (the prompt's "
        f"prefill is not counted), {L} layers x {E} experts top-{K}; engine read-ahead off; {args.rounds} rounds"
    )
    for pct in [float(x) for x in args.percents.split(",")]:
        rows = max(math.ceil(pct / 100 * L * E), K)
        sim = {pol: cachesim.simulate(pol, stream, rows).hit_rate for pol in cachesim.POLICIES}
        gb = (rows * record + record // 2) / plan.GIB
        res = {pol: [] for pol in ENGINE_POLICIES}
        for r in range(args.rounds):
            for pol in ENGINE_POLICIES if r % 2 == 0 else ENGINE_POLICIES[::-1]:
                # The loader names its default policy; this run's replaces it.
                artifact_loading.StreamEngine = functools.partial(_engine, pol)
                try:
                    model = load_model(DEMO_DIR, expert_cache_gb=gb, prefetch="off")
                finally:
                    artifact_loading.StreamEngine = real
                toks, times = decode(model, prompt, args.tokens)
                c = model.streaming.engine.counters()
                model.streaming.engine.close()
                ok &= toks == want
                lookups = c["hits"] + c["joins"] + c["misses"]
                res[pol].append((1 - c["exact_misses"] / lookups, statistics.median(times)))
        print(f"  {pct:g}% ({rows} records): simulator " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in sim.items()))
        print(
            "    engine "
            + ", ".join(
                f"{pol} {100 * statistics.median(h for h, _ in res[pol]):.1f}% "
                f"({statistics.median(t for _, t in res[pol]) * 1e3:.2f} ms/token)"
                for pol in ENGINE_POLICIES
            )
        )
    print("tokens identical to resident" if ok else "TOKENS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
