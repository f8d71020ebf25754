"""Fused hyper-connection mix: mixed[n, h] = mean_s sigmoid(up[n, s, h]) * normed[n, s, h].

The ops path (`HyperConnection.mix` in the graph) materialises sigmoid(up) and the product over all
hc_count streams; the kernel reads each element once and writes only the mixed row.
"""

from __future__ import annotations

from functools import cache
from math import gcd

import mlx.core as mx
import numpy as np

from . import make_kernel

NAME = "hc_mix"
INPUTS = ("up", "normed")
OUTPUTS = ("mixed",)

SOURCE = """
    uint h = thread_position_in_grid.x;
    uint n = thread_position_in_grid.y;
    float acc = 0.0f;
    for (int s = 0; s < S; ++s) {
        uint i = (n * S + s) * H + h;
        float w = 1.0f / (1.0f + metal::exp(-float(up[i])));
        acc += w * float(normed[i]);
    }
    mixed[n * H + h] = T(acc / float(S));
"""


def launch(n_rows: int, hc_count: int, hidden: int, dtype):
    tg = gcd(hidden, 256)
    return dict(
        grid=(hidden, n_rows, 1), threadgroup=(tg, 1, 1), template=[("T", dtype), ("S", hc_count), ("H", hidden)]
    )


def ops(up: mx.array, normed: mx.array, hc_count: int, hidden: int) -> mx.array:
    shape = (*normed.shape[:-1], hc_count, hidden)
    return (mx.sigmoid(up).reshape(shape) * normed.reshape(shape)).mean(axis=-2)


@cache
def kernel_object():
    return make_kernel(NAME, INPUTS, OUTPUTS, SOURCE)


def metal(up: mx.array, normed: mx.array, hc_count: int, hidden: int) -> mx.array:
    lead = normed.shape[:-1]
    n = int(np.prod(lead)) if lead else 1
    p = launch(n, hc_count, hidden, normed.dtype)
    (out,) = kernel_object()(
        inputs=[up.reshape(n, -1), normed.reshape(n, -1)],
        output_shapes=[(n, hidden)],
        output_dtypes=[normed.dtype],
        **p,
    )
    return out.reshape(*lead, hidden)
