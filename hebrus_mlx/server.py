"""`hebrus-mlx server`: an OpenAI-compatible HTTP server with the endpoints of `mlx_lm.server`.

POST /v1/chat/completions, POST /v1/completions (both with `stream: true` as server-sent events
and `stream_options.include_usage`), GET /v1/models, GET /health. Starlette on uvicorn.

One worker thread owns the model (MLX streams belong to the thread that built the graph, and the
streaming extension's ops too): requests queue in FIFO order and run one at a time. A client that
disconnects cancels its request, queued or running: its pending expert reads fail at once (one
ticket scope per request, `Model.streaming.request()`, speculative reads included), the last
queued step is drained so no ticket stays pinned, and the next request starts from clean state.
With `--decode-concurrency N` > 1 the worker batches instead (batch_generate.BatchGenerator): up
to N requests share each decode step and new prompts prefill between steps; a cancel drops the
request at the next step boundary. Prompts reuse the longest cached prefix (`PromptCache`, exact
prefixes only; see prompt_cache.py).

Under `mlx.launch` (pipeline parallel, see hebrus_mlx/pipeline) rank 0 serves HTTP and drives the
pipeline; the other ranks run their layer ranges. Prefix snapshots are kept by every rank for its
own layers (`--prompt-cache-bytes` bounds rank 0's share). A rank that dies fails the request with
a 503 and every later one (the pipeline is down); a stalled rank gets the request a 503 within the
pipeline timeout, then the server exits (MLX cannot interrupt a collective).

Chat provenance (AFN-006): messages are rendered by the checkpoint's template and tokenized by
provenance, so caller text never becomes a control token, whatever it spells. Bad requests get a
4xx with an OpenAI-style error object naming the field and one log line; the server keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import hmac
import json
import logging
import math
import queue
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, fields
from typing import Any

from . import anthropic_api, api_fields, constrain, flags, responses_api
from .api_fields import RequestError
from .artifact.untrusted import UntrustedFileError
from .artifact.untrusted import loads as untrusted_loads
from .cli_args import MLX_LM_SERVER_REFUSED, ArgumentParser, add_refused_arguments, prefetch_from_args
from .errors import HebrusError, UsageError
from .generate import DEFAULT_PREFILL_STEP_SIZE, GenerationError, context_limit, generation_stream
from .pipeline import launched as pipeline_launched
from .pipeline.stage import PipelineError
from .prompt_cache import PromptCache, Usage, stream_with_cache
from .sample_utils import SamplingError, check_sampling_args, make_sampler
from .stream.errors import StreamError
from .text.chat_template import ChatError
from .verb_flags import (
    PROMPT_ERRORS,
    add_prompt_cache_arguments,
    check_args,
    check_shared_flags,
    load_from_args,
    share_generate_flags,
)

log = logging.getLogger("hebrus_mlx.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_PROMPT_CACHE_BYTES = 2 << 30
DEFAULT_SHUTDOWN_TIMEOUT = 5.0
DEFAULT_PREP_PROCESS_BYTES = 64 << 10  # bodies this large are rendered/tokenized in the prep process
DEFAULT_MAX_TOKENS = 512  # a reply's cap when neither the request nor --max-tokens gives one (mlx_lm.server's)
API_KEY_ENV = "HEBRUS_MLX_API_KEY"  # the key without a command line that `ps` shows
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


# -- request parsing (no MLX) ---------------------------------------------------------------------


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class Sampling:
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    # Issue 24: the logits processors (make_logits_processors' arguments) and what to report.
    logit_bias: dict | None = None  # token ID -> bias
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    presence_context_size: int = 20
    frequency_penalty: float | None = None
    frequency_context_size: int = 20
    logprobs: bool = False  # report each token's log-probability
    top_logprobs: int = 0  # and this many alternatives

    def logits_processors(self, vocab_size: int) -> list:
        from .sample_utils import make_logits_processors

        return make_logits_processors(
            self.logit_bias,
            self.repetition_penalty,
            self.repetition_context_size,
            self.presence_penalty,
            self.presence_context_size,
            self.frequency_penalty,
            self.frequency_context_size,
            vocab_size=vocab_size,
        )


def parse_sampling(body: dict, defaults: ServerDefaults) -> Sampling:
    def number(name, default):
        v = body.get(name)
        if v is None:
            return default
        if not _is_number(v) or not math.isfinite(v):
            raise RequestError(f"{name} must be a finite number, got {json.dumps(v)}", name)
        return float(v)

    def integer(name, default):
        v = body.get(name)
        if v is None:
            return default
        if not _is_int(v):
            raise RequestError(f"{name} must be an integer, got {json.dumps(v)}", name)
        return v

    max_tokens = integer("max_tokens", None)
    max_completion = integer("max_completion_tokens", None)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise RequestError("max_tokens and max_completion_tokens disagree", "max_tokens")
    max_tokens = max_tokens if max_tokens is not None else max_completion
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    s = Sampling(
        max_tokens=max_tokens,
        temperature=number("temperature", defaults.temp),
        top_p=number("top_p", defaults.top_p),
        top_k=integer("top_k", defaults.top_k),
        min_p=number("min_p", defaults.min_p),
        seed=integer("seed", None),
        stop=[],
        stream=False,
        include_usage=False,
    )
    try:
        check_sampling_args(s.temperature, s.top_p, s.min_p, s.top_k)
    except SamplingError as e:
        name = "temperature" if e.field == "temp" else e.field
        raise RequestError(f"{name} {e.message}", name) from None
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            raise RequestError("stop must be a non-empty string or a list of them", "stop")
        s.stop = stop
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", "stream")
    s.stream = stream
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise RequestError("stream_options must be an object", "stream_options")
        inc = opts.get("include_usage", False)
        if not isinstance(inc, bool):
            raise RequestError("stream_options.include_usage must be a boolean", "stream_options.include_usage")
        s.include_usage = inc
    n = 1 if body.get("n") is None else body["n"]
    if n != 1 or not _is_int(n):
        raise RequestError("only n=1 is supported", "n")
    # Ranges and types were checked by api_fields.check_fields.
    if body.get("logit_bias"):
        s.logit_bias = {int(k): float(v) for k, v in body["logit_bias"].items()}
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            setattr(s, name, float(body[name]))
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        if body.get(name) is not None:
            setattr(s, name, body[name])
    logprobs = body.get("logprobs")
    if _is_int(logprobs):  # /v1/completions: the number of alternatives
        s.logprobs, s.top_logprobs = True, logprobs
    else:
        s.logprobs, s.top_logprobs = logprobs is True, body.get("top_logprobs") or 0
    return s


def token_logprob(tokenizer, logprobs, token: int, top: int) -> dict:
    """One generated token's report: its log-probability under the distribution it was drawn from
    (the log-softmax of the processed logits, as mlx-lm reports) and the `top` most likely tokens."""
    import mlx.core as mx

    def finite(v):  # JSON has no -inf; OpenAI reports -9999.0 for an impossible token
        return v if math.isfinite(v) else -9999.0

    entry = {"id": token, "token": tokenizer.decode([token]), "logprob": finite(logprobs[token].item()), "top": []}
    if top:
        best = mx.argpartition(-logprobs, kth=top - 1)[:top]
        values = logprobs[best]
        order = mx.argsort(-values)  # most likely first
        for i, v in zip(best[order].tolist(), values[order].tolist()):
            entry["top"].append({"id": i, "token": tokenizer.decode([i]), "logprob": finite(v)})
    return entry


def developer_as_system(messages):
    """OpenAI's `developer` role is the system role of newer clients (as mlx-lm maps it)."""
    if not isinstance(messages, list):
        return messages
    return [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages]


