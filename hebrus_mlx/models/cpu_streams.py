"""A second CPU stream for independent branches of the resident graph (MLX CPU backend only).

MLX's CPU backend runs a stream's ops one at a time on that stream's thread, and the BLAS in the
Linux wheels is single-threaded, so one decode step uses one core however many there are. Ops placed
on a second CPU stream run on a second thread; MLX orders them against the first stream with its own
cross-stream events. models/optimize.py puts independent parts of a layer's work there (half of the
routed experts; in prefill and verify blocks also some of the same-input projections and half of the
positions' logits); each part computes exactly what the single-stream op computes for those rows, so
outputs are bit-identical (tests/test_cpu_streams.py).

How many streams: `GraphOptions.cpu_streams` (models/options.py), read from the active options while
a graph is built. On Metal the model runs on one GPU stream and this is off: the GPU already runs
each op wide.
"""

from __future__ import annotations

import threading

import mlx.core as mx

from . import options as graph_options

# MLX streams belong to the thread that made them (as generate.generation_stream).
_thread = threading.local()


def side_stream() -> mx.Stream | None:
    """The second CPU stream of this thread, or None (one stream asked for, or a non-CPU device)."""
    if graph_options.active().cpu_streams < 2 or mx.default_device() != mx.cpu:
        return None
    stream = getattr(_thread, "side", None)
    if stream is None:
        stream = _thread.side = mx.new_stream(mx.cpu)
    return stream
