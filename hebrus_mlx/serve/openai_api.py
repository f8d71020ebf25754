"""OpenAI's chat completions and legacy completions: the response object, its server-sent chunks,
the logprobs shapes, usage, and the error object every OpenAI route answers with (a typed
failure mapped to its status)."""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from contextlib import aclosing

from ..errors import HebrusError
from ..pipeline.stage import PipelineError
from ..text.chat_template import ChatError
from ..text.tokenizer import PROMPT_ERRORS
from .api_fields import RequestError

log = logging.getLogger("hebrus_mlx.server")


def error_body(e: RequestError) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": None}}


def _text(e) -> str:
    # A typed error's own message (its str() is prefixed with the field).
    return e.message if isinstance(e, HebrusError) else str(e)


def param_of(e) -> str | None:
    """The JSON path a prompt error names (messages[2].content, tools[0]...), if any."""
    field = getattr(e, "field", "")
    if re.match(r"(messages|tools)(\[\d+\]|\.)", field):  # a typed error naming its JSON path
        return field
    m = re.match(r"(messages|tools)(\[\d+\])?(\.\w+(\[\d+\])?)*", _text(e))
    return m.group(0) if m else ("messages" if isinstance(e, ChatError) else None)


def as_request_error(e) -> RequestError:
    """A failure while serving as the RequestError answered: a bad prompt 400, a pipeline down
    503, anything else 500."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, PROMPT_ERRORS):
        return RequestError(_text(e))
    if isinstance(e, PipelineError):
        return RequestError(f"PipelineError: {_text(e)}", None, 503, "server_error")
    # A streamed read that failed (StreamError) or anything unexpected: the request was fine.
    return RequestError(f"{type(e).__name__}: {e}", None, 500, "server_error")


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


def usage(job) -> dict:
    """A job's usage object (chat and legacy completions)."""
    u = job.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


async def respond(request, job, parts, chat: bool, model_id: str):
    """The answer to a chat completions (`chat`) or legacy completions request: the JSON object, or
    with `stream` its server-sent chunks, from `parts` (output.parts of the queued job)."""
    from starlette.responses import JSONResponse, StreamingResponse

    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    head = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_id,
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
            async with aclosing(parts) as it:
                async for part in it:
                    if part[0] == "reasoning":
                        reasoning += part[1]
                    elif part[0] == "content":
                        text += part[1]
                        entries += part[2]
                    else:
                        _, finish, calls, rest = part
                        entries += rest
        except Exception as e:
            raise as_request_error(e) from None
        if chat:
            msg = {"role": "assistant", "content": text.strip() if calls or reasoning else text}
            if reasoning:
                msg["reasoning"] = reasoning.strip()
            if calls:
                msg["tool_calls"] = calls
            choice = {"index": 0, "message": msg, "finish_reason": finish, "logprobs": logprobs(entries)}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs(entries)}
        return JSONResponse({**head, "choices": [choice], "usage": usage(job)})

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
            async with aclosing(parts) as it:
                async for part in it:
                    if part[0] == "reasoning":
                        if chat:  # the legacy API has no place for it
                            yield chunk({"reasoning": part[1]})
                    elif part[0] == "content":
                        yield chunk({"content": part[1]} if chat else part[1], None, part[2])
                    else:
                        _, finish, calls, rest = part
        except Exception as e:  # the response has started: an error event, never a traceback
            err = as_request_error(e)
            log.warning("%d %s %s (stream): %s", err.status, request.method, request.url.path, err)
            yield "data: " + json.dumps(error_body(err)) + "\n\n"
            return
        if calls:
            yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        yield chunk({} if chat else "", finish, rest)
        if job.sampling.include_usage:
            yield ("data: " + json.dumps({**head, "object": chunk_object, "choices": [], "usage": usage(job)}) + "\n\n")
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
