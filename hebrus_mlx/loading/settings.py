"""What an artifact streams and how: one typed object, checked once when it is made.

`load()`, `load_model()`, `load_artifact_model()` and `load_pipeline()` take the same five
keywords as mlx-lm users pass them (`expert_cache_gb=8, prefetch="router-reuse:1"`, ...) or one
`settings=StreamSettings(...)`; either way the values are checked here, and the planner and the
streaming layer below take them as they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .. import flags
from ..errors import UsageError
from ..stream.predict import PrefetchSpec, parse_prefetch
from ..stream.sweep import parse_mode


@dataclass(frozen=True)
class StreamSettings:
    """expert_cache_gb / ple_cache_gb: stream the routed experts / the PLE pages through a cache of
    this many GiB (None: decided from available memory); prefetch: what to read ahead (a name such
    as "router-reuse:1" or a PrefetchSpec; None: the loader's default when experts stream);
    expert_mirror: a second copy of the expert store on another disk; prefill_sweep: auto, on or
    off (None: auto)."""

    expert_cache_gb: float | None = None
    ple_cache_gb: float | None = None
    prefetch: PrefetchSpec | None = None
    expert_mirror: str | None = None
    prefill_sweep: str = "auto"

    def __post_init__(self):
        for name in ("expert_cache_gb", "ple_cache_gb"):
            v = getattr(self, name)
            if v is None:
                continue
            # NaN, inf and 1e300 (it overflows the byte count) are refused too.
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= flags.MAX_CACHE_GB):
                raise UsageError(name, f"must be in (0, {flags.MAX_CACHE_GB:g}] GiB, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.prefetch is not None:
            object.__setattr__(self, "prefetch", parse_prefetch(self.prefetch))
        object.__setattr__(self, "prefill_sweep", parse_mode(self.prefill_sweep))
        if self.expert_mirror is not None:
            if not isinstance(self.expert_mirror, (str, os.PathLike)):
                raise UsageError("expert-mirror", f"must be a path, got {type(self.expert_mirror).__name__}")
            object.__setattr__(self, "expert_mirror", os.fspath(self.expert_mirror))

    def streaming_asked(self) -> str | None:
        """The first field that asks for streaming (an HF checkpoint refuses it), else None."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "prefill_sweep":
                if v == "on":
                    return f.name
            elif v is not None:
                return f.name
        return None


def resolve(settings: StreamSettings | None = None, **given) -> StreamSettings:
    """`settings`, or one made from the keywords given (None ones left out); both at once is a
    UsageError (which one would win is not obvious)."""
    given = {k: v for k, v in given.items() if v is not None}
    if settings is not None:
        if not isinstance(settings, StreamSettings):
            raise UsageError("settings", f"must be a StreamSettings, got {type(settings).__name__}")
        if given:
            raise UsageError(sorted(given)[0], "pass it inside settings=StreamSettings(...), not beside it")
        return settings
    return StreamSettings(**given)


__all__ = ["StreamSettings", "resolve"]
