"""What the model writes, parsed for the APIs: stop sequences, <think> blocks and tool calls. No
MLX here.

`parts` turns a job's events (the worker's text, logprob, done and error events) into the parts
every API consumes; openai_api, responses_api and anthropic_api only shape them.
"""

from __future__ import annotations

import json
import re
import secrets
from contextlib import aclosing

from ..artifact.untrusted import UntrustedFileError
from ..artifact.untrusted import loads as untrusted_loads

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


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


async def parts(events, job, parse_tools: bool, think: bool | None):
    """A job's events (an async iterator of (kind, value)) as output parts: ("reasoning", text),
    ("content", text, logprob entries) and last ("end", finish_reason, tool calls, logprob entries
    not yet given). `think`: None when the template does not separate thinking, else whether the
    output starts inside it. Stop sequences apply to the content (the one that ended the reply is
    `job.stop_hit`); tool calls are withheld until they parse. An error event is raised. `events` is
    closed (which cancels the job) when the reply ends, before the last part."""
    matcher = StopMatcher(job.sampling.stop, [TOOL_CALL_OPEN] if parse_tools else [])
    splitter = None if think is None else ThinkSplitter(think)
    tool_text, finish, pending = None, None, []
    async with aclosing(events):  # closed (the job cancelled) before the tool calls are parsed
        async for kind, value in events:
            if kind == "error":
                raise value
            if kind == "logprob":
                pending.append(value)
                continue
            final = kind == "done"
            text = value if kind == "text" else ""
            pieces = [("content", text)] if splitter is None else splitter.feed(text, final)
            for part, piece in pieces:
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
