"""The HTTP server's request fields (issue 22 §3): every field of a request is honoured or refused
with a 4xx naming it, never silently ignored.

Each field of /v1/chat/completions and /v1/completions is in exactly one of three sets:

- HONOURED: validated (type and range) and used. Since issue 24 that includes the logits
  processors (logit_bias, repetition/presence/frequency penalties and their context sizes),
  logprobs/top_logprobs and chat_template_kwargs; structured output (response_format, strict
  tools, tool_choice, parallel_tool_calls: constrain.py) and reasoning_effort (the template's
  thinking switch); store, metadata and service_tier are validated documented no-ops;
- NOT YET: validated, accepted at its no-op value (``xtc_probability: 0``, ``echo: false``,
  ...) and otherwise refused with "not supported by this server yet";
- anything else: refused as an unknown field. Clients built on the `openai` package send only the
  parameters their caller passes (plus `model`), so strictness does not break them; a misspelt
  or unsupported option is an error instead of a silently different generation.

The body itself is strict JSON (artifact.untrusted.loads: no duplicate keys, nesting bounded, no
lone surrogates), parsed off the event loop by the server. No MLX here.
"""

import math

from ..artifact import untrusted
from ..flags import INT32_MAX, SEED_MAX

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024
MAX_TOOLS = 512
MAX_TOOL_NAME_CHARS = 256
MAX_TOP_LOGPROBS = 20


