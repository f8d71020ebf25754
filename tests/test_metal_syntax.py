"""The Apple-only C++ (GPU-event streaming path, MTLIO backend) type-checks against real MLX Metal
and metal-cpp headers (tools/check_metal_syntax.py). Skipped, with the reason, where clang++ or
metal-cpp is missing (set HEBRUS_METAL_CPP to an unpacked metal-cpp_26). A type check only: never
linked or run here (AFN-013).

Provenance: the headers are MLX's and Apple's; the mutations below are controls that the check
rejects code naming APIs those headers do not declare."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_metal_syntax", ROOT / "tools" / "check_metal_syntax.py")
cms = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cms)

BASE, WHY = cms.toolchain()
needs_headers = pytest.mark.skipif(BASE is None, reason=f"Metal syntax check unavailable: {WHY}")


@needs_headers
@pytest.mark.parametrize("unit,macro", cms.UNITS, ids=[f"{u}-{m}" for u, m in cms.UNITS])
def test_metal_code_type_checks(unit, macro):
    r = cms.check(ROOT / "metal_ext" / unit, macro, BASE)
    assert r.returncode == 0 and "error:" not in r.stderr, r.stderr


@needs_headers
@pytest.mark.parametrize(
    "old,new",
    [
        ("encodeSignalEvent(", "encodeSignalEvents("),  # a metal-cpp method that does not exist
        ("enc.end_encoding();", "enc.end_encode();"),  # an MLX CommandEncoder method that does not exist
        ("mx::scheduler::enqueue(", "mx::scheduler::enqueue_task("),  # MLX scheduler API
    ],
)
def test_a_broken_edit_fails_the_check(tmp_path, old, new):
    src = (ROOT / "metal_ext" / "ops_metal.cpp").read_text()
    assert old in src
    bad = tmp_path / "ops_metal.cpp"
    bad.write_text(src.replace(old, new, 1))
    r = cms.check(bad, "HEBRUS_METAL_EVENTS", BASE)
    assert r.returncode != 0 and "error:" in r.stderr


def test_without_metal_cpp_the_tool_skips_with_a_reason(monkeypatch, capsys):
    monkeypatch.setenv("HEBRUS_METAL_CPP", "/nonexistent")
    monkeypatch.setattr(cms, "mlx_include", lambda: None)
    assert cms.main([]) == 2
    assert "skipped:" in capsys.readouterr().err
