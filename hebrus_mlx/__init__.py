"""hebrus-mlx: an MLX runtime for Qwen4Exp (Qwen3.8-Flash-Next).

`load`, `generate`, `stream_generate` and `batch_generate` mirror mlx_lm's top-level API; `GraphOptions` is
load's `options` (how the graph is built: models/options.py). They are imported on first
use so that `import hebrus_mlx` (and CPU-only admission, AFN-004) stays free of MLX. Because the
function `generate` shares its name with the submodule `hebrus_mlx.generate`, the package attribute
always resolves to the function; import from the module by name (`from hebrus_mlx.generate import
generate_step`) or reach it as `sys.modules["hebrus_mlx.generate"]` (the same for `batch_generate`).
"""

import importlib
import sys
import types

__version__ = "0.1.0"

_API = {
    "load": "hebrus_mlx.loader",
    "generate": "hebrus_mlx.generate",
    "stream_generate": "hebrus_mlx.generate",
    "batch_generate": "hebrus_mlx.batch_generate",
    "GraphOptions": "hebrus_mlx.models.options",
}


class _Package(types.ModuleType):
    def __getattribute__(self, name):
        if name in _API:
            return getattr(importlib.import_module(_API[name]), name)
        return super().__getattribute__(name)


sys.modules[__name__].__class__ = _Package

__all__ = ["load", "generate", "stream_generate", "batch_generate", "GraphOptions", "__version__"]
