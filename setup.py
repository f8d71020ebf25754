"""Build hook: compile metal_ext/ with CMake into hebrus_mlx/_ext (the
runtime module), hebrus_mlx/_hash (record digests without MLX, for the
artifact writers), hebrus_mlx/_bench (benchmark helpers) and
hebrus_mlx/_testing (the engine's fault injection, imported only by tests).

Project metadata lives in pyproject.toml; this file only adds the CMake
extensions so that ``pip install -e .`` and ``pip install .`` both build them.

Not ``mlx.extension``: its ``CMakeBuild`` builds every target of the project
once per extension (no per-target build, so two modules of one CMake project
compile twice), copies the whole build tree over the package for
``--inplace``, and its ``MetalExtension`` writes its own CMakeLists (no
static core library, no optional MTLIO backend). It covers only the
configure/build/rpath lines below.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name, source_dir):
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


def mtlio_option(environ) -> str:
    """The CMake switch for the MTLIO read backend: on only with HEBRUS_BUILD_MTLIO=1, since Apple's
    compiler has never built io_mtlio.cpp and a first-build error there must not block
    `pip install` on a Mac. Always passed, so a cached ON from an earlier build does not stick."""
    value = environ.get("HEBRUS_BUILD_MTLIO", "0").strip()
    if value not in ("0", "1", ""):
        raise SystemExit(f"HEBRUS_BUILD_MTLIO: expected 0 or 1, got {value!r}")
    return f"-DHEBRUS_BUILD_MTLIO={'ON' if value == '1' else 'OFF'}"


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        # For editable installs (build_ext --inplace) this is the source tree.
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # One build tree for both modules: the core library compiles once.
        build_dir = Path(self.build_temp).resolve() / "metal_ext"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        configure = [
            "cmake",
            "-S",
            ext.source_dir,
            "-B",
            str(build_dir),
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            mtlio_option(os.environ),
        ]
        # Extra configure options, the usual pip-build convention (the self-hosted Metal CI job
        # builds the GPU-event path with CMAKE_ARGS=-DHEBRUS_METAL_EVENTS=ON).
        configure += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(configure, check=True)
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", ext.name.split(".")[-1], "-j", jobs],
            check=True,
        )


setup(
    ext_modules=[
        CMakeExtension("hebrus_mlx._ext", ROOT / "metal_ext"),
        CMakeExtension("hebrus_mlx._bench", ROOT / "metal_ext"),
        CMakeExtension("hebrus_mlx._hash", ROOT / "metal_ext"),
        CMakeExtension("hebrus_mlx._testing", ROOT / "metal_ext"),
    ],
    cmdclass={"build_ext": CMakeBuild},
)
