"""Cost of the per-step checks of docs/RELIABILITY.md §5, measured side by side in one run:

- the non-finite check (AFN-010): one 248,320-wide row's vocabulary mask + log-softmax, with the
  `isfinite` of its log-normaliser evaluated and read, vs without;
- the router's frozen tie order (AFN-001): `ranked_experts` vs argpartition + argsort of the
  top 10 of 512 experts, for one token and for a 2,048-token chunk.

Interleaved A/B/B/A; each ratio is the median over rounds of (checked / plain).

    python benchmarks/bench_step_checks.py [--rounds 6] [--reps 50]
"""

import argparse
import statistics
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    import mlx.core as mx

    from hebrus_mlx.models.qwen4exp import ranked_experts
    from hebrus_mlx.sample_utils import apply_vocab_mask, checked_logprobs

    def timed(fn):
        fn()
        tic = time.perf_counter()
        for _ in range(args.reps):
            fn()
        return (time.perf_counter() - tic) / args.reps

    def ratio(plain, checked):
        ratios = []
        for r in range(args.rounds):
            pair = (plain, checked) if r % 2 == 0 else (checked, plain)
            t = {f: timed(f) for f in pair}
            ratios.append(t[checked] / t[plain])
        return statistics.median(ratios)

    row = mx.random.normal((1, 248_320))
    mx.eval(row)

    def logprobs_plain():
        x = apply_vocab_mask(row, 248_077)
        mx.eval(x - mx.logsumexp(x, axis=-1, keepdims=True))

    def logprobs_checked():
        lp, ok = checked_logprobs(row, 248_077)
        mx.eval(lp, ok)
        ok.item()

    print(f"non-finite check, one 248,320-wide row: x{ratio(logprobs_plain, logprobs_checked):.3f}")

    for tokens in (1, 2048):
        probs = mx.softmax(mx.random.normal((tokens, 512)), axis=-1)
        mx.eval(probs)

        def argpartition_order(probs=probs):
            inds = mx.argpartition(-probs, kth=9, axis=-1)[..., :10]
            scores = mx.take_along_axis(probs, inds, axis=-1)
            mx.eval(mx.take_along_axis(inds, mx.argsort(-scores, axis=-1), axis=-1))

        def ranked(probs=probs):
            mx.eval(ranked_experts(probs, 10))

        print(f"router top-10 of 512, {tokens} token(s): x{ratio(argpartition_order, ranked):.3f}")


if __name__ == "__main__":
    main()
