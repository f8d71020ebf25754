"""Text generation with the feel of `mlx_lm.generate`: `generate_step`, `speculative_generate_step`,
`stream_generate` and `generate` (library code, as mlx-lm's; the `hebrus-mlx generate` verb is
commands/generate.py, the flags it shares with chat and server commands/verb_flags.py).

One loop serves every path: `prefill_chunks` / `prefill` feed a prompt chunk by chunk (the chunk
cap, rollback, evaluation), `DecodeStep` turns one forward into log-probabilities and a token, and
the pipelined decode queues the next step before reading the current token; speculative decoding is
a strategy that loop calls (speculative/protocol.py). The prompt cache and trace replay use the
same prefill."""

import sys
import threading
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from . import flags
from .errors import KV_QUANT_UNSUPPORTED, GenerationError, UsageError  # noqa: F401 (GenerationError: public here)
from .sample_utils import check_finite, checked_logprobs, make_sampler
from .stream.rollback import rollback_on_error
from .traces.schema import KIND_DECODE, KIND_PREFILL

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100
DEFAULT_PREFILL_STEP_SIZE = 2048
MAX_DRAFT_TOKENS = 64  # a verify block of more drafted tokens only wastes work (1e11 hung the run)
CLEAR_CACHE_EVERY = 256  # tokens; as mlx-lm's generate, so the buffer cache does not grow unbounded

# One stream for the model's work, as mlx-lm: host-side work on the default stream does not queue
# behind (or in front of) a generation step. MLX streams belong to the thread that made them, so each
# generating thread (the server's worker, the CLI's main thread) gets its own.
_thread = threading.local()


def generation_stream():
    stream = getattr(_thread, "stream", None)
    if stream is None:
        stream = _thread.stream = mx.new_stream(mx.default_device())
    return stream


@contextmanager
def wired_limit(model):
    """Wire the model's weights while generating when they are a large part of the Metal working set
    (mlx-lm's rule); a no-op without Metal (this machine: not exercised)."""
    from .machine_profile import metal_device

    if not metal_device():
        yield
        return
    from mlx.utils import tree_reduce

    model_bytes = tree_reduce(lambda acc, x: acc + x.nbytes if isinstance(x, mx.array) else acc, model, 0)
    max_rec = mx.device_info()["max_recommended_working_set_size"]
    old = mx.set_wired_limit(min(model_bytes, max_rec)) if model_bytes > 0.9 * max_rec else None
    try:
        yield
    finally:
        if old is not None:
            mx.synchronize(generation_stream())
            mx.set_wired_limit(old)


@dataclass
class GenerationResponse:
    text: str
    token: int
    logprobs: mx.array
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None
    from_draft: bool = False  # a drafted token the target accepted (speculative decoding)


# mlx-lm's --max-kv-size keeps a rotating window of the last N keys. Qwen4Exp's QSA layers select
# keys from the whole context by the indexer's scores, and GDN layers carry a fixed-size state, so a
# window would silently change which keys QSA can pick: the flag is refused, not approximated.
MAX_KV_SIZE_UNSUPPORTED = (
    "not supported by Qwen4Exp (QSA selects keys from the whole context; a rotating window would change its output)"
)


def check_max_kv_size(max_kv_size, field):
    if max_kv_size is not None:
        raise UsageError(field, MAX_KV_SIZE_UNSUPPORTED)


def context_limit(model) -> int | None:
    """The most positions a sequence of `model` may hold (None: unbounded)."""
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


# -- the pieces of one sequence's generation: prefill and the decode step ----------------------------


def _snapshot(cache):
    # AFN-010: MLX arrays are values, so a snapshot is references (free); holding one also keeps the
    # previous buffers from being donated to the update. A cache without snapshots cannot roll back.
    snapshot = getattr(cache, "snapshot", None)
    return None if snapshot is None else snapshot()


