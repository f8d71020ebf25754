"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) without MLX:
request fields, messages and content blocks to chat messages, the message object, its server-sent
events and Anthropic's error object.

A request becomes a /v1/chat/completions body that the server runs on the chat path: the same
field checks, provenance-safe rendering by the checkpoint's template (AFN-006: caller text stays
data), prefix cache and batching. `system` is the system message, `tool_use` blocks the assistant's
tool calls, `tool_result` blocks tool messages, `thinking` the template's enable_thinking switch,
`tool_choice` any / tool the chat API's "required" / a named function. Anthropic's own checks run
first, so a refusal names Anthropic's field; a refusal from the chat path is renamed (`renamed`).

Events follow the sequence the `anthropic` client's `messages.stream` accumulates: message_start,
ping, then per content block (thinking, text, tool_use) content_block_start, its deltas
(thinking_delta, text_delta, input_json_delta), content_block_stop, and last message_delta
(stop_reason, stop_sequence, usage) and message_stop.
"""

from __future__ import annotations

import json
import re
import secrets

from . import api_fields
from .api_fields import (
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TOOL_NAME_CHARS,
    BlankHold,
    RequestError,
    is_int,
    show_value,
    stop_strings,
    tool_objects,
)

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"


def _keys(obj: dict, allowed: tuple, where: str):
    for k in obj:
        if k not in allowed:
            raise RequestError(f"{where}.{k} is not a known field ({', '.join(allowed)})", f"{where}.{k}")


def _text_of(obj: dict, key: str, where: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise RequestError(f"{where}.{key} must be a string, got {show_value(v)}", f"{where}.{key}")
    return v


def _cache_control(block: dict, where: str):
    # Accepted as a no-op: the server caches every prompt's prefix on its own (prompt_cache.py).
    cc = block.get("cache_control")
    if cc is not None and (
        not isinstance(cc, dict)
        or cc.get("type") != "ephemeral"
        or set(cc) - {"type", "ttl"}
        or cc.get("ttl", "5m") not in ("5m", "1h")
    ):
        name = f"{where}.cache_control" if where else "cache_control"
        raise RequestError(f'{name} must be {{"type": "ephemeral"}} (ttl "5m" or "1h")', name)


# -- request fields ------------------------------------------------------------------------------


# api_fields' validators, in the (body, name) form of this module's tables.
def _integer(lo):
    return lambda body, name: api_fields.integer_field(body, name, lo)


def _number(lo, hi):
    return lambda body, name: api_fields.number_field(body, name, lo, hi)


def _typed(types, what):
    return lambda body, name: api_fields.typed_field(body, name, types, what)


def _system(body, name):
    v = body[name]
    if isinstance(v, str):
        return
    if not isinstance(v, list):
        raise RequestError("system must be a string or a list of text blocks", name)
    for j, block in enumerate(v):
        _text_block(block, f"system[{j}]")


def _stop_sequences(body, name):
    if not stop_strings(body[name]):
        raise RequestError(
            f"stop_sequences must be a list of at most {MAX_STOP_SEQUENCES} non-empty strings "
            f"(each at most {MAX_STOP_CHARS} characters)",
            name,
        )


def _tools(body, name):
    for where, t in tool_objects(body, name, "tools"):
        if t.get("type", "custom") != "custom":  # Anthropic's server tools (web search, ...) run there
            raise RequestError(
                f"{where}.type {show_value(t['type'])} is not supported (only custom tools)", f"{where}.type"
            )
        _keys(t, ("type", "name", "description", "input_schema", "strict", "cache_control"), where)
        tname = t.get("name")
        if not isinstance(tname, str) or not 0 < len(tname) <= MAX_TOOL_NAME_CHARS:
            raise RequestError(f"{where}.name must be a non-empty string", f"{where}.name")
        if t.get("description") is not None:
            _text_of(t, "description", where)
        if not isinstance(t.get("input_schema"), dict):
            raise RequestError(f"{where}.input_schema must be a JSON Schema object", f"{where}.input_schema")
        if not isinstance(t.get("strict", False), bool):
            raise RequestError(f"{where}.strict must be a boolean", f"{where}.strict")
        _cache_control(t, where)


def _tool_choice(body, name):
    v = body[name]
    kinds = ("auto", "any", "tool", "none")
    if not isinstance(v, dict) or v.get("type") not in kinds:
        raise RequestError(f"tool_choice must be an object with type {', '.join(kinds)}, got {show_value(v)}", name)
    _keys(
        v,
        ("type", "name", "disable_parallel_tool_use") if v["type"] == "tool" else ("type", "disable_parallel_tool_use"),
        name,
    )
    if v["type"] == "tool":
        names = [t.get("name") for t in body.get("tools") or []]
        if v.get("name") not in names:
            raise RequestError(
                f"tool_choice.name {show_value(v.get('name'))} is not one of the tools", "tool_choice.name"
            )
    if not isinstance(v.get("disable_parallel_tool_use", False), bool):
        raise RequestError(
            "tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice.disable_parallel_tool_use"
        )


def _thinking(body, name):
    v = body[name]
    if not isinstance(v, dict) or v.get("type") not in ("enabled", "disabled"):
        raise RequestError(f'thinking must be {{"type": "enabled" | "disabled"}}, got {show_value(v)}', name)
    if v["type"] == "disabled":
        _keys(v, ("type",), name)
        return
    # The template's switch is on/off: budget_tokens is checked as Anthropic does, then the thinking
    # length is bounded by max_tokens alone.
    _keys(v, ("type", "budget_tokens"), name)
    budget = v.get("budget_tokens")
    if not is_int(budget) or budget < 1024:
        raise RequestError(
            f"thinking.budget_tokens must be an integer >= 1024, got {show_value(budget)}", "thinking.budget_tokens"
        )
    if is_int(body.get("max_tokens")) and budget >= body["max_tokens"]:
        raise RequestError("thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens")


def _output_config(body, name):
    v = body[name]
    if not isinstance(v, dict):
        raise RequestError(f"output_config must be an object, got {show_value(v)}", name)
    _keys(v, ("format", "effort"), name)
    if v.get("effort") is not None:  # the template's thinking is on/off, no effort levels
        raise RequestError("output_config.effort is not supported by this server", "output_config.effort")
    fmt = v.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise RequestError(
                'output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config.format"
            )
        _keys(fmt, ("type", "schema"), "output_config.format")


def _metadata(body, name):
    # Accepted as a no-op (Anthropic's abuse tracking): checked, then unused.
    v = body[name]
    if not isinstance(v, dict):
        raise RequestError(f"metadata must be an object, got {show_value(v)}", name)
    _keys(v, ("user_id",), name)
    if v.get("user_id") is not None and not isinstance(v["user_id"], str):
        raise RequestError("metadata.user_id must be a string", "metadata.user_id")


# Every field of each route: its check (None: to_chat checks it). docs/API_FIELDS.md lists them.
MESSAGES_FIELDS = {
    "model": _typed(str, "a string"),
    "messages": None,
    "max_tokens": _integer(1),
    "system": _system,
    "stop_sequences": _stop_sequences,
    "stream": _typed(bool, "a boolean"),
    "temperature": _number(0, 1),
    "top_p": _number(0, 1),
    "top_k": _integer(0),
    "tools": _tools,
    "tool_choice": _tool_choice,
    "thinking": _thinking,
    "metadata": _metadata,
    "output_config": _output_config,
    "cache_control": lambda body, name: _cache_control(body, ""),
}
COUNT_TOKENS_FIELDS = {
    k: MESSAGES_FIELDS[k]
    for k in ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "cache_control")
}
_REQUIRED = {MESSAGES: ("model", "messages", "max_tokens"), COUNT_TOKENS: ("model", "messages")}


def to_chat(body: dict, endpoint: str = MESSAGES) -> tuple[dict, list[str]]:
    """Check an Anthropic request and translate it: (a /v1/chat/completions body, the Anthropic path
    of each of its messages, for `renamed`)."""
    known = MESSAGES_FIELDS if endpoint == MESSAGES else COUNT_TOKENS_FIELDS
    for name in body:
        if name not in known:
            raise RequestError(f"unknown field {name!r} for {endpoint}", name)
    for name in _REQUIRED[endpoint]:
        if body.get(name) is None:
            raise RequestError(f"{name}: field required", name)
    for name, check in known.items():
        if check is not None and body.get(name) is not None:
            check(body, name)
    messages, origins = to_messages(body.get("system"), body["messages"])
    chat = {"model": body["model"], "messages": messages}
    for k in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    if body.get("tools"):
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    **({"description": t["description"]} if t.get("description") is not None else {}),
                    "parameters": t["input_schema"],
                    **({"strict": t["strict"]} if "strict" in t else {}),
                },
            }
            for t in body["tools"]
        ]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice["type"]
        if kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            chat["tool_choice"] = {"auto": "auto", "none": "none", "any": "required"}[kind]
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    fmt = (body.get("output_config") or {}).get("format")
    if fmt is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if body.get("thinking") is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": body["thinking"]["type"] == "enabled"}
    return chat, origins


# Chat-path field -> the Anthropic field it came from (a refusal of the chat path names the latter).
_CHAT_NAMES = [
    (re.compile(r"messages\[(\d+)\]"), None),  # by `origins`
    (re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"response_format"), "output_config.format"),
    (re.compile(r"tools\[(\d+)\]\.function\.(\w+)"), r"tools[\1].\2"),
    (re.compile(r"stop"), "stop_sequences"),
    (re.compile(r"parallel_tool_calls"), "tool_choice.disable_parallel_tool_use"),
    (re.compile(r"chat_template_kwargs(\.\w+)?"), "thinking"),
]


def renamed(e: RequestError, origins: list[str]) -> RequestError:
    """A refusal of the chat path naming the Anthropic field instead of the chat one."""
    if not e.param:
        return e
    for pattern, ours in _CHAT_NAMES:
        m = pattern.match(e.param)
        if m is None:
            continue
        if ours is None:
            i = int(m[1])
            param = origins[i] if i < len(origins) else "messages"
        else:
            param = m.expand(ours) if "\\" in ours else ours
        return RequestError(f"{param}: {e}", param, e.status, e.kind)
    return e


# -- messages and content blocks -> chat messages ----------------------------------------------------


def _text_block(block, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else block
        raise RequestError(f"{where}: block {show_value(kind)} is not a text block", where)
    _keys(block, ("type", "text", "cache_control", "citations"), where)
    if block.get("citations"):
        raise RequestError(f"{where}.citations are not supported", f"{where}.citations")
    _cache_control(block, where)
    return _text_of(block, "text", where)


def _tool_result(block: dict, where: str) -> dict:
    _keys(block, ("type", "tool_use_id", "content", "is_error", "cache_control"), where)
    _cache_control(block, where)
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{where}.tool_use_id must be a non-empty string", f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text blocks", f"{where}.content")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise RequestError(f"{where}.is_error must be a boolean", f"{where}.is_error")
    if is_error:  # the template has no error flag: the model reads it in the result
        content = "Error: " + content
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tool_use(block: dict, where: str) -> dict:
    _keys(block, ("type", "id", "name", "input", "cache_control"), where)
    _cache_control(block, where)
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise RequestError(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    if not isinstance(block.get("input"), dict):
        raise RequestError(f"{where}.input must be an object", f"{where}.input")
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": block["input"]}}


def to_messages(system, messages) -> tuple[list[dict], list[str]]:
    """`system` and `messages` as chat messages; also the Anthropic path each came from."""
    out, origins = [], []
    if system is not None:
        text = system if isinstance(system, str) else "\n\n".join(b["text"] for b in system)
        out.append({"role": "system", "content": text})
        origins.append("system")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of messages", "messages")
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{at} must be an object", at)
        _keys(m, ("role", "content"), at)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise RequestError(f"{at}.role {show_value(role)} is not user or assistant", f"{at}.role")
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not isinstance(content, list):
            raise RequestError(f"{at}.content must be a string or a list of content blocks", f"{at}.content")
        if role == "assistant":
            msg = {"role": "assistant", "content": ""}
            thinking = []
        for j, block in enumerate(content):
            where = f"{at}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":  # a message's consecutive text blocks are one text, as in /v1/responses
                text = _text_block(block, where)
                if role == "assistant":
                    msg["content"] += text
                elif out and out[-1]["role"] == "user" and origins[-1] == at:
                    out[-1]["content"] += text
                else:
                    out.append({"role": "user", "content": text})
                    origins.append(at)
            elif role == "user" and kind == "tool_result":
                out.append(_tool_result(block, where))
                origins.append(where)
            elif role == "assistant" and kind == "tool_use":
                msg.setdefault("tool_calls", []).append(_tool_use(block, where))
            elif role == "assistant" and kind == "thinking":
                _keys(block, ("type", "thinking", "signature"), where)
                thinking.append(_text_of(block, "thinking", where))
            else:
                allowed = "text, tool_use, thinking" if role == "assistant" else "text, tool_result"
                raise RequestError(
                    f"{where}: block type {show_value(kind)} is not supported ({allowed})", f"{where}.type"
                )
        if role == "assistant":
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            out.append(msg)
            origins.append(at)
    if messages[-1]["role"] == "assistant":
        # Anthropic continues a final assistant message (prefill); the chat path would render it as a
        # finished turn and start a new one: a different request, so refused.
        at = f"messages[{len(messages) - 1}]"
        raise RequestError(f"{at}: a final assistant message (prefill) is not supported; end with a user turn", at)
    return out, origins


# -- the message object and its events -------------------------------------------------------------------


class MessageBuilder:
    """Turns output.parts parts into content blocks and (when streaming) SSE events."""

    def __init__(self, model_id: str, stops: list[str], input_tokens: int):
        self.id = "msg_" + secrets.token_hex(12)
        self.stops = stops
        self.content: list[dict] = []
        self.open: dict | None = None  # the thinking or text block being written
        self.blank = BlankHold()
        self.message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": model_id,
            "content": self.content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }

    @staticmethod
    def _event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def start(self) -> list[str]:
        return [self._event("message_start", message={**self.message, "content": []}), self._event("ping")]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", index=len(self.content) - 1)]

    def add(self, kind: str, text: str) -> list[str]:
        """A piece of the reply: "thinking" or "text"."""
        if kind == "text" and (self.open is None or self.open["type"] != "text"):
            text = self.blank.pass_on(text)
        if not text:
            return []
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            self.open = {"type": kind, kind: ""}
            if kind == "thinking":
                self.open["signature"] = ""  # nothing signs it here; clients give it back as is
            self.content.append(self.open)
            events.append(
                self._event("content_block_start", index=len(self.content) - 1, content_block=dict(self.open))
            )
        self.open[kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(self._event("content_block_delta", index=len(self.content) - 1, delta=delta))
        return events

    def finish(self, finish: str, calls: list, stop_hit: str | None, usage: dict) -> list[str]:
        """The tool_use blocks, then message_delta and message_stop."""
        events = self._close()
        for c in calls:
            fn = c["function"]
            try:
                args = json.loads(fn["arguments"])
            except ValueError:
                args = None
            if not isinstance(args, dict):  # not an input object: the call stays text, nothing lost
                events += self.add("text", json.dumps({"name": fn["name"], "arguments": fn["arguments"]}))
                events += self._close()
                continue
            block = {"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"), "name": fn["name"]}
            self.content.append({**block, "input": args})
            idx = len(self.content) - 1
            events.append(self._event("content_block_start", index=idx, content_block={**block, "input": {}}))
            delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
            events.append(self._event("content_block_delta", index=idx, delta=delta))
            events.append(self._event("content_block_stop", index=idx))
        if any(b["type"] == "tool_use" for b in self.content):
            reason = "tool_use"
        elif finish == "length":
            reason = "max_tokens"
        elif stop_hit is not None and stop_hit in self.stops:
            reason = "stop_sequence"
        else:
            reason = "end_turn"
        stop_sequence = stop_hit if reason == "stop_sequence" else None
        self.message.update(stop_reason=reason, stop_sequence=stop_sequence, usage=usage)
        events.append(
            self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": stop_sequence}, usage=usage)
        )
        events.append(self._event("message_stop"))
        return events

    def error(self, e: RequestError) -> str:
        return self._event("error", error=error_body(e)["error"])


def usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict:
    """Anthropic's usage: input_tokens excludes the prefix read from the cache (reported apart)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large"}


def error_body(e: RequestError) -> dict:
    """Anthropic's error object; the message names the field."""
    message = str(e)
    if e.param and e.param not in message:
        message = f"{e.param}: {message}"
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
