"""Long context at the real limits, on the tiny config: the 262,144-position boundary, attention-cache
growth without quadratic copying, and a QSA decode step that allocates nothing as wide as the
context. Defends AFN-011 (the boundary is enforced before allocation) and AFN-016 (sparse attention
is bounded physical work, not a mask)."""

import math

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx.models import qwen4exp as q
from hebrus_mlx.models.cache import AttentionCache, ContextLengthError, LinearCache, SequenceCache
from hebrus_mlx.testing.tiny_configs import TINY_QWEN4EXP

LIMIT = 262_144  # Qwen4Exp's max_position_embeddings


def _model(**fields):
    args = q.ModelArgs.from_dict(dict(TINY_QWEN4EXP, max_position_embeddings=LIMIT, **fields))
    mx.random.seed(0)
    m = q.Model(args)
    mx.eval(m.parameters())
    return m


def _filled(m, n):
    """A sequence cache holding n tokens: attention layers get random K/V/index rows straight into
    their state (a 262K prefill of even the tiny model is far too slow here); recurrent layers
    start empty, which is a state the model can be in."""
    a, r = m.args, m.args.indexer_compress_ratio
    mx.random.seed(1)
    layers = []
    for layer in m.layers:
        if layer.is_linear:
            layers.append(LinearCache())
            continue
        c = AttentionCache()
        c.state = [
            mx.random.normal((1, a.num_key_value_heads, n, a.head_dim)),
            mx.random.normal((1, a.num_key_value_heads, n, a.head_dim)),
            mx.random.normal((1, n, a.indexer_head_dim)),
            mx.random.normal((1, n // r, a.indexer_head_dim)),
            n,
            n // r,
            0,
            r,
        ]
        mx.eval(c.state[:4])
        layers.append(c)
    return SequenceCache.from_layers(layers)


def _attention(cache):
    return [layer for layer in cache if isinstance(layer, AttentionCache)]


def test_context_262144_is_accepted_and_262145_refused_before_allocation():
    """AFN-011: the last accepted contexts (262,143 and 262,144 tokens) run and give finite logits;
    the first refused one (262,145) raises ContextLengthError naming `context` before any graph
    work: no allocation, the cache unchanged."""
    m = _model()
    cache = _filled(m, LIMIT - 2)
    for context in (LIMIT - 1, LIMIT):
        logits = m(mx.array([[5]]), cache=cache)
        mx.eval(logits)
        assert np.isfinite(np.array(logits)).all()
        assert cache.offset == context and all(c.length == context for c in _attention(cache))
    buffers = [(c.keys, c.values, c.raw_keys, c.block_keys) for c in _attention(cache)]
    token = mx.array([[5]])
    mx.eval(token)
    mx.synchronize()
    mx.reset_peak_memory()
    with pytest.raises(ContextLengthError) as err:
        m(token, cache=cache)
    assert err.value.field == "context" and "262145" in str(err.value)
    assert mx.get_peak_memory() == 0  # nothing was allocated since the reset
    assert cache.offset == LIMIT
    for c, before in zip(_attention(cache), buffers):
        assert c.length == LIMIT and all(a is b for a, b in zip((c.keys, c.values, c.raw_keys, c.block_keys), before))


def test_position_262143_is_accepted_and_262144_refused_on_a_fresh_cache():
    """AFN-011 via the anchor: one token at the last position (0-based 262,143) runs; one at
    262,144 (a 262,145-token context) and two at 262,143 are refused naming `context`, and leave
    the cache empty and unanchored."""
    m = _model()
    for position, n in ((LIMIT, 1), (LIMIT - 1, 2)):
        cache = m.make_cache()
        with pytest.raises(ContextLengthError) as err:
            m(mx.array([[5] * n]), cache=cache, position=position)
        assert err.value.field == "context"
        assert cache.offset == 0 and cache.start_position == 0
        assert all(c.keys is None for c in _attention(cache))
    cache = m.make_cache()
    logits = m(mx.array([[5]]), cache=cache, position=LIMIT - 1)
    assert np.isfinite(np.array(logits)).all() and cache.next_position == LIMIT


def test_attention_cache_growth_copies_linear_bytes():
    """Filling n positions one token at a time reallocates O(log n) times and copies at most 5n rows
    in all (growth by 1.25x, 4n, plus the 256-row rounding of small buffers; a fixed 256-row step
    reallocates n/256 times and copies ~n^2/512 rows, 32n here). Counted from outside: each change of the buffer's capacity is one allocation that
    copies the old buffer."""
    n, hkv, d, di = 16_384, 1, 4, 4
    cache = AttentionCache()
    k = mx.ones((1, hkv, 1, d))
    raw = mx.ones((1, 1, di))
    events, rows_copied, cap = 0, 0, 0
    for i in range(n):
        cache.append(k, k, raw)
        if cache.keys.shape[2] != cap:
            events += 1
            rows_copied += cap
            cap = cache.keys.shape[2]
        if i % 512 == 0:
            mx.eval(cache.keys, cache.values, cache.raw_keys)
    mx.eval(cache.keys, cache.values, cache.raw_keys)
    assert cache.length == n and cap >= n
    assert events <= math.ceil(math.log(n / 256) / math.log(1.25)) + 1, events
    assert rows_copied <= 5 * n, rows_copied
    assert np.array(cache.keys[:, :, :n]).sum() == n * hkv * d


def test_growth_stops_at_the_context_limit():
    """Growth never reserves rows past max_position_embeddings: a 2,000-position model's cache
    holds at most 2,000 rows however it grew."""
    m = _model()
    m.args.max_position_embeddings = 2_000
    cache = m.make_cache()
    m(mx.zeros((1, 1_700), dtype=mx.int32), cache=cache)  # capacity 1,792 (1,700 rounded to 256)
    m(mx.zeros((1, 200), dtype=mx.int32), cache=cache)  # 1.25x would reserve 2,304
    for c in _attention(cache):
        assert c.keys.shape[2] == 2_000 and c.raw_keys.shape[1] == 2_000
        assert c.block_keys.shape[1] <= 2_000 // m.args.indexer_compress_ratio


def _step_peak(attn, cache, x, attend=None):
    """Bytes allocated by one decode step above what was resident before it (MLX's peak memory)."""
    if attend is not None:
        attn.attend = attend
    try:
        mx.synchronize()
        mx.reset_peak_memory()
        resident = mx.get_active_memory()
        out = attn(x, cache)
        mx.eval(out, cache.keys, cache.values, cache.raw_keys, cache.block_keys)
        return mx.get_peak_memory() - resident
    finally:
        attn.__dict__.pop("attend", None)


def test_decode_step_allocates_nothing_as_wide_as_the_context():
    """AFN-016: one QSA decode step over a 131,072-token cache allocates less than a single float32
    row of context width (what a dense [1, S] mask alone would take; a [S, S] one is far larger).
    Measured with MLX's peak-memory counter. The group ratio is raised to 64 so the candidate-group
    scoring, which is O(S / ratio) by design, sits well below that line; the control (the same
    selection turned into an additive mask around dense attention) crosses it, so the
    measurement sees such a mask. K/V are appended in place: a per-step copy of the cache would
    cross it too."""
    S, ratio = 131_072, 64
    m = _model(indexer_compress_ratio=ratio, indexer_budget=2 * ratio)
    attn = next(layer.self_attn for layer in m.layers if not layer.is_linear)
    cache = _attention(_filled(m, S))[0]
    cache.max_length = LIMIT
    x = mx.random.normal((1, 1, m.args.hidden_size))
    mx.eval(attn(x, cache), cache.keys, cache.values, cache.raw_keys)  # first step grows the buffers
    mask_row = (S + 2) * 4

    peak = _step_peak(attn, cache, x)
    assert peak < mask_row, f"decode step allocated {peak} bytes; a [1, S] float32 mask is {mask_row}"

    def dense(queries, keys, values, idx, ok, n_tokens):
        mask = mx.full((1, n_tokens), -np.inf)
        mask[:, mx.where(ok[0, 0], idx[0, 0], idx[0, 0, 0])] = 0.0
        o = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=attn.scale, mask=mask)
        return o.transpose(0, 2, 1, 3).reshape(1, 1, -1)

    assert _step_peak(attn, cache, x, dense) > mask_row