@contextmanager
def _guarded(cache, snap, model=None):
    """Evaluation on the generation stream that, failing, leaves `cache` at `snap` (typed) and
    `model`'s streamed layers off the failed step's routes."""
    try:
        with rollback_on_error(cache, snap), mx.stream(generation_stream()):
            yield
    except BaseException:
        # The P1 hint must not hang on routes of the failed (partly unevaluated) graph: the next
        # step would evaluate that graph again, its resolves included.
        if getattr(model, "streaming", None) is not None:
            model.streaming.reset()
        raise


def _eval_cache(cache, fallback, extra=()):
    states = cache.arrays
    # Evaluating the cache alone leaves the chunk's vocabulary projection unevaluated.
    mx.eval(*(states if states else [fallback]), *extra)


def prefill_chunk_size(model, prefill_step_size: int) -> int:
    """Tokens per prefill chunk: `prefill_step_size`, capped where a streamed model needs it (a
    streamed chunk pins every expert it routes to in the arena at once, unless swept)."""
    streaming = getattr(model, "streaming", None)
    cap = None if streaming is None else streaming.prefill_chunk_cap
    return prefill_step_size if cap is None else min(prefill_step_size, cap)


def prefill_chunks(
    model, tokens: mx.array, cache, prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE, forward: Callable | None = None
) -> Generator[tuple[mx.array, Any], None, None]:
    """Feed `tokens` ([T] int32) into `cache` chunk by chunk (chunks of `prefill_chunk_size`), each
    chunk evaluated before the next is built and rolled back if that fails (AFN-010); yields
    (chunk, extra) once the chunk is in the cache.

    forward(chunk) -> (out, pending, extra): the model call of one chunk (default
    `model(chunk[None], cache=cache)`), arrays to evaluate with it (captures, hidden rows) and what
    to yield back; the chunk's logits are not evaluated (prefill needs the state only)."""
    if prefill_step_size < 1:
        raise GenerationError("prefill_step_size", f"must be >= 1, got {prefill_step_size}")
    if forward is None:
        forward = lambda chunk: (model(chunk[None], cache=cache), (), None)  # noqa: E731
    step = prefill_chunk_size(model, prefill_step_size)
    for start in range(0, tokens.size, step):
        chunk = tokens[start : start + step]
        with _guarded(cache, _snapshot(cache), model):
            out, pending, extra = forward(chunk)
            _eval_cache(cache, out, pending)
        yield chunk, extra


def prefill(
    model,
    tokens: mx.array,
    cache,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    cancelled: Callable[[], bool] = lambda: False,
) -> bool:
    """`prefill_chunks` run through; False (the cache holding the chunks before) when `cancelled()`
    turned true between chunks."""
    if cancelled():
        return False
    for _ in prefill_chunks(model, tokens, cache, prefill_step_size):
        if cancelled():
            return False
    return True


@dataclass
class PendingStep:
    """A queued decode step; its token and log-probabilities are lazy until read."""

    y: mx.array  # [1] int32
    logprobs: mx.array  # [V]
    snap: Any  # the cache before the step: where a failure of this step (or one queued on it) returns
    staged: Any = None  # the trace record of the token it fed
    hidden: mx.array | None = None  # [1, D] state after the fed token (drafters that ask for it)
    routes: mx.array | None = None  # [layers, 1, k] (the speculative governor's unique experts)
    finite: mx.array | None = None  # [1] bool: the logits were finite (AFN-010)

    def arrays(self) -> list:
        extra = [] if self.staged is None else list(self.staged.arrays)
        return extra + [a for a in (self.hidden, self.routes, self.finite) if a is not None]


def check_seed(seed, sampler) -> None:
    """Refuse a seed `DecodeStep` cannot honour (UsageError naming `seed`)."""
    if seed is None:
        return
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= flags.SEED_MAX:
        raise UsageError("seed", f"must be an integer in [0, 2**64 - 1], got {seed!r}")
    if not getattr(sampler, "takes_key", False):
        raise UsageError("seed", "needs a sampler that takes a key (hebrus_mlx.sample_utils.make_sampler)")


