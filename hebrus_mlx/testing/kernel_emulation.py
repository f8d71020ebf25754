"""The Metal kernels' MSL sources run through the MSL emulator on numpy (one sequence each): the
same SOURCE and launch geometry the device gets, checked against float64 oracles by tests and by
`hebrus-mlx qualify`'s emulation check."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..kernels import hc_mix as _hc_mix
from ..kernels import ple_gather as _ple_gather
from ..kernels import qsa_attention as _qsa_attention
from . import msl_emulator


def hc_mix(up: np.ndarray, normed: np.ndarray, hc_count: int, hidden: int) -> np.ndarray:
    n = normed.reshape(-1, hc_count * hidden).shape[0]
    p = _hc_mix.launch(n, hc_count, hidden, mx.float32)
    (out,) = msl_emulator.run(
        _hc_mix.NAME,
        _hc_mix.SOURCE,
        {"up": up.reshape(n, -1), "normed": normed.reshape(n, -1)},
        {"mixed": ((n, hidden), normed.dtype)},
        p["grid"],
        p["threadgroup"],
        p["template"],
    )
    return out.reshape(*normed.shape[:-1], hidden)


def ple_gather(
    history: np.ndarray, multipliers, sizes, offsets, table: np.ndarray, n_new: int, heads_per_ngram: int, eos: int
):
    """One sequence: history [T] int64 -> (rows [n_new, heads] int64, emb [n_new, heads * dim])."""
    heads, dim = len(sizes), table.shape[1]
    p = _ple_gather.launch(n_new, history.shape[0] - n_new, heads, heads_per_ngram, dim, eos, mx.float32)
    return msl_emulator.run(
        _ple_gather.NAME,
        _ple_gather.SOURCE,
        {
            "history": history.astype(np.int64),
            "multipliers": np.asarray(multipliers, np.int64),
            "sizes": np.asarray(sizes, np.int64),
            "offsets": np.asarray(offsets, np.int64),
            "table": table,
        },
        {"rows": ((n_new, heads), np.int64), "emb": ((n_new, heads * dim), table.dtype)},
        p["grid"],
        p["threadgroup"],
        p["template"],
    )


def qsa_attention(
    queries: np.ndarray, keys: np.ndarray, values: np.ndarray, idx: np.ndarray, ok: np.ndarray, scale: float
) -> np.ndarray:
    """One sequence: queries [Hq, L, D]; keys/values [Hkv, S, D] (any strides, as the cache's views
    are); idx/ok [L, W] -> [L, Hq * D]."""
    hq, L, D = queries.shape
    p = _qsa_attention.launch(L, hq, keys.shape[0], D, mx.float32)
    (out,) = msl_emulator.run(
        _qsa_attention.NAME,
        _qsa_attention.SOURCE,
        {
            "q": np.ascontiguousarray(queries),
            "k": keys,
            "v": values,
            "idx": np.ascontiguousarray(idx, np.int32),
            "ok": np.ascontiguousarray(ok, np.bool_),
            "scale": np.array([scale], np.float32),
        },
        {"out": ((L, hq * D), queries.dtype)},
        p["grid"],
        p["threadgroup"],
        p["template"],
        row_contiguous=_qsa_attention.ROW_CONTIGUOUS,
    )
    return out
