"""Replace how the verbs load their model, for tests: each verb module binds `load_from_args` (from
hebrus_mlx.commands.verb_flags) by name, so the fake goes into every one of them."""

import importlib

VERB_MODULES = (
    "hebrus_mlx.commands.verb_flags",
    "hebrus_mlx.commands.generate",
    "hebrus_mlx.commands.chat",
    "hebrus_mlx.commands.server",
    "hebrus_mlx.commands.cache_prompt",
)


def patch_load_from_args(monkeypatch, fake) -> None:
    # Import every module first: one imported after verb_flags is patched would bind the fake as
    # its own, and monkeypatch would then "restore" the fake there.
    modules = [importlib.import_module(name) for name in VERB_MODULES]
    for module in modules:
        monkeypatch.setattr(module, "load_from_args", fake)
