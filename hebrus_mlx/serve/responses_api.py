"""The Responses API (`POST /v1/responses`, issue 24 §3) without MLX: request fields, `input` items
to chat messages, the response object, its server-sent events, and the store that answers
`previous_response_id`.

A request becomes a chat conversation the checkpoint's template renders (the same provenance-safe
path as /v1/chat/completions): `instructions` is the system message, `input` a string (one user
message) or items (messages of role user/system/developer/assistant, `function_call` and
`function_call_output`, `reasoning` summaries given back). A stored response keeps its whole
conversation (inputs and outputs, without the instructions, which OpenAI does not carry over), so
a request naming it as `previous_response_id` renders the previous prompt and reply first: the
server's prefix cache then restores that state instead of prefilling it.

Events follow the sequence the official `openai` client's `responses.stream` accumulates:
response.created, response.in_progress, then per output item output_item.added, content_part.added,
the deltas (output_text / reasoning_text / function_call_arguments), their .done, content_part.done,
output_item.done, and last response.completed (or response.incomplete when max_output_tokens ran
out), each with a sequence_number.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import OrderedDict

from ..artifact import untrusted
from . import api_fields
from .api_fields import RequestError, show_value

DEFAULT_STORE_ENTRIES = 256
DEFAULT_STORE_BYTES = 64 << 20
DEFAULT_STORE_TTL = 3600.0  # seconds a stored response answers previous_response_id

_ROLES = ("user", "system", "developer", "assistant")


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# -- request fields ------------------------------------------------------------------------------


def _tools(body, name, vocab=None):
    for where, t in api_fields.tool_objects(body, name, "function tools"):
        if t.get("type") != "function":
            raise RequestError(
                f"{where}.type {show_value(t.get('type'))} is not supported (only function tools)", f"{where}.type"
            )
        for k in t:
            if k not in ("type", "name", "description", "parameters", "strict"):
                raise RequestError(f"{where}.{k} is not a function tool field", f"{where}.{k}")
        if not isinstance(t.get("name"), str) or not 0 < len(t["name"]) <= api_fields.MAX_TOOL_NAME_CHARS:
            raise RequestError(f"{where}.name must be a non-empty string", f"{where}.name")
        if "description" in t and not isinstance(t["description"], (str, type(None))):
            raise RequestError(f"{where}.description must be a string", f"{where}.description")
        if "parameters" in t and not isinstance(t["parameters"], (dict, type(None))):
            raise RequestError(f"{where}.parameters must be a JSON Schema object", f"{where}.parameters")
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise RequestError(f"{where}.strict must be a boolean", f"{where}.strict")


def _tool_choice(body, name, vocab=None):
    if api_fields.tool_choice_mode(body, name):
        return
    v = body[name]
    if isinstance(v, dict) and set(v) == {"type", "name"} and v["type"] == "function" and isinstance(v["name"], str):
        if v["name"] not in [t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)]:
            raise RequestError(f"{name} names the function {v['name']!r}, which is not in tools", name)
        return
    raise RequestError(
        f'tool_choice must be "none", "auto", "required" or {{"type": "function", "name": ...}}, got {show_value(v)}',
        name,
    )


def _text(body, name, vocab=None):
    v = api_fields.typed_field(body, name, dict, "an object")
    for k in v:
        if k not in ("format", "verbosity"):
            raise RequestError(f"text.{k} is not a known field (format, verbosity)", f"text.{k}")
    if v.get("verbosity") not in (None, "medium"):
        api_fields.not_yet_supported("text.verbosity", v["verbosity"])
    if v.get("format") is not None:
        api_fields.check_format(v["format"], "text.format", None)


def constraint(body: dict) -> dict | None:
    """api_fields.constraint() of a checked /v1/responses body."""
    tools = [
        (t["name"], t.get("parameters"), t.get("strict") is True, f"tools[{i}].parameters")
        for i, t in enumerate(body.get("tools") or [])
    ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice = choice["name"]
    fmt = api_fields.format_schema((body.get("text") or {}).get("format"), "text.format", None)
    return api_fields.constraint(tools, choice, body.get("parallel_tool_calls"), fmt)


def _only(value, what):
    def check(body, name, vocab=None):
        if body[name] != value:
            api_fields.not_yet_supported(name, body[name])

    check.__doc__ = what
    return check


def _bool(body, name, vocab=None):
    api_fields.typed_field(body, name, bool, "a boolean")


def _string(body, name, vocab=None):
    api_fields.typed_field(body, name, str, "a string")


_C = api_fields.COMMON_FIELDS
# The sampling fields, handed on to sampling.parse_sampling as a chat-completions body.
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "repetition_context_size",
    "presence_context_size",
    "frequency_context_size",
    "logit_bias",
)

RESPONSES_FIELDS = {
    "model": _string,
    "user": _string,
    "input": None,  # to_messages checks every item
    "instructions": _string,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _bool,
    "stream": _bool,
    "store": _bool,
    "previous_response_id": _string,
    "max_output_tokens": lambda b, n, v=None: api_fields.integer_field(b, n, 1),
    "metadata": api_fields.check_metadata,
    "text": _text,
    "reasoning": _only(None, "reasoning effort cannot be steered"),
    "truncation": _only("disabled", "the context is never truncated"),
    "include": _only([], "no extra output"),
    "top_logprobs": _only(0, "logprobs of the Responses API are not implemented"),
    "chat_template_kwargs": api_fields.chat_template_kwargs_field,
    # Sampling and logits processors, as for /v1/chat/completions.
    **{k: _C[k] for k in _SAMPLING_KEYS},
}


def check_fields(body: dict, vocab: int) -> tuple[dict, dict]:
    """Refuse unknown fields, validate known ones; returns (a chat-completions body with the
    sampling fields, for sampling.parse_sampling; the template options)."""
    _check(body, RESPONSES_FIELDS, "/v1/responses", vocab)
    sampling = {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        sampling["max_tokens"] = body["max_output_tokens"]
    sampling["stream"] = bool(body.get("stream"))
    return sampling, _template_options(body)


def _check(body: dict, fields: dict, endpoint: str, vocab: int) -> None:
    """Refuse fields `fields` does not name; run the check of each present one."""
    for name in body:
        if name not in fields:
            raise RequestError(f"unknown field {name!r} for {endpoint}", name)
    for name, check in fields.items():
        if check is not None and body.get(name) is not None:
            check(body, name, vocab)


def _template_options(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs") or {}
    return {"enable_thinking": kwargs["enable_thinking"]} if "enable_thinking" in kwargs else {}


# POST /v1/responses/input_tokens: the fields that shape the prompt (the rest of a create request
# is refused there as unknown, as OpenAI's endpoint does).
INPUT_TOKENS_FIELDS = {
    k: RESPONSES_FIELDS[k]
    for k in (
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "previous_response_id",
        "text",
        "reasoning",
        "truncation",
        "chat_template_kwargs",
    )
}


def check_count_fields(body: dict, vocab: int) -> dict:
    """check_fields for /v1/responses/input_tokens; returns the template options."""
    _check(body, INPUT_TOKENS_FIELDS, "/v1/responses/input_tokens", vocab)
    return _template_options(body)


def chat_tools(tools) -> list | None:
    """Responses function tools in the chat API's shape (what the template renders)."""
    if not tools:
        return None
    out = []
    for t in tools:
        fn = {"name": t["name"]}
        for k in ("description", "parameters"):
            if t.get(k) is not None:
                fn[k] = t[k]
        out.append({"type": "function", "function": fn})
    return out


