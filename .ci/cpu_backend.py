"""Run every Python of this environment on MLX's CPU backend (the hosted macOS CI job).

GitHub's hosted macOS runners are VMs whose Metal device is paravirtual or absent; MLX's macOS
build still reports `mx.metal.is_available()` and would compute on it by default. This installs a
.pth start-up hook into the environment's site-packages that calls `mx.set_default_device(mx.cpu)`
before any program runs, so the suite, and every `python -m hebrus_mlx.cli` it starts (whatever
PYTHONPATH they are given), computes on the CPU backend and sees no Metal device
(`hebrus_mlx.machine_profile.metal_device`). CI only: nothing in hebrus_mlx reads it.

    python .ci/cpu_backend.py install | check | remove
"""

import subprocess
import sys
import sysconfig
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"])
MODULE = "hebrus_ci_cpu_backend"
HOOK = f"""# {__doc__.splitlines()[0]} (installed by .ci/cpu_backend.py)
try:
    import mlx.core as _mx
except ImportError:  # before mlx is installed: nothing to switch
    pass
else:
    _mx.set_default_device(_mx.cpu)
"""
CHECK = (
    "import json, mlx.core as mx; from hebrus_mlx.machine_profile import metal_device; "
    "print(json.dumps([str(mx.default_device()), metal_device()]))"
)


def install():
    (SITE / f"{MODULE}.py").write_text(HOOK)
    (SITE / f"{MODULE}.pth").write_text(f"import {MODULE}\n")
    print(f"CPU backend hook installed in {SITE}")


def remove():
    for suffix in (".py", ".pth"):
        (SITE / f"{MODULE}{suffix}").unlink(missing_ok=True)


def check():
    """A fresh interpreter with its own PYTHONPATH (as tests give their subprocesses) must compute
    on the CPU and see no Metal device."""
    import os

    root = str(Path(__file__).resolve().parents[1])
    out = (
        subprocess.run(
            [sys.executable, "-c", CHECK],
            capture_output=True,
            text=True,
            check=True,
            cwd="/",
            env=dict(os.environ, PYTHONPATH=root),
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    device, metal = __import__("json").loads(out)
    print(f"fresh interpreter: default device {device}, Metal device {metal}")
    if device != "Device(cpu, 0)" or metal:
        sys.exit("the CPU backend hook is not in effect")


if __name__ == "__main__":
    {"install": install, "remove": remove, "check": check}[sys.argv[1] if len(sys.argv) > 1 else "check"]()
