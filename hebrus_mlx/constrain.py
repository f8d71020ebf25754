"""Constrained decoding: structured output (`response_format`, Responses `text.format`) and strict
tool calls, as a per-step token mask.

The grammar engine is llguidance (the one vLLM, SGLang and llama.cpp use). It was chosen over
outlines-core for speed and maintenance: it computes a mask in tens of microseconds from an Earley
parser over a token trie, with no per-schema index over the vocabulary to build first (outlines-core
compiles one per schema, growing with the schema and the vocabulary), and it is actively maintained
with JSON Schema, Lark grammars with special tokens, and bounded compile/step work (fuel limits).

The mask is a logits processor (`GrammarProcessor`): columns the grammar forbids become -inf before
generate's vocabulary mask and log-softmax (AFN-005), so the sampler, logprobs and stop tokens
work as for any request. A token the grammar allows keeps its logit unchanged: where the grammar
allows the unconstrained greedy token, constrained greedy output is the same token.

The processor derives its state from the token history it is handed, so a batched step that is
rolled back (AFN-010: its rows' history restored) rolls the matcher back too, and each row of a
batch has its own matcher.
"""

import json
import logging
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from .errors import UsageError

log = logging.getLogger("hebrus_mlx.constrain")

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_CLOSE = "</think>"
# The template writes tool calls with json.dumps' separators; fixed whitespace keeps a model from
# padding a constrained object with blanks until max_tokens.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(UsageError):
    """A schema or grammar llguidance refuses; `field` names the request field."""


_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def grammar_tokenizer(tok):
    """llguidance's tokenizer for a TextTokenizer (built from its tokenizer.json once per tokenizer:
    20 ms for the demo, 10 s holding the GIL for the 248k Qwen vocabulary on a slow x86 core; the
    server builds it before it listens). Its vocabulary is the logits' width (physical); IDs past
    the effective vocabulary have no bytes and are never allowed."""
    import llguidance

    with _tokenizers_lock:
        llt = _tokenizers.get(tok)
        if llt is None:
            try:
                llt = llguidance.LLTokenizer(
                    tok.backend.to_str(), n_vocab=tok.physical_vocab_size, eos_token=sorted(tok.stop_token_ids)
                )
            except (ValueError, RuntimeError) as e:
                raise GrammarError("tokenizer", f"the grammar engine cannot read this tokenizer: {e}") from None
            _tokenizers[tok] = llt
    return llt


def _limits():
    import llguidance

    # llguidance's defaults bound compile and per-step work by fuel; errors stay short.
    return llguidance.LLParserLimits(verbose_errors=False)


def _first_line(errors) -> str:
    text = "; ".join(errors) if isinstance(errors, list) else str(errors)
    return text.strip().splitlines()[0] if text.strip() else "invalid grammar"


def check_schema(tok, schema, field: str) -> None:
    """Refuse a JSON schema llguidance cannot compile (GrammarError naming `field`)."""
    import llguidance

    if not isinstance(schema, dict):
        raise GrammarError(field, "must be a JSON Schema object")
    llt = grammar_tokenizer(tok)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        failed, errors = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, llt, limits=_limits())
    except (ValueError, TypeError, RuntimeError) as e:
        raise GrammarError(field, f"schema not supported: {e}") from None
    if failed:
        raise GrammarError(field, f"schema not supported: {_first_line(errors)}")


def _styled(schema: dict) -> dict:
    return {**schema, "x-guidance": _JSON_STYLE}


@dataclass
class Tool:
    name: str
    parameters: dict | None  # the schema its arguments follow; None: any JSON object


@dataclass
class Spec:
    """What a request constrains: `schema` the reply's JSON (json_object: {"type": "object"});
    `tools` the callable tools, `calls` "required" (the reply is calls), "auto" (text, or calls
    from the first <tool_call> on) or None; `parallel` more than one call; `think` True when the
    prompt leaves the reply inside <think> (free text up to </think> comes first)."""

    schema: dict | None = None
    tools: list[Tool] | None = None
    calls: str | None = None
    parallel: bool = True
    think: bool | None = None


