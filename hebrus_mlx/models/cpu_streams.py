"""A second CPU stream for independent branches of the resident graph (MLX CPU backend only).

MLX's CPU backend runs a stream's ops one at a time on that stream's thread, and the BLAS in the
Linux wheels is single-threaded, so one decode step uses one core however many there are. Ops placed
on a second CPU stream run on a second thread; MLX orders them against the first stream with its own
cross-stream events. The graph puts independent parts of a layer's work there (half of the routed
experts; in prefill and verify blocks also some of the same-input projections and half of the
positions' logits); each part computes exactly what the single-stream op computes for those rows, so
outputs are bit-identical (tests/test_cpu_streams.py).

On Metal the model runs on one GPU stream and this is off: the GPU already runs each op wide.
`HEBRUS_CPU_STREAMS=1` switches it off on the CPU too (A/B, debugging); `set_cpu_streams` does the
same at run time.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import mlx.core as mx

from ..errors import UsageError


ENV = "HEBRUS_CPU_STREAMS"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _from_env() -> int:
    value = os.environ.get(ENV, "auto").strip()
    if value == "auto":
        return min(2, _cores())
    if value not in ("1", "2"):
        raise UsageError(ENV, f"must be auto, 1 or 2, got {value!r}")
    return int(value)

_streams: Optional[int] = None  # read from the environment on first use (load() does it early)
# MLX streams belong to the thread that made them (as generate.generation_stream).
_thread = threading.local()


def set_cpu_streams(n: int) -> int:
    """Use `n` (1 or 2) CPU streams for the resident graph from now on; returns the previous value."""
    global _streams
    if n not in (1, 2):
        raise UsageError("cpu_streams", f"must be 1 or 2, got {n!r}")
    previous, _streams = cpu_streams(), n
    return previous


def cpu_streams() -> int:
    """1 or 2: from set_cpu_streams, else HEBRUS_CPU_STREAMS (auto: 2 on a CPU with >= 2 cores)."""
    global _streams
    if _streams is None:
        _streams = _from_env()
    return _streams


def side_stream() -> Optional[mx.Stream]:
    """The second CPU stream of this thread, or None (one stream asked for, or a non-CPU device)."""
    if cpu_streams() < 2 or mx.default_device() != mx.cpu:
        return None
    stream = getattr(_thread, "side", None)
    if stream is None:
        stream = _thread.side = mx.new_stream(mx.cpu)
    return stream
