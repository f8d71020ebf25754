"""The machine profile `hebrus-mlx qualify` writes and `load()` reads (AFN-013): what passed on
this machine is switched on, nothing else. Read and written here, below both."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from .errors import HebrusError

SCHEMA = "hebrus-mlx/machine-profile/1"


class ProfileError(HebrusError, ValueError):
    """The machine profile exists but is not one this version can read."""

    default_field = "profile"


def profile_path() -> Path:
    return Path(os.environ.get("HEBRUS_PROFILE") or Path.home() / ".cache" / "hebrus-mlx" / "profile.json")


def read_profile(path: Optional[Path] = None) -> Optional[dict]:
    """The machine profile, or None when there is none (then nothing optional is switched on)."""
    path = Path(path) if path else profile_path()
    if not path.exists():
        return None
    try:
        profile = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(str(path), f"unreadable ({e})") from e
    if not isinstance(profile, dict) or profile.get("schema") != SCHEMA:
        raise ProfileError("profile.schema", f"expected {SCHEMA!r} in {path}")
    return profile


def write_profile(profile: dict, path: Optional[Path] = None) -> Path:
    """Publish the profile atomically; an existing one is replaced by the rename, never removed
    first (a reader sees the old profile or the new one)."""
    from .artifact.atomic import publish_file

    path = Path(path) if path else profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    publish_file(path, lambda w: w.write(json.dumps(profile, indent=1).encode()))
    return path