class RequestError(ValueError):
    """A request the server refuses; becomes an OpenAI-style error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def parse_body(data: bytes) -> dict:
    """The request body as strict JSON; RequestError naming the offending JSON path."""
    try:
        body = untrusted.loads(data, "body", root="")
    except untrusted.UntrustedFileError as e:
        raise RequestError(f"invalid JSON: {e.message}", None if e.field in ("body", "") else e.field) from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def is_int(x) -> bool:
    """An integer that is not a bool (JSON's true is not 1 here)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def show_value(v):
    import json

    text = json.dumps(v, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def number_field(body, name, lo=None, hi=None):
    """body[name], a finite number in [lo, hi] (a bound None: open)."""
    v = body[name]
    if not is_number(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" in [{lo}, {hi}]" if lo is not None and hi is not None else (f" >= {lo}" if lo is not None else "")
        raise RequestError(f"{name} must be a finite number{rng}, got {show_value(v)}", name)
    return v


def integer_field(body, name, lo=None, hi=INT32_MAX, expected=None):
    """body[name], an integer in [lo, hi]; the error says `expected` (default: that range)."""
    v = body[name]
    if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(f"{name} must be {expected or f'an integer in [{lo}, {hi}]'}, got {show_value(v)}", name)
    return v


def typed_field(body, name, types, what):
    """body[name], an instance of `types` (a bool only where `types` names bool); the error says `what`."""
    v = body[name]
    if not isinstance(v, types) or (
        bool not in (types if isinstance(types, tuple) else (types,)) and isinstance(v, bool)
    ):
        raise RequestError(f"{name} must be {what}, got {show_value(v)}", name)
    return v


def not_yet_supported(name, value):
    raise RequestError(
        f"{name}={show_value(value)} is not supported by this server yet (only its default is accepted)", name
    )


# -- the fields -----------------------------------------------------------------------------------
# The honoured sampling fields are checked here too (sampling.parse_sampling reads them): one
# validator per field for every route.


def _seed(body, name, vocab=None):
    integer_field(body, name, 0, SEED_MAX, "an integer in [0, 2**64 - 1]")


def stop_strings(v) -> bool:
    """Whether `v` is a list of at most MAX_STOP_SEQUENCES non-empty strings of at most MAX_STOP_CHARS
    characters (stop sequences on every API)."""
    return (
        isinstance(v, list)
        and len(v) <= MAX_STOP_SEQUENCES
        and all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in v)
    )


def _stop(body, name, vocab=None):
    v = body[name]
    stops = [v] if isinstance(v, str) else v
    if not stops or not stop_strings(stops):
        raise RequestError(
            f"stop must be a non-empty string or a list of at most {MAX_STOP_SEQUENCES} of them "
            f"(each at most {MAX_STOP_CHARS} characters)",
            name,
        )


def _stream_options(body, name, vocab=None):
    v = typed_field(body, name, dict, "an object")
    for k in v:
        if k != "include_usage":
            raise RequestError(f"stream_options.{k} is not a known option (only include_usage)", f"stream_options.{k}")
    if not isinstance(v.get("include_usage", False), bool):
        raise RequestError("stream_options.include_usage must be a boolean", "stream_options.include_usage")


def tool_objects(body, name, what):
    """(where, tool) for each object of a `tools` list of at most MAX_TOOLS `what` (every API)."""
    v = body[name]
    if not isinstance(v, list) or len(v) > MAX_TOOLS:
        raise RequestError(f"tools must be a list of at most {MAX_TOOLS} {what}", name)
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise RequestError(f"{where} must be an object", where)
        yield where, t


def _tools(body, name, vocab=None):
    for where, t in tool_objects(body, name, "tool objects"):
        for k in t:
            if k not in ("type", "function"):
                raise RequestError(f"{where}.{k} is not a tool field (type, function)", f"{where}.{k}")
        if t.get("type") != "function":
            raise RequestError(f'{where}.type must be "function", got {show_value(t.get("type"))}', f"{where}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{where}.function must be an object", f"{where}.function")
        for k in fn:
            if k not in ("name", "description", "parameters", "strict"):
                raise RequestError(f"{where}.function.{k} is not a function field", f"{where}.function.{k}")
        fname = fn.get("name")
        if not isinstance(fname, str) or not 0 < len(fname) <= MAX_TOOL_NAME_CHARS:
            raise RequestError(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if "description" in fn and not isinstance(fn["description"], str):
            raise RequestError(f"{where}.function.description must be a string", f"{where}.function.description")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise RequestError(
                f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters"
            )
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise RequestError(f"{where}.function.strict must be a boolean", f"{where}.function.strict")


def tool_choice_mode(body, name) -> bool:
    """Whether tool_choice is one of the modes "none", "auto", "required" (which needs tools), the same
    on every OpenAI endpoint; a function it names differs in shape between them."""
    v = body[name]
    if v not in ("none", "auto", "required"):
        return False
    if v == "required" and not body.get("tools"):
        raise RequestError('tool_choice "required" needs tools', name)
    return True


def _tool_choice(body, name, vocab=None):
    if tool_choice_mode(body, name):
        return
    v = body[name]
    if isinstance(v, dict) and v.get("type") == "function" and set(v) == {"type", "function"}:
        fn = v["function"]
        if isinstance(fn, dict) and set(fn) == {"name"} and isinstance(fn["name"], str):
            names = [t.get("function", {}).get("name") for t in body.get("tools") or [] if isinstance(t, dict)]
            if fn["name"] not in names:
                raise RequestError(f"{name} names the function {fn['name']!r}, which is not in tools", name)
            return
    raise RequestError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
        f"got {show_value(v)}",
        name,
    )


def _bool(body, name, vocab=None):
    typed_field(body, name, bool, "a boolean")


def _n(body, name, vocab=None):
    if not is_int(body[name]) or body[name] != 1:
        raise RequestError(f"only n=1 is supported, got {show_value(body[name])}", name)


def _logit_bias(body, name, vocab=None):
    v = body[name]
    if not isinstance(v, dict):
        raise RequestError(f"logit_bias must be an object of token ID -> bias, got {show_value(v)}", name)
    seen = {}
    for k, b in v.items():
        # Length first: int() of a key past Python's int-string limit (4300 digits) raises.
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12):
            raise RequestError(f"logit_bias key {show_value(k)} is not a token ID in [0, {vocab})", name)
        t = int(k)
        if vocab is not None and t >= vocab:
            raise RequestError(f"logit_bias key {k!r} is not a token ID in [0, {vocab})", name)
        if t in seen:  # "01" and "1": one would silently replace the other
            raise RequestError(f"logit_bias keys {seen[t]!r} and {k!r} name the same token {t}", name)
        seen[t] = k
        if not is_number(b) or not -100 <= b <= 100:
            raise RequestError(f"logit_bias[{k}] must be a number in [-100, 100], got {show_value(b)}", name)


def _no_op_number(default, lo=None, hi=None, lo_open=False):
    def check(body, name, vocab=None):
        v = body[name]
        if v is None:
            return
        if not is_number(v) or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
            rng = f"in {'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else f"{'>' if lo_open else '>='} {lo}"
            raise RequestError(f"{name} must be a finite number {rng}, got {show_value(v)}", name)
        if v != default:
            not_yet_supported(name, v)

    return check


def _no_op_int(default, lo, hi):
    def check(body, name, vocab=None):
        if body[name] is None:
            return
        v = integer_field(body, name, lo, hi)
        if v != default:
            not_yet_supported(name, v)

    return check


def _no_op_bool(default):
    def check(body, name, vocab=None):
        v = body[name]
        if v is None:
            return
        if not isinstance(v, bool):
            raise RequestError(f"{name} must be a boolean, got {show_value(v)}", name)
        if v != default:
            not_yet_supported(name, v)

    return check


def _context_size(body, name, vocab=None):
    # The window of the matching penalty (mlx-lm's default 20); accepted alone, it changes nothing.
    integer_field(body, name, 1, INT32_MAX, "an integer >= 1")


def _response_format(body, name, vocab=None):
    check_format(body[name], name, "json_schema")


def check_format(v, name: str, nested: str | None) -> None:
    """A response format: {"type": "text"}, {"type": "json_object"} or a json_schema one, its
    schema under `nested` (chat: {"type": "json_schema", "json_schema": {"name", "schema", ...}})
    or beside the type (None: the Responses API's text.format)."""
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError(
            f"{name} must be an object with type text, json_object or json_schema, got {show_value(v)}", name
        )
    if v["type"] != "json_schema":
        if set(v) != {"type"}:
            raise RequestError(f"{name} of type {v['type']} takes no other field", name)
        return
    where, fmt = (name, v) if nested is None else (f"{name}.{nested}", v.get(nested))
    if nested is not None:
        if set(v) != {"type", nested} or not isinstance(fmt, dict):
            raise RequestError(f"{name} of type json_schema takes one field, {nested} (an object)", name)
    allowed = {"name", "schema", "strict", "description"} | ({"type"} if nested is None else set())
    for k in fmt:
        if k not in allowed:
            raise RequestError(f"{where}.{k} is not a json_schema field", f"{where}.{k}")
    if not isinstance(fmt.get("name"), str) or not 0 < len(fmt["name"]) <= 64:
        raise RequestError(f"{where}.name must be a string of 1 to 64 characters", f"{where}.name")
    if not isinstance(fmt.get("schema"), dict):
        raise RequestError(f"{where}.schema must be a JSON Schema object", f"{where}.schema")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise RequestError(f"{where}.strict must be a boolean", f"{where}.strict")
    if fmt.get("description") is not None and not isinstance(fmt["description"], str):
        raise RequestError(f"{where}.description must be a string", f"{where}.description")


def format_schema(v, name: str, nested: str | None) -> tuple[dict, str] | None:
    """(schema the reply's JSON follows, the field naming it) of a checked response format, or
    None for text. json_object is any JSON object; a json_schema one is constrained whether
    `strict` or not (a stronger promise than OpenAI's non-strict "try")."""
    if v is None or v["type"] == "text":
        return None
    if v["type"] == "json_object":
        return {"type": "object"}, name
    fmt, where = (v, name) if nested is None else (v[nested], f"{name}.{nested}")
    return fmt["schema"], f"{where}.schema"


def constraint(tools, tool_choice, parallel, schema) -> dict | None:
    """What a checked request constrains, or None: `tools` as (name, parameters, strict, field),
    `tool_choice` "none"/"auto"/"required"/a function name, `parallel` parallel_tool_calls,
    `schema` format_schema's answer. A named or required choice forces calls; auto constrains
    calls once opened when a tool is strict or only one call is allowed."""
    calls = None
    if tools and tool_choice != "none":
        if tool_choice not in (None, "auto", "required"):
            tools, calls = [t for t in tools if t[0] == tool_choice], "required"
        elif tool_choice == "required":
            calls = "required"
        elif any(t[2] for t in tools) or parallel is False:
            calls = "auto"
    if calls is None and schema is None:
        return None
    return {"tools": tools if calls else None, "calls": calls, "parallel": parallel is not False, "schema": schema}


# Accepted and not acted on (documented in docs/STRUCTURED_OUTPUT.md): nothing is stored, metadata
# is not kept, every request is served at the same tier.
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_METADATA_KEYS = 16


def check_metadata(body, name, vocab=None):
    """OpenAI's `metadata` (chat completions and responses): a small map of strings to strings."""
    v = body[name]
    if (
        not isinstance(v, dict)
        or len(v) > MAX_METADATA_KEYS
        or not all(isinstance(k, str) and len(k) <= 64 and isinstance(x, str) and len(x) <= 512 for k, x in v.items())
    ):
        raise RequestError(
            f"metadata must be an object of at most {MAX_METADATA_KEYS} string keys (<= 64 "
            "characters) to strings (<= 512 characters)",
            name,
        )


def _one_of(values):
    def check(body, name, vocab=None):
        if body[name] not in values:
            raise RequestError(f"{name} must be one of {', '.join(values)}, got {show_value(body[name])}", name)

    return check


def thinking_of(effort: str) -> bool:
    """reasoning_effort -> the template's thinking switch: none/minimal off, any other on."""
    return effort not in ("none", "minimal")


def chat_template_kwargs_field(body, name, vocab=None):
    v = typed_field(body, name, dict, "an object")
    for k, x in v.items():
        if k != "enable_thinking":
            raise RequestError(f"chat_template_kwargs.{k} is not supported (only enable_thinking)", f"{name}.{k}")
        if not isinstance(x, bool):
            raise RequestError(f"{name}.enable_thinking must be a boolean", f"{name}.enable_thinking")


def _string(body, name, vocab=None):
    typed_field(body, name, str, "a string")


def _completions_logprobs(body, name, vocab=None):
    # The legacy API's logprobs: how many alternatives per position (0: the chosen token's only).
    integer_field(body, name, 0, MAX_TOP_LOGPROBS)


def _logprobs(body, name, vocab=None):
    typed_field(body, name, bool, "a boolean")


def _top_logprobs(body, name, vocab=None):
    v = integer_field(body, name, 0, MAX_TOP_LOGPROBS)
    if v and body.get("logprobs") is not True:  # OpenAI's rule: alternatives come with logprobs
        raise RequestError("top_logprobs needs logprobs: true", name)


def _suffix(body, name, vocab=None):
    v = body[name]
    if v not in (None, ""):
        if not isinstance(v, str):
            raise RequestError(f"suffix must be a string, got {show_value(v)}", name)
        not_yet_supported(name, v)


COMMON_FIELDS = {
    "model": _string,
    "user": _string,
    # Honoured sampling fields (SAMPLING_FIELDS): checked here, read by sampling.parse_sampling.
    "max_tokens": lambda b, n, v=None: integer_field(b, n, 1),
    "temperature": lambda b, n, v=None: number_field(b, n, 0, 1e6),
    "top_p": lambda b, n, v=None: number_field(b, n, 0, 1),
    "top_k": lambda b, n, v=None: integer_field(b, n, 0),
    "min_p": lambda b, n, v=None: number_field(b, n, 0, 1),
    "seed": _seed,
    "stop": _stop,
    "stream": _bool,
    "stream_options": _stream_options,
    "n": _n,
    # Logits processors (sample_utils.make_logits_processors), in mlx-lm's order: logit_bias, then
    # the repetition, presence and frequency penalties; 0 (and repetition 1) is off.
    "frequency_penalty": lambda b, n, v=None: number_field(b, n, -2, 2),
    "presence_penalty": lambda b, n, v=None: number_field(b, n, -2, 2),
    "repetition_penalty": lambda b, n, v=None: number_field(b, n, 0, 1e6),
    "repetition_context_size": _context_size,
    "presence_context_size": _context_size,
    "frequency_context_size": _context_size,
    "xtc_probability": _no_op_number(0, 0, 1),
    "xtc_threshold": _no_op_number(0, 0, 0.5),
    "logit_bias": _logit_bias,
}
SAMPLING_FIELDS = tuple(k for k in COMMON_FIELDS if k not in ("model", "user")) + ("max_completion_tokens",)
CHAT_FIELDS = {
    **COMMON_FIELDS,
    **{
        "messages": None,  # the chat renderer checks every message
        "max_completion_tokens": lambda b, n, v=None: integer_field(b, n, 1),
        "tools": _tools,
        "tool_choice": _tool_choice,
        "parallel_tool_calls": _bool,
        "logprobs": _logprobs,
        "top_logprobs": _top_logprobs,
        "response_format": _response_format,
        "chat_template_kwargs": chat_template_kwargs_field,
        "store": _bool,
        "metadata": check_metadata,
        "service_tier": _one_of(SERVICE_TIERS),
        "reasoning_effort": _one_of(REASONING_EFFORTS),
    },
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    **{
        "prompt": None,  # checked by the endpoint (string or token IDs)
        "logprobs": _completions_logprobs,
        "echo": _no_op_bool(False),
        "best_of": _no_op_int(1, 1, 1),
        "suffix": _suffix,
    },
}


def check_fields(body: dict, chat: bool, vocab: int) -> dict:
    """Refuse unknown fields and validate every known one (see the module doc); returns the
    renderer options the body asks for (``enable_thinking``)."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in known:
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            raise RequestError(f"unknown field {name!r} for {endpoint}", name)
    for name, check in known.items():
        if check is not None and body.get(name) is not None:  # null is the field's absence
            check(body, name, vocab)
    options = {}
    kwargs = body.get("chat_template_kwargs") or {}
    if "enable_thinking" in kwargs:
        options["enable_thinking"] = kwargs["enable_thinking"]
    if chat and body.get("reasoning_effort") is not None:
        think = thinking_of(body["reasoning_effort"])
        if options.get("enable_thinking", think) != think:
            raise RequestError("reasoning_effort and chat_template_kwargs.enable_thinking disagree", "reasoning_effort")
        options["enable_thinking"] = think
    return options


def check_sampling_fields(body: dict) -> None:
    """Run the validator of each sampling field `body` gives (SAMPLING_FIELDS: the chat API's)."""
    for name in SAMPLING_FIELDS:
        if body.get(name) is not None:
            CHAT_FIELDS[name](body, name)


def chat_constraint(body: dict) -> dict | None:
    """constraint() of a checked /v1/chat/completions body."""
    tools = [
        (
            t["function"]["name"],
            t["function"].get("parameters"),
            t["function"].get("strict") is True,
            f"tools[{i}].function.parameters",
        )
        for i, t in enumerate(body.get("tools") or [])
    ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice = choice["function"]["name"]
    fmt = format_schema(body.get("response_format"), "response_format", "json_schema")
    return constraint(tools, choice, body.get("parallel_tool_calls"), fmt)


class BlankHold:
    """Reply text that is whitespace alone, held until other text follows: an API builder opens no
    text block for it (e.g. the newline a model writes before a tool call)."""

    def __init__(self):
        self.held = ""

    def pass_on(self, text: str) -> str:
        """What of the held text and `text` to emit now ("" while all of it is whitespace)."""
        self.held += text
        if not self.held.strip():
            return ""
        text, self.held = self.held, ""
        return text
