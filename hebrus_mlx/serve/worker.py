"""The worker: one thread that owns the model and runs the queued jobs.

MLX streams belong to the thread that built the graph (the streaming extension's ops too), so the
model is loaded and run on the worker's thread. Requests queue in FIFO order and run one at a
time; a cancel (client gone, shutdown) fails the job's pending expert reads at once (one ticket
scope per request) and the last queued step is drained so no ticket stays pinned. With
`decode_concurrency` > 1 the jobs share decode steps instead (batch_generate.BatchGenerator): new
prompts prefill between steps and a cancel drops the job at the next step boundary. Both loops
hand each generated token to one output path (`_token`): its log-probability, then its text.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

from .. import constrain
from ..generate import DEFAULT_PREFILL_STEP_SIZE, GenerationError, context_limit, generation_stream
from ..pipeline.stage import PipelineError
from ..prompt_cache import PromptCache, Usage, stream_with_cache
from ..stream.errors import StreamError
from .sampling import Sampling, token_logprob

log = logging.getLogger("hebrus_mlx.server")


@dataclass
class ServerDefaults:
    """What the server's command line sets for every request: sampling defaults, the decode loop's
    settings (prefill chunk, drafting, batching) and the prefix cache on disk."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = None  # --max-tokens; None: not given (see App._max_tokens)
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE
    draft_model: str | None = None  # speculative decoding: 'ngram', 'mtp' or a draft model dir
    num_draft_tokens: int | None = None
    prompt_cache_dir: str | None = None  # prefix snapshots on disk (prompt_cache_disk.py)
    prompt_cache_dir_bytes: int = 8 << 30
    decode_concurrency: int = 1  # > 1: requests share decode steps (batch_generate.BatchGenerator)
    prompt_concurrency: int = 1  # requests prefilling at once, a chunk per round, under batching

    @classmethod
    def from_args(cls, args) -> ServerDefaults:
        """The defaults the server's command line gives: each field is the flag of its name."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


@dataclass
class Job:
    """One request queued for the worker: its prompt IDs and sampling, and the asyncio queue its
    events go to (("text", str), ("logprob", entry), ("done", finish_reason), ("error", exc))."""

    ids: list[int]
    sampling: Sampling
    max_tokens: int
    loop: Any
    events: Any  # asyncio.Queue, filled from the worker thread
    cancel: threading.Event = field(default_factory=threading.Event)
    usage: Usage = field(default_factory=lambda: Usage(0, 0))
    tickets: Any = None  # its ticket scope (Streaming.request()) while it runs: a cancel fails its reads
    finished: bool = False
    stop_hit: str | None = None  # the stop sequence that ended the reply (Anthropic's stop_sequence)
    grammar: Any = None  # constrain.GrammarProcessor of a structured-output / strict-tool request

    def emit(self, event):
        """From any thread: put `event` ((kind, value)) in the job's queue, on its event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Worker:
    """Loads the model on its own thread and runs jobs one at a time, FIFO."""

    def __init__(self, load, prompt_cache_bytes: int, defaults: ServerDefaults):
        self.defaults = defaults
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.model = self.tokenizer = None
        self.busy = False
        self.current: Job | None = None  # the running job (a stalled pipeline answers it)
        self.batch = None  # the BatchGenerator under --decode-concurrency > 1
        self.broken: PipelineError | None = None  # a pipeline rank died: every request fails
        self.close = None  # run on the worker thread when it stops (a pipeline releases its ranks)
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(load,), name="hebrus-worker", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    @property
    def context(self) -> int | None:
        return context_limit(self.model)

    def _run(self, load):
        try:
            self.model, self.tokenizer = load()
            if self.defaults.prompt_cache_dir is not None:
                from ..prompt_cache_disk import DiskPromptCache

                self.prompt_cache.disk = DiskPromptCache(
                    self.defaults.prompt_cache_dir, self.defaults.prompt_cache_dir_bytes, self.model
                )
            if hasattr(self.model, "on_stall"):
                self.model.on_stall = self._on_stall
            if hasattr(self.tokenizer, "backend"):
                # Built before serving: for a 248k vocabulary it holds the GIL for seconds, which on
                # a first structured request would stall the event loop and every stream.
                try:
                    constrain.grammar_tokenizer(self.tokenizer)
                except constrain.GrammarError as e:  # plain requests are still served
                    log.warning("structured output unavailable: %s", e.message)
            # The loaded model, tokenizer and modules never die: out of the collector's reach, a
            # collection that a big request's allocations trigger (on a prep thread, holding the
            # GIL) walks only the request's objects, not ~200k startup objects.
            gc.freeze()
        except BaseException as e:  # reported by the constructor on the caller's thread
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        if self.defaults.decode_concurrency > 1:
            return self._run_batched()
        while True:
            job = self.jobs.get()
            if job is None:
                if self.close is not None and self.broken is None:
                    self.close()
                return
            if job.cancel.is_set():
                continue
            if self.broken is not None:
                job.emit(("error", self.broken))
                continue
            self.busy, self.current = True, job
            try:
                self._generate(job)
            except PipelineError as e:
                self.broken = e
                log.error("pipeline down, refusing further requests: %s", e)
                job.emit(("error", e))
            except (StreamError, GenerationError, ValueError) as e:
                if job.cancel.is_set():  # its tickets were failed on purpose
                    log.info("cancelled request stopped: %s: %s", type(e).__name__, e)
                else:
                    job.emit(("error", e))
            except Exception as e:  # never a traceback to the client; one log line here
                log.error("generation failed: %s: %s", type(e).__name__, e)
                job.emit(("error", e))
            finally:
                self.current = None
                if self.broken is None:
                    self._drain(job)
                self.busy = False

    def _run_batched(self):
        """--decode-concurrency > 1: up to N requests share each decode step, new prompts prefill a
        chunk per round between steps (BatchGenerator). A cancel (disconnect, stop string,
        shutdown) drops the request at the next round boundary; a failed round fails the requests
        it touched (their state is discarded) and the others go on."""
        from ..batch_generate import BatchGenerator, BatchStepError

        tok = self.tokenizer
        d = self.defaults
        g = BatchGenerator(
            self.model,
            effective_vocab_size=tok.effective_vocab_size,
            stop_tokens=tok.stop_token_ids,
            decode_concurrency=d.decode_concurrency,
            prompt_concurrency=d.prompt_concurrency,
            prefill_step_size=d.prefill_step_size,
            prompt_cache=self.prompt_cache,
        )
        self.batch = g
        live = {}  # uid -> [job, detokenizer, start time, first-token time]
        stopping = False
        while True:
            while not stopping:  # take every waiting job; block only when there is nothing to run
                try:
                    job = self.jobs.get(block=not len(g))
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                elif not job.cancel.is_set():
                    self._admit(g, job, live)
            for uid, entry in list(live.items()):
                if entry[0].cancel.is_set():
                    g.remove([uid])
                    del live[uid]
            if stopping and not live:
                if self.model.streaming is not None:
                    self.model.streaming.reset()
                return
            self.busy = bool(len(g))
            if not len(g):
                continue
            try:
                responses = g.next()
            except BatchStepError as e:
                for uid in e.uids:
                    job = live.pop(uid)[0]
                    g.remove([uid])
                    if job.cancel.is_set():
                        log.info("cancelled request stopped: %s", e)
                    else:
                        log.error("generation failed: %s: %s", type(e.cause).__name__, e.cause)
                        job.emit(("error", e.cause))
                if self.model.streaming is not None:
                    self.model.streaming.reset()  # the next step's P1 hint must not hang on failed routes
                continue
            except Exception as e:  # never a traceback to the client; the requests in flight fail
                log.error("generation failed: %s: %s", type(e).__name__, e)
                for uid, (job, *_) in list(live.items()):
                    g.remove([uid])
                    job.emit(("error", e))
                live.clear()
                continue
            self.busy = bool(len(g))  # before the last "done" goes out
            for r in responses:
                entry = live.get(r.uid)
                if entry is None:
                    continue
                job, detok, tic, first = entry
                now = time.perf_counter()
                u = job.usage
                if first is None:
                    entry[3] = first = now
                    u.prompt_seconds = now - tic
                    u.cached_tokens = g.cached_tokens(r.uid) or 0
                u.completion_tokens += 1
                u.generation_seconds = now - first
                if r.finish_reason != "stop":
                    detok.add_token(r.token)
                if r.finish_reason is not None:
                    detok.finalize()
                self._token(job, r.token, r.logprobs, detok.last_segment, r.finish_reason)
                if r.finish_reason is not None:
                    del live[r.uid]
                    job.emit(("done", r.finish_reason))

    def _admit(self, g, job: Job, live: dict):
        """Queue `job` in the batch generator (its sampler, seed and max_tokens)."""
        if self.broken is not None:
            job.emit(("error", self.broken))
            return
        s = job.sampling
        try:
            sampler = s.sampler()
            (uid,) = g.insert(
                [job.ids],
                max_tokens=[job.max_tokens],
                samplers=[sampler],
                logits_processors=[self._processors(job)],
                seeds=[s.seed],
            )
        except (GenerationError, ValueError) as e:
            job.emit(("error", e))
            return
        job.usage.prompt_tokens = len(job.ids)
        live[uid] = [job, self.tokenizer.detokenizer, time.perf_counter(), None]

    def _on_stall(self, message: str):
        # On the watchdog's thread, just before the process exits: answer the running request.
        log.error("pipeline stalled: %s; failing the request, then exiting", message)
        job = self.current
        if job is not None and not job.finished:
            job.emit(("error", PipelineError(message)))
            time.sleep(1.0)  # the event loop sends the error response meanwhile

    def _drain(self, job: Job):
        # A closed generator leaves its queued step in flight; finishing it here returns every
        # expert lease it holds before the next job starts. If the job was cancelled that step
        # fails on its stale tickets, as intended; its state is discarded with the job's cache.
        import mlx.core as mx

        try:
            mx.synchronize(generation_stream())  # the worker thread's generation stream
            mx.synchronize()
        except Exception as e:
            if job.cancel.is_set():
                log.info("cancelled request's last step: %s", e)
            else:
                log.error("draining the last step failed: %s: %s", type(e).__name__, e)
        # The P1 hint of the next step hangs on this job's last routes, which may come from a
        # step that failed (cancelled tickets): the next job must not evaluate them. (Another
        # conversation's routes are a poor hint anyway.)
        if self.model.streaming is not None:
            self.model.streaming.reset()

    def _generate(self, job: Job):
        streaming = self.model.streaming
        if streaming is None:
            return self._decode(job)
        # One ticket scope per request: a speculative run inside retires generations of it, so a
        # cancel from the event loop fails every pending read of the request, drafted or not.
        with streaming.request() as tickets:
            job.tickets = tickets
            if job.cancel.is_set():  # cancelled before its scope existed
                tickets.cancel()
            self._decode(job)

    def _decode(self, job: Job):
        s = job.sampling
        sampler = s.sampler()
        processors = self._processors(job)
        draft = self.defaults.draft_model
        if draft is not None and job.grammar is not None:
            # Drafted tokens are not checked against the grammar: this request decodes plainly.
            log.info("constrained request: speculative drafting off for it (drafts are not grammar-checked)")
            draft = None
        finish = None
        for r in stream_with_cache(
            self.model,
            self.tokenizer,
            job.ids,
            self.prompt_cache,
            job.max_tokens,
            sampler=sampler,
            prefill_step_size=self.defaults.prefill_step_size,
            cancelled=job.cancel.is_set,
            usage=job.usage,
            draft_model=draft,
            num_draft_tokens=self.defaults.num_draft_tokens,
            logits_processors=processors,
            seed=s.seed,  # its own key: MLX's global generator stays the unseeded requests'
        ):
            finish = r.finish_reason
            self._token(job, r.token, r.logprobs, r.text, finish)
        # "done" once the generator has closed: the prompt cache holds the reply by then.
        if not job.cancel.is_set():
            job.emit(("done", finish or "stop"))

    def _token(self, job: Job, token: int, logprobs, text: str, finish: str | None):
        """One generated token's events, from either loop: its log-probability when the request
        asks (not for a stop token: it is not part of the text), then its text (the
        detokenizer's new segment, "" while a character is incomplete). `finish`: the token's
        finish reason, None before the last."""
        s = job.sampling
        if s.logprobs and finish != "stop":
            job.emit(("logprob", token_logprob(self.tokenizer, logprobs, token, s.top_logprobs)))
        job.emit(("text", text))

    def _processors(self, job: Job) -> list:
        """The job's logits processors; the grammar mask last (it only sets columns to -inf)."""
        out = job.sampling.logits_processors(self.tokenizer.effective_vocab_size)
        return out + ([job.grammar] if job.grammar is not None else [])

    def cancel(self, job: Job):
        """From any thread: stop `job` (queued or running) and fail its pending expert reads, so
        a step blocked on the SSD ends now instead of after its reads."""
        job.cancel.set()
        tickets = job.tickets
        if tickets is not None and not job.finished:
            tickets.cancel()

    def stop(self):
        """Let the thread end once the queued jobs are done (cancel them first to end it now)."""
        self.jobs.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most `timeout` seconds for the thread to end (after stop()); True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """Whether the worker's thread still runs."""
        return self._thread.is_alive()
