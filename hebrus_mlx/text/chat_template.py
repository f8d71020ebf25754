"""Chat rendering with provenance (AFN-006, AFN-007).

`render` runs the checkpoint's own Jinja template in a sandbox and returns the rendered bytes plus
a complete, gap-free list of segments, each DATA (caller text) or TRUSTED_CONTROL (template text).

How provenance is kept: every caller string enters the template as a `_DataRef`, a `str` whose
value is a per-render nonce placeholder and which answers string questions (`in`, `startswith`,
`|length`, `strip`, `split`, ...) from the real text. Placeholders in the output map back to DATA;
everything else the template emitted is TRUSTED_CONTROL. The same template is also rendered with
the plain strings; that text is authoritative and the placeholder render must reproduce it exactly,
otherwise rendering fails closed (`ProvenanceError`) instead of guessing.

Trimming is Python's `str.strip` (Unicode whitespace plus U+001C..U+001F, whole code points), as
Jinja's `trim` filter is; it also applies across a caller/template boundary, e.g. `macro()|trim`.
"""

import json
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import jinja2.visitor
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..artifact import untrusted
from ..errors import HebrusError

DATA = "DATA"
TRUSTED_CONTROL = "TRUSTED_CONTROL"

ROLES = ("system", "user", "assistant", "tool")
MEDIA_PART_TYPES = ("image", "image_url", "input_image", "video", "video_url", "audio", "input_audio", "audio_url")

QWEN_TEMPLATE_PATH = Path(__file__).parent / "templates" / "qwen_chat_template.jinja"


class ChatError(HebrusError, ValueError):
    """A request the renderer refuses; nothing is rendered."""

    default_field = "messages"


class MediaPartError(ChatError):
    pass


class RoleError(ChatError):
    pass


class ToolArgumentsError(ChatError):
    pass


class TemplateError(ChatError):
    """The template raised or failed to render."""

    default_field = "chat_template"


class ProvenanceError(ChatError):
    """The template transformed caller text in a way whose provenance cannot be tracked."""


@dataclass(frozen=True)
class Segment:
    kind: str
    start: int  # byte offsets into Rendered.text_bytes
    end: int


@dataclass(frozen=True)
class Rendered:
    text_bytes: bytes
    segments: tuple[Segment, ...]

    @property
    def text(self) -> str:
        return self.text_bytes.decode("utf-8")

    def pieces(self) -> list[tuple[str, str]]:
        """(kind, text) per segment, after checking the segments tile the bytes exactly."""
        pos, out = 0, []
        for n, s in enumerate(self.segments):
            if s.kind not in (DATA, TRUSTED_CONTROL):
                raise ChatError(f"segment {n}: unknown kind {s.kind!r}")
            if s.start != pos or s.end <= s.start or s.end > len(self.text_bytes):
                raise ChatError(f"segment {n}: [{s.start}, {s.end}) does not continue at byte {pos}")
            try:
                out.append((s.kind, self.text_bytes[s.start : s.end].decode("utf-8")))
            except UnicodeDecodeError:
                raise ChatError(f"segment {n}: not on a UTF-8 character boundary") from None
            pos = s.end
        if pos != len(self.text_bytes):
            raise ChatError(f"segments cover {pos} of {len(self.text_bytes)} bytes")
        return out


# -- provenance-tracking strings ---------------------------------------------------------------


class _Registry:
    def __init__(self, avoid: list[str]):
        while True:
            self.nonce = secrets.token_hex(8)
            if not any(self.nonce in s for s in avoid):
                break
        self.texts: list[str] = []
        self.pattern = re.compile("\ue000" + self.nonce + r"(\d+)\ue001")

    def ref(self, text: str) -> "_DataRef":
        self.texts.append(str.__str__(text))
        return _DataRef(self, len(self.texts) - 1)

    def split(self, s: str) -> list[Any]:
        """A str with placeholders -> list of plain str (template text) and _DataRef."""
        out, pos = [], 0
        for m in self.pattern.finditer(s):
            if m.start() > pos:
                out.append(s[pos : m.start()])
            out.append(_DataRef(self, int(m.group(1))))
            pos = m.end()
        if pos < len(s):
            out.append(s[pos:])
        return out


