"""`GraphOptions`: every choice of how the resident graph is built and run, in one typed object.

Each field picks between implementations of the same maths; every choice keeps greedy tokens
identical to the plain path (tests/test_graph_fast_paths.py, test_cpu_streams.py, test_kernels.py).
`load()` and the CLI build one, `models/optimize.apply` applies it at load, and the model makes it
the active options while it builds each forward's graph (`use`), so two models with different
options can run side by side in one process (the benchmarks' A/B, the tests' plain-vs-fast).

None means "decide for the backend in use" (`resolved()`): measured choices, docs/BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..errors import UsageError


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


@dataclass(frozen=True)
class GraphOptions:
    # mx.compile the elementwise regions (norms, gates, mixes). None: on Metal only; on the CPU
    # backend the first run JIT-compiles each region (a C++ compiler per shape, tens of seconds cold)
    # and the warm gain does not pay for it (docs/BENCHMARKS.md, "compiled regions").
    compile: bool | None = None
    # One matmul for each group of same-input projections, for inputs up to `join_max_tokens`
    # positions (decode and verify blocks; prefill keeps per-Linear matmuls, measured faster).
    join_projections: bool = True
    join_max_tokens: int = 16
    # Resident float weights stored [in, out] (the CPU BLAS runs x @ W^T faster so). None: CPU only.
    in_major: bool | None = None
    # One cos/sin table per QSA call instead of mx.fast.rope (a per-call table rebuild on the CPU
    # backend; a fused kernel on Metal). None: CPU only.
    rope_tables: bool | None = None
    # The dense QSA regime (every visible key selected) through the fused SDPA kernel instead of the
    # sparse gather.
    dense_sdpa: bool = True
    # CPU streams for the resident graph (models/cpu_streams.py): 1 or 2. None: 2 on the CPU backend
    # with >= 2 cores, else 1 (a GPU runs each op wide on its one stream).
    cpu_streams: int | None = None
    # Metal kernels the machine profile qualified on this device (kernels/__init__.py); False: none.
    metal_kernels: bool = True
    # Streaming's GPU-event and MTLIO paths where qualified (stream/engine.py); False: not used.
    gpu_events: bool = True
    mtlio: bool = True

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "cpu_streams":
                if value not in (None, 1, 2):
                    raise UsageError("cpu_streams", f"must be 1 or 2 (or None: auto), got {value!r}")
            elif f.name == "join_max_tokens":
                if type(value) is not int or value < 0:
                    raise UsageError("join_max_tokens", f"must be an integer >= 0, got {value!r}")
            elif not (isinstance(value, bool) or (value is None and f.default is None)):
                raise UsageError(f.name, f"must be true or false, got {value!r}")

    @classmethod
    def plain(cls) -> GraphOptions:
        """Every alternative off: the reference path the fast ones are checked against."""
        return cls(
            compile=False,
            join_projections=False,
            in_major=False,
            rope_tables=False,
            dense_sdpa=False,
            cpu_streams=1,
            metal_kernels=False,
        )

    def resolved(self) -> GraphOptions:
        """The None fields decided for the default device (itself when none is None: a model's
        options are resolved once at load, and each forward asks again)."""
        if None not in (self.compile, self.in_major, self.rope_tables, self.cpu_streams):
            return self
        cpu = mx.default_device() == mx.cpu
        auto = {"compile": not cpu, "in_major": cpu, "rope_tables": cpu, "cpu_streams": min(2, _cores()) if cpu else 1}
        return dataclasses.replace(self, **{k: v for k, v in auto.items() if getattr(self, k) is None})

    def replace(self, **changes) -> GraphOptions:
        return dataclasses.replace(self, **changes)

    @classmethod
    def parse(cls, text: str) -> GraphOptions:
        """`--graph` on the command line: `KEY=VALUE[,KEY=VALUE...]` over the fields (on/off, true/false,
        auto for the None fields, integers for cpu_streams and join_max_tokens); `plain` alone turns
        every alternative off. A bad key or value is a UsageError naming it."""
        if text.strip() == "plain":
            return cls.plain()
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in fields:
                raise UsageError("--graph", f"expected KEY=VALUE with KEY one of {', '.join(fields)}, got {item!r}")
            values[key] = _parse_value(key, raw.strip().lower(), fields[key].default is None)
        try:
            return cls(**values)
        except UsageError as e:
            raise UsageError(f"--graph {e.field}", e.message) from None


def _parse_value(key: str, raw: str, auto: bool):
    if raw == "auto" and auto:
        return None
    if key in ("cpu_streams", "join_max_tokens"):
        try:
            return int(raw, 10)
        except ValueError:
            raise UsageError(f"--graph {key}", f"expected an integer, got {raw!r}") from None
    if raw in ("on", "true", "1", "yes"):
        return True
    if raw in ("off", "false", "0", "no"):
        return False
    raise UsageError(f"--graph {key}", f"expected on or off{' or auto' if auto else ''}, got {raw!r}")


def jit_cache_dir() -> Path:
    """Where MLX's CPU backend keeps the kernels it compiles for mx.compile'd graphs."""
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"


def jit_notice(options: GraphOptions) -> str | None:
    """One line for stderr when this run will JIT-compile kernels with a C++ compiler before its first
    token (compiled regions on the CPU backend, nothing compiled yet on this machine), else None: so
    a cold first run says what it is doing instead of staying silent."""
    if not options.resolved().compile or mx.default_device() != mx.cpu:
        return None
    cache = jit_cache_dir()
    if cache.is_dir() and any(cache.glob("*.so")):
        return None
    return (
        f"hebrus-mlx: first run with compiled regions on this machine: MLX compiles its CPU kernels into "
        f"{cache} (up to a minute or more, once; --graph compile=off skips it)"
    )


_active: contextvars.ContextVar[GraphOptions | None] = contextvars.ContextVar("graph_options", default=None)
_default: GraphOptions | None = None


def active() -> GraphOptions:
    """The options the graph being built follows: the model's while it runs, else the default."""
    current = _active.get()
    if current is not None:
        return current
    global _default
    if _default is None:
        _default = GraphOptions().resolved()
    return _default


@contextlib.contextmanager
def use(options: GraphOptions):
    """Make `options` (resolved) the active ones in this context."""
    token = _active.set(options.resolved())
    try:
        yield
    finally:
        _active.reset(token)
