"""Cost of route capture on the demo model: decode and prefill with and without --trace-out,
interleaved A/B/B/A, ratio = median over rounds of (traced time / plain time) per pair.

    python benchmarks/bench_traces.py [--rounds 4] [--tokens 64] [--prompt 512] [--features 0]
"""

import argparse
import statistics
import tempfile
import time

import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--features", type=int, default=0)
    args = p.parse_args()
    from hebrus_mlx import load
    from hebrus_mlx.generate import stream_generate

    model, tok = load("demo")
    prompt = np.random.default_rng(0).integers(10, 4000, args.prompt).tolist()

    def once(traced):
        kw = {}
        tmp = tempfile.TemporaryDirectory(prefix="bench-traces-")
        if traced:
            kw = {"trace_out": tmp.name, "trace_features": args.features}
        t0 = time.perf_counter()
        first = None
        toks = []
        for r in stream_generate(model, tok, prompt, max_tokens=args.tokens, prefill_step_size=256, **kw):
            if first is None:
                first = time.perf_counter()
            toks.append(r.token)
        end = time.perf_counter()
        tmp.cleanup()
        return first - t0, end - first, toks

    once(False)
    prefill, decode = [], []
    for _ in range(args.rounds):
        a1, b1, b2, a2 = once(False), once(True), once(True), once(False)
        assert a1[2] == b1[2] == b2[2] == a2[2], "capture changed the tokens"
        for a, b in ((a1, b1), (a2, b2)):
            prefill.append(b[0] / a[0])
            decode.append(b[1] / a[1])
    print(
        f"demo, prompt {args.prompt} (prefill step 256), {args.tokens} decoded tokens, features every "
        f"{args.features or 'off'}, {args.rounds} A/B/B/A rounds"
    )
    print(
        f"traced / plain time: prefill {statistics.median(prefill):.3f}x, decode {statistics.median(decode):.3f}x "
        f"(medians of {len(decode)} pairs; tokens identical)"
    )


if __name__ == "__main__":
    main()