class _DataRef(str):
    """A caller string inside the template: prints as its placeholder, behaves like its text."""

    def __new__(cls, reg: _Registry, idx: int):
        self = super().__new__(cls, f"\ue000{reg.nonce}{idx}\ue001")
        self._reg, self._idx = reg, idx
        return self

    @property
    def _text(self) -> str:
        return self._reg.texts[self._idx]

    def _wrap(self, text):
        return self._reg.ref(text)

    def __str__(self):
        return self

    def __len__(self):
        return len(self._text)

    def __contains__(self, x):
        return str(x) in self._text if not isinstance(x, _DataRef) else x._text in self._text

    def __eq__(self, other):
        return self._text == (other._text if isinstance(other, _DataRef) else other)

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash(self._text)

    def __lt__(self, other):
        return self._text < (other._text if isinstance(other, _DataRef) else other)

    def __getitem__(self, key):
        return self._wrap(self._text[key])

    def __iter__(self):
        return iter([self._wrap(c) for c in self._text])

    def strip(self, chars=None):
        return self._wrap(self._text.strip(chars))

    def lstrip(self, chars=None):
        return self._wrap(self._text.lstrip(chars))

    def rstrip(self, chars=None):
        return self._wrap(self._text.rstrip(chars))

    def split(self, sep=None, maxsplit=-1):
        return [self._wrap(p) for p in self._text.split(sep, maxsplit)]

    def rsplit(self, sep=None, maxsplit=-1):
        return [self._wrap(p) for p in self._text.rsplit(sep, maxsplit)]

    def splitlines(self, keepends=False):
        return [self._wrap(p) for p in self._text.splitlines(keepends)]

    def replace(self, old, new, count=-1):
        # Text the template substitutes into caller text is kept as DATA: the safe direction.
        return self._wrap(self._text.replace(_real(old), _real(new), count))

    def startswith(self, prefix, *args):
        return self._text.startswith(_real(prefix), *args)

    def endswith(self, suffix, *args):
        return self._text.endswith(_real(suffix), *args)

    def find(self, sub, *args):
        return self._text.find(_real(sub), *args)

    def count(self, sub, *args):
        return self._text.count(_real(sub), *args)

    def lower(self):
        return self._wrap(self._text.lower())

    def upper(self):
        return self._wrap(self._text.upper())

    def isspace(self):
        return self._text.isspace()


def _real(x):
    if isinstance(x, _DataRef):
        return x._text
    if isinstance(x, tuple):
        return tuple(_real(v) for v in x)
    return x


