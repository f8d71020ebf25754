"""Gated DeltaNet recurrence: per-token decode via mx.fast and a chunked form for prefill.

State layout is MLX's `[B, Hv, Dv, Dk]` (the transpose of the reference's `[B, Hv, Dk, Dv]`).
Inputs follow `mx.fast.gated_delta_update`: q already l2-normalised and scaled by Dk**-0.5,
k l2-normalised, and the decay given in log space as `g` (gamma = exp(g)).
"""

from __future__ import annotations

import mlx.core as mx

CHUNK_SIZE = 64
# Up to this many tokens the per-token recurrence runs (decode, speculative verify blocks): the
# chunked form pads every call to CHUNK_SIZE, so a 4-token block would cost a 64-token chunk.
RECURRENT_MAX_TOKENS = 8


def l2_normalize(x: mx.array, eps: float = 1e-6) -> mx.array:
    # eps is added to the sum of squares, as the reference does.
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


# On the CPU backend mx.fast.gated_delta_update is an ops fallback with a view op around every
# step; the same arithmetic on grouped-head views (no repeat of q/k, keepdims sums) is half the nodes
# and bit-identical (tests/test_graph_fast_paths.py). Metal keeps the fused kernel.
GROUPED_OPS = mx.default_device() == mx.cpu


def recurrent_step(q, k, v, g, beta, state):
    """Token-by-token recurrence (the decode path). Shapes: q,k [B,T,Hk,Dk]; v [B,T,Hv,Dv]."""
    if GROUPED_OPS:
        return _grouped_steps(q, k, v, mx.exp(g), beta, state)
    return mx.fast.gated_delta_update(q, k, v, mx.exp(g), beta, state)


def _grouped_steps(q, k, v, gamma, beta, state):
    """The recurrence, per token: decay the state, read its memory of k, write the beta-scaled
    correction, read q. Value heads share key heads in consecutive groups (as mx.repeat does)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    r = Hv // Hk
    s = state.reshape(B, Hk, r, Dv, Dk)

    def at(x, t, *shape):  # token t of x as a [B, Hk, ...] view (one node for a single token)
        return x.reshape(B, *shape) if T == 1 else x[:, t].reshape(B, *shape)

    ys = []
    for t in range(T):
        kt = at(k, t, Hk, 1, 1, Dk)
        s = s * at(gamma, t, Hk, r, 1, 1)
        kv_mem = (s * kt).sum(axis=-1, keepdims=True)
        delta = (at(v, t, Hk, r, Dv, 1) - kv_mem) * at(beta, t, Hk, r, 1, 1)
        s = s + kt * delta
        ys.append((s * at(q, t, Hk, 1, 1, Dk)).sum(axis=-1, keepdims=True).reshape(B, 1, Hv, Dv))
    y = ys[0] if T == 1 else mx.concatenate(ys, axis=1)
    return y.astype(v.dtype), s.reshape(B, Hv, Dv, Dk)


def _unit_lower_inverse(m: mx.array) -> mx.array:
    """Inverse of (I + m) for strictly lower-triangular m, by block doubling.

    At each level the inverse of [[A, 0], [C, B]] is [[A^-1, 0], [-B^-1 C A^-1, B^-1]]; starting
    from 1x1 identity blocks, log2(C) levels of batched matmuls give the exact triangular inverse.
    """
    n = m.shape[-1]
    batch = m.shape[:-2]
    inv = mx.broadcast_to(mx.eye(1, dtype=m.dtype), (*batch, n, 1, 1))
    size = 1
    while size < n:
        blocks = n // (2 * size)
        inv = inv.reshape(*batch, blocks, 2, size, size)
        a_inv, b_inv = inv[..., 0, :, :], inv[..., 1, :, :]
        rows = m.reshape(*batch, blocks, 2 * size, n)
        # Off-diagonal block C: rows [size, 2size) x cols [0, size) of each diagonal 2size block.
        starts = mx.arange(blocks) * 2 * size
        cols = starts[:, None] + mx.arange(size)[None, :]
        lower_rows = rows[..., size:, :]  # [*, blocks, size, n]
        c = mx.take_along_axis(lower_rows, mx.broadcast_to(cols[:, None, :], (*batch, blocks, size, size)), axis=-1)
        off = -(b_inv @ c @ a_inv)
        zeros = mx.zeros_like(off)
        top = mx.concatenate([a_inv, zeros], axis=-1)
        bottom = mx.concatenate([off, b_inv], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)
        size *= 2
    return inv.reshape(*batch, n, n)


def chunked(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE):
    """Chunked (WY / UT-transform) form of the same recurrence, for prefill and multi-token steps.

    Returns (out [B,T,Hv,Dv], state [B,Hv,Dv,Dk]); matches `recurrent_step` up to rounding.
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if Hv != Hk:
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    pad = (-T) % chunk_size
    # [B, H, T, D] in float32
    q, k, v = (
        mx.pad(x.astype(mx.float32), [(0, 0), (0, pad), (0, 0), (0, 0)]).transpose(0, 2, 1, 3) for x in (q, k, v)
    )
    g, beta = (mx.pad(x.astype(mx.float32), [(0, 0), (0, pad), (0, 0)]).transpose(0, 2, 1) for x in (g, beta))
    n = (T + pad) // chunk_size
    C = chunk_size

    def chunks(x):
        return x.reshape(B, Hv, n, C, *x.shape[3:])

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    cum = mx.cumsum(g, axis=-1)  # [B,H,n,C]
    causal = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    diff = cum[..., :, None] - cum[..., None, :]
    decay = mx.where(causal, mx.exp(mx.where(causal, diff, 0.0)), 0.0)  # [B,H,n,C,C]

    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    system = mx.where(strict, (k_beta @ k.swapaxes(-1, -2)) * decay, 0.0)
    inv = _unit_lower_inverse(system)
    new_values = inv @ v_beta  # u
    k_cumdecay = inv @ (k_beta * mx.exp(cum)[..., None])  # w
    intra = mx.where(causal, (q @ k.swapaxes(-1, -2)) * decay, 0.0)
    q_decayed = q * mx.exp(cum)[..., None]
    k_tail = k * mx.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = mx.exp(cum[..., -1])[..., None, None]  # [B,H,n,1,1]

    s = state.astype(mx.float32).swapaxes(-1, -2)  # reference layout [B,H,Dk,Dv]
    outs = []
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        outs.append(q_decayed[:, :, i] @ s + intra[:, :, i] @ v_new)
        s = s * chunk_decay[:, :, i] + k_tail[:, :, i].swapaxes(-1, -2) @ v_new
    out = mx.concatenate(outs, axis=2)[:, :, :T]  # [B,H,T,Dv]
    return out.transpose(0, 2, 1, 3), s.swapaxes(-1, -2).astype(state.dtype)
