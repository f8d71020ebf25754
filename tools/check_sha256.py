"""Known-answer check of metal_ext's SHA-256 on another architecture.

Builds metal_ext/tests/sha256_kat.cpp with the engine's SHA-256 sources for
the host (``--arch native``: SHA-NI or portable rounds) or cross-compiled for
arm64 Linux (``--arch aarch64``: the ARMv8 SHA-2 instruction path of
sha256_armv8.cpp, run under qemu-aarch64), and compares every digest with
hashlib on the FIPS 180-2 vectors plus random buffers of many lengths.

    python tools/check_sha256.py --arch aarch64

Needs g++ (native) or aarch64-linux-gnu-g++ + qemu-aarch64 (apt:
g++-aarch64-linux-gnu qemu-user). Exits 0 when every digest matches, 1 on a
mismatch, 2 when the toolchain is missing. What qemu proves: the
instruction sequence computes SHA-256; not its speed, and not the macOS
build (AFN-013).
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kat_toolchain  # noqa: E402
from kat_toolchain import EXT, ToolchainMissing  # noqa: E402, F401 (ToolchainMissing: the tests catch it here)

# FIPS 180-2 appendix B (and the empty message).
NIST = [
    (b"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    (
        b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
    ),
    (b"a" * 1_000_000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
]


def toolchain(arch: str):
    """(compiler, runner prefix, per-file flags of sha256_armv8.cpp)."""
    cxx, runner = kat_toolchain.toolchain(arch)
    return cxx, runner, ([] if arch == "native" else ["-march=armv8-a+crypto"])


def build(arch: str, out_dir: Path):
    cxx, runner, arm_flags = toolchain(arch)
    common = [cxx, "-std=c++20", "-O2", f"-I{EXT}"]
    arm_obj = out_dir / "sha256_armv8.o"
    subprocess.run(common + arm_flags + ["-c", str(EXT / "sha256_armv8.cpp"), "-o", str(arm_obj)], check=True)
    exe = out_dir / f"sha256_kat_{arch}"
    subprocess.run(
        common + [str(EXT / "tests" / "sha256_kat.cpp"), str(EXT / "sha256.cpp"), str(arm_obj), "-o", str(exe)],
        check=True,
    )
    return runner + [str(exe)]


def cases(seed: int = 0):
    """NIST messages plus random buffers around every block boundary and a
    few large ones."""
    rng = random.Random(seed)
    lengths = list(range(0, 200)) + [255, 256, 1000, 4095, 4096, 4097, 65536 + 3]
    lengths += [rng.randrange(1, 300_000) for _ in range(20)]
    return [m for m, _ in NIST] + [rng.randbytes(n) for n in lengths]


def check(arch: str, seed: int = 0):
    """(backend, mismatches): every case's three digests vs hashlib (and the
    NIST constants for those vectors)."""
    msgs = cases(seed)
    out = kat_toolchain.run_kat(build, arch, msgs, "sha256-kat-")
    backend, lines = out[0], out[1 : 1 + len(msgs)]
    bad = []
    for i, (m, line) in enumerate(zip(msgs, lines)):
        want = NIST[i][1] if i < len(NIST) else hashlib.sha256(m).hexdigest()
        assert i >= len(NIST) or want == hashlib.sha256(m).hexdigest()
        got = line.split()
        if got != [want] * 3:
            bad.append((len(m), got, want))
    if len(lines) != len(msgs):
        bad.append(("lines", len(lines), len(msgs)))
    return backend, bad


def main(argv=None) -> int:
    def report(args, result):
        backend, bad = result
        print(f"{args.arch}: backend={backend}, {len(cases(args.seed))} messages x 3 digests, {len(bad)} mismatches")
        return bad

    return kat_toolchain.main(__doc__, argv, check, report)


if __name__ == "__main__":
    sys.exit(main())
