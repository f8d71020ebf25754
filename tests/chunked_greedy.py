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
