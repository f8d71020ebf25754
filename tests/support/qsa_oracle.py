"""Dense masked attention: the bounded correctness oracle for QSA (AFN-011), for tests only."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class DenseOracleLimitError(ValueError):
    """The dense QSA oracle was asked for more keys than a sparse query can ever see (AFN-011)."""


def dense_qsa_oracle(q, k, v, scale, window: int, n_visible: int):
    """Dense masked attention for contexts where every visible key is selected anyway.

    Only a bounded correctness oracle (AFN-011): it refuses more than `window` visible keys before
    allocating anything. q: [B, H, Q, D] for the last Q positions; k, v: [B, Hkv, T, D].
    """
    if n_visible > window:
        raise DenseOracleLimitError(
            f"dense QSA oracle accepts at most {window} visible keys (budget + ratio - 1), got {n_visible}"
        )
    B, H, Q, D = q.shape
    T = k.shape[2]
    rep = H // k.shape[1]
    k = mx.repeat(k, rep, axis=1)
    v = mx.repeat(v, rep, axis=1)
    scores = (q @ k.swapaxes(-1, -2)) * scale
    query_pos = mx.arange(T - Q, T)[:, None]
    scores = mx.where(mx.arange(T)[None, :] <= query_pos, scores, -np.inf)
    return mx.softmax(scores, axis=-1) @ v
