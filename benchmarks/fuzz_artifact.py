"""Fuzz every file of a converted tiny artifact with >= 10,000 random byte
flips and truncations. Each case must end in a typed ArtifactError or in
byte-identical data; anything else aborts the run.

    python benchmarks/fuzz_artifact.py [--cases 10000] [--seed 0]
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from support.artifact_fixture import fuzz, tiny_artifact  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        _, art = tiny_artifact(root, dtype=a.dtype)
        t0 = time.perf_counter()
        counts = fuzz(art, a.cases, seed=a.seed)
        dt = time.perf_counter() - t0
    typed = sum(n for (_, o), n in counts.items() if o == "typed")
    same = sum(n for (_, o), n in counts.items() if o == "identical")
    print(f"{'file':<24}{'typed':>8}{'identical':>11}")
    for name in sorted({f for f, _ in counts}):
        print(f"{name:<24}{counts.get((name, 'typed'), 0):>8}{counts.get((name, 'identical'), 0):>11}")
    print(
        f"cases {a.cases}: typed error {typed}, byte-identical {same}, silent corruption 0, crashes 0 "
        f"({dt:.1f} s, {1e3 * dt / a.cases:.2f} ms/case)"
    )


if __name__ == "__main__":
    main()
