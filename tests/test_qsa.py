"""QSA is physically sparse and orders its selection by time (AFN-011, AFN-016, AFN-017)."""

import math

import mlx.core as mx
import numpy as np
import pytest
from support.parity_fixtures import model
from support.qsa_oracle import DenseOracleLimitError, dense_qsa_oracle

from hebrus_mlx.models.qwen4exp import QSAAttention, _online_softmax_attention, _select_groups


def test_ties_choose_lower_positions_and_emit_chronologically():
    """Contract control: equal scores at the boundary -> lower group positions win (AFN-017)."""
    scores = mx.array([[0.5, 0.9, 0.5, 0.5, 0.9, 0.1]])
    valid = mx.ones((1, 6), dtype=mx.bool_)
    groups, ok = _select_groups(scores, valid, keep=3)
    assert np.array(ok).all()
    assert np.array(groups).tolist() == [[0, 1, 4]]


def test_invalid_groups_are_never_chosen_below_budget():
    scores = mx.array([[0.2, 0.0, 0.0, 0.0]])
    valid = mx.array([[True, True, False, False]])
    groups, ok = _select_groups(scores, valid, keep=3)
    chosen = np.array(groups)[np.array(ok)].tolist()
    assert chosen == [0, 1]


def _attention_layer(m):
    return next(layer.self_attn for layer in m.layers if not layer.is_linear)


def _independent_selection(q, block_keys, query_idx, ratio, keep):
    """NumPy cross-check of the selection rule for one query (independent of the MLX code)."""
    complete = (query_idx + 1) // ratio
    scores = [np.maximum(q @ block_keys[g], 0).sum() / math.sqrt(q.shape[-1]) for g in range(complete)]
    order = sorted(range(complete), key=lambda g: (-scores[g], g))[:keep]
    tokens = [g * ratio + j for g in sorted(order) for j in range(ratio)]
    return tokens + list(range(complete * ratio, query_idx + 1))


@pytest.mark.parametrize("n_tokens", [5, 40, 200])
def test_selection_width_is_bounded_by_budget_at_any_context(n_tokens):
    """The gathered row per query is budget + ratio - 1 wide however long the context is, and
    its contents equal an independent NumPy selection."""
    m = model("tiny_a")
    attn = _attention_layer(m)
    rng = np.random.default_rng(n_tokens)
    di = m.args.indexer_head_dim
    q = mx.array(rng.standard_normal((1, m.args.indexer_n_heads, 3, di)).astype(np.float32))
    ratio = m.args.indexer_compress_ratio
    keys = mx.array(rng.standard_normal((1, n_tokens // ratio, di)).astype(np.float32))
    first = n_tokens - 3
    idx, ok = attn.indexer.select(q, keys, first, n_tokens)
    assert idx.shape == (1, 3, min(m.args.qsa_window, n_tokens))
    for i in range(3):
        ours = np.array(idx)[0, i][np.array(ok)[0, i]].tolist()
        expected = _independent_selection(
            np.array(q)[0, :, i], np.array(keys)[0], first + i, ratio, m.args.indexer_budget // ratio
        )
        assert ours == expected


def test_online_softmax_equals_plain_softmax():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 3, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 3, 150, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 3, 150, 8)).astype(np.float32)
    ok = rng.random((3, 150)) > 0.3
    out = np.array(_online_softmax_attention(mx.array(q), mx.array(k), mx.array(v), mx.array(ok), 0.3, tile=64))
    s = np.einsum("bhqrd,bhqwd->bhqrw", q, k) * 0.3
    s = np.where(ok[None, None, :, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, np.einsum("bhqrw,bhqwd->bhqrd", p, v), atol=1e-5)


def _layer_io(m, n_tokens, seed=0):
    attn = _attention_layer(m)
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((1, n_tokens, m.args.hidden_size)).astype(np.float32))
    cache = m.make_cache()[m.args.layer_types.index("indexed_attention")]
    return attn, x, cache


@pytest.mark.parametrize("model_name", ["tiny_a", "tiny_c"])
def test_sparse_equals_dense_oracle_up_to_its_last_accepted_size(model_name):
    """Below and at budget + ratio - 1 every key is selected, so sparse == dense; one more key
    and the oracle refuses before allocating (AFN-011)."""
    m = model(model_name)
    window = m.args.qsa_window
    for n in (window - 1, window):
        attn, x, cache = _layer_io(m, n)
        B, L, _ = x.shape
        cos, sin = attn.rotary.tables(mx.arange(n))
        q = attn.q_proj(x).reshape(B, L, attn.n_heads, 2 * attn.head_dim)[..., : attn.head_dim]
        q = attn.rotary.apply(attn.q_norm(q).transpose(0, 2, 1, 3), cos, sin)
        k = attn.rotary.apply(
            attn.k_norm(attn.k_proj(x).reshape(B, L, attn.n_kv_heads, attn.head_dim)).transpose(0, 2, 1, 3), cos, sin
        )
        v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, attn.head_dim).transpose(0, 2, 1, 3)
        dense = dense_qsa_oracle(q, k, v, attn.scale, window, n_visible=n)
        idx, ok = attn.indexer.select(attn.indexer.project(x, attn.rotary, cos, sin)[0], _blocks(attn, x, n), 0, n)
        sparse = attn.sparse_attention(q, k, v, idx, ok)
        np.testing.assert_allclose(np.array(sparse), np.array(dense.transpose(0, 2, 1, 3).reshape(1, n, -1)), atol=1e-5)
    with pytest.raises(DenseOracleLimitError, match="at most"):
        dense_qsa_oracle(None, None, None, 1.0, window, n_visible=window + 1)


def _blocks(attn, x, n):
    _, raw = attn.indexer.project(x, attn.rotary, *attn.rotary.tables(mx.arange(n)))
    complete = n // attn.indexer.ratio
    return attn.indexer.block_keys(raw[:, : complete * attn.indexer.ratio], 0, attn.rotary, 0)


def test_dense_oracle_is_unreachable_from_the_model():
    """AFN-011/013: the oracle is a test seam; the model's attention path never calls it."""
    import inspect

    import hebrus_mlx.models.qwen4exp as q4

    assert "dense_qsa_oracle" not in inspect.getsource(QSAAttention)
    assert "dense_qsa_oracle" not in inspect.getsource(q4)