class StopMatcher:
    """Releases text except a tail that may still become a stop sequence (or a tool-call
    opening); `feed` returns (text to release, hit) where hit is the marker found, if any."""

    def __init__(self, stops: list[str], markers: list[str] = ()):
        self.stops = list(stops)
        self.markers = list(markers)
        self.buf = ""

    def feed(self, text: str, final: bool = False):
        self.buf += text
        hit, at = None, len(self.buf)
        for s in self.stops + self.markers:
            i = self.buf.find(s)
            if i != -1 and i < at:
                hit, at = s, i
        if hit is not None:
            out, self.buf = self.buf[:at], self.buf[at:]
            return out, hit
        if final:
            out, self.buf = self.buf, ""
            return out, None
        keep = 0
        for s in self.stops + self.markers:
            for k in range(min(len(s) - 1, len(self.buf)), 0, -1):
                if self.buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        out = self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(out) :]
        return out, None


def parse_tool_calls(text: str):
    """Split model output into (content, calls) the way the Qwen-family template writes calls:
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. Blocks that do not parse stay
    in the content; calls get OpenAI's shape (arguments as a JSON string)."""
    calls, content, pos = [], [], 0
    pattern = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S)
    for m in pattern.finditer(text):
        try:  # the model's text is untrusted too: bounded nesting, no duplicate keys (issue 22)
            obj = untrusted_loads(m.group(1).strip(), "tool_call")
        except UntrustedFileError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        content.append(text[pos : m.start()])
        pos = m.end()
        calls.append(
            {
                "id": "call_" + secrets.token_hex(12),
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    content.append(text[pos:])
    return "".join(content).strip() if calls else text, calls


class ThinkSplitter:
    """Splits model text into reasoning (inside <think>...</think>) and content, holding back a
    tail that may still become a tag; the leading newlines of each part are dropped."""

    def __init__(self, reasoning: bool):
        self.reasoning = reasoning
        self.matcher = StopMatcher([], [THINK_OPEN, THINK_CLOSE])
        self.fresh = True  # at the start of a part

    def feed(self, text: str, final: bool = False):
        parts = []
        out, hit = self.matcher.feed(text, final)
        while True:
            if self.fresh:
                out = out.lstrip("\n")
            if out:
                self.fresh = False
                parts.append(("reasoning" if self.reasoning else "content", out))
            if hit is None:
                return parts
            self.matcher.buf = self.matcher.buf[len(hit) :]
            self.reasoning, self.fresh = hit == THINK_OPEN, True
            out, hit = self.matcher.feed("", final)


def chat_logprob(e: dict) -> dict:
    """A token_logprob entry in the chat API's shape."""

    def one(x):
        return {"token": x["token"], "logprob": x["logprob"], "bytes": list(x["token"].encode("utf-8"))}

    return {**one(e), "top_logprobs": [one(x) for x in e["top"]]}


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """token_logprob entries in the legacy completions API's shape (text_offset from `offset`)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{x["token"]: x["logprob"] for x in e["top"]} if e["top"] else None for e in entries],
        "text_offset": offsets,
    }


# -- the worker: owns the model -------------------------------------------------------------------


@dataclass
class ServerDefaults:
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
                from .prompt_cache_disk import DiskPromptCache

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
                self._emit(job, ("error", self.broken))
                continue
            self.busy, self.current = True, job
            try:
                self._generate(job)
            except PipelineError as e:
                self.broken = e
                log.error("pipeline down, refusing further requests: %s", e)
                self._emit(job, ("error", e))
            except (StreamError, GenerationError, ValueError) as e:
                if job.cancel.is_set():  # its tickets were failed on purpose
                    log.info("cancelled request stopped: %s: %s", type(e).__name__, e)
                else:
                    self._emit(job, ("error", e))
            except Exception as e:  # never a traceback to the client; one log line here
                log.error("generation failed: %s: %s", type(e).__name__, e)
                self._emit(job, ("error", e))
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
        from .batch_generate import BatchGenerator, BatchStepError

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
                        self._emit(job, ("error", e.cause))
                if self.model.streaming is not None:
                    self.model.streaming.reset()  # the next step's P1 hint must not hang on failed routes
                continue
            except Exception as e:  # never a traceback to the client; the requests in flight fail
                log.error("generation failed: %s: %s", type(e).__name__, e)
                for uid, (job, *_) in list(live.items()):
                    g.remove([uid])
                    self._emit(job, ("error", e))
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
                    if job.sampling.logprobs:  # the stop token is not part of the text
                        self._emit(
                            job,
                            ("logprob", token_logprob(self.tokenizer, r.logprobs, r.token, job.sampling.top_logprobs)),
                        )
                if r.finish_reason is not None:
                    detok.finalize()
                self._emit(job, ("text", detok.last_segment))
                if r.finish_reason is not None:
                    del live[r.uid]
                    self._emit(job, ("done", r.finish_reason))

    def _admit(self, g, job: Job, live: dict):
        """Queue `job` in the batch generator (its sampler, seed and max_tokens)."""
        if self.broken is not None:
            self._emit(job, ("error", self.broken))
            return
        s = job.sampling
        try:
            sampler = make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k)
            (uid,) = g.insert(
                [job.ids],
                max_tokens=[job.max_tokens],
                samplers=[sampler],
                logits_processors=[self._processors(job)],
                seeds=[s.seed],
            )
        except (GenerationError, ValueError) as e:
            self._emit(job, ("error", e))
            return
        job.usage.prompt_tokens = len(job.ids)
        live[uid] = [job, self.tokenizer.detokenizer, time.perf_counter(), None]

    def _on_stall(self, message: str):
        # On the watchdog's thread, just before the process exits: answer the running request.
        log.error("pipeline stalled: %s; failing the request, then exiting", message)
        job = self.current
        if job is not None and not job.finished:
            self._emit(job, ("error", PipelineError(message)))
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

    @staticmethod
    def _emit(job: Job, event):
        job.loop.call_soon_threadsafe(job.events.put_nowait, event)

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
        sampler = make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k)
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
            if s.logprobs and finish != "stop":  # the stop token is not part of the text
                self._emit(job, ("logprob", token_logprob(self.tokenizer, r.logprobs, r.token, s.top_logprobs)))
            self._emit(job, ("text", r.text))
        if not job.cancel.is_set():
            self._emit(job, ("done", finish or "stop"))

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
        self.jobs.put(None)


# -- HTTP -----------------------------------------------------------------------------------------


def _error_body(e: RequestError) -> dict:
    return {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": None}}


class _Disconnected(Exception):
    """The client went away before its request body arrived."""


SHUTTING_DOWN = "the server is shutting down"
SWITCH_INTERVAL_S = 0.001  # the GIL hand-off interval while serving (CPython's default: 0.005)


class App:
    def __init__(
        self,
        worker: Worker,
        model_id: str,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        allowed_origins: Sequence[str] = (),
        prep_process_bytes: int = 0,
    ):
        from concurrent.futures import ThreadPoolExecutor

        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware
        from starlette.routing import Route

        self.worker, self.model_id, self.api_key, self.max_body_bytes = worker, model_id, api_key, max_body_bytes
        self.created = int(time.time())
        # JSON parsing, template rendering and tokenization run here, off the event loop, so a
        # 4 MB request never stalls /health or other clients' streams (two at a time).
        self.prep = ThreadPoolExecutor(2, thread_name_prefix="hebrus-prep")
        # A request body of at least `prep_process_bytes` (0: none) is rendered and tokenized in a
        # child process instead (prep_process.py): on a thread its seconds of Python share the GIL
        # with this loop. Small ones stay on the threads: no round trip, no queue behind a big one.
        self.prep_process_bytes = prep_process_bytes
        self.prep_process = None
        if prep_process_bytes > 0 and hasattr(worker.tokenizer, "backend"):  # a TextTokenizer: rebuilt there
            from .prep_process import PrepProcess

            self.prep_process = PrepProcess(worker.tokenizer)
        self.live: dict = {}  # id -> job with a waiting response (cancelled on shutdown)
        self.preparing: set = set()  # futures of off-loop work a request awaits (answered 503 on shutdown)
        self.stopping = False
        self.stop_started: float | None = None  # time.monotonic() of the first SIGTERM/SIGINT
        tmpl = worker.tokenizer.chat_template or ""
        added = worker.tokenizer.added_tokens
        # Tool calls are parsed only where the template writes them in this format.
        self.tool_markers = TOOL_CALL_OPEN in tmpl and TOOL_CALL_OPEN in added and TOOL_CALL_CLOSE in added
        # Thinking is split out (the `reasoning` field) where the template writes <think> blocks.
        self.think_ids = None
        if THINK_OPEN in tmpl and THINK_OPEN in added and THINK_CLOSE in added:
            self.think_ids = tuple(worker.tokenizer.convert_tokens_to_ids([THINK_OPEN, THINK_CLOSE]))
        self.stored = responses_api.ResponseStore()  # previous_response_id
        # CORS (--allowed-origins): none by default, so a web page cannot drive a local server.
        middleware = (
            [Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])]
            if allowed_origins
            else []
        )
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._wrap(self.chat), methods=["POST"]),
                Route("/chat/completions", self._wrap(self.chat), methods=["POST"]),
                Route("/v1/completions", self._wrap(self.completions), methods=["POST"]),
                Route("/completions", self._wrap(self.completions), methods=["POST"]),
                Route("/v1/responses", self._wrap(self.responses), methods=["POST"]),
                Route("/v1/responses/input_tokens", self._wrap(self.response_input_tokens), methods=["POST"]),
                Route("/v1/responses/{response_id}", self._wrap(self.stored_response), methods=["GET"]),
                Route("/v1/responses/{response_id}", self._wrap(self.delete_response), methods=["DELETE"]),
                Route("/v1/responses/{response_id}/input_items", self._wrap(self.input_items), methods=["GET"]),
                Route("/v1/messages", self._wrap(self.messages, anthropic_api.error_body), methods=["POST"]),
                Route(
                    "/v1/messages/count_tokens",
                    self._wrap(self.count_tokens, anthropic_api.error_body),
                    methods=["POST"],
                ),
                Route("/v1/models", self._wrap(self.models), methods=["GET"]),
                Route("/v1/models/{model_id:path}", self._wrap(self.model), methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            middleware=middleware,
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    # Errors ---------------------------------------------------------------------------------
    def _json(self, obj, status=200):
        from starlette.responses import JSONResponse

        return JSONResponse(obj, status_code=status)

    def _refuse(self, request, e: RequestError, shape=_error_body):
        log.warning("%d %s %s: %s", e.status, request.method, request.url.path, e)
        return self._json(shape(e), e.status)

    async def _not_found(self, request, exc):
        return self._refuse(request, RequestError(f"no route {request.url.path}", None, 404, "not_found_error"))

    async def _not_allowed(self, request, exc):
        return self._refuse(request, RequestError(f"{request.method} not allowed on {request.url.path}", None, 405))

    def _wrap(self, handler, shape=_error_body):
        """`handler` behind the key check; a refusal is the error object `shape` builds (OpenAI's
        by default, Anthropic's on its routes)."""

        async def endpoint(request):
            try:
                self._authorize(request)
                if self.stopping:
                    raise RequestError(SHUTTING_DOWN, None, 503, "server_error")
                return await handler(request)
            except _Disconnected:
                from starlette.responses import Response

                log.info("%s %s: client disconnected before sending its body", request.method, request.url.path)
                return Response(status_code=400)  # nobody reads it
            except RequestError as e:
                return self._refuse(request, e, shape)
            except PROMPT_ERRORS as e:
                return self._refuse(request, RequestError(str(e), _param_of(e)), shape)
            except Exception as e:  # one line, no traceback, the server keeps serving
                log.error("500 %s %s: %s: %s", request.method, request.url.path, type(e).__name__, e)
                return self._json(shape(RequestError(f"{type(e).__name__}: {e}", None, 500, "server_error")), 500)

        return endpoint

    def _authorized(self, request) -> bool:
        if self.api_key is None:
            return True
        # OpenAI's clients send `Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY`.
        want = self.api_key.encode()
        bearer = hmac.compare_digest(request.headers.get("authorization", "").encode(), b"Bearer " + want)
        return hmac.compare_digest(request.headers.get("x-api-key", "").encode(), want) or bearer

    def _authorize(self, request):
        if not self._authorized(request):
            raise RequestError(
                "missing or wrong API key (Authorization: Bearer ... or x-api-key: ...)",
                None,
                401,
                "authentication_error",
            )

    async def _off_loop(self, fn, *args, **kwargs):
        import functools

        if self.stopping:
            raise RequestError(SHUTTING_DOWN, None, 503, "server_error")
        fut = asyncio.get_running_loop().run_in_executor(self.prep, functools.partial(fn, *args, **kwargs))
        return await self._prepared(fut)

    async def _prepared(self, fut):
        """Await off-loop work; answered 503 when shutdown cancels it."""
        self.preparing.add(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            # begin_shutdown cancelled the wait (the thread may still be rendering): answer now, so
            # uvicorn's grace period is not spent waiting on a request that will never be served.
            if self.stopping and fut.cancelled():
                raise RequestError(SHUTTING_DOWN, None, 503, "server_error") from None
            raise
        finally:
            self.preparing.discard(fut)

    async def _body(self, request) -> dict:
        from starlette.requests import ClientDisconnect

        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            raise RequestError(f"request body over {self.max_body_bytes} bytes", None, 413)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise RequestError(f"request body over {self.max_body_bytes} bytes", None, 413)
                chunks.append(chunk)
        except ClientDisconnect:
            raise _Disconnected() from None
        request.state.body_bytes = size
        return await self._off_loop(api_fields.parse_body, b"".join(chunks))

    async def _ids(self, request, method: str, *args, **kwargs) -> list[int]:
        """Token IDs from the tokenizer's `method` (apply_chat_template, encode), off the loop: in
        the prep process for a big body, else on a prep thread."""
        if self.prep_process is None or getattr(request.state, "body_bytes", 0) < self.prep_process_bytes:
            return await self._off_loop(getattr(self.worker.tokenizer, method), *args, **kwargs)
        if self.stopping:
            raise RequestError(SHUTTING_DOWN, None, 503, "server_error")
        ids = await self._prepared(asyncio.wrap_future(self.prep_process.submit(method, *args, **kwargs)))
        out: list[int] = []
        for i in range(0, len(ids), 1 << 15):  # millions of ints: a slice at a time, the loop runs between
            out.extend(ids[i : i + (1 << 15)].tolist())
            await asyncio.sleep(0)
        return out

    # Endpoints ------------------------------------------------------------------------------
    async def health(self, request):
        if not self._authorized(request):  # alive, nothing more, without the key
            return self._json({"status": "stopping" if self.stopping else "ok"})
        w = self.worker
        out = {
            "status": "stopping" if self.stopping else "ok",
            "queued": w.jobs.qsize(),
            "busy": w.busy,
            "prompt_cache": {
                "entries": len(w.prompt_cache),
                "bytes": w.prompt_cache.nbytes,
                "hits": w.prompt_cache.hits,
                "misses": w.prompt_cache.misses,
            },
        }
        g = w.batch
        if g is not None:  # --decode-concurrency > 1: decode steps run and the rows they fed
            out["batch"] = {
                "decode_concurrency": g.decode_concurrency,
                "active": g.active,
                "decode_steps": g.steps,
                "rows": g.rows,
            }
        streaming = getattr(w.model, "streaming", None)
        if streaming is not None:
            mem = streaming.memory()
            out["stream"] = {"tickets": mem.get("tickets"), "pinned_slots": mem.get("pinned_slots")}
        stages = getattr(w.model, "all_stages", None)
        if stages is not None:  # under mlx.launch: who holds which layers, and whether the pipeline is up
            out["pipeline"] = {"ranks": [[st.start, st.stop - 1] for st in stages], "down": w.broken is not None}
            if w.broken is not None:
                out["status"] = "pipeline down"
        return self._json(out)

    def _model_object(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "hebrus-mlx"}

    async def models(self, request):
        return self._json({"object": "list", "data": [self._model_object()]})

    async def model(self, request):
        """GET /v1/models/{id}: this server's one model, or 404 naming the field."""
        want = request.path_params["model_id"]
        if want != self.model_id:
            raise RequestError(
                f"model {want!r} is not served here (this server serves {self.model_id!r})",
                "model",
                404,
                "not_found_error",
            )
        return self._json(self._model_object())

    def _max_tokens(self, s: Sampling, n_prompt: int, where: str, whole_context: bool = False) -> int:
        """The request's cap on its reply. Without one: --max-tokens, else DEFAULT_MAX_TOKENS, or with
        `whole_context` (/v1/responses) the context left, as OpenAI's Responses API does: a reply
        the request did not bound ends by itself, not `incomplete` at an arbitrary cap."""
        room = None if self.worker.context is None else self.worker.context - n_prompt
        if room is not None and room < 1:
            raise RequestError(f"{where} has {n_prompt} tokens; the model context is {self.worker.context}", where)
        if s.max_tokens is None:
            cap = self.worker.defaults.max_tokens
            if cap is None:
                cap = room if whole_context and room is not None else DEFAULT_MAX_TOKENS
            return cap if room is None else min(cap, room)
        if room is not None and s.max_tokens > room:
            raise RequestError(
                f"max_tokens {s.max_tokens} + {n_prompt} prompt tokens exceeds the model context {self.worker.context}",
                "max_tokens",
            )
        return s.max_tokens

    async def chat(self, request):
        job, parse_tools, think = await self._chat_job(request, await self._body(request))
        return await self._respond(request, job, chat=True, parse_tools=parse_tools, think=think)

    async def _chat_job(self, request, body: dict):
        """A chat-completions body as a queued-to-be job (/v1/messages comes here too): (the job,
        whether tool calls are parsed out, the think state)."""
        tok = self.worker.tokenizer
        options = api_fields.check_fields(body, True, tok.effective_vocab_size)
        s = parse_sampling(body, self.worker.defaults)
        if body.get("messages") is None:
            raise RequestError("messages is required", "messages")
        tools = body.get("tools")
        if tok.chat_template is None:
            raise RequestError("this model has no chat template; use /v1/completions", "messages")
        # Provenance-safe: rendered by the template, caller strings tokenized as DATA (AFN-006).
        # Off the event loop: rendering and tokenizing megabytes takes seconds.
        ids = await self._ids(
            request,
            "apply_chat_template",
            developer_as_system(body["messages"]),
            tools=tools or None,
            add_generation_prompt=True,
            **options,
        )
        max_tokens = self._max_tokens(s, len(ids), "messages")
        parse_tools = bool(tools) and self.tool_markers and body.get("tool_choice") != "none"
        think = self._think_state(ids)
        job = Job(ids, s, max_tokens, asyncio.get_running_loop(), asyncio.Queue())
        job.grammar = await self._grammar(api_fields.chat_constraint(body), think)
        return job, parse_tools, think

    async def completions(self, request):
        body = await self._body(request)
        tok = self.worker.tokenizer
        api_fields.check_fields(body, False, tok.effective_vocab_size)
        s = parse_sampling(body, self.worker.defaults)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await self._ids(request, "encode", prompt)  # caller text: DATA
        elif isinstance(prompt, list) and prompt and all(_is_int(i) for i in prompt):
            bad = [i for i in prompt if not 0 <= i < tok.effective_vocab_size]
            if bad:
                raise RequestError(f"prompt token ID {bad[0]} outside [0, {tok.effective_vocab_size})", "prompt")
            ids = list(prompt)
        else:
            raise RequestError("prompt must be a string or a non-empty list of token IDs", "prompt")
        if not ids:
            raise RequestError("prompt is empty", "prompt")
        max_tokens = self._max_tokens(s, len(ids), "prompt")
        return await self._respond(
            request, Job(ids, s, max_tokens, asyncio.get_running_loop(), asyncio.Queue()), chat=False, parse_tools=False
        )

    async def responses(self, request):
        """POST /v1/responses (see responses_api.py)."""
        body = await self._body(request)
        tok = self.worker.tokenizer
        sampling, options = responses_api.check_fields(body, tok.effective_vocab_size)
        s = parse_sampling(sampling, self.worker.defaults)
        if body.get("input") is None:
            raise RequestError("input is required", "input")
        history = self._history(body)
        conversation = history + responses_api.to_messages(body["input"], history=history)
        tools = responses_api.chat_tools(body.get("tools"))
        if tok.chat_template is None:
            raise RequestError("this model has no chat template", "input")
        ids = await self._ids(
            request,
            "apply_chat_template",
            responses_api.with_instructions(body.get("instructions"), conversation),
            tools=tools,
            add_generation_prompt=True,
            **options,
        )
        max_tokens = self._max_tokens(s, len(ids), "input", whole_context=True)
        job = Job(ids, s, max_tokens, asyncio.get_running_loop(), asyncio.Queue())
        parse_tools = bool(tools) and self.tool_markers and body.get("tool_choice") != "none"
        think = self._think_state(ids)
        job.grammar = await self._grammar(responses_api.constraint(body), think)
        builder = responses_api.ResponseBuilder(body, self.model_id, body.get("tools"))

        def usage():
            u = job.usage
            return {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            }

        def step(part):
            if part[0] == "end":
                return builder.finish(part[1], part[2], usage())
            return builder.add("reasoning" if part[0] == "reasoning" else "message", part[1])

        def done():
            if body.get("store") is not False:
                items = responses_api.input_items(body["input"])
                self.stored.put(builder.id, conversation + builder.messages(), builder.final, items)

        return await self._event_response(
            request,
            (job, parse_tools, think),
            builder.start,
            step,
            lambda: builder.final,
            lambda err: builder._event("error", code=err.kind, message=str(err), param=err.param),
            done,
        )

    async def _event_response(self, request, generation, start, step, final, error_event, done=None):
        """The events of an API builder over one generation: `start()`'s, then `step(part)`'s for each
        output part of `generation` (job, parse_tools, think), then `done()` runs. Without streaming
        they run to the end and `final()` is the JSON answer; streamed, a failure ends with
        `error_event(err)`: the response has started, so an error event, never a traceback."""
        job = generation[0]

        async def events():
            for e in start():
                yield e
            async with aclosing(self._outputs(request, *generation)) as parts:
                async for part in parts:
                    for e in step(part):
                        yield e
            if done is not None:
                done()

        if not job.sampling.stream:
            try:
                async with aclosing(events()) as it:
                    async for _ in it:
                        pass
            except Exception as e:
                raise _as_request_error(e) from None
            return self._json(final())

        from starlette.responses import StreamingResponse

        async def sse():
            try:
                async with aclosing(events()) as it:
                    async for e in it:
                        yield e
            except Exception as e:
                err = _as_request_error(e)
                log.warning("%d %s %s (stream): %s", err.status, request.method, request.url.path, err)
                yield error_event(err)

        return StreamingResponse(
            sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    def _history(self, body: dict) -> list[dict]:
        """The stored conversation `previous_response_id` names (none without it)."""
        rid = body.get("previous_response_id")
        if rid is None:
            return []
        stored = self.stored.get(rid)
        if stored is None:
            raise RequestError(
                f"previous response {rid!r} not found (not stored, evicted or expired)", "previous_response_id"
            )
        return stored["messages"]

    def _stored(self, request) -> tuple[str, dict]:
        rid = request.path_params["response_id"]
        stored = self.stored.get(rid)
        if stored is None:
            raise RequestError(
                f"response {rid!r} not found (not stored, evicted or expired)", "response_id", 404, "not_found_error"
            )
        return rid, stored

    async def stored_response(self, request):
        return self._json(self._stored(request)[1]["response"])

    async def delete_response(self, request):
        """DELETE /v1/responses/{id}: it no longer answers retrieve or previous_response_id."""
        rid, _ = self._stored(request)
        self.stored.delete(rid)
        return self._json({"id": rid, "object": "response", "deleted": True})

    async def input_items(self, request):
        """GET /v1/responses/{id}/input_items: the request's input as items, a page of OpenAI's list."""
        _, stored = self._stored(request)
        return self._json(responses_api.list_page(stored["items"], dict(request.query_params)))

    async def response_input_tokens(self, request):
        """POST /v1/responses/input_tokens: the tokens a /v1/responses request would prefill."""
        body = await self._body(request)
        options = responses_api.check_count_fields(body, self.worker.tokenizer.effective_vocab_size)
        if self.worker.tokenizer.chat_template is None:
            raise RequestError("this model has no chat template", "input")
        items = responses_api.to_messages(body["input"]) if body.get("input") is not None else []
        conversation = self._history(body) + items
        if not conversation:
            raise RequestError("input is required (or previous_response_id)", "input")
        ids = await self._ids(
            request,
            "apply_chat_template",
            responses_api.with_instructions(body.get("instructions"), conversation),
            tools=responses_api.chat_tools(body.get("tools")),
            add_generation_prompt=True,
            **options,
        )
        return self._json({"object": "response.input_tokens", "input_tokens": len(ids)})

    async def messages(self, request):
        """POST /v1/messages: Anthropic's Messages API on the chat path (anthropic_api.py)."""
        chat, origins = anthropic_api.to_chat(await self._body(request))
        try:
            job, parse_tools, think = await self._chat_job(request, chat)
        except RequestError as e:
            raise anthropic_api.renamed(e, origins) from None
        except PROMPT_ERRORS as e:
            raise anthropic_api.renamed(RequestError(str(e), _param_of(e)), origins) from None
        builder = anthropic_api.MessageBuilder(self.model_id, job.sampling.stop, len(job.ids))

        def step(part):
            if part[0] == "end":
                u = job.usage
                usage = anthropic_api.usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
                return builder.finish(part[1], part[2], job.stop_hit, usage)
            return builder.add("thinking" if part[0] == "reasoning" else "text", part[1])

        return await self._event_response(
            request, (job, parse_tools, think), builder.start, step, lambda: builder.message, builder.error
        )

    async def count_tokens(self, request):
        """POST /v1/messages/count_tokens: the tokens /v1/messages would prefill for the same body."""
        chat, origins = anthropic_api.to_chat(await self._body(request), anthropic_api.COUNT_TOKENS)
        tok = self.worker.tokenizer
        try:
            options = api_fields.check_fields(chat, True, tok.effective_vocab_size)
            if tok.chat_template is None:
                raise RequestError("this model has no chat template", "messages")
            ids = await self._ids(
                request,
                "apply_chat_template",
                chat["messages"],
                tools=chat.get("tools"),
                add_generation_prompt=True,
                **options,
            )
        except RequestError as e:
            raise anthropic_api.renamed(e, origins) from None
        except PROMPT_ERRORS as e:
            raise anthropic_api.renamed(RequestError(str(e), _param_of(e)), origins) from None
        return self._json({"input_tokens": len(ids)})

    # Generation -----------------------------------------------------------------------------
    async def _events(self, request, job: Job):
        """Queue the job and yield its events; a disconnect (or the consumer closing) cancels it."""

        async def watch():
            # The body is read: the next ASGI message is the disconnect (as Starlette's
            # StreamingResponse listens for it); it wakes the consumer below.
            while (await request.receive())["type"] != "http.disconnect":
                pass
            log.info("client disconnected: request cancelled")
            job.events.put_nowait(("disconnected", None))

        watcher = asyncio.create_task(watch())
        if self.stopping:
            raise RequestError(SHUTTING_DOWN, None, 503, "server_error")
        self.live[id(job)] = job
        self.worker.jobs.put(job)
        try:
            while True:
                event = await job.events.get()
                if event[0] == "disconnected":
                    return
                if event[0] == "shutdown":
                    job.finished = True
                    raise RequestError(SHUTTING_DOWN, None, 503, "server_error")
                if event[0] in ("done", "error"):
                    job.finished = True
                yield event
                if job.finished:
                    return
        finally:
            self.live.pop(id(job), None)
            watcher.cancel()
            self.worker.cancel(job)

    def begin_shutdown(self):
        """On SIGTERM/SIGINT (the event loop's thread): refuse new requests, cancel every waiting
        one (queued or running: its expert reads fail at once) and answer it 503."""
        self.stopping = True
        if self.stop_started is None:
            self.stop_started = time.monotonic()
        for job in list(self.live.values()):
            self.worker.cancel(job)
            job.events.put_nowait(("shutdown", None))
        for fut in list(self.preparing):
            fut.cancel()
        self.prep.shutdown(wait=False, cancel_futures=True)
        if self.prep_process is not None:
            self.prep_process.stop()  # kills the child: a render in progress is abandoned

    def grace_left(self, timeout: float) -> float:
        """Seconds of --shutdown-timeout left: one grace period from the signal for everything
        (uvicorn's wait for responses and the worker's join together, not one each)."""
        if self.stop_started is None:
            return timeout
        return max(0.0, self.stop_started + timeout - time.monotonic())

    async def _outputs(self, request, job: Job, parse_tools: bool, think: bool | None):
        """The job's output as parts: ("reasoning", text), ("content", text, logprob entries) and
        last ("end", finish_reason, tool calls, logprob entries not yet given). `think`: None when
        the template does not separate thinking, else whether the output starts inside it.
        Stop sequences apply to the content; tool calls are withheld until they parse."""
        matcher = StopMatcher(job.sampling.stop, [TOOL_CALL_OPEN] if parse_tools else [])
        splitter = None if think is None else ThinkSplitter(think)
        tool_text, finish, pending = None, None, []
        async with aclosing(self._events(request, job)) as events:
            async for kind, value in events:
                if kind == "error":
                    raise value
                if kind == "logprob":
                    pending.append(value)
                    continue
                final = kind == "done"
                text = value if kind == "text" else ""
                parts = [("content", text)] if splitter is None else splitter.feed(text, final)
                for part, piece in parts:
                    if part == "reasoning":
                        yield ("reasoning", piece)
                    elif tool_text is not None:  # inside tool calls: withheld until the end
                        tool_text += piece
                    else:
                        out, hit = matcher.feed(piece)
                        if hit == TOOL_CALL_OPEN:
                            tool_text, matcher.buf = matcher.buf, ""
                        elif hit is not None:
                            finish, job.stop_hit = "stop", hit
                        if out:
                            yield ("content", out, pending)
                            pending = []
                        if finish is not None:
                            pending = []  # tokens past a stop sequence are not reported
                            break
                if finish is not None:
                    break
                if final:
                    out, hit = matcher.feed("", final=True) if tool_text is None else ("", None)
                    if out:
                        yield ("content", out, pending)
                        pending = []
                    finish = "stop" if hit is not None else value
                    break
        calls = []
        if tool_text is not None:
            extra, calls = parse_tool_calls(tool_text)
            if not calls and extra:  # not a call after all: plain text
                yield ("content", extra, pending)
                pending = []
        yield ("end", "tool_calls" if calls else (finish or "stop"), calls, pending)

    async def _grammar(self, c: dict | None, think: bool | None):
        """The grammar processor of a request's constraint (api_fields.constraint), compiled on a
        prep thread: llguidance bounds the work by fuel, so a hostile schema costs that thread a
        bounded time and never the worker; a schema it refuses is a 400 naming the field."""
        if c is None:
            return None
        if c["calls"] is not None and not self.tool_markers:
            raise RequestError(
                "this model's chat template writes no <tool_call> blocks: tool calls cannot be constrained "
                "(strict tools, tool_choice required or a named function, parallel_tool_calls false)",
                "tool_choice",
            )
        return await self._off_loop(self._compile, c, think)

    def _compile(self, c: dict, think: bool | None):
        tok = self.worker.tokenizer
        try:
            schema = None
            if c["schema"] is not None:
                schema, field = c["schema"]
                constrain.check_schema(tok, schema, field)
            tools = None
            if c["tools"] is not None:
                tools = []
                for name, params, strict, where in c["tools"]:
                    if strict:
                        params = params or {"type": "object", "properties": {}, "additionalProperties": False}
                        constrain.check_schema(tok, params, where)
                    elif params is not None:
                        # Not strict: its schema guides the call where the engine takes it (as vLLM
                        # does for forced calls), else any object; never a refusal.
                        try:
                            constrain.check_schema(tok, params, where)
                        except constrain.GrammarError:
                            params = None
                    tools.append(constrain.Tool(name, params))
            spec = constrain.Spec(schema, tools, c["calls"], c["parallel"], think)
            return constrain.compile_spec(tok, spec, "tools" if c["calls"] else c["schema"][1])
        except constrain.GrammarError as e:
            raise RequestError(f"{e.field}: {e.message}", e.field) from None

    def _think_state(self, ids: list[int]) -> bool | None:
        """None when the template does not separate thinking, else whether the prompt leaves the
        reply inside a <think> block (a template that opens it for the model)."""
        if self.think_ids is None:
            return None
        opened, closed = self.think_ids
        last = {t: i for i, t in enumerate(ids) if t in (opened, closed)}
        return last.get(opened, -1) > last.get(closed, -1)

    @staticmethod
    def _usage(job: Job) -> dict:
        u = job.usage
        return {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        }

    async def _respond(self, request, job: Job, chat: bool, parse_tools: bool, think: bool | None = None):
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        head = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_id,
        }
        want_logprobs = job.sampling.logprobs
        offset = [0]  # the legacy API's text_offset

        def logprobs(entries):
            if not want_logprobs:
                return None
            if chat:
                return {"content": [chat_logprob(e) for e in entries]}
            out = completion_logprobs(entries, offset[0])
            offset[0] += sum(len(e["token"]) for e in entries)
            return out

        if not job.sampling.stream:
            text, reasoning, entries, calls, finish = "", "", [], [], "stop"
            try:
                async with aclosing(self._outputs(request, job, parse_tools, think)) as parts:
                    async for part in parts:
                        if part[0] == "reasoning":
                            reasoning += part[1]
                        elif part[0] == "content":
                            text += part[1]
                            entries += part[2]
                        else:
                            _, finish, calls, rest = part
                            entries += rest
            except Exception as e:
                raise _as_request_error(e) from None
            if chat:
                msg = {"role": "assistant", "content": text.strip() if calls or reasoning else text}
                if reasoning:
                    msg["reasoning"] = reasoning.strip()
                if calls:
                    msg["tool_calls"] = calls
                choice = {"index": 0, "message": msg, "finish_reason": finish, "logprobs": logprobs(entries)}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs(entries)}
            return self._json({**head, "choices": [choice], "usage": self._usage(job)})

        from starlette.responses import StreamingResponse

        chunk_object = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_or_text, finish=None, entries=None):
            lp = logprobs(entries) if entries else None
            if chat:
                choice = {"index": 0, "delta": delta_or_text, "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": 0, "text": delta_or_text, "finish_reason": finish, "logprobs": lp}
            return "data: " + json.dumps({**head, "object": chunk_object, "choices": [choice]}) + "\n\n"

        async def sse():
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            try:
                async with aclosing(self._outputs(request, job, parse_tools, think)) as parts:
                    async for part in parts:
                        if part[0] == "reasoning":
                            if chat:  # the legacy API has no place for it
                                yield chunk({"reasoning": part[1]})
                        elif part[0] == "content":
                            yield chunk({"content": part[1]} if chat else part[1], None, part[2])
                        else:
                            _, finish, calls, rest = part
            except Exception as e:  # the response has started: an error event, never a traceback
                err = _as_request_error(e)
                log.warning("%d %s %s (stream): %s", err.status, request.method, request.url.path, err)
                yield "data: " + json.dumps(_error_body(err)) + "\n\n"
                return
            if calls:
                yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
            yield chunk({} if chat else "", finish, rest)
            if job.sampling.include_usage:
                yield (
                    "data: "
                    + json.dumps({**head, "object": chunk_object, "choices": [], "usage": self._usage(job)})
                    + "\n\n"
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )


def _text(e) -> str:
    # A typed error's own message (its str() is prefixed with the field).
    return e.message if isinstance(e, HebrusError) else str(e)


def _param_of(e) -> str | None:
    field = getattr(e, "field", "")
    if re.match(r"(messages|tools)(\[\d+\]|\.)", field):  # a typed error naming its JSON path
        return field
    m = re.match(r"(messages|tools)(\[\d+\])?(\.\w+(\[\d+\])?)*", _text(e))
    return m.group(0) if m else ("messages" if isinstance(e, ChatError) else None)


def _as_request_error(e) -> RequestError:
    if isinstance(e, RequestError):
        return e
    if isinstance(e, PROMPT_ERRORS):
        return RequestError(_text(e))
    if isinstance(e, PipelineError):
        return RequestError(f"PipelineError: {_text(e)}", None, 503, "server_error")
    # A streamed read that failed (StreamError) or anything unexpected: the request was fine.
    return RequestError(f"{type(e).__name__}: {e}", None, 500, "server_error")


# -- command line ---------------------------------------------------------------------------------


_NOT_SHARED = {"help", "prompt", "system_prompt", "ignore_chat_template", "verbose", "prompt_cache_file"}


def _origins(value: str) -> list[str]:
    origins = [o.strip() for o in value.split(",") if o.strip()]
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s,]+", o):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin (scheme://host[:port]) or '*'")
    if not origins:
        raise argparse.ArgumentTypeError("no origin given")
    return origins


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="hebrus-mlx server",
        description="OpenAI-compatible HTTP server (like mlx_lm.server).",
        conflict_handler="resolve",
    )
    p.shared = share_generate_flags(p, _NOT_SHARED)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=flags.integer(0, 65535), default=8080, help="0 picks a free port (printed on start)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (visible in ps: prefer --api-key-file or ${API_KEY_ENV})",
    )
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from PATH (one line)")
    p.add_argument(
        "--shutdown-timeout",
        type=flags.seconds(),
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="on SIGTERM/SIGINT: seconds to let cancelled requests finish before exiting "
        f"(default {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    p.add_argument(
        "--decode-concurrency",
        type=flags.integer(1),
        default=1,
        help="requests that share each decode step (continuous batching; default 1: one at a time)",
    )
    p.add_argument(
        "--prompt-concurrency",
        type=flags.integer(1),
        default=1,
        help="requests prefilling at once under --decode-concurrency > 1, a chunk per decode step",
    )
    add_prompt_cache_arguments(p, DEFAULT_PROMPT_CACHE_BYTES, "no prefix reuse")
    p.add_argument(
        "--max-body-bytes",
        type=flags.integer(1),
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are a 413, refused from the declared length (default %(default)s)",
    )
    p.add_argument(
        "--prep-process-bytes",
        type=flags.integer(0, flags.INT64_MAX),
        default=DEFAULT_PREP_PROCESS_BYTES,
        help="request bodies of at least this many bytes are rendered and tokenized in a separate "
        "process, so the event loop never waits on them (default %(default)s; 0: all on threads)",
    )
    p.add_argument(
        "--allowed-origins",
        type=_origins,
        default=[],
        metavar="ORIGINS",
        help="comma-separated origins browsers may call from (CORS), '*' for any "
        "(default: none; mlx-lm's default is '*')",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="server log level (default INFO)",
    )
    add_refused_arguments(p, MLX_LM_SERVER_REFUSED)
    p.set_defaults(max_tokens=None)  # not given: DEFAULT_MAX_TOKENS, or the context left (/v1/responses)
    return p


