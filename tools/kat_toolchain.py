"""What tools/check_sha256.py and tools/check_xxh3.py share: the toolchain of a known-answer driver
(the host's compiler, or aarch64-linux-gnu-g++ with qemu-aarch64 to run the result) and its command
line (exit 0: every digest matches, 1: a mismatch, 2: the toolchain is missing)."""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

EXT = Path(__file__).resolve().parents[1] / "metal_ext"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's cross runtime (qemu -L)


class ToolchainMissing(RuntimeError):
    pass


def toolchain(arch: str):
    """(compiler, runner prefix)."""
    if arch == "native":
        cxx = shutil.which("g++") or shutil.which("clang++")
        if cxx is None:
            raise ToolchainMissing("no g++/clang++")
        return cxx, []
    cxx = shutil.which("aarch64-linux-gnu-g++")
    qemu = shutil.which("qemu-aarch64")
    if cxx is None or qemu is None:
        raise ToolchainMissing("needs aarch64-linux-gnu-g++ and qemu-aarch64")
    return cxx, [qemu, "-L", SYSROOT]


def run_kat(build, arch: str, msgs, prefix: str):
    """Build the driver (`build(arch, out_dir)` -> command), feed it `msgs` as length-prefixed
    records and return its output lines (a header line, then one line per message)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        cmd = build(arch, Path(d))
        rec = Path(d) / "records.bin"
        rec.write_bytes(b"".join(struct.pack("<I", len(m)) + m for m in msgs))
        return subprocess.run(cmd + [str(rec)], capture_output=True, text=True, check=True).stdout.split("\n")


def main(doc: str, argv, check, report) -> int:
    """Parse --arch/--seed, run `check(arch, seed)`; `report(args, result)` prints the summary and
    returns the mismatches (the first five are printed)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--arch", choices=["native", "aarch64"], default="aarch64")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        result = check(args.arch, args.seed)
    except ToolchainMissing as e:
        print(f"skipped: {e}", file=sys.stderr)
        return 2
    bad = report(args, result)
    for b in bad[:5]:
        print("  mismatch:", b)
    return 1 if bad else 0
