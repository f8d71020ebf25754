"""Samplers and logits processors with mlx-lm's call shapes, behind the vocabulary boundary (AFN-005).

Logits have `physical_vocab_size` columns; only IDs below `effective_vocab_size` name tokens. Every
hebrus generation loop (generate_step, the speculative protocol, the drafters) sets the unassigned
columns to -inf and renormalises before it calls a sampler, so a sampler built here needs no
vocabulary argument. A loop that does not mask (e.g. `mlx_lm.generate`) gets the boundary by
passing `effective_vocab_size=` to `make_sampler`: temperature, top-k, top-p, min-p, XTC and argmax
then all see -inf for unassigned rows.

The filters follow mlx-lm 0.32.2's `sample_utils` rules (same order: top-p, min-p, XTC, top-k, then
a categorical draw at `temp`); no code is taken from it and nothing here imports `mlx_lm`.
"""

import functools
import math
from collections.abc import Callable
from numbers import Real

import mlx.core as mx

from .errors import HebrusError, NonFiniteError

__all__ = [
    "apply_vocab_mask",
    "masked_logprobs",
    "checked_logprobs",
    "check_finite",
    "make_sampler",
    "check_sampling_args",
    "make_logits_processors",
    "make_repetition_penalty",
    "make_presence_penalty",
    "make_frequency_penalty",
    "SamplingError",
]

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class SamplingError(HebrusError, ValueError):
    """A bad sampler or logits-processor argument; `field` names it (e.g. ``top_p``)."""

    default_field = "sampling"


def apply_vocab_mask(logits: mx.array, effective_vocab_size: int) -> mx.array:
    """Set columns >= effective_vocab_size to -inf (last axis)."""
    width = logits.shape[-1]
    if effective_vocab_size >= width:
        return logits
    valid = mx.arange(width) < effective_vocab_size
    return mx.where(valid, logits, mx.array(-mx.inf, dtype=logits.dtype))


def masked_logprobs(logits: mx.array, effective_vocab_size: int) -> mx.array:
    """Log-probabilities over the effective vocabulary (last axis): columns past it are -inf, the
    rest renormalised. The one mask + log-softmax of every loop (plain, speculative, drafters)."""
    return checked_logprobs(logits, effective_vocab_size)[0]


def checked_logprobs(logits: mx.array, effective_vocab_size: int) -> tuple[mx.array, mx.array]:
    """`masked_logprobs` and, per row, whether its log-normaliser is finite (bool, the leading
    shape): a NaN or +inf logit, or no finite one, makes it not (AFN-010). The check reuses the
    log-softmax's own reduction: one isfinite on a scalar per row."""
    logits = apply_vocab_mask(logits, effective_vocab_size)
    norm = mx.logsumexp(logits, axis=-1, keepdims=True)
    return logits - norm, mx.isfinite(norm[..., 0])


def check_finite(finite: mx.array) -> None:
    """Raise NonFiniteError (field ``logits``) unless every row was finite (`finite`: the bools of
    `checked_logprobs`). Raised inside a step's guard, the sequence goes back to before the step."""
    if not finite.all().item():
        raise NonFiniteError("logits", "the step computed NaN or infinity; the sequence was rolled back to before it")