def _unwrap(obj):
    if isinstance(obj, _DataRef):
        return obj._text
    if isinstance(obj, dict):
        return {_unwrap(k): _unwrap(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_unwrap(v) for v in obj]
    return obj


def _has_ref(obj) -> bool:
    if isinstance(obj, _DataRef):
        return True
    if isinstance(obj, dict):
        return any(_has_ref(k) or _has_ref(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return any(_has_ref(v) for v in obj)
    return False


def _strip_composite(reg: _Registry, s: str, chars, left: bool, right: bool) -> str:
    """Python strip over template text mixed with placeholders, edge by edge, whole code points."""
    parts = reg.split(s)
    if left:
        while parts:
            p = parts[0]
            q = p._text.lstrip(chars) if isinstance(p, _DataRef) else p.lstrip(chars)
            if q:
                parts[0] = reg.ref(q) if isinstance(p, _DataRef) else q
                break
            parts.pop(0)
    if right:
        while parts:
            p = parts[-1]
            q = p._text.rstrip(chars) if isinstance(p, _DataRef) else p.rstrip(chars)
            if q:
                parts[-1] = reg.ref(q) if isinstance(p, _DataRef) else q
                break
            parts.pop()
    return "".join(str.__str__(p) for p in parts)


# -- environment --------------------------------------------------------------------------------


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson_plain(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Plain json.dumps, as transformers' chat environment does (Jinja's own tojson HTML-escapes).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# -- limits (issue 22) ------------------------------------------------------------------------------
#
# A checkpoint's template is untrusted code. Jinja's sandbox stops attribute escapes, not work: a
# digest-valid template with nested loops grew `generate` past 4 GB and hung. Every render gets a
# budget: steps (loop iterations, calls, operators, filters), wall time, and a size cap on the
# output and on every value it builds. Operations that multiply size are checked before they run
# (sequence * n, str.replace / center / ljust / expandtabs / indent, join, %-widths, int ** int), and
# every string a call, filter, operator or `~` returns is checked after. Anything the template
# raises (OverflowError, RecursionError, TypeError, ...) becomes a TemplateError.


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds of one chat-template render."""

    max_chars: int = 16 << 20  # output and any one value it builds; at least 4x the caller text
    max_steps: int = 1_000_000  # loop iterations + calls + operators + filters
    max_seconds: float = 5.0


DEFAULT_LIMITS = TemplateLimits()


class TemplateLimitError(TemplateError):
    """The template exceeded its render budget (`TemplateLimits`)."""


class _Limit(Exception):
    pass


class _Budget:
    def __init__(self, limits: TemplateLimits, caller_chars: int, deadline: float | None = None):
        self.limits = limits
        self.max_chars = max(limits.max_chars, 4 * caller_chars)
        self.steps = 0
        # One deadline for a whole render (both of its passes), not one per pass.
        self.deadline = time.monotonic() + limits.max_seconds if deadline is None else deadline

    def step(self, n=1):
        self.steps += n
        if self.steps > self.limits.max_steps:
            raise _Limit(f"more than {self.limits.max_steps} steps (loop iterations, calls, operators)")
        self.clock()

    def clock(self):
        if time.monotonic() > self.deadline:
            raise _Limit(f"rendering took more than {self.limits.max_seconds} s")

    def costly(self, size, weight, what):
        """Charge `size * weight` steps before a filter that does Python-speed work per element
        runs, and refuse it when those steps, at the budget's own rate (max_seconds / max_steps per
        step), would end past the deadline: one call can no longer overrun the time budget."""
        n = size * weight
        if self.steps + n > self.limits.max_steps:
            raise _Limit(f"{what} on {size} elements would take more than the {self.limits.max_steps} steps")
        if time.monotonic() + n * self.limits.max_seconds / self.limits.max_steps > self.deadline:
            raise _Limit(f"{what} on {size} elements would run past the {self.limits.max_seconds} s budget")
        self.steps += n

    def chars(self, n, what):
        if n > self.max_chars:
            raise _Limit(f"{what} would hold {n} characters, over the cap of {self.max_chars}")

    def value(self, v, what="a value"):
        if isinstance(v, (str, list, tuple)):
            self.chars(len(v), what)
        return v

    def rendered(self, v, what):
        """Upper estimate of len(str(v)) for containers, walked without recursion, stopping past the cap."""
        total, stack = 0, [v]
        while stack:
            x = stack.pop()
            if isinstance(x, str):
                total += len(x)
            elif isinstance(x, (list, tuple, set, frozenset)):
                total += 2 + 2 * len(x)
                stack.extend(x)
            elif isinstance(x, dict):
                total += 2 + 4 * len(x)
                stack.extend(x.keys())
                stack.extend(x.values())
            elif isinstance(x, int):
                total += x.bit_length() // 3 + 2
            else:
                total += 24
            if total > self.max_chars:
                self.chars(total, what)
        return v

    def int_arg(self, x, what):
        if isinstance(x, int) and not isinstance(x, bool) and abs(x) > self.max_chars:
            raise _Limit(f"{what}: argument {x} is over the size cap of {self.max_chars}")


_PCT_WIDTH = re.compile(r"%[#0 +-]*(\d+|\*)?(?:\.(\d+|\*))?")
_FMT_WIDTH = re.compile(r"\{[^{}]*:[^{}]*?(\d+)")


def _check_format(budget, fmt, args, what, percent):
    for m in (_PCT_WIDTH if percent else _FMT_WIDTH).finditer(fmt):
        for g in m.groups():
            if g and g.isdigit():
                budget.int_arg(int(g), what)
    for a in args if isinstance(args, (tuple, list)) else (args,):
        budget.int_arg(a, what)


# Filters doing Python-speed work per character or item of their input (0.5-7 us per element
# measured on jinja 3 here, vs ~0.01 us for C-speed ones such as trim, lower or replace), and the
# steps each element costs (1 step = max_seconds / max_steps = 5 us by default: about 2x what was
# measured). `wordwrap` on a 4 MB string took ~16 s, beyond the 5 s budget, in one call.
_COSTLY_FILTERS = {
    "wordwrap": 1,
    "urlize": 3,
    "striptags": 2,
    "sort": 2,
    "min": 1,
    "max": 1,
    "title": 1,
    "list": 1,
    "unique": 2,
    "urlencode": 1,
    "wordcount": 1,
    "join": 1,
    "dictsort": 2,
    "groupby": 2,
    "batch": 1,
    "slice": 1,
    "sum": 1,
    "map": 1,
    "select": 1,
    "reject": 1,
    "selectattr": 1,
    "rejectattr": 1,
    "pprint": 1,
    "center": 1,
    "indent": 1,
    "format": 1,
    "xmlattr": 1,
    "filesizeformat": 1,
}
# Super-linear in their input (markupsafe's striptags rebuilds the string per tag): capped outright.
_INPUT_CAP = {"striptags": 1 << 16}

# Filters that only restructure or measure their input (no stringification of a container).
_STRUCTURAL_FILTERS = frozenset(
    (
        "length",
        "count",
        "first",
        "last",
        "selectattr",
        "rejectattr",
        "map",
        "select",
        "reject",
        "list",
        "items",
        "dictsort",
        "sort",
        "reverse",
        "unique",
        "min",
        "max",
        "sum",
        "default",
        "d",
        "attr",
        "batch",
        "slice",
        "groupby",
        "random",
        "abs",
        "int",
        "float",
        "bool",
        "round",
        "safe",
        "lower",
        "upper",
        "capitalize",
        "title",
        "trim",
        "truncate",
        "wordcount",
        "filesizeformat",
        "striptags",
    )
)


def _bounded_filter(name, fn, env):
    import functools

    @functools.wraps(fn)  # keeps jinja's pass_* marker
    def bounded(*args, **kwargs):
        b = env.budget
        if b is None:
            return fn(*args, **kwargs)
        b.step()
        vals = [
            a
            for a in list(args) + list(kwargs.values())
            if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment))
        ]
        for i, a in enumerate(vals):
            if i:  # widths, counts, indents; the input itself may be any number
                b.int_arg(a, f"filter {name}")
            if name not in _STRUCTURAL_FILTERS:
                b.rendered(a, f"the input of filter {name}")
        if name == "replace" and len(vals) >= 3 and all(isinstance(v, str) for v in vals[:3]):
            s, old, new = vals[:3]
            b.chars(len(s) + (s.count(old) if old else len(s) + 1) * max(len(new) - len(old), 0), "replace")
        if name in ("indent", "center") and vals and isinstance(vals[0], str):
            width = next((v for v in vals[1:] if isinstance(v, int) and not isinstance(v, bool)), 4)
            b.chars(len(vals[0]) + (vals[0].count("\n") + 1) * width, name)
        if name == "format" and vals and isinstance(vals[0], str):
            _check_format(b, vals[0], vals[1:], "filter format", True)
        if vals and name in _COSTLY_FILTERS and hasattr(vals[0], "__len__"):
            size = len(vals[0])
            if size > _INPUT_CAP.get(name, size):
                raise _Limit(f"filter {name}: an input of {size} elements, over its cap of {_INPUT_CAP[name]}")
            b.costly(size, _COSTLY_FILTERS[name], f"filter {name}")
        out = fn(*args, **kwargs)
        b.clock()  # a filter that still ran long is reported at once, not at a later step
        return b.value(out, f"the output of filter {name}")

    return bounded


def _bounded_str_call(b, owner, name, args, kwargs):
    """Pre-checks of the str methods whose output can outgrow their input."""
    ints = list(args) + list(kwargs.values())
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        for a in ints:
            b.int_arg(a, f"str.{name}")
        if name == "expandtabs":
            tab = ints[0] if ints and isinstance(ints[0], int) else 8
            b.chars(len(owner) + owner.count("\t") * tab, "str.expandtabs")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        b.chars(len(owner) + (owner.count(old) if old else len(owner) + 1) * max(len(new) - len(old), 0), "str.replace")
    elif name == "join" and args:
        items = args[0]
        if isinstance(items, (list, tuple)):
            b.chars(sum(len(x) if isinstance(x, str) else 24 for x in items) + len(owner) * len(items), "str.join")
        else:
            b.rendered(items, "str.join")


class _Env(ImmutableSandboxedEnvironment):
    """Sandbox that keeps caller-text provenance through strip calls on composite strings, and
    bounds the work of a render (`budget`, see TemplateLimits)."""

    registry: _Registry | None = None
    budget: _Budget | None = None
    intercepted_binops = frozenset(("+", "-", "*", "/", "//", "%", "**"))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        reg = __self.registry
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", None)
        b = __self.budget
        if b is not None:
            b.step()
            if type(owner) is str or isinstance(owner, _DataRef):
                _bounded_str_call(b, owner, name, args, kwargs)
        if (
            reg is not None
            and type(owner) is str
            and name in ("strip", "lstrip", "rstrip")
            and reg.pattern.search(owner)
        ):
            chars = args[0] if args else kwargs.get("chars")
            return _strip_composite(reg, owner, _real(chars), name != "rstrip", name != "lstrip")
        out = super().call(__context, __obj, *args, **kwargs)
        return out if b is None else b.value(out, f"the result of {name or 'a call'}()")

    def getattr(self, obj, attribute):
        value = super().getattr(obj, attribute)
        if self.budget is not None and isinstance(obj, str) and attribute in ("format", "format_map"):
            inner, b = value, self.budget

            def format_checked(*args, **kwargs):
                _check_format(b, str.__str__(obj), list(args) + list(kwargs.values()), "str.format", False)
                return inner(*args, **kwargs)

            return format_checked
        return value

    def call_binop(self, context, operator, left, right):
        b = self.budget
        if b is not None:
            b.step()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        b.chars(len(seq) * max(n, 0), "a repeated sequence")
                if isinstance(left, int) and isinstance(right, int):
                    if left.bit_length() + right.bit_length() > 1 << 16:
                        raise _Limit("an integer product over 65536 bits")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int):
                if abs(left) > 1 and right > 0 and right * left.bit_length() > 1 << 16:
                    raise _Limit(f"{left} ** {right} is over 65536 bits")
            elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                b.chars(len(left) + len(right), "a sum of sequences")
            elif operator == "%" and isinstance(left, str):
                _check_format(b, str.__str__(left), right, "% formatting", True)
        out = super().call_binop(context, operator, left, right)
        return out if b is None else b.value(out, f"the result of {operator}")

    def _parse(self, source, name, filename):
        # Every for-loop's iterable steps the budget per item; every `~` result is size-checked.
        return _Bounder().visit(super()._parse(source, name, filename))

    def bounded_iter(self, iterable):
        b = self.budget
        for x in iterable:
            if b is not None:
                b.step()
            yield x

    def bounded_value(self, v):
        return v if self.budget is None else self.budget.value(v, "a ~ concatenation")

    def bounded_concat(self, parts):
        # Output, macro bodies, {% set %} and {% filter %} blocks are joined here.
        parts = list(parts)
        if self.budget is not None:
            self.budget.chars(sum(len(p) for p in parts), "the rendered text")
        return "".join(parts)

    def bounded_finalize(self, value):
        if self.budget is not None and not isinstance(value, str):
            self.budget.rendered(value, "an output expression")
        return value


class _Bounder(jinja2.visitor.NodeTransformer):
    def _call(self, attr, node):
        return jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute(attr), [node], [], None, None, lineno=node.lineno)

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = self._call("bounded_iter", node.iter)
        return node

    def visit_Concat(self, node):
        return self._call("bounded_value", self.generic_visit(node))


def _make_env(registry: _Registry | None, budget: _Budget | None = None) -> _Env:
    env = _Env(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.finalize = env.bounded_finalize
    env.concat = env.bounded_concat
    env.registry = registry
    env.budget = budget
    env.globals["raise_exception"] = _raise_exception
    env.globals.pop("lipsum", None)  # generates text from a number: not a chat template's business
    if registry is None:
        env.filters["tojson"] = _tojson_plain
        _bound_filters(env)
        return env

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        out = _tojson_plain(_unwrap(x), ensure_ascii, indent, separators, sort_keys)
        # JSON of caller values is caller text as a whole, punctuation included.
        return registry.ref(out) if _has_ref(x) else out

    def trim(value, chars=None):
        if isinstance(value, _DataRef):
            return value.strip(_real(chars))
        s = str(value)
        if registry.pattern.search(s):
            return _strip_composite(registry, s, _real(chars), True, True)
        return s.strip(chars)

    env.filters["tojson"] = tojson
    env.filters["trim"] = trim
    _bound_filters(env)
    return env


def _bound_filters(env):
    for name, fn in list(env.filters.items()):
        env.filters[name] = _bounded_filter(name, fn, env)


# -- request validation ---------------------------------------------------------------------------


def _check_str(x, where):
    if not isinstance(x, str):
        raise ChatError(f"{where} must be a string, got {type(x).__name__}")
    return x


def _check_content(content, where):
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ChatError(f"{where}[{j}] must be an object")
        kind = part.get("type")
        if kind in MEDIA_PART_TYPES:
            raise MediaPartError(f"{where}[{j}]: {kind!r} parts are not supported (text-only model)")
        if kind != "text":
            raise ChatError(f"{where}[{j}]: unknown content part type {kind!r}")
        parts.append({"type": "text", "text": _check_str(part.get("text"), f"{where}[{j}].text")})
    return parts


def _check_json_value(x, where):
    try:
        json.dumps(x, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ToolArgumentsError(f"{where} is not JSON-serialisable: {e}") from None
    return x


def _check_tool_call(call, where):
    if not isinstance(call, dict):
        raise ToolArgumentsError(f"{where} must be an object")
    fn = call.get("function", call)
    if not isinstance(fn, dict):
        raise ToolArgumentsError(f"{where}.function must be an object")
    name = _check_str(fn.get("name"), f"{where}.function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = untrusted.loads(args, f"{where}.function.arguments", root=f"{where}.function.arguments")
        except untrusted.UntrustedFileError as e:
            raise ToolArgumentsError(f"{where}.function.arguments is not valid JSON: {e.message}") from None
    if not isinstance(args, dict):
        raise ToolArgumentsError(f"{where}.function.arguments must be a JSON object, got {type(args).__name__}")
    _check_json_value(args, f"{where}.function.arguments")
    out = {"type": "function", "function": {"name": name, "arguments": args}}
    if "id" in call:
        out["id"] = _check_str(call["id"], f"{where}.id")
    return out


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError("messages must be a non-empty list")
    out = []
    n_system = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise RoleError(f"{where}.role {role!r} is not one of {', '.join(ROLES)}")
        if role == "system":
            n_system += 1
            if n_system > 1:
                raise RoleError(f"{where}: a second system message (only one, first)")
            if i != 0:
                raise RoleError(f"{where}: the system message must be the first message")
        msg = {"role": role, "content": _check_content(m.get("content"), f"{where}.content")}
        if role == "assistant":
            if m.get("reasoning_content") is not None:
                msg["reasoning_content"] = _check_str(m["reasoning_content"], f"{where}.reasoning_content")
            if m.get("tool_calls"):
                if not isinstance(m["tool_calls"], list):
                    raise ToolArgumentsError(f"{where}.tool_calls must be a list")
                msg["tool_calls"] = [
                    _check_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])
                ]
        elif msg["content"] is None:
            raise ChatError(f"{where}.content is missing")
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                msg[key] = _check_str(m[key], f"{where}.{key}")
        out.append(msg)
    return out


def _check_tools(tools):
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatError("tools must be a list")
    for j, t in enumerate(tools):
        if not isinstance(t, dict):
            raise ChatError(f"tools[{j}] must be an object")
        _check_json_value(t, f"tools[{j}]")
    return list(tools)


def _wrap(obj, reg: _Registry, keys: bool):
    """Deep copy with every caller string replaced by a _DataRef (dict keys too when `keys`)."""
    if isinstance(obj, str):
        return reg.ref(obj)
    if isinstance(obj, dict):
        return {(reg.ref(k) if keys and isinstance(k, str) else k): _wrap(v, reg, keys) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_wrap(v, reg, keys) for v in obj]
    return obj


def _wrap_message(m: dict, reg: _Registry) -> dict:
    out = {}
    for k, v in m.items():
        if k == "role":
            out[k] = v  # validated, from a closed set: structure, not text
        elif k == "tool_calls":
            out[k] = [
                {
                    **c,
                    "function": {
                        "name": reg.ref(c["function"]["name"]),
                        "arguments": _wrap(c["function"]["arguments"], reg, keys=True),
                    },
                }
                for c in v
            ]
        elif k == "content" and isinstance(v, list):
            out[k] = [{"type": "text", "text": reg.ref(p["text"])} for p in v]
        else:
            out[k] = _wrap(v, reg, keys=False)
    return out


def _strings(obj, acc):
    if isinstance(obj, str):
        acc.append(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _strings(k, acc)
            _strings(v, acc)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _strings(v, acc)
    return acc


# -- rendering -------------------------------------------------------------------------------------


class ChatRenderer:
    def __init__(self, template: str, special_tokens_map: dict | None = None, limits: TemplateLimits = DEFAULT_LIMITS):
        if not isinstance(template, str) or not template:
            raise ChatError("chat template must be a non-empty string")
        self.template = template
        self.special_tokens_map = dict(special_tokens_map or {})
        self.limits = limits
        try:
            _make_env(None).from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not compile: {e}") from None
        except (RecursionError, MemoryError, OverflowError) as e:  # a pathological parse
            raise TemplateError(f"chat template does not compile: {type(e).__name__}") from None

    def _run(
        self, registry, messages, tools, add_generation_prompt, enable_thinking, caller_chars=0, deadline=None
    ) -> str:
        budget = _Budget(self.limits, caller_chars + len(self.template), deadline)
        env = _make_env(registry, budget)
        kwargs = dict(self.special_tokens_map)
        kwargs.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        try:
            return env.from_string(self.template).render(**kwargs)
        except _Limit as e:
            raise TemplateLimitError(f"chat template stopped: {e} (TemplateLimits)") from None
        except ChatError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from None
        except Exception as e:  # the template is untrusted code: whatever it raises is its failure
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None

    def render(self, messages, tools=None, add_generation_prompt=True, enable_thinking=None) -> Rendered:
        try:  # bounded nesting, valid Unicode: no RecursionError in the checks and copies below
            untrusted.check_tree(messages, "messages", root="messages")
            untrusted.check_tree(tools, "tools", root="tools")
        except untrusted.UntrustedFileError as e:
            raise ChatError(e.field, e.message) from None
        msgs = _check_messages(messages)
        tools = _check_tools(tools)
        if enable_thinking is not None and not isinstance(enable_thinking, bool):
            raise ChatError(f"enable_thinking must be a bool, got {enable_thinking!r}")

        deadline = time.monotonic() + self.limits.max_seconds  # both passes share the time budget
        caller = _strings([msgs, tools], [])
        caller_chars = sum(map(len, caller))
        authoritative = self._run(None, msgs, tools, add_generation_prompt, enable_thinking, caller_chars, deadline)

        reg = _Registry(caller + [self.template])
        w_msgs = [_wrap_message(m, reg) for m in msgs]
        w_tools = None if tools is None else _wrap(tools, reg, keys=True)
        marked = self._run(reg, w_msgs, w_tools, add_generation_prompt, enable_thinking, caller_chars, deadline)

        pieces: list[list] = []
        for p in reg.split(marked):
            kind, text = (DATA, p._text) if isinstance(p, _DataRef) else (TRUSTED_CONTROL, p)
            if not text:
                continue
            if pieces and pieces[-1][0] == kind:
                pieces[-1][1] += text
            else:
                pieces.append([kind, text])
        if "".join(t for _, t in pieces) != authoritative or "\ue000" + reg.nonce in "".join(t for _, t in pieces):
            raise ProvenanceError("the template transforms caller text in a way provenance tracking does not follow")

        segs, pos, chunks = [], 0, []
        for kind, text in pieces:
            b = text.encode("utf-8")
            segs.append(Segment(kind, pos, pos + len(b)))
            chunks.append(b)
            pos += len(b)
        return Rendered(b"".join(chunks), tuple(segs))


def qwen_template() -> str:
    """The shipped Qwen-style template (for the demo model)."""
    return QWEN_TEMPLATE_PATH.read_text(encoding="utf-8")


def render(
    messages,
    tools=None,
    add_generation_prompt=True,
    enable_thinking=None,
    *,
    chat_template=None,
    special_tokens_map=None,
) -> Rendered:
    """Render with `chat_template` (default: the shipped Qwen-style template)."""
    renderer = ChatRenderer(chat_template if chat_template is not None else qwen_template(), special_tokens_map)
    return renderer.render(messages, tools, add_generation_prompt, enable_thinking)
