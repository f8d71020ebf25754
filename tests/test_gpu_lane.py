"""The GPU lane (benchmarks/gpu_lane.sh + gpu_lane.py, issue 25) up to its CUDA-specific parts.

No GPU here: the driver's --device cpu --quick dry run runs the same sections on the CPU backend
(a tiny transformers checkpoint built by the driver itself against transformers' own logits, the
mlx-vlm peer on the same weights, the shipped demo resident vs streamed). What only a GPU can
show (bfloat16 on the device, CUDA speed, the CPU-stream hop to a GPU) is not claimed here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("transformers")
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def test_dry_run_of_every_section(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_lane.py"),
            "--device",
            "cpu",
            "--quick",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "gpu_lane.json").read_text())
    s = r["sections"]
    assert all(v["status"] == "ok" for v in s.values()), {k: v.get("error") for k, v in s.items()}
    assert s["environment"]["backend"] == "cpu" and s["environment"]["extension"]
    p = s["parity"]
    assert p["hebrus_float32"]["max_abs_logit_diff"] < 1e-4 and p["hebrus_float32"]["top1_agreement"] == 1.0
    assert p["hebrus_bfloat16"]["max_abs_logit_diff"] < 0.1 * p["hebrus_bfloat16"]["ref_logit_scale"]
    assert s["speed"]["hebrus"]["decode_tok_s"] > 0 and s["speed"]["hebrus"]["peak_memory_gb"] > 0
    if "hebrus_vs_mlx_vlm" in s["speed"]:  # the peer where mlx-vlm is unpacked (MLX_VLM_ROOT)
        assert s["speed"]["greedy_tokens_identical"] and p["mlx_vlm_float32"]["max_abs_logit_diff"] < 1e-4
    st = s["streamed"]
    assert st["identical"] and st["cache_fraction"] == 0.05
    assert st["runs"]["streamed_5pct_prefetch_off"]["streamed"] and not st["runs"]["resident"]["streamed"]
    md = (tmp_path / "gpu_lane.md").read_text()
    assert "dry run" in md and "## Streamed vs resident" in md


def test_gpu_device_is_refused_without_a_gpu_backend(tmp_path):
    import mlx.core as mx

    if mx.cuda.is_available() or mx.metal.is_available():
        pytest.skip("this machine has a GPU backend")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_lane.py"), "--device", "gpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--device" in proc.stderr and "Traceback" not in proc.stderr


def test_lane_script_refuses_without_prepared_wheels(tmp_path):
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "benchmarks" / "gpu_lane.sh"),
            "--lane",
            str(tmp_path / "lane"),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "gpu_lane_prepare.sh" in proc.stderr


def test_a_plain_install_pulls_no_cuda():
    """`pip install -e .` on CPU-only Linux stays as it was: mlx[cpu], no CUDA wheel in any default
    or test requirement (the lane installs its own from prepared wheels)."""
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = (
        proj["project"]["dependencies"]
        + proj["project"]["optional-dependencies"]["test"]
        + proj["build-system"]["requires"]
    )
    assert not [r for r in reqs if "cuda" in r.lower()]
    assert "mlx[cpu]==0.32.4; sys_platform == 'linux'" in proj["project"]["dependencies"]
