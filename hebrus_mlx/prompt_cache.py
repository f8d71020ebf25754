"""Prefix reuse across requests: snapshots of whole sequence state at prefix boundaries.

Hybrid state (GDN recurrent + conv tails, PLE n-gram context and conv tail, QSA K/V and block
keys) cannot be trimmed back to a shorter prefix (AFN-010), so reuse is by exact prefix only: a
snapshot taken after `key` tokens serves any later prompt that starts with `key` and is longer.
Two boundaries are kept per request: the prompt minus its last token (the next turn of a chat
re-sends it) and prompt + generated tokens (the next turn continues from the reply when the
client sends it back verbatim). Entries are evicted least recently used by bytes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import importlib

import mlx.core as mx

_gen = importlib.import_module("hebrus_mlx.generate")  # the package attribute is the function


def _snapshot_arrays(snap) -> List[mx.array]:
    out = []

    def walk(x):
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)

    walk(snap)
    return out


@dataclass
class _Entry:
    snapshot: tuple
    nbytes: int


class PromptCache:
    """LRU of detached `SequenceCache` snapshots keyed by the exact token prefix they hold."""

    def __init__(self, max_bytes: int):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: "OrderedDict[Tuple[int, ...], _Entry]" = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self):
        return len(self._entries)

    def fetch(self, model, ids: Sequence[int]):
        """(cache, n): a cache holding the longest stored prefix of `ids` shorter than `ids`
        (n tokens), or a fresh cache and 0."""
        ids = tuple(ids)
        best = None
        for key in self._entries:
            if len(key) < len(ids) and (best is None or len(key) > len(best)) and ids[: len(key)] == key:
                best = key
        cache = model.make_cache()
        if best is None:
            self.misses += 1
            return cache, 0
        self.hits += 1
        self._entries.move_to_end(best)
        cache.restore(self._entries[best].snapshot)
        return cache, len(best)

    def insert(self, ids: Sequence[int], cache) -> bool:
        """Store a detached snapshot of `cache`, which must hold exactly `ids`."""
        key = tuple(ids)
        if self.max_bytes == 0 or not key or not hasattr(cache, "detach"):
            return False
        if getattr(cache, "offset", None) != len(key):
            raise ValueError(f"cache holds {getattr(cache, 'offset', None)} tokens, key has {len(key)}")
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        snap = cache.detach()
        arrays = _snapshot_arrays(snap)
        mx.eval(arrays)
        nbytes = sum(a.nbytes for a in arrays)
        if nbytes > self.max_bytes:
            return False
        self._entries[key] = _Entry(snap, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def clear(self):
        self._entries.clear()
        self.nbytes = 0


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int = 0
    prompt_seconds: float = 0.0  # until the first token is known
    generation_seconds: float = 0.0


def stream_with_cache(
    model,
    tokenizer,
    ids: Sequence[int],
    prompt_cache: Optional[PromptCache],
    max_tokens: int,
    sampler=None,
    prefill_step_size: int = _gen.DEFAULT_PREFILL_STEP_SIZE,
    cancelled: Callable[[], bool] = lambda: False,
    usage: Optional[Usage] = None,
    draft_model=None,
    num_draft_tokens: Optional[int] = None,
) -> Iterator[_gen.GenerationResponse]:
    """`stream_generate` over a prompt whose longest cached prefix is restored instead of
    prefilled. Fills `usage` as it goes. Stops early (no error) when `cancelled()` turns true.
    `draft_model` / `num_draft_tokens` decode speculatively as `stream_generate` does (the drafter
    sees the tokens from the last cached position on, so a prompt-lookup drafter finds fewer
    matches after a long cached prefix; the tokens are the same either way)."""
    ids = list(ids)
    limit = _gen.context_limit(model)
    if not ids:
        raise _gen.GenerationError("prompt is empty")
    if limit is not None and len(ids) + max_tokens > limit:
        raise _gen.GenerationError(
            f"max_tokens {max_tokens} + prompt {len(ids)} tokens exceeds the model context {limit}")
    tic = time.perf_counter()
    if prompt_cache is not None:
        cache, n = prompt_cache.fetch(model, ids)
    else:
        cache, n = model.make_cache(), 0
    if usage is not None:
        usage.prompt_tokens, usage.cached_tokens = len(ids), n
    # generate's prefill (chunk cap, rollback); the last token is the decode loop's first input.
    if not _gen.prefill(model, mx.array(ids[n:-1], dtype=mx.int32), cache, prefill_step_size, cancelled):
        return
    if prompt_cache is not None and len(ids) - 1 > n:
        prompt_cache.insert(ids[:-1], cache)
    draft = {} if draft_model is None else {"draft_model": draft_model, "num_draft_tokens": num_draft_tokens}
    steps = _gen.stream_generate(model, tokenizer, ids[-1:], max_tokens=max_tokens, sampler=sampler,
                                 prompt_cache=cache, prefill_step_size=prefill_step_size, **draft)
    tokens: List[int] = []
    finished = False
    try:
        for r in steps:
            tokens.append(r.token)
            if usage is not None:
                if len(tokens) == 1:
                    usage.prompt_seconds = time.perf_counter() - tic
                    tic = time.perf_counter()
                usage.completion_tokens = len(tokens)
                usage.generation_seconds = time.perf_counter() - tic
            yield r
            finished = r.finish_reason is not None
            if cancelled():
                return
    finally:
        steps.close()
        # Every token handed out has been fed (generate_step queues the next step before it
        # yields), so the cache holds prompt + tokens unless a step failed part way.
        if prompt_cache is not None and (finished or not cancelled()) and cache.offset == len(ids) + len(tokens):
            mx.eval(cache.arrays)
            prompt_cache.insert(ids + tokens, cache)
