"""Continuous batching: `BatchGenerator` (the scheduler) and `batch_generate` (the one-call API),
in the shape of mlx-lm's.

Each round (`BatchGenerator.next()`):
1. queued requests are admitted while fewer than `prompt_concurrency` are prefilling and fewer
   than `decode_concurrency` hold a place (prefilling or decoding);
2. every prefilling request feeds one chunk of its prompt (generate's `prefill_chunks`: the same
   chunk cap, rollback and evaluation as a solo run), so a long prompt interleaves with running
   decodes instead of stalling them; a request whose prompt is in joins the decode set;
3. one decode step feeds every decoding request's last token through `batch.batch_forward`
   (split into steps of at most `batch.max_batch_rows` rows where a streamed arena bounds them),
   and each row's logits go through that request's own logits processors, vocabulary mask,
   log-softmax and sampler (generate's `DecodeStep`), so its tokens are its solo run's.

Stop tokens, `max_tokens`, the sampler (and its seed), logits processors and cancel (`remove`) are
per request. A `PromptCache` given to the generator serves each request's longest cached prefix
and stores each prompt and each finished sequence, as the one-at-a-time server does.

A failed round (a streamed read's I/O error, a bad digest) rolls every sequence it touched back to
its state before the round and raises `BatchStepError` naming their uids: the caller removes them
(the server fails those requests) or calls `next()` again, which continues them exactly. A step
whose logits went non-finite (NaN, infinity) is rolled back the same way; its error
(`NonFiniteError`, field ``logits``) names only the rows that went non-finite (AFN-010). A prompt
prefix enters the `PromptCache` once its first token's logits were finite.

Speculative drafting is not run inside a batch: `BatchGenerator` takes no drafter (the server
refuses `--draft-model` with `--decode-concurrency` > 1).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .batch import batch_forward, max_batch_rows
from .errors import GenerationError, HebrusError, NonFiniteError, UsageError
from .generate import (
    CLEAR_CACHE_EVERY,
    DEFAULT_PREFILL_STEP_SIZE,
    DecodeStep,
    check_seed,
    context_limit,
    generation_stream,
    prefill_chunks,
    prompt_ids,
)
from .sample_utils import make_sampler
from .stream.errors import translate
from .stream.rollback import rollback_on_error

log = logging.getLogger("hebrus_mlx.batch")

__all__ = ["BatchGenerator", "BatchResponse", "BatchStepError", "Response", "batch_generate"]


class BatchStepError(HebrusError, RuntimeError):
    """A batched round failed; `uids` are the requests that failed (every row it touched was rolled
    back to before it: all of them, or for a NonFiniteError the rows that went non-finite) and
    `cause` the typed error (e.g. a StreamIOError)."""

    default_field = "batch"

    def __init__(self, cause: BaseException, uids: Sequence[int]):
        super().__init__(str(cause))
        self.cause, self.uids = cause, list(uids)


@dataclass
class Response:
    """One generated token of one request."""

    uid: int
    token: int
    logprobs: mx.array  # [V] log-probabilities (-inf past the effective vocabulary)
    finish_reason: str | None  # "stop", "length" or None
    prompt_cache: Any = None  # with a finish_reason: the sequence's cache (its offset: tokens it holds)


@dataclass(eq=False)  # identity: a request is itself
class _Seq:
    uid: int
    ids: list[int]
    max_tokens: int
    sampler: Callable
    processors: list[Callable]
    stops: frozenset
    seed: int | None  # its own random key (generate.DecodeStep), independent of the other requests
    cache: Any = None
    start: int = 0  # tokens a cache given at insert held before `ids` (mlx-lm's prompt_caches)
    cached_tokens: int = 0
    chunks: Any = None  # the prefill_chunks generator while prefilling
    step: Any = None  # generate.DecodeStep (processors, mask, sampler)
    y: int = 0  # the next input token
    tokens: list[int] = field(default_factory=list)
    prefix: Any = None  # the prompt's state for the PromptCache, stored once a token came out finite


def _stop_set(tokenizer) -> frozenset:
    return frozenset(getattr(tokenizer, "stop_token_ids", None) or getattr(tokenizer, "eos_token_ids", None) or ())


class BatchGenerator:
    """Up to `decode_concurrency` sequences share each decode step; `prompt_concurrency` of them
    prefill (a chunk per round) at a time. `insert` returns uids; `next()` runs one round and
    returns that round's `Response`s; `remove(uids)` cancels at the next round boundary.

    effective_vocab_size: the tokenizer's (AFN-005); stop_tokens: the default stop set (the
    tokenizer's); sampler / logits_processors: the defaults for requests that give none."""

    def __init__(
        self,
        model,
        *,
        effective_vocab_size: int,
        max_tokens: int = 256,
        stop_tokens: Sequence[int] | None = None,
        sampler: Callable | None = None,
        logits_processors: list[Callable] | None = None,
        decode_concurrency: int = 8,
        prompt_concurrency: int = 1,
        prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
        prompt_cache=None,
    ):
        for name, value in (
            ("decode_concurrency", decode_concurrency),
            ("prompt_concurrency", prompt_concurrency),
            ("prefill_step_size", prefill_step_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(name, f"must be an int >= 1, got {value!r}")
        self.model = model
        self.effective_vocab_size = effective_vocab_size
        self.max_tokens = max_tokens
        self.stop_tokens = frozenset(stop_tokens or ())
        self.sampler = sampler or make_sampler()
        self.logits_processors = list(logits_processors or [])
        self.decode_concurrency = decode_concurrency
        self.prompt_concurrency = prompt_concurrency
        self.prefill_step_size = prefill_step_size
        self.prompt_cache = prompt_cache
        # A streamed arena pins every expert one step routes to: steps take at most this many rows.
        cap = max_batch_rows(model)
        self.rows_per_step = decode_concurrency if cap is None else max(1, min(decode_concurrency, cap))
        self._queued: deque[_Seq] = deque()
        self._prefilling: list[_Seq] = []
        self._decoding: list[_Seq] = []
        self._uid = 0
        self._carry: list[Response] = []
        self._inflight: _Step | None = (
            None  # the queued decode step not yet read  # responses of a round that failed part way (next round's)
        )
        self.steps = 0  # decode forwards run
        self.rows = 0  # decode rows fed (tokens generated)

    # -- requests ------------------------------------------------------------------------------------
    def insert(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens=None,
        samplers=None,
        logits_processors=None,
        stop_tokens=None,
        seeds=None,
        caches=None,
    ) -> list[int]:
        """Queue requests; per-request lists (or None: the defaults). `seeds[i]` gives request i its
        own random key: its tokens are its solo run's with that seed (generate_step(seed=)),
        whatever else runs. `caches[i]` (mlx-lm's): a sequence cache holding a prefix that
        `prompts[i]` continues; it is copied, not updated in place. Returns their uids."""
        n = len(prompts)

        def each(values, name):
            if values is None:
                return [None] * n
            if len(values) != n:
                raise UsageError(name, f"needs one entry per prompt ({n}), got {len(values)}")
            return list(values)

        if caches is not None and self.prompt_cache is not None:
            raise UsageError("caches", "cannot be combined with the generator's prompt_cache (prefix reuse): give one")
        limit = context_limit(self.model)
        seqs = []
        for ids, mt, smp, procs, stops, seed, given in zip(
            prompts,
            each(max_tokens, "max_tokens"),
            each(samplers, "samplers"),
            each(logits_processors, "logits_processors"),
            each(stop_tokens, "stop_tokens"),
            each(seeds, "seeds"),
            each(caches, "caches"),
        ):
            ids = [int(t) for t in ids]
            if not ids:
                raise GenerationError("prompt is empty")
            check_seed(seed, smp or self.sampler)
            mt = self.max_tokens if mt is None else mt
            if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
                raise GenerationError("max_tokens", f"must be an int >= 1, got {mt!r}")
            start = 0 if given is None else given.offset
            if limit is not None and start + len(ids) + mt > limit:
                held = f" + {start} cached" if start else ""
                raise GenerationError(
                    "max_tokens",
                    f"max_tokens {mt} + prompt {len(ids)}{held} tokens exceeds the model context {limit}",
                )
            seqs.append(
                _Seq(
                    uid=-1,
                    ids=ids,
                    max_tokens=mt,
                    sampler=smp or self.sampler,
                    processors=list(self.logits_processors if procs is None else procs),
                    stops=self.stop_tokens if stops is None else frozenset(stops),
                    seed=seed,
                    cache=None if given is None else given.copy(),
                    start=start,
                )
            )
        uids = []
        for s in seqs:
            s.uid = self._uid
            self._uid += 1
            self._queued.append(s)
            uids.append(s.uid)
        return uids

    def remove(self, uids) -> None:
        """Drop requests (queued, prefilling or decoding); their state is discarded."""
        gone = set(uids)
        self._queued = deque(s for s in self._queued if s.uid not in gone)
        for s in self._prefilling:
            if s.uid in gone and s.chunks is not None:
                s.chunks.close()
        self._prefilling = [s for s in self._prefilling if s.uid not in gone]
        self._decoding = [s for s in self._decoding if s.uid not in gone]
        step = self._inflight
        if step is not None and not any(s in self._decoding for s in step.rows):
            self._inflight = None
            _settle_quietly(step)  # nobody reads it: settle it now (streamed leases returned)

    def __len__(self) -> int:
        return len(self._queued) + len(self._prefilling) + len(self._decoding)

    @property
    def active(self) -> int:
        """Requests holding a place (prefilling or decoding)."""
        return len(self._prefilling) + len(self._decoding)

    def cached_tokens(self, uid: int) -> int | None:
        """Prompt tokens served from the prefix cache (None until admitted)."""
        for s in self._prefilling + self._decoding:
            if s.uid == uid:
                return s.cached_tokens
        return None

    # -- rounds --------------------------------------------------------------------------------------
    def next(self) -> list[Response]:
        """One round: admissions, a prefill chunk per prefilling request, one decode step."""
        with mx.stream(generation_stream()), self._tickets():
            self._admit()
            self._prefill_round()
            out, self._carry = self._carry, []
            return out + self._decode_round()

    @contextmanager
    def _tickets(self):
        # One ticket scope per round: its reads carry it; a cancel (interrupt) fails them all.
        streaming = getattr(self.model, "streaming", None)
        if streaming is None:
            yield
            return
        with streaming.request() as scope:
            self.scope = scope
            try:
                yield
            finally:
                self.scope = None

    scope = None

    def interrupt(self) -> None:
        """From any thread: fail the current round's pending expert reads at once (shutdown)."""
        scope = self.scope
        if scope is not None:
            scope.cancel()

    def _admit(self):
        while (
            self._queued and len(self._prefilling) < self.prompt_concurrency and self.active < self.decode_concurrency
        ):
            s = self._queued.popleft()
            if s.cache is not None:
                pass  # given at insert
            elif self.prompt_cache is not None:
                s.cache, s.cached_tokens = self.prompt_cache.fetch(self.model, s.ids)
            else:
                s.cache = self.model.make_cache()
            s.step = DecodeStep(
                self.model,
                s.cache,
                effective_vocab_size=self.effective_vocab_size,
                sampler=s.sampler,
                logits_processors=s.processors,
                seed=s.seed,
            )
            if s.processors and s.cache.offset:  # processors see the whole prompt, restored prefix included
                s.step.history = mx.array(s.ids[: s.cache.offset], dtype=mx.int32)
            # The last prompt token is the first decode input (as generate's loop).
            self._start_prefill(s)
            s.y = s.ids[-1]
            self._prefilling.append(s)

    def _start_prefill(self, s: _Seq):
        """Prefill chunks from where the cache stands (its start, or a failed chunk's rollback)."""
        s.chunks = prefill_chunks(
            self.model,
            mx.array(s.ids[s.cache.offset - s.start : -1], dtype=mx.int32),
            s.cache,
            self.prefill_step_size,
            s.step.prefill_forward,
        )

    def _prefill_round(self):
        done = []
        for s in list(self._prefilling):
            history = s.step.history
            try:
                next(s.chunks)
                if s.cache.offset - s.start >= len(s.ids) - 1:  # the last chunk is in: join this round's step
                    s.chunks.close()
                    done.append(s)
            except StopIteration:
                done.append(s)
            except Exception as e:  # prefill_chunks rolled the chunk back and typed the error
                s.step.history = history
                self._start_prefill(s)  # a failed generator is spent: resume from the cache
                raise BatchStepError(e, [s.uid]) from e
        for s in done:
            s.chunks = None
            self._prefilling.remove(s)
            if self.prompt_cache is not None and len(s.ids) - 1 > s.cached_tokens:
                s.prefix = s.cache.snapshot()
            self._decoding.append(s)

    def _decode_round(self) -> list[Response]:
        """One decode step over every decoding request. Pipelined as generate's loop: the step is
        built on the previous step's (still lazy) tokens and started before those are read, so the
        host builds while the device computes. Where a streamed arena splits the rows into several
        steps (more rows than `rows_per_step`), the steps run one after the other instead."""
        rows = list(self._decoding)
        if len(rows) > self.rows_per_step:
            out = self._settle()
            rows = list(self._decoding)
            for start in range(0, len(rows), self.rows_per_step):
                step = self._build(rows[start : start + self.rows_per_step], None)
                try:
                    out += self._read(step, None)
                except BatchStepError:
                    self._carry = out  # the steps before the failed one stand: handed out next round
                    raise
            return out
        prev, self._inflight = self._inflight, None
        step = self._build(rows, prev) if rows else None
        out = [] if prev is None else self._read(prev, step)
        if step is not None and any(s in self._decoding for s in step.rows):
            self._inflight = step
        elif step is not None:
            _settle_quietly(step)  # every row of it finished: its work is not wanted
        return out

    def _settle(self) -> list[Response]:
        prev, self._inflight = self._inflight, None
        return [] if prev is None else self._read(prev, None)

    def _build(self, rows: list[_Seq], prev: _Step | None) -> _Step:
        """Queue one batched step for `rows`; a row in `prev` feeds prev's token (lazy)."""
        carried = {} if prev is None else {id(s): j for j, s in enumerate(prev.rows)}
        inputs = [prev.picks[carried[id(s)]][0] if id(s) in carried else mx.array([s.y], dtype=mx.int32) for s in rows]
        snaps = [(s.cache.snapshot(), s.step.history, s.step.key) for s in rows]
        step = _Step(rows, [None] * len(rows), snaps)
        finite = [None] * len(rows)
        try:
            ys = mx.concatenate(inputs) if len(inputs) > 1 else inputs[0]
            logits = batch_forward(self.model, ys, [s.cache for s in rows])
            # Rows without processors or a seed that share a sampler: one mask, log-softmax and
            # draw over their rows (each a row-wise op: the same values as one row at a time).
            shared: dict[int, list[int]] = {}
            for b, s in enumerate(rows):
                if not s.processors and s.seed is None:
                    shared.setdefault(id(s.sampler), []).append(b)
                    continue
                logprobs, finite[b] = s.step.checked(logits[b : b + 1], inputs[b])
                token = s.step.draw(logprobs)
                s.step.fed(inputs[b])
                step.picks[b] = (token, logprobs[0])
            for group in shared.values():
                first = rows[group[0]].step
                part = logits if len(group) == len(rows) else logits[mx.array(group)]
                logprobs, ok = first.checked(part, None)
                tokens = first.draw(logprobs)  # unseeded: the global generator
                for j, b in enumerate(group):
                    step.picks[b] = (tokens[j : j + 1], logprobs[j])
                    finite[b] = ok[j : j + 1]
            step.finite = mx.concatenate(finite)
            mx.async_eval([p for pair in step.picks for p in pair], step.finite)
        except Exception as e:  # refused (e.g. the context), or a read failed as it started
            _restore(rows, snaps)
            touched = list(rows)
            if prev is not None:
                _settle_quietly(prev)
                _restore(prev.rows, prev.snaps)
                touched += [s for s in prev.rows if s not in rows]
            raise BatchStepError(translate(e), [s.uid for s in touched]) from e
        return step

    def _read(self, step: _Step, following: _Step | None) -> list[Response]:
        """Wait for `step`'s tokens and hand them out. A failure rolls its rows back to before it,
        and `following` (queued on it) with them; BatchStepError names every row touched (non-finite
        logits: the rows that went non-finite)."""
        failed = []
        try:
            with rollback_on_error(None, None):
                mx.eval([p for pair in step.picks for p in pair], step.finite)
            failed = [s.uid for s, ok in zip(step.rows, step.finite.tolist()) if not ok]
            if failed:
                raise NonFiniteError("logits", f"requests {failed}: the step computed NaN or infinity")
        except Exception as e:
            touched = list(step.rows)
            if following is not None:
                _settle_quietly(following)
                _restore(following.rows, following.snaps)
                touched += [s for s in following.rows if s not in step.rows]
            _restore(step.rows, step.snaps)
            raise BatchStepError(e, failed or [s.uid for s in touched]) from e
        self.steps += 1
        self.rows += len(step.rows)
        out = []
        for s, (token, logprobs) in zip(step.rows, step.picks):
            if s not in self._decoding:
                continue  # cancelled while its step was in flight
            token = token.item()
            s.tokens.append(token)
            if s.prefix is not None:  # its prompt's state gave finite logits: stored now (AFN-010)
                self._store_prefix(s)
            finish = "stop" if token in s.stops else ("length" if len(s.tokens) == s.max_tokens else None)
            out.append(Response(s.uid, token, logprobs, finish, None if finish is None else s.cache))
            s.y = token
            if finish is not None:
                self._finish(s)
        if self.rows % CLEAR_CACHE_EVERY < len(step.rows):
            mx.clear_cache()
        return out

    def _store_prefix(self, s: _Seq):
        live = s.cache.snapshot()
        s.cache.restore(s.prefix)
        try:
            self.prompt_cache.insert(s.ids[:-1], s.cache)
        finally:
            s.cache.restore(live)
            s.prefix = None

    def _finish(self, s: _Seq):
        self._decoding.remove(s)
        if self.prompt_cache is None:
            return
        # The cache holds the prompt and every token (pipelined: the last one is fed by the step
        # queued on it, as generate's loop) or every token but the last (steps run one by one).
        for held in (s.ids + s.tokens, s.ids + s.tokens[:-1]):
            if s.cache.offset == len(held):
                try:
                    self.prompt_cache.insert(held, s.cache)
                except Exception as e:  # the step feeding it failed: that surfaces when it is read
                    log.info("prefix not stored: %s", e)
                return


@dataclass
class _Step:
    """One queued batched decode step: its rows, their lazy (token [1], logprobs [V]) and each
    row's state before it (cache snapshot, processors' history, random key)."""

    rows: list[_Seq]
    picks: list[Any]
    snaps: list[Any]
    finite: Any = None  # [rows] bool: each row's logits were finite


def _restore(rows, snaps):
    """AFN-010 for a batched step: each row back to its state before the step."""
    for s, (snap, history, key) in zip(rows, snaps):
        s.cache.restore(snap)
        s.step.history = history
        s.step.key = key


def _settle_quietly(step: _Step):
    """Evaluate a step nobody reads, so its streamed leases are returned; its error (if any) is
    the step's it was queued on, reported there."""
    try:
        mx.eval([p for pair in step.picks for p in pair])
    except Exception as e:
        log.info("discarded step failed: %s", e)


@dataclass
class BatchResponse:
    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    stats: dict[str, float]
    caches: list | None = None  # return_prompt_caches: each sequence's cache (its offset: tokens it holds)
    logprobs: list[list[float]] | None = None  # return_logprobs: each generated token's log-probability


def batch_generate(
    model,
    tokenizer,
    prompts: Sequence,
    max_tokens=256,
    *,
    verbose: bool = False,
    sampler=None,
    logits_processors=None,
    decode_concurrency: int = 8,
    prompt_concurrency: int = 1,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    prompt_cache=None,
    prompt_caches=None,
    return_prompt_caches: bool = False,
    return_logprobs: bool = False,
    seeds=None,
) -> BatchResponse:
    """Generate for several prompts at once (strings are encoded as data, or token id lists);
    `max_tokens` an int or one per prompt; `seeds` None or one per prompt (None: unseeded). Each
    sequence's tokens are its solo run's (greedy: the same tokens; docs/GENERATION.md).

    mlx-lm's keywords: `prompt_caches` (one sequence cache per prompt, holding a prefix the prompt
    continues; copied, not updated in place; not with `prompt_cache`, the shared prefix cache),
    `return_prompt_caches` (`caches`: each sequence's cache after it), `return_logprobs`
    (`logprobs`: each generated token's log-probability); `token_ids` are always there."""
    if prompt_caches is not None and prompt_cache is not None:
        raise UsageError("prompt_caches", "cannot be combined with prompt_cache (prefix reuse): give one")
    ids = [prompt_ids(tokenizer, p).tolist() for p in prompts]
    per = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(ids)
    g = BatchGenerator(
        model,
        effective_vocab_size=tokenizer.effective_vocab_size,
        stop_tokens=_stop_set(tokenizer),
        sampler=sampler,
        logits_processors=logits_processors,
        decode_concurrency=decode_concurrency,
        prompt_concurrency=prompt_concurrency,
        prefill_step_size=prefill_step_size,
        prompt_cache=prompt_cache,
    )
    uids = g.insert(ids, max_tokens=per, caches=prompt_caches, seeds=seeds)
    tokens = {u: [] for u in uids}
    finish: dict[int, str | None] = {u: None for u in uids}
    caches: dict[int, Any] = {}
    logprobs: dict[int, list[float]] = {u: [] for u in uids}
    tic = time.perf_counter()
    while len(g):
        for r in g.next():
            if r.finish_reason != "stop":
                tokens[r.uid].append(r.token)
                if return_logprobs:
                    logprobs[r.uid].append(r.logprobs[r.token].item())
            if r.prompt_cache is not None:
                caches[r.uid] = r.prompt_cache
            finish[r.uid] = r.finish_reason
    elapsed = time.perf_counter() - tic
    texts = [tokenizer.decode(tokens[u]) for u in uids]
    n = sum(len(t) for t in tokens.values())
    stats = {
        "generation_tokens": n,
        "seconds": elapsed,
        "tokens_per_second": n / max(elapsed, 1e-9),
        "decode_steps": g.steps,
    }
    if verbose:
        for i, t in enumerate(texts):
            print(f"[{i}] {t}")
        print(f"Generation: {n} tokens, {stats['tokens_per_second']:.3f} tokens-per-sec ({g.steps} steps)")
    return BatchResponse(
        texts,
        [tokens[u] for u in uids],
        [finish[u] for u in uids],
        stats,
        caches=[caches[u] for u in uids] if return_prompt_caches else None,
        logprobs=[logprobs[u] for u in uids] if return_logprobs else None,
    )