class DecodeStep:
    """One sequence's forward and logits -> log-probabilities -> token: logits processors, the
    vocabulary mask and the log-softmax once (AFN-005), then the sampler. The plain decode, the
    speculative verify and prefill all feed the model through it.

    hidden: forwards also return the pre-mixer state rows (drafters that need them); routes:
    forwards asked for them capture the routed experts (not across a pipeline).

    seed: the sequence draws from its own key (`mx.random.key(seed)`, split per draw), so its
    tokens depend on nothing else that runs and MLX's global generator is never reseeded; None:
    draws from the global generator, which no seeded sequence moves (fresh per process unless
    the caller seeds it)."""

    def __init__(
        self,
        model,
        cache,
        *,
        effective_vocab_size: int,
        sampler: Callable,
        logits_processors: list[Callable] | None = None,
        trace=None,
        hidden: bool = False,
        routes: bool = False,
        seed: int | None = None,
    ):
        check_seed(seed, sampler)
        self.model, self.cache = model, cache
        self.effective_vocab_size = effective_vocab_size
        self.sampler = sampler
        # A hebrus-mlx sampler masks and normalises its input; here that ran already.
        self._sample = getattr(sampler, "from_logprobs", sampler)
        self.processors = list(logits_processors or [])
        self.trace = trace
        self.hidden = hidden
        self.pipeline = getattr(model, "last_row_logits", False)  # rank 0 of a pipeline: no route capture
        self.routes = routes and not self.pipeline
        self.history: mx.array | None = None  # every token fed (kept for logits processors)
        self.key = None if seed is None else mx.random.key(seed)  # the next draw's parent key

    def next_key(self) -> mx.array | None:
        """A key for one draw of this sequence (None: unseeded, the global generator)."""
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub

    def draw(self, logprobs: mx.array) -> mx.array:
        """The sampler's tokens for `logprobs` (masked, normalised), from this sequence's key."""
        key = self.next_key()
        return self._sample(logprobs) if key is None else self._sample(logprobs, key=key)

    def guard(self, snap):
        return _guarded(self.cache, snap, self.model)

    def forward(self, ids: mx.array, kind: int = KIND_DECODE, rows: bool = False, routes: bool = False):
        """Feed `ids` ([T] int32): (logits [T, V] (a pipeline: the last row unless `rows`),
        hidden [T, D] or None, the trace record or None, routes [layers, T, k] or None), lazy."""
        kw = {}
        cap = None
        if self.trace is not None:
            cap = self.trace.capture()
        elif routes and self.routes:
            from .models.qwen4exp import Capture  # the model module is imported by whoever built `model`

            cap = Capture(hidden=False)
        if cap is not None:
            kw["capture"] = cap
        if self.hidden:
            kw["return_hidden"] = True
        if rows and self.pipeline:
            kw["all_logits"] = True
        out = self.model(ids[None], cache=self.cache, **kw)
        logits, hidden = out if self.hidden else (out, None)
        staged = None if self.trace is None else self.trace.stage(cap, ids, kind)
        stacked = None
        if cap is not None and self.trace is None and cap.routes:
            stacked = mx.stack([cap.routes[i][0] for i in sorted(cap.routes)])
        return logits[0], None if hidden is None else hidden[0], staged, stacked

    def fed(self, ids: mx.array) -> None:
        """`ids` entered the sequence (the processors' history)."""
        if self.processors:
            self.history = ids if self.history is None else mx.concatenate([self.history, ids])

    def logprobs(self, logits: mx.array, fed: mx.array) -> mx.array:
        """[L, V] logits of the forward that fed `fed` -> [L, V] log-probabilities, -inf past the
        effective vocabulary; each row's processors see the history through that row's input."""
        return self.checked(logits, fed)[0]

    def checked(self, logits: mx.array, fed: mx.array) -> tuple[mx.array, mx.array]:
        """`logprobs` and [L] bools: each row's logits were finite (`check_finite`)."""
        if self.processors:
            out = []
            for i in range(logits.shape[0]):
                seen = fed[: fed.size - logits.shape[0] + i + 1]
                history = seen if self.history is None else mx.concatenate([self.history, seen])
                row = logits[i : i + 1]
                for proc in self.processors:
                    row = proc(history, row)
                out.append(row)
            logits = out[0] if len(out) == 1 else mx.concatenate(out, axis=0)
        return checked_logprobs(logits, self.effective_vocab_size)

    def prefill_forward(self, chunk: mx.array):
        """`prefill_chunks`' forward: the chunk's trace record and hidden rows come back."""
        out, hidden, staged, _ = self.forward(chunk, KIND_PREFILL)
        self.fed(chunk)
        pending = ([] if staged is None else list(staged.arrays)) + ([] if hidden is None else [hidden])
        return out, pending, (staged, hidden)

    def queue(self, y: mx.array) -> PendingStep:
        """Build the step feeding `y` ([1], possibly not yet evaluated) and start evaluating it."""
        snap = _snapshot(self.cache)
        with self.guard(snap):
            logits, hidden, staged, routes = self.forward(y, KIND_DECODE, routes=True)
            logprobs, finite = self.checked(logits[-1:], y)
            step = PendingStep(self.draw(logprobs), logprobs[0], snap, staged, hidden, routes, finite)
            self.fed(y)
            mx.async_eval(step.y, logprobs, *step.arrays())
        return step

    def read(self, step: PendingStep) -> int:
        """The step's token (waits for it); its trace record is committed first. Non-finite
        logits raise NonFiniteError (the caller's guard rolls the sequence back)."""
        check_finite(step.finite)
        if step.staged is not None:
            self.trace.commit(step.staged)
        return step.y.item()

    def finish(self, step: PendingStep) -> None:
        """Evaluate a step nobody reads (queued on the last token), so the cache and the streamed
        experts' leases are settled when the caller gets control. Non-finite logits take the
        cache back to before it: every token was handed out, but the state it fed is not kept
        (the prompt cache then stores nothing of it, AFN-010)."""
        mx.eval(step.y, step.logprobs, *step.arrays())
        if not step.finite.all().item():
            self.cache.restore(step.snap)
            return
        if step.staged is not None:
            self.trace.commit(step.staged)