def _is_number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(field, value, low=-math.inf, high=math.inf, low_open=False):
    if not _is_number(value) or not math.isfinite(value):
        raise SamplingError(field, f"must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        span = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise SamplingError(field, f"must be in {span}, got {value}")


def check_sampling_args(
    temp=0.0,
    top_p=0.0,
    min_p=0.0,
    top_k=0,
    min_tokens_to_keep=1,
    xtc_probability=0.0,
    xtc_threshold=0.1,
    xtc_special_tokens=None,
):
    """Raise SamplingError naming the first bad sampling argument (mlx-lm checks some of these only
    when a token is drawn; here they fail before any work)."""
    _number("temp", temp, 0.0)
    _number("top_p", top_p, 0.0, 1.0)
    _number("min_p", min_p, 0.0, 1.0)
    if not _is_int(top_k) or top_k < 0:
        raise SamplingError("top_k", f"must be an int >= 0, got {top_k!r}")
    if not _is_int(min_tokens_to_keep) or min_tokens_to_keep < 1:
        raise SamplingError("min_tokens_to_keep", f"must be an int >= 1, got {min_tokens_to_keep!r}")
    _number("xtc_probability", xtc_probability, 0.0, 1.0)
    _number("xtc_threshold", xtc_threshold, 0.0, 0.5)
    if xtc_special_tokens is not None:
        if not isinstance(xtc_special_tokens, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in xtc_special_tokens
        ):
            raise SamplingError("xtc_special_tokens", f"must be a list of token IDs, got {xtc_special_tokens!r}")


# -- filters: log-probabilities [..., V] in, the same with dropped rows at -inf -------------------------
# Compiled once per argument values (mlx-lm does the same): the elementwise tails fuse. The random
# ones take and advance MLX's global random state, so a seed reproduces their draws; given a `key`
# (a request's own, generate.DecodeStep), they draw from it instead and leave the global state alone.
_compiled = functools.partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)


def _neg_inf(x):
    return mx.array(-mx.inf, dtype=x.dtype)


@_compiled
def _top_p(x: mx.array, top_p: float) -> mx.array:
    # Keep, from the most probable down, every token whose more-probable predecessors hold less
    # than top_p of the mass; the least probable kept one sets the threshold (ties at it stay).
    desc = -mx.sort(-x, axis=-1)
    probs = mx.exp(desc.astype(mx.float32))
    before = mx.cumsum(probs, axis=-1) - probs
    keep = (before < top_p * probs.sum(axis=-1, keepdims=True)).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(desc, keep - 1, axis=-1)
    return mx.where(x < threshold, _neg_inf(x), x)


@_compiled
def _min_p(x: mx.array, min_p: float, min_tokens_to_keep: int) -> mx.array:
    # Drop tokens less probable than min_p times the best one, but never the best `min_tokens_to_keep`.
    drop = x < mx.max(x, axis=-1, keepdims=True) + math.log(min_p)
    if min_tokens_to_keep > 1:
        best = mx.argpartition(-x, kth=min_tokens_to_keep - 1, axis=-1)[..., :min_tokens_to_keep]
        drop = mx.put_along_axis(drop, best, mx.array(False), axis=-1)
    return mx.where(drop, _neg_inf(x), x)


