"""Sequence state: chunk partitions, snapshot/restore, holes and context limits.
Defends AFN-010 (state moves as one unit), AFN-012 (PLE history across ubatches), AFN-018 (holes)."""

import mlx.core as mx
import numpy as np
import pytest
from support.parity_fixtures import capture, model

from hebrus_mlx.models.cache import CacheHoleError, ContextLengthError, LinearCache
from hebrus_mlx.models.qwen4exp import Capture


def _run(m, ids, sizes):
    """Feed ids in chunks of the given sizes (cycled); return logits, routes per layer, cache."""
    cache = m.make_cache()
    logits, routes = [], {i: [] for i in range(m.args.num_hidden_layers)}
    pos, k = 0, 0
    while pos < ids.shape[1]:
        n = min(sizes[k % len(sizes)], ids.shape[1] - pos)
        cap = Capture()
        logits.append(m(mx.array(ids[:, pos : pos + n]), cache=cache, capture=cap))
        for i, r in cap.routes.items():
            routes[i].append(np.array(r).reshape(-1, m.args.num_experts_per_tok))
        pos, k = pos + n, k + 1
    out = np.concatenate([np.array(x) for x in logits], axis=1)
    return out, {i: np.concatenate(v) for i, v in routes.items()}, cache


def _discrete_state(cache):
    """Integer state that must be identical across partitions: counters and n-gram contexts."""
    out = [cache.offset]
    for layer in cache:
        if isinstance(layer, LinearCache):
            if layer.ngram_context is not None:
                out.append(np.array(layer.ngram_context).tolist())
        else:
            out.append((layer.length, layer.n_groups))
    return out


def _float_state(cache):
    return [np.array(a) for a in cache.arrays if a.dtype != mx.int64]


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_partitions_give_identical_routes_logits_and_state(name):
    m = model(name)
    ids = capture(name)["input_ids"].astype(np.int32)
    base_logits, base_routes, base_cache = _run(m, ids, [ids.shape[1]])
    for sizes in ([1], [1, 2, 1], [3, 5], [16, 7]):
        logits, routes, cache = _run(m, ids, sizes)
        err = np.abs(logits - base_logits).max()
        assert err <= 1e-5, f"{sizes}: logits differ by {err}"
        for i in routes:
            np.testing.assert_array_equal(routes[i], base_routes[i], err_msg=f"{sizes} layer {i}")
        assert _discrete_state(cache) == _discrete_state(base_cache)
        for a, b in zip(_float_state(cache), _float_state(base_cache)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5, err_msg=f"{sizes}: state differs")


def test_snapshot_restore_replays_bit_identically():
    m = model("tiny_a")
    ids = capture("tiny_a")["input_ids"].astype(np.int32)
    cache = m.make_cache()
    m(mx.array(ids[:, :20]), cache=cache)
    snap = cache.snapshot()
    digest = cache.digest()
    first = np.array(m(mx.array(ids[:, 20:23]), cache=cache))
    assert cache.digest() != digest
    cache.restore(snap)
    assert cache.digest() == digest
    again = np.array(m(mx.array(ids[:, 20:23]), cache=cache))
    np.testing.assert_array_equal(first, again)


def test_append_that_skips_a_position_is_rejected_before_work():
    m = model("tiny_a")
    cache = m.make_cache()
    m(mx.array([[10, 11, 12]]), cache=cache)
    digest = cache.digest()
    with pytest.raises(CacheHoleError, match="hole"):
        m(mx.array([[13]]), cache=cache, position=4)
    assert cache.digest() == digest
    m(mx.array([[13]]), cache=cache, position=3)  # the successor is accepted
    assert cache.offset == 4


def test_left_padding_anchor_is_accepted():
    """A sequence may start at any logical position (AFN-018's legal left padding)."""
    m = model("tiny_a")
    cache = m.make_cache()
    m(mx.array([[10, 11]]), cache=cache, position=5)
    assert cache.next_position == 7


def test_layer_that_lost_tokens_is_a_hole():
    m = model("tiny_a")
    cache = m.make_cache()
    m(mx.array([[10, 11, 12, 13]]), cache=cache)
    attn = next(layer for layer in cache if not isinstance(layer, LinearCache))
    attn.length -= 1  # as if a middle token had been removed from this layer only
    with pytest.raises(CacheHoleError):
        m(mx.array([[14]]), cache=cache)


def _unallocated(cache) -> bool:
    """No layer of `cache` holds an array (every counter still 0)."""
    return all(a is None or (type(a) is int and a == 0) for layer in cache for a in layer.snapshot())


def test_context_above_max_positions_is_rejected_before_allocation():
    m = model("tiny_a")
    cache = m.make_cache()
    limit = m.args.max_position_embeddings
    with pytest.raises(ContextLengthError, match="max_position_embeddings"):
        m(mx.zeros((1, limit + 1), dtype=mx.int32), cache=cache)
    assert cache.offset == 0 and _unallocated(cache)
    m(mx.array([[1] * 4]), cache=cache)
    assert not _unallocated(cache)  # the control: the check sees an allocation
    with pytest.raises(ContextLengthError):
        m(mx.zeros((1, limit - 3), dtype=mx.int32), cache=cache)
    assert cache.offset == 4


def test_rejected_anchor_leaves_the_cache_untouched():
    m = model("tiny_a")
    cache = m.make_cache()
    with pytest.raises(ContextLengthError):
        m(mx.array([[1, 2, 3]]), cache=cache, position=m.args.max_position_embeddings - 2)
    assert cache.start_position == 0 and cache.offset == 0