# -- input items -> chat messages ------------------------------------------------------------------


def _content_text(content, where: str, assistant: bool) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of content parts", where)
    kinds = ("output_text", "refusal") if assistant else ("input_text",)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in kinds + ("text",):
            kind = part.get("type") if isinstance(part, dict) else part
            raise RequestError(
                f"{at}: content part {show_value(kind)} is not supported (text only: {', '.join(kinds)})", at
            )
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise RequestError(f"{at}.text must be a string", f"{at}.text")
        texts.append(text)
    return "".join(texts)


def _string_field(item, key, where):
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise RequestError(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return v


def to_messages(items, where: str = "input", history: list | None = None) -> list[dict]:
    """`input` (a string or a list of items) as chat messages; RequestError naming the item.
    Everything the chat layer would check is checked here, so errors name the caller's Responses
    field (`input[1].arguments`), never the chat message it became. `history`: the stored
    conversation `input` continues (its tool calls may be answered by function_call_output)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError(f"{where} must be a string or a non-empty list of items", where)
    out: list[dict] = []
    reasoning: list[str] = []  # a reasoning item given back: the next assistant turn's thinking
    calls = {c.get("id") for m in history or () for c in m.get("tool_calls") or () if isinstance(c, dict)}

    def assistant():  # consecutive assistant items (text, calls) are one turn
        if out and out[-1]["role"] == "assistant":
            return out[-1]
        msg = {"role": "assistant", "content": ""}
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{at} must be an object", at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise RequestError(f"{at}.role {show_value(role)} is not one of {', '.join(_ROLES)}", f"{at}.role")
            text = _content_text(item.get("content"), f"{at}.content", role == "assistant")
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, call_id = _string_field(item, "name", at), _string_field(item, "call_id", at)
            args = item.get("arguments", "{}")
            if not isinstance(args, str):
                raise RequestError(f"{at}.arguments must be a JSON string", f"{at}.arguments")
            try:
                parsed = untrusted.loads(args, f"{at}.arguments", root=f"{at}.arguments")
            except untrusted.UntrustedFileError as e:
                raise RequestError(f"{at}.arguments is not valid JSON: {e.message}", f"{at}.arguments") from None
            if not isinstance(parsed, dict):
                raise RequestError(f"{at}.arguments must be a JSON object string", f"{at}.arguments")
            calls.add(call_id)
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            )
        elif kind == "function_call_output":
            call_id = _string_field(item, "call_id", at)
            output = item.get("output")
            if isinstance(output, list):
                output = _content_text(output, f"{at}.output", False)
            if not isinstance(output, str):
                raise RequestError(f"{at}.output must be a string", f"{at}.output")
            if call_id not in calls:
                raise RequestError(
                    f"{at}.call_id {call_id!r} answers no function_call before it (in input or the previous response)",
                    f"{at}.call_id",
                )
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            for key in ("content", "summary"):
                if item.get(key) is not None and not isinstance(item[key], list):
                    raise RequestError(f"{at}.{key} must be a list of parts", f"{at}.{key}")
            parts = (item.get("content") or []) + (item.get("summary") or [])
            for p in parts:
                if not isinstance(p, dict) or not isinstance(p.get("text"), str):
                    raise RequestError(f"{at}: reasoning parts must be objects with text", at)
            reasoning.append("".join(p["text"] for p in (item.get("content") or item.get("summary") or [])))
            continue
        else:
            raise RequestError(
                f"{at}.type {show_value(kind)} is not supported (message, function_call, function_call_output, reasoning)",
                f"{at}.type",
            )
        if reasoning and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning = []
    return out


def input_items(items) -> list[dict]:
    """`input` (checked by to_messages) as the items GET /v1/responses/{id}/input_items lists: each
    with an id and a status, a message's text as content parts."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    out = []
    for item in items:
        kind = item.get("type", "message")
        item = {**item, "type": kind, "status": item.get("status") or "completed"}
        if kind == "message":
            if isinstance(item["content"], str):
                part = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item["id"] = item.get("id") or _new_id("msg_")
        else:
            item["id"] = item.get("id") or _new_id({"function_call": "fc_", "reasoning": "rs_"}.get(kind, "fco_"))
        out.append(item)
    return out


MAX_LIST_LIMIT = 100
LIST_QUERY = ("limit", "order", "after")  # GET /v1/responses/{id}/input_items


def list_page(items: list[dict], query: dict) -> dict:
    """A page of `items` as OpenAI's list object, from the query's limit (1..100, default 20), order
    (asc or desc, the default) and after (an item id); other query parameters are refused."""
    for k in query:
        if k not in LIST_QUERY:
            raise RequestError(f"unknown query parameter {k!r} (limit, order, after)", k)
    limit = query.get("limit", "20")
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= MAX_LIST_LIMIT):
        raise RequestError(f"limit must be an integer in [1, {MAX_LIST_LIMIT}], got {limit!r}", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError(f"order must be asc or desc, got {order!r}", "order")
    items = items if order == "asc" else items[::-1]
    if "after" in query:
        ids = [i["id"] for i in items]
        if query["after"] not in ids:
            raise RequestError(f"after {query['after']!r} is not an item of this response", "after")
        items = items[ids.index(query["after"]) + 1 :]
    page = items[: int(limit)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }


def with_instructions(instructions: str | None, messages: list[dict]) -> list[dict]:
    """The instructions as the one leading system message (merged with a system item first)."""
    if instructions is None:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": instructions + "\n\n" + messages[0]["content"]}] + messages[1:]
    return [{"role": "system", "content": instructions}] + messages


# -- the response object and its events ----------------------------------------------------------------


class ResponseBuilder:
    """Turns output.parts parts into output items and (when streaming) SSE events."""

    def __init__(self, body: dict, model_id: str, tools: list | None):
        self.id = _new_id("resp_")
        self.created = int(time.time())
        self.seq = 0
        self.output: list[dict] = []
        self.current: dict | None = None  # the open item: a message or reasoning
        self.text = ""
        self.blank = api_fields.BlankHold()
        self.head = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": model_id,
            "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "tools": tools or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "store": body.get("store") is not False,
            "metadata": body.get("metadata") or {},
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "truncation": "disabled",
            "reasoning": None,
            "user": body.get("user"),
            "error": None,
            "incomplete_details": None,
        }

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def response(self, status: str, usage: dict | None = None) -> dict:
        out = {**self.head, "status": status, "output": self.output if status != "in_progress" else []}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["usage"] = usage
        return out

    def start(self) -> list[str]:
        r = self.response("in_progress")
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _close(self) -> list[str]:
        item, self.current = self.current, None
        if item is None:
            return []
        idx = self.output.index(item)
        part = item["content"][0]
        # A message's text part carries logprobs (none here); a reasoning part has no such field.
        kind, extra = ("output_text", {"logprobs": []}) if item["type"] == "message" else ("reasoning_text", {})
        events = [
            self._event(
                f"response.{kind}.done",
                item_id=item["id"],
                output_index=idx,
                content_index=0,
                text=part["text"],
                **extra,
            )
        ]
        item["status"] = "completed"
        events.append(
            self._event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part)
        )
        events.append(self._event("response.output_item.done", output_index=idx, item=item))
        return events

    def _open(self, kind: str) -> list[str]:
        events = self._close()
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {
                "type": "message",
                "id": _new_id("msg_"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
        else:
            part = {"type": "reasoning_text", "text": ""}
            item = {"type": "reasoning", "id": _new_id("rs_"), "status": "in_progress", "summary": [], "content": []}
        self.output.append(item)
        self.current = item
        idx = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=idx, item=json.loads(json.dumps(item))))
        item["content"].append(part)
        events.append(
            self._event(
                "response.content_part.added", item_id=item["id"], output_index=idx, content_index=0, part=dict(part)
            )
        )
        return events

    def add(self, kind: str, text: str) -> list[str]:
        """A piece of content ("message") or reasoning ("reasoning")."""
        if kind == "message" and (self.current is None or self.current["type"] != "message"):
            text = self.blank.pass_on(text)  # whitespace alone (e.g. before a tool call) opens no message
        if not text:
            return []
        events = [] if self.current is not None and self.current["type"] == kind else self._open(kind)
        item = self.current
        item["content"][0]["text"] += text
        idx = len(self.output) - 1
        if kind == "message":
            self.text += text
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        else:
            events.append(
                self._event(
                    "response.reasoning_text.delta", item_id=item["id"], output_index=idx, content_index=0, delta=text
                )
            )
        return events

    def finish(self, finish: str, calls: list, usage: dict) -> list[str]:
        """The tool calls, then response.completed (or .incomplete when the token budget ran out)."""
        events = self._close()
        for c in calls:
            fn = c["function"]
            item = {
                "type": "function_call",
                "id": _new_id("fc_"),
                "call_id": c["id"],
                "name": fn["name"],
                "arguments": "",
                "status": "in_progress",
            }
            self.output.append(item)
            idx = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=idx, item=dict(item)))
            # The arguments arrive whole: one delta carrying all of them, then done.
            at = {"item_id": item["id"], "output_index": idx}
            events.append(self._event("response.function_call_arguments.delta", **at, delta=fn["arguments"]))
            item.update(arguments=fn["arguments"], status="completed")
            events.append(
                self._event("response.function_call_arguments.done", **at, name=fn["name"], arguments=fn["arguments"])
            )
            events.append(self._event("response.output_item.done", output_index=idx, item=item))
        self.status = "incomplete" if finish == "length" else "completed"
        self.final = self.response(self.status, usage)
        events.append(self._event("response." + self.status, response=self.final))
        return events

    def messages(self) -> list[dict]:
        """The output as chat messages (what the next turn's template renders)."""
        msg = {"role": "assistant", "content": ""}
        for item in self.output:
            if item["type"] == "message":
                msg["content"] += item["content"][0]["text"]
            elif item["type"] == "reasoning":
                msg["reasoning_content"] = item["content"][0]["text"]
            else:
                msg.setdefault("tool_calls", []).append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]},
                    }
                )
        return [msg]


