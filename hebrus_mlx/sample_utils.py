"""Samplers with the vocabulary boundary (AFN-005).

Logits have `physical_vocab_size` columns; only IDs below `effective_vocab_size` name tokens. The
mask runs before anything selects: temperature, top-k, top-p, min-p and argmax all see -inf for
unassigned rows, and log-probabilities are renormalised over the valid rows.
"""

from typing import Callable

import mlx.core as mx

__all__ = ["apply_vocab_mask", "make_sampler", "check_sampling_args"]


def apply_vocab_mask(logits: mx.array, effective_vocab_size: int) -> mx.array:
    """Set columns >= effective_vocab_size to -inf (last axis)."""
    width = logits.shape[-1]
    if effective_vocab_size >= width:
        return logits
    valid = mx.arange(width) < effective_vocab_size
    return mx.where(valid, logits, mx.array(-mx.inf, dtype=logits.dtype))


def check_sampling_args(temp=0.0, top_p=0.0, min_p=0.0, top_k=0):
    """Raise ValueError naming the first bad sampling argument."""
    if not temp >= 0.0:
        raise ValueError(f"temp must be >= 0, got {temp}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k}")


def make_sampler(
    effective_vocab_size: int,
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler chain behind the vocabulary mask.

    Takes logits or log-probabilities `[B, physical_vocab]` and returns token IDs `[B]`, always
    below `effective_vocab_size`.
    """
    check_sampling_args(temp, top_p, min_p, top_k)
    # Imported here: the mlx_lm package pulls in transformers (~4 s), too slow for CLI errors.
    from mlx_lm.sample_utils import make_sampler as _mlx_make_sampler

    inner = _mlx_make_sampler(temp=temp, top_p=top_p, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep, top_k=top_k)

    def sampler(logprobs: mx.array) -> mx.array:
        x = apply_vocab_mask(logprobs, effective_vocab_size)
        # Renormalise so top-p/min-p see probabilities of the valid rows only.
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        return inner(x)

    # generate's decode step masks and normalises once and calls this (AFN-005 holds: its input is
    # -inf past the effective vocabulary and renormalised over the valid rows).
    sampler.from_logprobs = inner
    # The distribution the sampler draws from, for speculative rejection sampling; None = argmax.
    sampler.distribution = None if temp == 0 else _make_distribution(
        effective_vocab_size, temp, top_p, min_p, min_tokens_to_keep, top_k)
    return sampler


def _make_distribution(effective_vocab_size, temp, top_p, min_p, min_tokens_to_keep, top_k):
    """logprobs [B, V] -> float32 probabilities of the token `make_sampler` would draw (same filter
    chain and order as mlx-lm's sampler, then softmax(x / temp))."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    def distribution(logprobs: mx.array) -> mx.array:
        x = apply_vocab_mask(logprobs.astype(mx.float32), effective_vocab_size)
        x = x - mx.logsumexp(x, axis=-1, keepdims=True)
        if 0 < top_p < 1.0:
            x = apply_top_p(x, top_p)
        if min_p != 0.0:
            x = apply_min_p(x, min_p, min_tokens_to_keep)
        if top_k > 0:
            x = apply_top_k(x, top_k)
        return mx.softmax(x * (1.0 / temp), axis=-1)

    return distribution