@_compiled
def _top_k(x: mx.array, top_k: int) -> mx.array:
    if top_k >= x.shape[-1]:
        return x
    rest = mx.argpartition(-x, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(x, rest, _neg_inf(x), axis=-1)


def _xtc_drop(x: mx.array, draw: mx.array, probability: float, threshold: float, special: list[int]) -> mx.array:
    # "Exclude top choices": with the given probability, drop every token above `threshold` except
    # the least probable of them; special tokens (e.g. EOS) are never dropped.
    probs = mx.softmax(x.astype(mx.float32), axis=-1)
    lowest_above = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    drop = probs > lowest_above
    if special:
        drop[..., special] = False
    return mx.where((draw <= probability) & drop, _neg_inf(x), x)


@_compiled
def _xtc(x: mx.array, probability: float, threshold: float, special: list[int]) -> mx.array:
    return _xtc_drop(x, mx.random.uniform(0, 1), probability, threshold, special)


@mx.compile
def _xtc_keyed(x: mx.array, key: mx.array, probability: float, threshold: float, special: list[int]) -> mx.array:
    return _xtc_drop(x, mx.random.uniform(0, 1, key=key), probability, threshold, special)


@_compiled
def _categorical(x: mx.array, temp: float) -> mx.array:
    return mx.random.categorical(x * (1.0 / temp))


@mx.compile
def _categorical_keyed(x: mx.array, key: mx.array, temp: float) -> mx.array:
    return mx.random.categorical(x * (1.0 / temp), key=key)


def _renormalised(x: mx.array, effective_vocab_size: int | None) -> mx.array:
    if effective_vocab_size is None:
        return x
    return masked_logprobs(x, effective_vocab_size)  # top-p/min-p see the valid rows' mass only


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: list[int] | None = None,
    *,
    effective_vocab_size: int | None = None,
) -> Sampler:
    """mlx-lm's `make_sampler`: log-probabilities `[B, V]` -> token IDs `[B]`.

    `temp=0` is argmax. `effective_vocab_size`: mask columns at and past it first (AFN-005); hebrus's
    own loops mask before sampling, so leave it None there and set it when the sampler goes to a loop
    that does not (mlx-lm's). `sampler(logprobs, key=k)` draws from the random key `k` (a seeded
    request's own, split per draw) instead of MLX's global generator, which it then leaves as it
    was; `sampler.takes_key` marks a sampler that accepts it. The sampler's `distribution` (absent
    with XTC, whose random exclusion no fixed distribution describes; None for argmax) is what the
    speculative protocol's rejection sampling needs.
    """
    check_sampling_args(
        temp, top_p, min_p, top_k, min_tokens_to_keep, xtc_probability, xtc_threshold, xtc_special_tokens
    )
    if effective_vocab_size is not None and (not _is_int(effective_vocab_size) or effective_vocab_size < 1):
        raise SamplingError("effective_vocab_size", f"must be an int >= 1, got {effective_vocab_size!r}")
    if temp == 0:

        def greedy(logprobs: mx.array, vocab=effective_vocab_size, key=None) -> mx.array:
            return mx.argmax(_renormalised(logprobs, vocab), axis=-1)

        greedy.distribution = None
        greedy.takes_key = True
        greedy.from_logprobs = functools.partial(greedy, vocab=None)
        return greedy

    special = list(xtc_special_tokens or [])
    chain = []  # filters f(x, key): only XTC draws
    if 0 < top_p < 1.0:
        chain.append(lambda x, key: _top_p(x, top_p))
    if min_p != 0.0:
        chain.append(lambda x, key: _min_p(x, min_p, min_tokens_to_keep))
    if xtc_probability > 0.0:

        def xtc(x, key):
            if key is None:
                return _xtc(x, xtc_probability, xtc_threshold, special)
            return _xtc_keyed(x, key, xtc_probability, xtc_threshold, special)

        chain.append(xtc)
    if top_k > 0:
        chain.append(lambda x, key: _top_k(x, top_k))
    scale = 1.0 / temp

    def filtered(logprobs, vocab, key=None):
        x = _renormalised(logprobs, vocab)
        for f in chain:
            x = f(x, key)
        return x

    def sampler(logprobs: mx.array, vocab=effective_vocab_size, key=None) -> mx.array:
        if key is None:
            return _categorical(filtered(logprobs, vocab), temp)
        xtc_key, key = mx.random.split(key)
        return _categorical_keyed(filtered(logprobs, vocab, xtc_key), key, temp)

    # A loop that masked and renormalised already (generate's decode step) draws through this.
    sampler.from_logprobs = functools.partial(sampler, vocab=None)
    sampler.takes_key = True
    if xtc_probability == 0.0:

        def distribution(logprobs: mx.array) -> mx.array:
            """float32 probabilities of the token `sampler` draws from these log-probabilities."""
            return mx.softmax(filtered(logprobs.astype(mx.float32), effective_vocab_size) * scale, axis=-1)

        sampler.distribution = distribution
    return sampler


# -- logits processors: (tokens so far [T], logits [B, V]) -> logits ------------------------------------


def _recent_counts(tokens, context_size: int, width: int) -> mx.array | None:
    """How often each ID occurs in the last `context_size` tokens ([width] float32), None if none."""
    if not isinstance(tokens, mx.array):
        tokens = mx.array(list(tokens), dtype=mx.int32)
    if tokens.size == 0:
        return None
    recent = tokens.reshape(-1)[-context_size:]
    return mx.zeros((width,), dtype=mx.float32).at[recent].add(1.0)


def _context_size(field, value):
    if not _is_int(value) or value < 1:
        raise SamplingError(field, f"must be an int >= 1, got {value!r}")


def _count_penalty(context_size: int, penalise) -> LogitsProcessor:
    """A processor applying `penalise(logits, counts)` where an ID occurs in the last `context_size`."""

    def processor(tokens, logits):
        counts = _recent_counts(tokens, context_size, logits.shape[-1])
        return logits if counts is None else penalise(logits, counts)

    return processor


