"""Read-ahead predictors on the demo model streamed through a small expert cache (issue 13).

Each round decodes the same greedy sequence once per predictor, order reversed every round
(A/B/B/A against the first mode, the control), on a fresh load (cold cache; the engine reads with
O_DIRECT, and the store's page cache is dropped before each run). Prints per predictor: median
ms/token, exposed wait, timely recall, precision, wasted bytes, p99 issue->ready, and the ratio
to the control; exits 1 if any predictor's tokens differ from the control's.

    python benchmarks/bench_prefetch.py [--fraction 0.05] [--tokens 48] [--rounds 4]
        [--modes previous,off,router-reuse:1,router-reuse:2,hyper-reuse] [--mirror DIR]

--mirror DIR (a copy of the demo's experts.hbem in DIR) adds each mode again reading through
`--expert-mirror DIR` (labelled MODE+mirror) and prints how the reads split between the files.
On one disk no gain is expected; two disks are not verified here.
"""

import argparse
import math
import os
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from hebrus_mlx.admission import admit
from hebrus_mlx.artifact import expert_major as em
from hebrus_mlx.loader import DEMO_DIR, load_model
from hebrus_mlx.loading import plan
from hebrus_mlx.stream.engine import prediction_stats


def cache_gb(fraction):
    m = admit(str(DEMO_DIR))
    fam = m.family
    record = sum(2 * n if d == "uint16" else n for _, _, d, _, _, n in em.record_layout(fam, m.experts.codec))
    rows = max(math.ceil(fraction * fam.num_hidden_layers * fam.num_experts), fam.num_experts_per_tok)
    return (rows * record + record // 2) / plan.GIB, rows, m.file(m.experts)


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(config, gb, store, prompt, tokens, chunk):
    mode, _, mirror = config.partition("+")
    mirror = mirror or None
    drop_cache(store)
    if mirror is not None:
        drop_cache(os.path.join(mirror, os.path.basename(store)))
    model = load_model(DEMO_DIR, expert_cache_gb=gb, prefetch=mode, expert_mirror=mirror)
    st = model.streaming
    cache, out = model.make_cache(), None
    for i in range(0, len(prompt), chunk):
        out = model(mx.array([prompt[i : i + chunk]]), cache)
        mx.eval(out)
    st.engine.reset_counters()
    toks, times = [], []
    for _ in range(tokens):
        t = int(np.array(out[0, -1]).argmax())
        toks.append(t)
        t0 = time.perf_counter()
        out = model(mx.array([[t]]), cache)
        mx.eval(out)
        times.append(time.perf_counter() - t0)
    c = st.engine.counters()
    c["file_reads"] = st.engine.file_reads(st.experts.store)["reads"]
    st.engine.close()
    return statistics.median(times), toks, c


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fraction", type=float, default=0.05, help="expert cache as a fraction of the records")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--modes",
        default="previous,off,router-reuse:1,router-reuse:2,hyper-reuse",
        help="comma-separated --prefetch values; the first is the control",
    )
    p.add_argument("--mirror", default=None, metavar="DIR", help="also run every mode with --expert-mirror DIR")
    args = p.parse_args()
    modes = args.modes.split(",")
    if args.mirror:
        modes += [f"{m}+{args.mirror}" for m in modes]
    gb, rows, store = cache_gb(args.fraction)
    prompt = np.random.default_rng(7).integers(2, 4000, args.prompt_tokens).tolist()
    chunk = 4
    res = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            res[m].append(run(m, gb, store, prompt, args.tokens, chunk))
    ctrl = modes[0]
    want = res[ctrl][0][1]
    print(
        f"demo model streamed at {args.fraction:.0%} ({rows} of 512 records), {args.tokens} decode tokens after "
        f"a {args.prompt_tokens}-token prompt, {args.rounds} rounds (order reversed every round), control {ctrl}"
    )
    ok = True
    for m in modes:
        ts = [t for t, _, _ in res[m]]
        same = all(toks == want for _, toks, _ in res[m])
        ok &= same
        cs = [c for _, _, c in res[m]]
        med = lambda f: statistics.median(f(c) for c in cs)  # noqa: E731
        st = [prediction_stats(c) for c in cs]
        rec = [s["timely_recall"] for s in st if s["timely_recall"] is not None]
        pre = [s["precision"] for s in st if s["precision"] is not None]
        # Paired per round (the modes of a round ran back to back): robust to the machine's phases.
        paired = statistics.median(c[0] / t for c, t in zip(res[ctrl], ts))
        name = m if "+" not in m else m.split("+")[0] + "+mirror"
        split = "/".join(str(n) for n in cs[0]["file_reads"])
        print(
            f"  {name:15s} {statistics.median(ts) * 1e3:7.2f} ms/token (paired x{paired:.3f} vs "
            f"{ctrl}; runs {' '.join(f'{t * 1e3:.1f}' for t in ts)}), exposed wait "
            f"{med(lambda c: c['exposed_wait_ns']) / 1e6 / args.tokens:.3f} ms/token, "
            f"exact misses {med(lambda c: c['exact_misses']) / args.tokens:.1f}/token, "
            f"timely recall {100 * statistics.median(rec) if rec else float('nan'):.1f}%, "
            f"precision {100 * statistics.median(pre) if pre else float('nan'):.1f}%, "
            f"wasted {med(lambda c: c['wasted_bytes']) / 1e6:.2f} MB, "
            f"p99 {med(lambda c: c['latency_p99_ns']) / 1e6:.2f} ms, reads per file {split}, "
            f"tokens {'identical' if same else 'DIFFER'}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