# -- the generation loop --------------------------------------------------------------------------------


def generate_step(
    prompt: mx.array,
    model,
    *,
    effective_vocab_size: int | None = None,
    max_tokens: int = 256,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: list[Callable[[mx.array, mx.array], mx.array]] | None = None,
    prompt_cache: list[Any] | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    max_kv_size: int | None = None,
    trace=None,
    draft_model=None,
    num_draft_tokens: int | None = None,
    seed: int | None = None,
) -> Generator[tuple[int, mx.array], None, None]:
    """Yield (token, logprobs) pairs; logprobs are over the physical width, -inf past the
    effective vocabulary (AFN-005; default: the one `hebrus_mlx.load` gave the model, from its
    tokenizer). `max_tokens=-1` runs until the caller stops.

    trace: a `traces.capture.TraceRecorder` records the native routes of every token fed (read
    back once per step or prefill chunk); the caller closes it.

    `draft_model` (a hebrus_mlx.speculative Drafter) decodes speculatively with blocks of up to
    `num_draft_tokens`; the tokens are the same (greedy) or identically distributed (sampling).

    seed: this sequence's own random key (DecodeStep); None draws from MLX's global generator."""
    for token, logprobs, _ in _generate(
        prompt,
        model,
        effective_vocab_size=effective_vocab_size,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        max_kv_size=max_kv_size,
        trace=trace,
        draft_model=draft_model,
        num_draft_tokens=num_draft_tokens,
        seed=seed,
    ):
        yield token, logprobs


