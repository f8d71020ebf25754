"""Chunked prefill then greedy decode with plain model calls: the control several tests compare with."""

import mlx.core as mx
import numpy as np


def chunked_greedy(model, prompt, steps, chunk, on_prefilled=None):
    """(tokens, logits of every forward as [L, V] numpy); `on_prefilled()` runs between the two."""
    cache, tokens, logits = model.make_cache(), list(prompt), []
    for i in range(0, len(prompt), chunk):
        out = model(mx.array([prompt[i : i + chunk]]), cache)
        mx.eval(out)
        logits.append(np.array(out[0]))
    if on_prefilled is not None:
        on_prefilled()
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        out = model(mx.array([tokens[-1:]]), cache)
        mx.eval(out)
        logits.append(np.array(out[0]))
    return tokens, logits


def assert_streamed_equals_resident(resident, streamed, prompt, steps):
    """`chunked_greedy` on both models, in chunks of the streamed engine's `max_chunk_tokens`: the
    same tokens, bitwise-equal logits of every forward, and the engine's cache really missed and
    evicted, without errors."""
    e = streamed.streaming.experts
    want = chunked_greedy(resident, prompt, steps, e.max_chunk_tokens)
    got = chunked_greedy(streamed, prompt, steps, e.max_chunk_tokens)
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1])
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(a, b)
    c = e.engine.counters()
    assert c["misses"] > 0 and c["evictions"] > 0 and c["errors"] == 0
