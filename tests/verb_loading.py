"""Replace how the verbs load their model, for tests: each verb module binds `load_from_args` (from
hebrus_mlx.verb_flags) by name, so the fake goes into every one of them."""

import importlib

VERB_MODULES = (
    "hebrus_mlx.verb_flags",
    "hebrus_mlx.commands.generate",
    "hebrus_mlx.chat",
    "hebrus_mlx.server",
    "hebrus_mlx.commands.cache_prompt",
)


def patch_load_from_args(monkeypatch, fake) -> None:
    for name in VERB_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "load_from_args", fake)