def make_repetition_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """Sign-aware multiplicative penalty on each ID seen in the last `context_size` tokens: a positive
    logit is divided by `penalty`, a negative one multiplied (CTRL, arXiv:1909.05858)."""
    _number("repetition_penalty", penalty, 0.0, low_open=True)
    _context_size("repetition_context_size", context_size)
    return _count_penalty(
        context_size,
        lambda logits, counts: mx.where(counts > 0, mx.where(logits < 0, logits * penalty, logits / penalty), logits),
    )


def make_presence_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """OpenAI's presence penalty: `penalty` off each ID seen at least once in the last `context_size`."""
    _number("presence_penalty", penalty)
    _context_size("presence_context_size", context_size)
    return _count_penalty(context_size, lambda logits, counts: mx.where(counts > 0, logits - penalty, logits))


def make_frequency_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """OpenAI's frequency penalty: `penalty` off each ID once per occurrence in the last `context_size`."""
    _number("frequency_penalty", penalty)
    _context_size("frequency_context_size", context_size)
    return _count_penalty(context_size, lambda logits, counts: logits - (counts * penalty).astype(logits.dtype))


def _make_logit_bias(logit_bias: dict[int, float], vocab_size: int | None) -> LogitsProcessor:
    if not isinstance(logit_bias, dict):
        raise SamplingError("logit_bias", f"must be a dict of token ID -> bias, got {type(logit_bias).__name__}")
    for token, bias in logit_bias.items():
        if not _is_int(token) or token < 0:
            raise SamplingError("logit_bias", f"keys must be token IDs (ints >= 0), got {token!r}")
        if vocab_size is not None and token >= vocab_size:
            raise SamplingError("logit_bias", f"token ID {token} is not in the vocabulary [0, {vocab_size})")
        _number(f"logit_bias.{token}", bias)
    ids = sorted(logit_bias)
    top = ids[-1]
    dense = {}  # logits width -> bias row, built once per width

    def logit_bias_processor(_tokens, logits):
        width = logits.shape[-1]
        if width not in dense:
            if top >= width:
                raise SamplingError("logit_bias", f"token ID {top} is past the logits width {width}")
            row = mx.zeros((width,), dtype=mx.float32)
            row[mx.array(ids)] = mx.array([float(logit_bias[i]) for i in ids])
            dense[width] = row
        return logits + dense[width].astype(logits.dtype)

    return logit_bias_processor


def make_logits_processors(
    logit_bias: dict[int, float] | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int | None = 20,
    presence_penalty: float | None = None,
    presence_context_size: int | None = 20,
    frequency_penalty: float | None = None,
    frequency_context_size: int | None = 20,
    *,
    vocab_size: int | None = None,
) -> list[LogitsProcessor]:
    """mlx-lm's `make_logits_processors`: the list `generate_step(logits_processors=...)` applies in
    order (logit bias, then repetition, presence and frequency penalties; a penalty of None or 0 adds
    nothing). Every argument is checked here, before any work; `vocab_size` (the tokenizer's
    effective vocabulary) also refuses a bias on an ID that names no token. Processors run before
    the loop's vocabulary mask, so unassigned rows stay at -inf whatever they do."""
    if vocab_size is not None and (not _is_int(vocab_size) or vocab_size < 1):
        raise SamplingError("vocab_size", f"must be an int >= 1, got {vocab_size!r}")
    out = []
    if logit_bias:
        out.append(_make_logit_bias(logit_bias, vocab_size))
    elif logit_bias is not None and not isinstance(logit_bias, dict):
        raise SamplingError("logit_bias", f"must be a dict of token ID -> bias, got {type(logit_bias).__name__}")
    for make, penalty, context_size in (
        (make_repetition_penalty, repetition_penalty, repetition_context_size),
        (make_presence_penalty, presence_penalty, presence_context_size),
        (make_frequency_penalty, frequency_penalty, frequency_context_size),
    ):
        if penalty is None or (_is_number(penalty) and penalty == 0):
            continue
        out.append(make(penalty, context_size))
    return out