def build_lark(spec: Spec, added: dict[str, int]) -> tuple[str, bool]:
    """The Lark grammar of `spec` and whether it is lazy (starts at the first <tool_call>).
    `added`: the tokenizer's added tokens; the markers are named by ID (`<[id]>`), which holds
    whether or not the tokenizer flags them special (Qwen's <tool_call> and <think> are not)."""
    rules = []
    lazy = spec.calls == "auto" and spec.schema is None
    if spec.tools is not None and spec.calls is not None:
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.name},
                    "arguments": t.parameters if t.parameters is not None else {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in spec.tools
        ]
        call = options[0] if len(options) == 1 else {"anyOf": options}
        more = " (/\\n?/ call)*" if spec.parallel else ""
        rules += [
            f"calls: call{more}",
            f'call: <[{added[TOOL_CALL_OPEN]}]> "\\n" args "\\n" <[{added[TOOL_CALL_CLOSE]}]>',
            f"args: %json {json.dumps(_styled(call))}",
        ]
    if spec.schema is not None:
        rules.append(f"reply: %json {json.dumps(_styled(spec.schema))}")
    if lazy:
        return "\n".join(["start: calls", *rules]), True
    parts = (["reply"] if spec.schema is not None else []) + (["calls"] if spec.calls is not None else [])
    body = parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")"
    if spec.calls == "required":
        body = "calls"
    if spec.think:  # the prompt opened the block: the reply closes it first
        start = f"start: /(?s:.*)/ <[{added[THINK_CLOSE]}]> /[ \\n]*/ {body}"
    else:  # outside a thinking block the reply is the structured output itself
        start = f"start: {body}"
    return "\n".join([start, *rules]), False


def compile_spec(tok, spec: Spec, field: str) -> "GrammarProcessor":
    """A fresh processor for one generation under `spec` (compiling is bounded by llguidance's fuel
    limits, and drops the GIL; the server runs it on a prep thread, never on the worker);
    GrammarError naming `field` if llguidance refuses the grammar."""
    lark, lazy = build_lark(spec, tok.added_tokens)
    return compile_lark(tok, lark, field, tok.added_tokens.get(TOOL_CALL_OPEN) if lazy else None)


def compile_lark(tok, lark: str, field: str, trigger: int | None = None) -> "GrammarProcessor":
    """A processor for a Lark grammar (llguidance's dialect: `<special>` tokens, `%json {...}`),
    lazy from `trigger` on when given."""
    import llguidance

    m = llguidance.LLMatcher(
        grammar_tokenizer(tok), llguidance.LLMatcher.grammar_from_lark(lark), log_level=0, limits=_limits()
    )
    if m.is_error():
        raise GrammarError(field, f"grammar not supported: {_first_line(m.get_error())}")
    return GrammarProcessor(m, tok.physical_vocab_size, sorted(tok.stop_token_ids), trigger)


class GrammarProcessor:
    """A logits processor (history [N], logits [1, V]) -> logits with the grammar's forbidden
    columns at -inf. The first call's history is the prompt; later calls read the tokens added
    since (a shorter history than last time: the caller rolled a step back, so does the matcher).
    Lazy (`trigger` set): no mask until the trigger token is drawn, then the grammar from it on."""

    def __init__(self, matcher, vocab: int, stops: list[int], trigger: int | None = None):
        self.matcher, self.vocab, self.stops, self.trigger = matcher, vocab, stops, trigger
        self.start: int | None = None  # the prompt's length
        self.seen = 0  # generated tokens accounted for
        self.fed_from: int | None = None if trigger is not None else 0  # where the matcher's input starts

    def _sync(self, history) -> None:
        n = history.shape[-1] - self.start
        if n < self.seen:  # rolled back
            if self.fed_from is not None:
                if n <= self.fed_from and self.trigger is not None:
                    self.matcher.reset()
                    self.fed_from = None
                else:
                    self.matcher.rollback(self.seen - n)
            self.seen = n
        if n == self.seen:
            return
        new = history[self.start + self.seen :].tolist()
        if self.fed_from is None:
            if self.trigger not in new:
                self.seen = n
                return
            k = new.index(self.trigger)
            self.fed_from, new = self.seen + k, new[k:]
        if not self.matcher.is_stopped() and not self.matcher.consume_tokens(new):
            log.warning("constrained decoding: %s", _first_line(self.matcher.get_error()))
        self.seen = n

    def bitmask(self) -> np.ndarray | None:
        """The allowed columns now as llguidance's bitmask (uint32 words, bit j of word i: column
        32 i + j), or None (unconstrained: lazy, not triggered)."""
        if self.fed_from is None:
            return None
        if self.matcher.is_error():  # cannot happen for tokens it allowed; end the reply
            words = np.zeros((self.vocab + 31) // 32, dtype=np.uint32)
            for t in self.stops:
                words[t // 32] |= np.uint32(1 << (t % 32))
            return words
        return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)

    def __call__(self, history, logits):
        import mlx.core as mx

        if self.start is None:
            self.start = history.shape[-1]
        self._sync(history)
        words = self.bitmask()
        if words is None:
            return logits
        # Unpacked by numpy: on MLX's CPU backend the shift-and-mask graph cost 14x more (bench).
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: logits.shape[-1]].astype(bool)
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))
