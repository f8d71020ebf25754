"""Import parts of an unpacked package tree (mlx-vlm's wheel) without running its package `__init__`
files, which import far more than tests and benchmarks need (its vision stack, PIL)."""

from __future__ import annotations

import os
import sys
import types


def register_bare_packages(root: str, names) -> None:
    """Put `root` on sys.path and register each dotted package name in `names` not yet imported as an
    empty module whose __path__ is its folder under `root`: its submodules then import normally while
    its own `__init__` never runs."""
    if root not in sys.path:
        sys.path.insert(0, root)
    for name in names:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(root, *name.split("."))]
            sys.modules[name] = package
