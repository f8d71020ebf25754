import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support import families  # noqa: F401  (registers the test checkpoints' family descriptors)

# The independent MLX oracle (mlx-vlm 0.7.10) is unpacked, never installed (its package __init__
# pulls heavy dependencies). .ci/run provides it; a developer's `python -m pytest` fetches the wheel
# once into the user cache (PyPI only). Without it the cross-check tests skip, naming the path.
MLX_VLM_VERSION = "0.7.10"


def _provide_mlx_vlm():
    if os.environ.get("MLX_VLM_ROOT"):
        return
    for root in (Path("/work/pkgs/mlx_vlm_0710"), Path.home() / ".cache" / "hebrus-mlx" / "mlx_vlm_0710"):
        if (root / "mlx_vlm" / "models" / "qwen4_exp").is_dir():
            os.environ["MLX_VLM_ROOT"] = str(root)
            return
    wheels = root.parent / "wheels"
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                f"mlx-vlm=={MLX_VLM_VERSION}",
                "-d",
                str(wheels),
            ],
            check=True,
            timeout=300,
            capture_output=True,
        )
        with zipfile.ZipFile(next(wheels.glob(f"mlx_vlm-{MLX_VLM_VERSION}-*.whl"))) as z:
            z.extractall(root)
        os.environ["MLX_VLM_ROOT"] = str(root)
    except (OSError, subprocess.SubprocessError, StopIteration, zipfile.BadZipFile):
        pass  # offline: the oracle tests skip


_provide_mlx_vlm()


@pytest.fixture(scope="module")
def demo():
    """(model, tokenizer) of the shipped demo, once per test module (a module may define its own)."""
    from hebrus_mlx import load

    return load("demo")