# -- stored responses ----------------------------------------------------------------------------------


class ResponseStore:
    """Stored responses for previous_response_id: LRU bounded in number and bytes, each expiring
    `ttl` seconds after it was stored. Thread-safe (the event loop and the prep threads)."""

    def __init__(
        self,
        max_entries: int = DEFAULT_STORE_ENTRIES,
        max_bytes: int = DEFAULT_STORE_BYTES,
        ttl: float = DEFAULT_STORE_TTL,
        clock=time.monotonic,
    ):
        self.max_entries, self.max_bytes, self.ttl, self.clock = max_entries, max_bytes, ttl, clock
        self._entries: OrderedDict[str, tuple] = OrderedDict()  # id -> (expires, nbytes, record)
        self.nbytes = 0
        self._lock = threading.Lock()

    def __len__(self):
        return len(self._entries)

    def put(self, rid: str, messages: list[dict], response: dict, items: list[dict] = ()) -> bool:
        """Store a response: its whole conversation `messages`, the response object and the
        request's input `items` (input_items.list)."""
        nbytes = len(json.dumps([messages, response, items]).encode())
        if nbytes > self.max_bytes or self.max_entries == 0:
            return False
        record = {"messages": messages, "response": response, "items": list(items)}
        with self._lock:
            self._entries[rid] = (self.clock() + self.ttl, nbytes, record)
            self.nbytes += nbytes
            while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
                _, (_, n, _) = self._entries.popitem(last=False)
                self.nbytes -= n
        return True

    def get(self, rid: str) -> dict | None:
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                return None
            if entry[0] <= self.clock():
                del self._entries[rid]
                self.nbytes -= entry[1]
                return None
            self._entries.move_to_end(rid)
            return entry[2]

    def delete(self, rid: str) -> bool:
        with self._lock:
            entry = self._entries.pop(rid, None)
            if entry is not None:
                self.nbytes -= entry[1]
            return entry is not None
