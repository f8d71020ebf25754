"""Run the project's known-answer hash self-tests natively (the macOS arm64 CI job).

Every tools/check_*.py that takes `--arch` (check_sha256.py today; the fast per-record check's
self-test when it lands, whatever its name) is built for this host and run with `--arch native`:
each must exit 0 (2, a missing toolchain, fails here too). On arm64 the installed extension's
SHA-256 must also have picked the ARMv8 instructions (`--require-arm64`): the path that qemu
only emulates on Linux.

    python .ci/hash_selftests.py [--require-arm64]
"""

import argparse
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def selftests():
    # `--arch` is defined in the script or by the shared tools/kat_toolchain.py it uses.
    return sorted(
        p
        for p in (ROOT / "tools").glob("check_*.py")
        if re.search(r"""["']--arch["']|^import kat_toolchain|^from kat_toolchain""", p.read_text(), re.M)
    )


def _fast_check_backend():
    """The XXH3 backend the installed extension picked, or None in a build without the fast check."""
    for module, fn in (("hebrus_mlx._hash", "xxh3_backend"), ("hebrus_mlx._ext", "xxh3_backend")):
        try:
            mod = __import__(module, fromlist=[fn])
        except ImportError:
            continue
        if hasattr(mod, fn):
            return str(getattr(mod, fn)())
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--require-arm64",
        action="store_true",
        help="fail unless this is arm64 and the engine's SHA-256 backend is armv8",
    )
    a = ap.parse_args(argv)
    scripts = selftests()
    if not scripts:
        print("no tools/check_*.py with --arch found", file=sys.stderr)
        return 1
    failed = []
    for s in scripts:
        proc = subprocess.run([sys.executable, str(s), "--arch", "native"], capture_output=True, text=True, cwd=ROOT)
        print(f"{s.name} --arch native: exit {proc.returncode}\n{proc.stdout.strip()}\n{proc.stderr.strip()}".strip())
        if proc.returncode != 0:
            failed.append(s.name)
    if a.require_arm64:
        import mlx.core  # noqa: F401  (libmlx before the extension)

        from hebrus_mlx import _ext

        backend = _ext.sha256_backend()
        print(f"{platform.machine()}: installed extension's SHA-256 backend {backend}")
        if platform.machine() not in ("arm64", "aarch64") or backend != "armv8":
            failed.append(f"engine SHA-256 backend {backend} on {platform.machine()} (want armv8 on arm64)")
        fast = _fast_check_backend()
        if fast is not None:  # the per-read fast check (XXH3-128), where this build has it
            print(f"installed extension's fast-check backend {fast}")
            if "neon" not in fast.lower():
                failed.append(f"fast-check backend {fast} on arm64 (want the NEON path)")
    if failed:
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
        return 1
    print(f"{len(scripts)} native hash self-tests passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
