"""Tests for the metal_ext build (setup.py + metal_ext/CMakeLists.txt).

Provenance: contract controls against pyproject.toml and the installed mlx
version; no fixture is produced by the code under test.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_extension_is_built_and_shares_the_mlx_domain(tmp_path):
    """CI builds the extension; its ops must exchange real mx.arrays
    (nanobind 2.x or a foreign domain fails at the first call)."""
    from hebrus_mlx import _ext

    path = tmp_path / "s.bin"
    path.write_bytes(bytes(range(256)) * 32)
    eng = _ext.Engine(threads=1, cache_bytes=1 << 16)
    table = eng.register_table(eng.add_store(str(path)), [0, 4096], [4096, 4096])
    out = _ext.gather_records(eng, table, mx.array([1, 0]))
    assert isinstance(out, mx.array) and out.shape == (2, 4096)
    assert out[0, :4].tolist() == [0, 1, 2, 3]


def test_build_requirements_pin_the_runtime_mlx():
    """The extension compiles against MLX headers: the build pin must equal
    the runtime pin and the installed version; nanobind must be >= 3."""
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    build = cfg["build-system"]["requires"]
    runtime = cfg["project"]["dependencies"]
    for req in ("mlx[cpu]==", "mlx=="):
        b = [r for r in build if r.startswith(req)]
        assert len(b) == 1 and b[0] in runtime, (req, build)
        assert b[0].split("==")[1].split(";")[0].strip() == mx.__version__
    assert any(r.replace(" ", "").startswith("nanobind>=3") for r in build)


def test_package_works_without_the_extension():
    """Without _ext, streaming reports unavailable and the reference works."""
    code = textwrap.dedent(
        """
        import sys, os, tempfile
        sys.modules["hebrus_mlx._ext"] = None  # simulate a missing build
        from hebrus_mlx.stream import engine as se
        from hebrus_mlx.testing.stream_reference import ReferenceEngine
        assert not se.available() and "could not be imported" in se.unavailable_reason()
        try:
            se.StreamEngine(cache_bytes=1 << 20)
        except se.StreamUnavailableError:
            pass
        else:
            raise SystemExit("StreamEngine constructed without the extension")
        fd, p = tempfile.mkstemp()
        os.write(fd, b"abcdef"); os.close(fd)
        ref = ReferenceEngine()
        assert ref.read(ref.request(ref.add_store(p), 1, 3)) == b"bcd"
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_bench_code_is_a_separate_module():
    """Issue 10: benchmark-only code (raw_pread) is built into
    hebrus_mlx._bench, not the runtime module; the runtime exports the
    engine's error table instead."""
    from hebrus_mlx import _bench, _ext

    assert hasattr(_bench, "raw_pread") and not hasattr(_ext, "raw_pread")
    assert _ext.error_codes()[0] == "ok"


def test_fault_injection_is_compiled_only_into_the_test_module():
    """Issue 26 §5: the engine's test hooks (fault injection, hold, read delays) are built only
    into hebrus_mlx._testing, which the same install builds beside _ext: the runtime module has
    neither the entry points nor the injector's code, and a streamed generation never imports
    the test module."""
    from hebrus_mlx import _ext, _testing

    hooks = ("inject_fault", "hold", "set_read_delay_us", "inject_digest_fault")
    assert not [h for h in hooks for obj in (_ext, _ext.Engine, _ext.SweepRing) if hasattr(obj, h)]
    assert all(hasattr(_testing, h) for h in hooks[:3])
    release, test = (Path(m.__file__).read_bytes() for m in (_ext, _testing))
    for marker in (b"FaultInjector", b"inject_fault", b"set_read_delay_us"):
        assert marker not in release and marker in test, marker
    code = textwrap.dedent(
        """
        import sys
        import mlx.core as mx
        from hebrus_mlx.loader import DEMO_DIR, load_model
        model = load_model(DEMO_DIR, expert_cache_gb=0.004, ple_cache_gb=4 * 65536 / 2**30)
        mx.eval(model(mx.array([[5, 6, 7]]), model.make_cache()))
        assert model.streaming.engine.counters()["misses"] > 0
        print(sorted(m for m in sys.modules if m.startswith("hebrus_mlx._")))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "hebrus_mlx._testing" not in r.stdout and "hebrus_mlx._ext" in r.stdout


def _enclosing_ifs(cmake: str, needle: str):
    """The conditions of the if() blocks around the first line containing `needle` (an elseif or
    else replaces its block's condition)."""
    stack = []
    for line in cmake.splitlines():
        s = line.strip()
        if s.startswith("if("):
            stack.append(s[3:])
        elif s.startswith("elseif("):
            stack[-1] = s[7:]
        elif s.startswith("else("):
            stack[-1] = "else of " + stack[-1]
        elif s.startswith("endif("):
            stack.pop()
        elif needle in s:
            return list(stack)
    raise AssertionError(f"{needle} not in CMakeLists.txt")


def test_mtlio_backend_is_opt_in_in_the_default_build():
    """io_mtlio.cpp has never met Apple's compiler, so the default build (`pip install` on a Mac)
    leaves it out: CMake compiles it only under HEBRUS_BUILD_MTLIO (default OFF), and setup.py
    turns that on only for HEBRUS_BUILD_MTLIO=1, passing OFF otherwise (a cached ON does not
    stick); any other value stops the build naming the variable. Read from the files, not built."""
    import ast
    import re

    cmake = (ROOT / "metal_ext" / "CMakeLists.txt").read_text()
    assert re.search(r'option\(HEBRUS_BUILD_MTLIO "[^"]*" OFF\)', cmake)
    conditions = _enclosing_ifs(cmake, "io_mtlio.cpp")
    assert "HEBRUS_BUILD_MTLIO" in conditions[0] and "else of" not in conditions[0], conditions

    tree = ast.parse((ROOT / "setup.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "mtlio_option"]
    scope = {}
    exec(compile(ast.Module([fn], []), "setup.py", "exec"), scope)
    option = scope["mtlio_option"]
    assert option({}) == option({"HEBRUS_BUILD_MTLIO": "0"}) == "-DHEBRUS_BUILD_MTLIO=OFF"
    assert option({"HEBRUS_BUILD_MTLIO": "1"}) == "-DHEBRUS_BUILD_MTLIO=ON"
    with pytest.raises(SystemExit, match="^HEBRUS_BUILD_MTLIO: expected 0 or 1"):
        option({"HEBRUS_BUILD_MTLIO": "yes"})
    (build,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "build_extension"]
    assert "mtlio_option(os.environ)" in ast.unparse(build)
