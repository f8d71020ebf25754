"""Type-check metal_ext's Apple-only code against real MLX Metal and metal-cpp headers.

`clang++ -fsyntax-only -fblocks` of the translation units that contain Metal code, with the macros
that switch that code on:
- ops_metal.cpp, ops.cpp, trace_ops.cpp with HEBRUS_METAL_EVENTS=1 (the GPU-event streaming path);
- io_mtlio.cpp and ops.cpp with HEBRUS_MTLIO=1 (the MTLIO read backend).

Headers: MLX's own (`<mlx package>/include`, which ships mlx/backend/metal/*.h even in the Linux
wheel) and Apple's metal-cpp — MLX 0.32 builds with metal-cpp 26
(https://developer.apple.com/metal/cpp/files/metal-cpp_26.zip). metal-cpp is looked for in
$HEBRUS_METAL_CPP, then `<mlx package>/include/metal_cpp` (macOS wheels ship it). On Linux the
Apple system headers metal-cpp includes (objc, CoreFoundation, dispatch, IOSurface, CoreGraphics,
mach, TargetConditionals) are replaced by the declaration-only stubs in tools/apple_stubs/; on
macOS the SDK's own are used and no stub is on the path.

    HEBRUS_METAL_CPP=/path/to/metal-cpp python tools/check_metal_syntax.py

Exit 0: every unit type-checks; 1: a compile error (printed); 2: clang++, MLX's Metal headers or
metal-cpp not found (the reason is printed). What it proves: the code names MLX/metal-cpp APIs
that exist, with matching types. Not that it links (libmlx exports only MLX_API symbols), nor
anything at run time: that needs a Mac (AFN-013).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / "tools" / "apple_stubs"
UNITS = (
    ("ops_metal.cpp", "HEBRUS_METAL_EVENTS"),
    ("ops.cpp", "HEBRUS_METAL_EVENTS"),
    ("trace_ops.cpp", "HEBRUS_METAL_EVENTS"),
    ("io_mtlio.cpp", "HEBRUS_MTLIO"),
    ("ops.cpp", "HEBRUS_MTLIO"),
)


def mlx_include() -> Path | None:
    try:
        import mlx
    except ImportError:
        return None
    for base in mlx.__path__:
        inc = Path(base) / "include"
        if (inc / "mlx" / "backend" / "metal" / "device.h").is_file():
            return inc
    return None


def metal_cpp(mlx_inc: Path | None) -> Path | None:
    for cand in (os.environ.get("HEBRUS_METAL_CPP"), mlx_inc and mlx_inc / "metal_cpp"):
        if cand and (Path(cand) / "Metal" / "Metal.hpp").is_file():
            return Path(cand)
    return None


def toolchain() -> tuple[list | None, str]:
    """(base command, '') or (None, why not)."""
    clang = shutil.which(os.environ.get("CXX_CLANG", "clang++"))
    if clang is None:
        return None, "no clang++ (metal-cpp needs -fblocks, which g++ lacks)"
    inc = mlx_include()
    if inc is None:
        return None, "the installed mlx has no include/mlx/backend/metal headers"
    mcpp = metal_cpp(inc)
    if mcpp is None:
        return None, (
            "metal-cpp not found: set HEBRUS_METAL_CPP to an unpacked metal-cpp_26 (the release MLX 0.32 builds with)"
        )
    cmd = [
        clang,
        "-std=c++20",
        "-fsyntax-only",
        "-fblocks",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        "-I",
        str(ROOT / "metal_ext"),
        "-isystem",
        str(inc),
        "-isystem",
        str(mcpp),
    ]
    if platform.system() != "Darwin":
        cmd += ["-isystem", str(STUBS)]
    return cmd, ""


def check(unit: Path, macro: str, base: list) -> subprocess.CompletedProcess:
    return subprocess.run(base + [f"-D{macro}=1", str(unit)], capture_output=True, text=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="check these files (each with every macro) instead")
    a = p.parse_args(argv)
    base, why = toolchain()
    if base is None:
        print(f"skipped: {why}", file=sys.stderr)
        return 2
    units = (
        [(Path(f), m) for f in a.files for m in sorted({m for _, m in UNITS})]
        if a.files
        else [(ROOT / "metal_ext" / f, m) for f, m in UNITS]
    )
    failed = 0
    for unit, macro in units:
        r = check(unit, macro, base)
        ok = r.returncode == 0 and "error:" not in r.stderr
        print(f"{'ok  ' if ok else 'FAIL'} {unit.name} -D{macro}=1")
        if not ok:
            failed += 1
            print(r.stderr, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
