"""kill -9 a conversion N times at random points, then convert once more (issue 22 §1).

Converts the tiny_a reference checkpoint (tests/support/fixtures/parity) into an artifact, then starts
`hebrus-mlx convert --overwrite` N times and SIGKILLs each one at a random moment after its temp
directory appears. Prints: how many kills landed mid-write, the stale temporaries they left (and
their bytes), whether the earlier artifact stayed byte-identical after every kill, and what the
next conversion removed.

    python benchmarks/fuzz_convert_kill.py [--kills 25] [--seed 0]
"""

import argparse
import os
import random
import signal
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from support.convert_fixture import parity_source  # noqa: E402
from test_convert_out import _convert, _snapshot, _start_and_wait_for_temp, _temps  # noqa: E402


def _size(path):
    p = Path(path)
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = parity_source("tiny_a", os.path.join(tmp, "hf"))
        out = os.path.join(tmp, "art")
        assert _convert(["--hf-path", src, "--out", out]).returncode == 0
        first = _snapshot(out)
        rng = random.Random(a.seed)
        killed = intact = 0
        after = []  # temporaries present after each kill (each run removes its predecessors' first)
        for _ in range(a.kills):
            proc = _start_and_wait_for_temp(src, out, rng)
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            proc.stderr.close()
            killed += proc.returncode == -signal.SIGKILL
            intact += _snapshot(out) == first
            after.append(len(_temps(out)))
        stale = _temps(out)
        stale_bytes = sum(_size(os.path.join(tmp, t)) for t in stale)
        r = _convert(["--hf-path", src, "--out", out, "--overwrite"])
        removed = r.stderr.count("removed ")
        print(f"kills: {a.kills} started, {killed} killed mid-conversion; artifact intact after {intact}/{a.kills}")
        print(f"temporaries present after each kill: min {min(after)} max {max(after)} (the killed run's own)")
        print(f"stale temporaries left at the end: {len(stale)} ({stale_bytes} bytes)")
        print(
            f"next conversion: exit {r.returncode}, removed {removed}, left {len(_temps(out))}, "
            f"artifact identical: {_snapshot(out) == first}"
        )


if __name__ == "__main__":
    main()
