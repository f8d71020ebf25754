"""The HTTP routes of `hebrus-mlx server` (Starlette on uvicorn): OpenAI's /v1/chat/completions,
/v1/completions (both with `stream: true` as server-sent events and
`stream_options.include_usage`) and /v1/responses, Anthropic's /v1/messages, /v1/models and
/health, over one Worker (worker.py).

A request body is read with a size bound, parsed and checked field by field (api_fields.py and the
API modules), rendered and tokenized off the event loop (a prep thread, or for a big body the prep
process, prep_process.py), then queued as a Job; the worker's events become output parts
(output.py) that each API shapes. A client that disconnects cancels its request, queued or
running. Chat provenance (AFN-006): messages are rendered by the checkpoint's template and
tokenized by provenance, so caller text never becomes a control token. Bad requests get a 4xx
with the API's error object naming the field and one log line; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing

from ..text.tokenizer import PROMPT_ERRORS
from . import anthropic_api, api_fields, openai_api, output, responses_api
from .api_fields import RequestError, is_int
from .output import THINK_CLOSE, THINK_OPEN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from .sampling import Sampling, compile_constraint, parse_sampling
from .worker import Job, Worker

log = logging.getLogger("hebrus_mlx.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_TOKENS = 512  # a reply's cap when neither the request nor --max-tokens gives one (mlx_lm.server's)


def developer_as_system(messages):
    """OpenAI's `developer` role is the system role of newer clients (as mlx-lm maps it)."""
    if not isinstance(messages, list):
        return messages
    return [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages]


class PrepThreads(ThreadPoolExecutor):
    """The threads that parse, render and tokenize requests off the event loop; `alive` says
    whether one still runs (after shutdown, a render it could not abandon)."""

    def __init__(self, n: int):
        self._started: list[threading.Thread] = []
        super().__init__(n, thread_name_prefix="hebrus-prep", initializer=self._record)

    def _record(self):
        self._started.append(threading.current_thread())

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._started)


class _Disconnected(Exception):
    """The client went away before its request body arrived."""


SHUTTING_DOWN = "the server is shutting down"


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
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware
        from starlette.routing import Route

        self.worker, self.model_id, self.api_key, self.max_body_bytes = worker, model_id, api_key, max_body_bytes
        self.created = int(time.time())
        # JSON parsing, template rendering and tokenization run here, off the event loop, so a
        # 4 MB request never stalls /health or other clients' streams (two at a time).
        self.prep = PrepThreads(2)
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

    def _refuse(self, request, e: RequestError, shape=openai_api.error_body):
        log.warning("%d %s %s: %s", e.status, request.method, request.url.path, e)
        return self._json(shape(e), e.status)

    async def _not_found(self, request, exc):
        return self._refuse(request, RequestError(f"no route {request.url.path}", None, 404, "not_found_error"))

    async def _not_allowed(self, request, exc):
        return self._refuse(request, RequestError(f"{request.method} not allowed on {request.url.path}", None, 405))

    def _wrap(self, handler, shape=openai_api.error_body):
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
                return self._refuse(request, RequestError(str(e), openai_api.param_of(e)), shape)
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
            # The engine's running totals (bytes read, hits, misses, waits): an operator's per-token
            # read cost is the difference between two reads of this over the tokens between them.
            out["stream_counters"] = {k: v for k, v in streaming.counters().items() if isinstance(v, int)}
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
        return await openai_api.respond(
            request, job, self._outputs(request, job, parse_tools, think), True, self.model_id
        )

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
        elif isinstance(prompt, list) and prompt and all(is_int(i) for i in prompt):
            bad = [i for i in prompt if not 0 <= i < tok.effective_vocab_size]
            if bad:
                raise RequestError(f"prompt token ID {bad[0]} outside [0, {tok.effective_vocab_size})", "prompt")
            ids = list(prompt)
        else:
            raise RequestError("prompt must be a string or a non-empty list of token IDs", "prompt")
        if not ids:
            raise RequestError("prompt is empty", "prompt")
        max_tokens = self._max_tokens(s, len(ids), "prompt")
        job = Job(ids, s, max_tokens, asyncio.get_running_loop(), asyncio.Queue())
        return await openai_api.respond(request, job, self._outputs(request, job, False, None), False, self.model_id)

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
                raise openai_api.as_request_error(e) from None
            return self._json(final())

        from starlette.responses import StreamingResponse

        async def sse():
            try:
                async with aclosing(events()) as it:
                    async for e in it:
                        yield e
            except Exception as e:
                err = openai_api.as_request_error(e)
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
            raise anthropic_api.renamed(RequestError(str(e), openai_api.param_of(e)), origins) from None
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
            raise anthropic_api.renamed(RequestError(str(e), openai_api.param_of(e)), origins) from None
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

    def _outputs(self, request, job: Job, parse_tools: bool, think: bool | None):
        """The job queued, its events as output parts (output.parts)."""
        return output.parts(self._events(request, job), job, parse_tools, think)

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
        return await self._off_loop(compile_constraint, self.worker.tokenizer, c, think)

    def _think_state(self, ids: list[int]) -> bool | None:
        """None when the template does not separate thinking, else whether the prompt leaves the
        reply inside a <think> block (a template that opens it for the model)."""
        if self.think_ids is None:
            return None
        opened, closed = self.think_ids
        last = {t: i for i, t in enumerate(ids) if t in (opened, closed)}
        return last.get(opened, -1) > last.get(closed, -1)