def speculative_generate_step(
    prompt: mx.array,
    model,
    draft_model,
    *,
    effective_vocab_size: int | None = None,
    max_tokens: int = 256,
    sampler: Callable[[mx.array], mx.array] | None = None,
    logits_processors: list[Callable[[mx.array, mx.array], mx.array]] | None = None,
    prompt_cache: Any | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    max_kv_size: int | None = None,
    num_draft_tokens: int | None = None,
    governor: Any = "auto",
    stats=None,
    trace: list | None = None,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """generate_step with a Drafter (hebrus_mlx.speculative), yielding (token, logprobs, from_draft)
    like mlx-lm's: from_draft marks a drafted token the target accepted. num_draft_tokens: the
    block limit (default 3); governor: "auto" (default: choose the block per step, see
    speculative/governor.py), None (always the limit) or a Governor; stats: a SpeculativeStats to
    fill; trace: a list that receives a speculative.protocol.StepTrace per verify step (golden
    replay). Steps with no draft run pipelined exactly as generate_step's."""
    yield from _generate(
        prompt,
        model,
        effective_vocab_size=effective_vocab_size,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        max_kv_size=max_kv_size,
        draft_model=draft_model,
        num_draft_tokens=num_draft_tokens,
        governor=governor,
        stats=stats,
        step_trace=trace,
    )


@contextmanager
def _no_tickets():
    yield None


def _generate(
    prompt,
    model,
    *,
    effective_vocab_size=None,
    max_tokens=256,
    sampler=None,
    logits_processors=None,
    prompt_cache=None,
    prefill_step_size=DEFAULT_PREFILL_STEP_SIZE,
    max_kv_size=None,
    trace=None,
    draft_model=None,
    num_draft_tokens=None,
    governor="auto",
    stats=None,
    step_trace=None,
    seed=None,
):
    """The one loop: prefill all but the last prompt token, then the pipelined decode, with the
    speculative blocks a drafter's strategy chooses in between. Yields (token, logprobs, from_draft)."""
    if draft_model is not None and trace is not None:
        raise UsageError(
            "trace",
            "route capture of speculative decoding is not supported (only "
            "verified tokens may enter a clean-path trace, AFN-021)",
        )
    if prompt.ndim != 1 or prompt.size == 0:
        raise GenerationError("prompt must be a non-empty 1-D array of token IDs")
    if prefill_step_size < 1:
        raise GenerationError("prefill_step_size", f"must be >= 1, got {prefill_step_size}")
    check_max_kv_size(max_kv_size, "max_kv_size")
    if effective_vocab_size is None:
        # AFN-005: the logits rows past the tokenizer's IDs are masked, so the width must be known.
        effective_vocab_size = getattr(model, "tokenizer_vocab_size", None)
        if effective_vocab_size is None:
            raise UsageError(
                "effective_vocab_size",
                "this model does not carry one (models from hebrus_mlx.load do): give the tokenizer's",
            )
    cache = model.make_cache() if prompt_cache is None else prompt_cache
    sampler = sampler or make_sampler()  # the vocabulary mask is this loop's (DecodeStep)
    streaming = getattr(model, "streaming", None)
    # Every streamed read of the sequence carries its request's ticket scope (a server request's
    # own, or one opened here): speculation retires generations in it, a cancel fails them all.
    with _no_tickets() if streaming is None else streaming.request() as tickets:
        spec = None
        if draft_model is not None:
            from .speculative.protocol import Speculation

            spec = Speculation(
                model,
                draft_model,
                cache,
                sampler,
                tickets,
                num_draft_tokens=num_draft_tokens,
                governor=governor,
                stats=stats,
                max_tokens=max_tokens,
                trace=step_trace,
            )
        step = DecodeStep(
            model,
            cache,
            effective_vocab_size=effective_vocab_size,
            sampler=sampler,
            logits_processors=logits_processors,
            trace=trace,
            hidden=spec is not None and spec.needs_hidden,
            routes=spec is not None and spec.track_routes,
            seed=seed,
        )
        if trace is not None:
            trace.begin(getattr(cache, "next_position", 0))
        y = prompt.astype(mx.int32)
        hidden = []
        for _, (staged, h) in prefill_chunks(model, y[:-1], cache, prefill_step_size, step.prefill_forward):
            if staged is not None:
                trace.commit(staged)
            if h is not None:
                hidden.append(h)
        if spec is not None:
            spec.begin(y.tolist(), hidden)
        yield from _decode(step, spec, y[-1:], max_tokens)


def _decode(step: DecodeStep, spec, y: mx.array, max_tokens: int):
    """Plain steps are pipelined: the next one is queued before the current token is read, so the
    host never idles the device. `spec` (None: plain decoding) picks a draft length while a step is
    in flight; a length > 0 skips queueing, and once the token is read a verify block continues."""
    if spec is not None:
        spec.start_plain()
    pending = step.queue(y)
    produced = 0
    while True:
        # Until its token is read, the current step and the one queued on top of it roll back
        # together to the state before the current step.
        with step.guard(pending.snap):
            if produced == max_tokens:  # plain: the step queued on the last token is in flight
                step.finish(pending)
                return
            last = produced + 1 == max_tokens
            block = 0 if spec is None or last else spec.block_size(produced + 1)
            # Plain decoding feeds every token it hands out (the prompt cache continues from them);
            # speculation stops at the last one.
            nxt = step.queue(pending.y) if block == 0 and (spec is None or not last) else None
            token = step.read(pending)
        if spec is not None:
            spec.plain(token, pending)
        yield token, pending.logprobs, False
        produced += 1
        if produced % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        if nxt is not None:
            pending = nxt
            continue
        if last:
            return
        while block > 0:  # verify blocks from `token` while the strategy keeps choosing them
            proposal = spec.propose(block)
            if not proposal.tokens:
                break  # nothing to verify: a plain step
            for token, logprobs, from_draft in spec.verify(step, token, proposal):  # noqa: B020 (next block from the last)
                yield token, logprobs, from_draft
                produced += 1
                if produced == max_tokens:
                    return
            block = spec.block_size(produced)
        spec.start_plain()
        pending = step.queue(mx.array([token], dtype=mx.int32))


def prompt_ids(tokenizer, prompt) -> mx.array:
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)  # caller text: DATA, no special-token resolution
    elif isinstance(prompt, mx.array):
        ids = prompt.tolist()
    else:
        ids = list(prompt)
    ids = tokenizer.check_ids(ids)
    if not ids:
        raise GenerationError("prompt is empty")
    bad = [i for i in ids if i >= tokenizer.effective_vocab_size]
    if bad:
        raise GenerationError(f"prompt contains unassigned token ID {bad[0]} (>= {tokenizer.effective_vocab_size})")
    return mx.array(ids, dtype=mx.int32)


