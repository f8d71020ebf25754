"""Known-answer check of metal_ext's XXH3-128 on this machine or on arm64.

Builds metal_ext/tests/xxh3_kat.cpp with metal_ext/xxh3.cpp for the host (``--arch native``:
AVX2, SSE2 and scalar paths) or cross-compiled for arm64 Linux (``--arch aarch64``: the NEON and
scalar paths, run under qemu-aarch64), and compares every digest of every backend (one-shot and
streamed in uneven pieces) with

- the published XXH3-128 sanity vectors of the xxHash project (seed 0; tests/sanity_test_vectors.h
  of https://github.com/Cyan4973/xxHash, over the sanity buffer tests/sanity_test.c generates), and
- the independent `xxhash` package from PyPI (when installed: the test extra) on random buffers
  around every size class, stripe, block and stream-buffer boundary.

    python tools/check_xxh3.py --arch aarch64

Needs g++ (native) or aarch64-linux-gnu-g++ + qemu-aarch64 (apt: g++-aarch64-linux-gnu
qemu-user). Exits 0 when every digest matches, 1 on a mismatch, 2 when the toolchain is
missing. What qemu proves: the NEON sequence computes XXH3-128; not its speed, and not the macOS
build (AFN-013).
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kat_toolchain  # noqa: E402
from kat_toolchain import EXT, ToolchainMissing, toolchain  # noqa: E402, F401 (ToolchainMissing: the tests catch it here)

# xxHash's sanity vectors for XXH3-128, seed 0: (length of the sanity buffer prefix, low64,
# high64).
PUBLISHED = [
    (0, 0x6001C324468D497F, 0x99AA06D3014798D8),
    (1, 0xC44BDFF4074EECDB, 0xA6CD5E9392000F6A),
    (3, 0x54247382A8D6B94D, 0x20EFC49FF02422EA),
    (4, 0x2E7D8D6876A39FE9, 0x970D585AC632BF8E),
    (8, 0x64C69CAB4BB21DC5, 0x47A7F080D82BB456),
    (9, 0xED7CCBC501EB7501, 0x564EF6078950D457),
    (16, 0x562980258A998629, 0xC68C368ECF8A9C05),
    (17, 0xABBC12D11973D7DB, 0x955FA78643ED3669),
    (128, 0xEBB15E34A7FB5AB1, 0x39992220E045260A),
    (129, 0x86C9E3BC8F0A3B5C, 0x03815FC91F1B30B6),
    (240, 0x5C9AAE94C8EBE5A0, 0xAA4202DAA2769DC8),
    (241, 0xC5A639ECD2030E5E, 0x99A80ECF0ECFC647),
    (256, 0x55DE574AD89D0AC5, 0x8B1C66091423D288),
    (512, 0x617E49599013CB6B, 0x18D2D110DCC9BCA1),
]


def sanity_buffer(n: int) -> bytes:
    """xxHash's sanity-test input: the top byte of a generator multiplied by PRIME64 each step,
    starting from PRIME32."""
    gen, out = 2654435761, bytearray()
    for _ in range(n):
        out.append(gen >> 56)
        gen = (gen * 11400714785074694797) & (2**64 - 1)
    return bytes(out)


def published_hex(low: int, high: int) -> str:
    return f"{high:016x}{low:016x}"  # canonical: high half first, big-endian


def build(arch: str, out_dir: Path):
    cxx, runner = toolchain(arch)
    exe = out_dir / f"xxh3_kat_{arch}"
    subprocess.run(
        [
            cxx,
            "-std=c++20",
            "-O2",
            f"-I{EXT}",
            str(EXT / "tests" / "xxh3_kat.cpp"),
            str(EXT / "xxh3.cpp"),
            "-o",
            str(exe),
        ],
        check=True,
    )
    return runner + [str(exe)]


def cases(seed: int = 0):
    """The published vectors' inputs, then random buffers at every size class and around the
    64-byte stripe, 1024-byte block and 256-byte stream-buffer boundaries, plus a record-sized
    one (2,764,800 bytes: bench_stream's expert)."""
    sanity = sanity_buffer(max(n for n, _, _ in PUBLISHED))
    rng = random.Random(seed)
    lengths = list(range(0, 300)) + [
        383,
        384,
        385,
        511,
        512,
        513,
        1023,
        1024,
        1025,
        1087,
        1088,
        1089,
        2047,
        2048,
        2049,
        4095,
        4096,
        4097,
        16385,
        65539,
    ]
    lengths += [rng.randrange(1, 300_000) for _ in range(16)] + [2_764_800]
    return [sanity[:n] for n, _, _ in PUBLISHED] + [rng.randbytes(n) for n in lengths]


def _oracle():
    try:
        import xxhash
    except ImportError:
        return None
    return lambda m: xxhash.xxh3_128(m).hexdigest()


def check(arch: str, seed: int = 0, require_oracle: bool = False):
    """(backends, mismatches, messages checked by the oracle): every backend's one-shot and
    streamed digest of every case against the published vector or the `xxhash` oracle."""
    oracle = _oracle()
    if oracle is None and require_oracle:
        raise ModuleNotFoundError("the xxhash package (pip install xxhash) is the oracle")
    msgs = cases(seed)
    out = kat_toolchain.run_kat(build, arch, msgs, "xxh3-kat-")
    backends, lines = out[0].split(","), out[1 : 1 + len(msgs)]
    bad, oracled = [], 0
    for i, (m, line) in enumerate(zip(msgs, lines)):
        if i < len(PUBLISHED):
            want = published_hex(*PUBLISHED[i][1:])
            if oracle is not None and oracle(m) != want:
                bad.append(("oracle disagrees with the published vector", len(m)))
        elif oracle is not None:
            want = oracle(m)
            oracled += 1
        else:
            continue
        got = line.split()
        if got != [want] * (2 * len(backends)):
            bad.append((len(m), got, want))
    if len(lines) != len(msgs):
        bad.append(("lines", len(lines), len(msgs)))
    return backends, bad, oracled


def main(argv=None) -> int:
    def report(args, result):
        backends, bad, oracled = result
        print(
            f"{args.arch}: backends {','.join(backends)}; {len(PUBLISHED)} published vectors"
            f" + {oracled} buffers vs the xxhash package, one-shot and streamed per backend;"
            f" {len(bad)} mismatches"
        )
        return bad

    return kat_toolchain.main(__doc__, argv, check, report)


if __name__ == "__main__":
    sys.exit(main())
