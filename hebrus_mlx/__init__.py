"""hebrus-mlx: an MLX runtime for Qwen4Exp (Qwen3.8-Flash-Next).

`load`, `generate` and `stream_generate` mirror mlx_lm's top-level API; they are imported on first
use so that `import hebrus_mlx` (and CPU-only admission) stays free of MLX.
"""

__version__ = "0.1.0"

_LAZY = {"load": "hebrus_mlx.utils", "generate": "hebrus_mlx.generate", "stream_generate": "hebrus_mlx.generate"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hebrus_mlx' has no attribute {name!r}")


__all__ = ["load", "generate", "stream_generate", "__version__"]
