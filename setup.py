"""Build hook: compile metal_ext/ with CMake into hebrus_mlx/_ext.

Project metadata lives in pyproject.toml; this file only adds the CMake
extension so that ``pip install -e .`` and ``pip install .`` both build it.
"""

import os
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


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        # For editable installs (build_ext --inplace) this is the source tree.
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        configure = [
            "cmake",
            "-S", ext.source_dir,
            "-B", str(build_dir),
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
        ]
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(configure, check=True)
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", "_ext", "-j", jobs],
            check=True,
        )


setup(
    ext_modules=[CMakeExtension("hebrus_mlx._ext", ROOT / "metal_ext")],
    cmdclass={"build_ext": CMakeBuild},
)