def stream_generate(
    model,
    tokenizer,
    prompt: str | Sequence[int] | mx.array,
    max_tokens: int = 256,
    *,
    draft_model=None,
    num_draft_tokens: int | None = None,
    speculative_stats=None,
    trace_out=None,
    trace_features: int = 0,
    trace_owner: str = "local",
    trace_generation: int = 0,
    trace_sampling: dict | None = None,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Generate, yielding a GenerationResponse per token; stops on the tokenizer's stop set.
    `kwargs` go to generate_step (sampler, logits_processors, prompt_cache, prefill_step_size, ...).

    draft_model: decode speculatively with a name (ngram, mtp), a draft model directory or a
    Drafter, resolved here (names and directories need the tokenizer); speculative_stats: a
    SpeculativeStats to fill.

    trace_out: record a route trace of this sequence into that directory (off by default; token
    IDs are sensitive). trace_features=N also records the router input of every Nth position;
    trace_owner/trace_generation are opaque labels; trace_sampling describes the sampler."""
    _check_step_kwargs(kwargs)
    ids = prompt_ids(tokenizer, prompt)
    limit = context_limit(model)
    if limit is not None and ids.size > limit:
        raise GenerationError(f"prompt has {ids.size} tokens; the model context is {limit}")
    if max_tokens != -1 and max_tokens < 1:
        raise GenerationError("max_tokens", f"must be >= 1, got {max_tokens}")
    if limit is not None:
        room = limit - ids.size
        max_tokens = room if max_tokens == -1 else min(max_tokens, room)
    if draft_model is not None:
        if trace_out is not None or kwargs.get("trace") is not None:
            raise UsageError(
                "trace",
                "route capture of speculative decoding is not supported (only "
                "verified tokens may enter a clean-path trace, AFN-021)",
            )
        from .speculative import make_drafter

        draft_model = make_drafter(draft_model, model, tokenizer, kwargs.get("sampler"), num_draft_tokens)
    if trace_out is not None:
        # A recorder on the same loop, closed (remaining observations published) however it ends.
        from .traces.capture import TraceRecorder

        if trace_sampling is None:
            trace_sampling = {"sampler": "greedy" if kwargs.get("sampler") is None else "caller"}
        kwargs["trace"] = TraceRecorder.for_model(
            trace_out,
            model,
            tokenizer,
            owner=trace_owner,
            generation=trace_generation,
            sampling=trace_sampling,
            feature_every=trace_features,
        )
    try:
        mx.reset_peak_memory()
        tic = time.perf_counter()
        steps = _generate(
            ids,
            model,
            effective_vocab_size=tokenizer.effective_vocab_size,
            max_tokens=max_tokens,
            draft_model=draft_model,
            num_draft_tokens=num_draft_tokens,
            stats=speculative_stats,
            **kwargs,
        )
        with wired_limit(model):
            yield from _responses(
                steps, ids, tokenizer, tokenizer.detokenizer, tokenizer.stop_token_ids, max_tokens, tic
            )
    finally:
        if trace_out is not None:
            kwargs["trace"].close()


_SAMPLER_HINT = "give sampler=make_sampler(...) (hebrus_mlx.sample_utils, as mlx-lm's)"
# mlx-lm's generate_step arguments with no meaning here, and why; any other unknown name is refused too.
_REFUSED_KWARGS = {
    **{k: _SAMPLER_HINT for k in ("temp", "top_p", "min_p", "top_k", "xtc_probability", "xtc_threshold")},
    "kv_bits": KV_QUANT_UNSUPPORTED,
    "kv_group_size": KV_QUANT_UNSUPPORTED,
    "quantized_kv_start": KV_QUANT_UNSUPPORTED,
    "input_embeddings": "not supported: Qwen4Exp here takes token IDs",
    "prompt_progress_callback": "not supported yet",
}


def _check_step_kwargs(kwargs: dict) -> None:
    """A keyword stream_generate does not pass on (an mlx-lm one included) is a UsageError naming
    it before any work, not a TypeError from deep inside the loop."""
    taken = set(_generate.__kwdefaults__) - {"max_tokens", "draft_model", "num_draft_tokens", "stats"}
    for name in kwargs:
        if name not in taken:
            reason = _REFUSED_KWARGS.get(name, f"not an argument of generate (takes {', '.join(sorted(taken))})")
            raise UsageError(name, reason)


def _responses(steps, ids, tokenizer, detok, stops, max_tokens, tic):
    prompt_tps = 0.0
    for n, (token, logprobs, from_draft) in enumerate(steps, start=1):
        if n == 1:
            prompt_tps = ids.size / (time.perf_counter() - tic)
            tic = time.perf_counter()
        finish = "stop" if token in stops else ("length" if n == max_tokens else None)
        if finish != "stop":
            detok.add_token(token)
        if finish is not None:
            detok.finalize()
        yield GenerationResponse(
            text=detok.last_segment,
            token=token,
            logprobs=logprobs,
            prompt_tokens=ids.size,
            prompt_tps=prompt_tps,
            generation_tokens=n,
            generation_tps=n / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            from_draft=from_draft,
        )
        if finish is not None:
            return


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """Generate a complete response; with `verbose`, stream it and print mlx_lm-style stats."""
    text = ""
    response = None
    if kwargs.get("draft_model") is not None and kwargs.get("speculative_stats") is None:
        from .speculative import SpeculativeStats

        kwargs["speculative_stats"] = SpeculativeStats()
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            # After the first token: a bad prompt or --draft-model is one line on stderr, alone.
            print(("=" * 10 + "\n" if response.generation_tokens == 1 else "") + response.text, end="", flush=True)
        text += response.text
    if verbose:
        if response is None:
            print("=" * 10)
        print()
        print("=" * 10)
        if response is None:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
        if kwargs.get("speculative_stats") is not None:
            print(kwargs["speculative_stats"].summary())
        if model.streaming is not None:
            for line in model.streaming.summary():
                print(line)
        if hasattr(model, "named_modules"):  # an MLX model (not a stand-in exposing only __call__)
            from .models.optimize import implementations_line

            # On stderr: stdout keeps mlx_lm.generate's layout (the stats end with its own lines).
            print(implementations_line(model), file=sys.stderr)
    return text
