"""The machine profile `hebrus-mlx qualify` writes and `load()` reads (AFN-013): what passed on
this machine is switched on, nothing else. Read and written here, below both."""

from __future__ import annotations

import functools
import json
import os
import platform
from collections.abc import Iterator
from pathlib import Path

from .errors import HebrusError

SCHEMA = "hebrus-mlx/machine-profile/1"
PASSED, FAILED = "passed", "failed"
NOT_QUALIFIED = "not qualified on this machine"
# What must match between the machine that wrote a profile and the one reading it: another Mac,
# another macOS (its Metal compiler) or another MLX re-qualifies.
IDENTITY = ("system", "release", "machine", "mlx")


class ProfileError(HebrusError, ValueError):
    """The machine profile exists but is not one this version can read."""

    default_field = "profile"


def profile_path() -> Path:
    return Path(os.environ.get("HEBRUS_PROFILE") or Path.home() / ".cache" / "hebrus-mlx" / "profile.json")


def read_profile(path: Path | None = None) -> dict | None:
    """The machine profile, or None when there is none (then nothing optional is switched on)."""
    path = Path(path) if path else profile_path()
    if not path.exists():
        return None
    from .artifact.untrusted import UntrustedFileError, read_json_path

    try:  # bounded: size cap, nesting, duplicate keys (issue 22; a profile may be handed to us)
        profile = read_json_path(path, "json", field=str(path))
    except UntrustedFileError as e:
        raise ProfileError(str(path), f"unreadable ({e.message})") from None
    except OSError as e:
        raise ProfileError(str(path), f"unreadable ({e})") from e
    if not isinstance(profile, dict) or profile.get("schema") != SCHEMA:
        raise ProfileError("profile.schema", f"expected {SCHEMA!r} in {path}")
    return profile


def write_profile(profile: dict, path: Path | None = None, overwrite: bool = False) -> Path:
    """Publish the profile atomically; an existing one is replaced by the rename, never removed
    first (a reader sees the old profile or the new one), and never a file hebrus-mlx did not
    write unless `overwrite` (qualify --out, issue 22)."""
    from .artifact.atomic import check_output_file, publish_file

    path = Path(path) if path else profile_path()
    check_output_file(path, overwrite=overwrite, field="--out")
    path.parent.mkdir(parents=True, exist_ok=True)
    profile = {"schema": profile.get("schema"), **profile}  # first: how a later run recognises it
    # JSON is produced before the temp exists; the synced temp is read back before the rename.
    data = json.dumps(profile, indent=1).encode()
    publish_file(path, lambda w: w.write(data), verify=read_profile)
    return path


@functools.lru_cache(maxsize=1)
def _metal_device_opens() -> bool:
    import mlx.core as mx

    try:
        return bool(mx.device_info(mx.gpu))
    except RuntimeError:  # MLX's Metal build on a Mac (or VM) with no Metal device
        return False


def metal_device() -> bool:
    """MLX computes on a Metal device here. `mx.metal.is_available()` only says MLX was built with
    Metal (it is True on every Mac, a VM without a GPU too); a run whose default device is the CPU
    (`mx.set_default_device(mx.cpu)`, as the hosted macOS CI job sets) has no Metal path either."""
    import mlx.core as mx

    if not (hasattr(mx, "metal") and mx.metal.is_available()) or mx.default_device() != mx.gpu:
        return False
    return _metal_device_opens()


def compute_backend() -> str:
    """Which MLX backend computes the default device's work: "metal", "cuda" or "cpu"."""
    import mlx.core as mx

    if metal_device():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu:
        return "cuda"
    return "cpu"


def this_machine() -> dict:
    """The identity a profile is bound to, plus whether MLX computes on a Metal device now."""
    import mlx.core as mx

    return {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "mlx": mx.__version__,
        "metal": metal_device(),
    }


def _entry(profile: dict | None, path) -> dict | None:
    node = profile
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def passed(profile: dict | None, *path: str) -> bool:
    """True only if the entry at `path` (e.g. "kernels", "hc_mix") passed on a Metal device, in a
    profile written on this machine (same OS release, architecture and MLX, AFN-013) and Metal is
    present now. A claim failing any of these is ignored: the feature stays off."""
    entry = _entry(profile, path)
    if entry is None or entry.get("status") != PASSED or entry.get("device") != "metal":
        return False
    wrote = profile.get("machine") if isinstance(profile.get("machine"), dict) else {}
    here = this_machine()
    return bool(wrote.get("metal") and here["metal"] and all(wrote.get(k) == here[k] for k in IDENTITY))


def claims(profile: dict | None) -> Iterator[str]:
    """Dotted paths of every entry the profile marks passed (whether or not it is honoured)."""

    def walk(node, prefix):
        if isinstance(node, dict):
            if node.get("status") == PASSED:
                yield prefix
            for k, v in node.items():
                yield from walk(v, f"{prefix}.{k}" if prefix else k)

    yield from walk(profile or {}, "")


def ignored_claims(profile: dict | None) -> list:
    """Passed entries `passed()` will not honour here (another machine/MLX, no Metal, no device)."""
    return [c for c in claims(profile) if not passed(profile, *c.split("."))]