def api_key_from(args, environ=None) -> str | None:
    """The key from exactly one of --api-key, --api-key-file or $HEBRUS_MLX_API_KEY (None: no key)."""
    import os

    environ = os.environ if environ is None else environ
    given = [
        (f, v)
        for f, v in (
            ("--api-key", args.api_key),
            ("--api-key-file", args.api_key_file),
            (API_KEY_ENV, environ.get(API_KEY_ENV)),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise UsageError(given[1][0], f"the API key is also given by {given[0][0]}; give it once")
    if not given:
        return None
    field, value = given[0]
    if field == "--api-key-file":
        from .artifact import untrusted

        path = os.path.abspath(os.path.expanduser(value))
        try:
            data = untrusted.read_path(
                untrusted.resolve(os.path.dirname(path), os.path.basename(path), field, links=True), "api_key", field
            )
        except OSError as e:
            raise UsageError(field, f"{value}: {e.strerror or e}") from None
        except untrusted.UntrustedFileError as e:
            raise UsageError(field, e.message) from None
        try:
            value = data.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise UsageError(field, f"{value}: not UTF-8") from None
    if not value or any(c.isspace() or not c.isprintable() for c in value):
        raise UsageError(field, "the API key must be one non-empty word of printable characters")
    if not value.isascii():  # an HTTP header cannot carry it as sent: no client could ever match it
        raise UsageError(field, "the API key must be ASCII (it travels in the Authorization header)")
    return value


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket (before the "listening on" line: a client may connect once it reads it);
    a taken port or an address this machine lacks is a UsageError naming the flag."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(
                "--port", f"port {port} on {host} is in use; give another --port (0 picks a free one)"
            ) from None
        raise UsageError("--host", f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    return sock


class _Server:
    """uvicorn's server, stopped our way: the first SIGTERM/SIGINT/SIGHUP cancels every in-flight
    generation (App.begin_shutdown) and uvicorn stops accepting and waits at most
    --shutdown-timeout for the responses; main() then exits 0 (uvicorn's re-raise of the
    signal after its shutdown is absorbed)."""

    @staticmethod
    def run(app: App, config, sock, announce=lambda: None):
        """`announce()` (the "listening on" line) runs once a stop signal can no longer kill the
        process: one that arrives before uvicorn installs its handlers is held and replayed."""
        import contextlib
        import signal

        import uvicorn

        pending = []

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                first = not self.should_exit
                super().handle_exit(sig, frame)
                if first:
                    log.warning("signal %d: stopping (cancelling %d request(s))", sig, len(app.live))
                    app.begin_shutdown()

            @contextlib.contextmanager
            def capture_signals(self):
                # uvicorn handles SIGINT/SIGTERM only; SIGHUP (the terminal closed) would kill the
                # process with requests in flight: it takes the same graceful path.
                with super().capture_signals():
                    hup = signal.signal(signal.SIGHUP, self.handle_exit)
                    for sig in pending:  # arrived between the announcement and these handlers
                        self.handle_exit(sig, None)
                    try:
                        yield
                    finally:
                        signal.signal(signal.SIGHUP, hup)

        # uvicorn restores these and raises the caught signal again once it has shut down: make
        # that a no-op so the worker is stopped and the process exits normally.
        previous = {
            s: signal.signal(s, lambda sig, _frame: pending.append(sig))
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }
        try:
            announce()
            Server(config).run(sockets=[sock])
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def main(argv=None) -> int:
    """`hebrus-mlx server`; typed errors propagate to `cli.run` (one line, exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args)
    api_key = api_key_from(args)
    check_shared_flags(args, parser, "server")
    if not 0 <= args.port <= 65535:
        raise UsageError("--port", f"must be in [0, 65535], got {args.port}")
    if args.max_body_bytes < 1:
        raise UsageError("--max-body-bytes", f"must be >= 1, got {args.max_body_bytes}")
    if args.pipeline_split is not None and not pipeline_launched():
        raise UsageError("--pipeline-split", "needs a distributed launch (mlx.launch)")
    if args.decode_concurrency > 1 and args.draft_model is not None:
        raise UsageError(
            "--decode-concurrency",
            "speculative drafting (--draft-model) runs one request at a time; "
            "give --decode-concurrency 1 or drop --draft-model",
        )
    if args.decode_concurrency > 1 and pipeline_launched():
        raise UsageError("--decode-concurrency", "a pipeline (mlx.launch) serves one request at a time")
    if args.prompt_concurrency > args.decode_concurrency:
        raise UsageError(
            "--prompt-concurrency",
            f"must be <= --decode-concurrency ({args.decode_concurrency}), got {args.prompt_concurrency}",
        )
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prefetch_from_args(args)  # checked before the model loads
    pipe = None
    if pipeline_launched():
        import mlx.core as mx

        from .hub import resolve_model
        from .pipeline.cli import load_or_serve

        if mx.distributed.init().rank() != 0:
            load_or_serve(resolve_model(args.model), args)  # serves until rank 0 stops
            return 0
    import uvicorn

    defaults = ServerDefaults.from_args(args)

    def load():
        if args.seed is not None:  # on the worker thread, which samples
            import mlx.core as mx

            mx.random.seed(args.seed)
        if pipeline_launched():
            nonlocal pipe
            pipe, model, tokenizer = load_or_serve(resolve_model(args.model), args)
            return model, tokenizer
        return load_from_args(args)

    sock = _listen(args.host, args.port)  # before the model loads: a taken port is the user's one line
    worker = Worker(load, args.prompt_cache_bytes, defaults)
    if pipe is not None:
        from .pipeline.cli import finish

        worker.close = lambda: finish(pipe.model)  # stops the serving ranks, prints one line per rank
    app = App(worker, args.model, api_key, args.max_body_bytes, args.allowed_origins, args.prep_process_bytes)
    # Rendering and tokenizing a big request on a prep thread is Python-heavy: every time the
    # event loop gives up the GIL for I/O it waits for the prep thread's next switch (5 ms by
    # default, several times per /health). 1 ms keeps that wait small (benchmarks/bench_server_stall.py).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app.app,
        log_level=args.log_level.lower(),
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    try:
        _Server.run(
            app, config, sock, lambda: print(f"hebrus-mlx server: listening on http://{host}:{port}", flush=True)
        )
    finally:
        worker.stop()
        # The worker drains its cancelled step (its expert reads already failed); a pipeline also
        # stops its ranks. A worker still busy past the grace period is left to the process exit.
        worker._thread.join(timeout=60 if pipe is not None else app.grace_left(args.shutdown_timeout))
        disk = worker.prompt_cache.disk
        if disk is not None and not disk.flush(timeout=max(1.0, app.grace_left(args.shutdown_timeout))):
            log.warning("prompt cache: snapshots still being written at exit are lost")
        if app.prep_process is not None:
            app.prep_process.stop()  # no orphan, whatever way uvicorn ended
            if not app.prep_process.join(5.0):
                log.warning("the request preparation process did not exit")
    if worker._thread.is_alive() or any(t.is_alive() for t in app.prep._threads):
        log.warning("exiting with work still running (past --shutdown-timeout)")
    else:
        log.info("stopped")
    # Leave without interpreter finalization: the worker thread's MLX thread-locals (its compile
    # cache holds Python objects) are destroyed when the OS thread exits, which can be after
    # join() returns; overlapping finalization, CPython aborts the process (SIGABRT in about 1 of
    # 6 shutdowns with streamed experts, seen under gdb). Everything is stopped by now.
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    from .cli import run

    sys.exit(run("server", main))
