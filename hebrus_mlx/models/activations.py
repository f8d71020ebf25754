"""Activations as plain ops. mlx.nn's `silu` and `softplus` are mx.compile'd functions, which MLX's
CPU backend JIT-compiles with a C++ compiler the first time each runs on a machine (seconds each,
before the first token); the same ops uncompiled compute the same values and need no compiler.
Inside a compiled region (GraphOptions.compile) they fuse like any other op."""

import mlx.core as mx


def silu(x):
    return x * mx.sigmoid(x)


def softplus(x):
    return mx.logaddexp(x, 0)
