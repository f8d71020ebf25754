"""Tokenizer for hebrus-mlx: the checkpoint's tokenizer.json is the authority (AFN-007).

Two numbers are kept apart (AFN-005): `effective_vocab_size` is how many IDs the tokenizer assigns
(the valid sampling domain), `physical_vocab_size` is the width of the model's logits. IDs in
[effective, physical) decode to "" and are never sampled; IDs outside [0, physical) are errors.

Caller text and template text are tokenized by provenance (AFN-006): DATA never resolves
special/added tokens, TRUSTED_CONTROL may.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from ..artifact import untrusted
from ..errors import GenerationError, HebrusError
from .chat_template import DATA, TRUSTED_CONTROL, ChatError, ChatRenderer, Rendered

# Tokens that end a chat turn or a document when the tokenizer defines them.
STOP_TOKEN_STRINGS = ("<|endoftext|>", "<|im_end|>")


class TokenizerError(HebrusError, ValueError):
    """Bad tokenizer files or arguments."""

    default_field = "tokenizer"


# What a bad prompt or request raises (the chat template, the tokenizer, generation's own checks):
# chat prints it as one line and goes on, the server answers 400. Never a fault of the process.
PROMPT_ERRORS = (ChatError, TokenizerError, GenerationError)


class TokenIdError(TokenizerError):
    """A token ID outside [0, physical_vocab_size)."""


class SegmentError(TokenizerError):
    """Segments that do not tile the rendered bytes, or have an unknown kind."""


class TextTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        physical_vocab_size: int,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens_map: dict | None = None,
    ):
        self._tok = tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        ids = set(vocab.values())
        n = len(ids)
        if n == 0 or min(ids) != 0 or max(ids) != n - 1:
            # A gap would make "valid for sampling" a set, not a boundary.
            raise TokenizerError(f"tokenizer IDs are not dense 0..{n - 1} (max {max(ids, default=-1)})")
        self.effective_vocab_size = n
        if not isinstance(physical_vocab_size, int) or isinstance(physical_vocab_size, bool):
            raise TokenizerError(f"physical_vocab_size must be an int, got {physical_vocab_size!r}")
        if physical_vocab_size < n:
            raise TokenizerError(f"physical_vocab_size {physical_vocab_size} < effective vocabulary {n}")
        self.physical_vocab_size = physical_vocab_size
        self.added_tokens = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}

        stops = set()
        for i in eos_token_ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
                raise TokenizerError(f"eos_token_id {i!r} is not a token ID in [0, {n})")
            stops.add(i)
        for s in STOP_TOKEN_STRINGS:
            if s in self.added_tokens:
                stops.add(self.added_tokens[s])
        self.stop_token_ids = frozenset(stops)
        self.chat_template = chat_template
        self.special_tokens_map = dict(special_tokens_map or {})
        self._renderer = None

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` loaded from tokenizer.json."""
        return self._tok

    # -- encode -------------------------------------------------------------------------------

    def _encode_data(self, text: str) -> list[int]:
        # Normaliser, pre-tokenizer and model straight from the file, skipping the added-token
        # matcher: a literal "<|im_end|>" in caller text is ordinary text.
        # Long text goes in chunks (`_chunked`): each tokenizers call holds the GIL throughout, and
        # 4 MB in one call stalled every other thread (the server's event loop) for 10 s.
        tok = self._tok
        if tok.normalizer is not None:
            text = "".join(_chunked(text, lambda s: [tok.normalizer.normalize_str(s)], joined=True))
        if tok.pre_tokenizer is not None:
            pieces = _chunked(text, lambda s: [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(s)])
        else:
            pieces = [text]
        out = []
        for piece in pieces:
            out.extend(t.id for t in tok.model.tokenize(piece))
        return out

    def _encode_control(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode(self, text: str, add_special_tokens: bool = True, *, trusted: bool = False) -> list[int]:
        """Encode one string; caller text is DATA unless `trusted` is set explicitly.

        `add_special_tokens` is accepted for mlx-lm/transformers callers; Qwen's post-processor
        adds no BOS/EOS, so it changes nothing (a tokenizer.json whose post-processor would add
        some is refused rather than silently ignored).
        """
        if not isinstance(text, str):
            raise TokenizerError(f"text must be str, got {type(text).__name__}")
        post = self._tok.post_processor
        if add_special_tokens and post is not None and post.num_special_tokens_to_add(False):
            raise TokenizerError(
                "add_special_tokens: this tokenizer's post-processor adds special tokens; pass add_special_tokens=False"
            )
        return self._encode_control(text) if trusted else self._encode_data(text)

    def encode_segments(self, segments) -> list[int]:
        """Tokenize each segment by its provenance; all or nothing.

        `segments` is a `Rendered` (its byte segments are validated to tile the bytes) or a
        sequence of (kind, text) pairs.
        """
        pieces = _segment_pieces(segments)
        out: list[int] = []
        for kind, text in pieces:
            out.extend(self._encode_control(text) if kind == TRUSTED_CONTROL else self._encode_data(text))
        return out

    def render_chat(self, messages, tools=None, add_generation_prompt=True, enable_thinking=None) -> Rendered:
        """Render with the checkpoint's template; the result keeps each byte's provenance
        (DATA / TRUSTED_CONTROL segments). `encode_segments(render_chat(...))` are the IDs."""
        if self.chat_template is None:
            raise TokenizerError("this checkpoint has no chat template (chat_template.jinja or tokenizer_config.json)")
        if self._renderer is None:
            self._renderer = ChatRenderer(self.chat_template, self.special_tokens_map)
        return self._renderer.render(messages, tools, add_generation_prompt, enable_thinking)

    def apply_chat_template(
        self,
        messages,
        tools=None,
        add_generation_prompt=True,
        tokenize=True,
        enable_thinking=None,
        return_dict=False,
        **kwargs,
    ):
        """mlx-lm / transformers call shape: token IDs (`tokenize=True`) or the rendered string.

        The IDs are tokenized by provenance (AFN-006): caller text stays DATA. The string is for
        display; re-encoding it with `encode` would turn the template's control spellings into
        plain text, so use the IDs for generation. `return_dict=False` is what mlx-lm's
        TokenizerWrapper passes; True (transformers' BatchEncoding) is refused.
        """
        if return_dict:
            raise TokenizerError("apply_chat_template: return_dict=True is not supported (the IDs are a list)")
        if kwargs:
            # transformers' extras (return_dict, continue_final_message, ...) change the output.
            raise TokenizerError(f"apply_chat_template: unsupported argument {sorted(kwargs)[0]!r}")
        rendered = self.render_chat(messages, tools, add_generation_prompt, enable_thinking)
        return self.encode_segments(rendered) if tokenize else rendered.text

    # -- vocabulary ---------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> frozenset:
        """Every ID that ends generation (generation_config eos plus the stop tokens)."""
        return self.stop_token_ids

    @property
    def eos_token_id(self) -> int | None:
        """The checkpoint's eos token (tokenizer_config `eos_token`), else the smallest stop ID."""
        eos = self.special_tokens_map.get("eos_token")
        if eos in self.added_tokens:
            return self.added_tokens[eos]
        return min(self.stop_token_ids) if self.stop_token_ids else None

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        """None for Qwen (no BOS): mlx-lm's stream_generate then encodes a string prompt as is."""
        return self.special_tokens_map.get("bos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self.added_tokens.get(self.bos_token) if self.bos_token is not None else None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    @has_chat_template.setter
    def has_chat_template(self, _value):
        # mlx-lm's TokenizerWrapper forwards its own `has_chat_template = ...` to the tokenizer it
        # wraps (True for any tokenizer with its own apply_chat_template); the answer stays derived
        # from this tokenizer's template, which the wrapper then reads back.
        pass

    @property
    def vocab_size(self) -> int:
        return self.effective_vocab_size

    def __len__(self) -> int:
        return self.effective_vocab_size  # transformers' len(tokenizer): every assigned ID

    def get_vocab(self) -> dict:
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens):
        """One token string -> ID (None if unknown), or a list of them -> list, like transformers."""
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tok.id_to_token(self.check_ids([ids])[0])
        return [self._tok.id_to_token(i) for i in self.check_ids(ids)]

    # -- decode -------------------------------------------------------------------------------

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        out = []
        for i in ids:
            if hasattr(i, "item"):
                i = i.item()
            if not isinstance(i, int) or isinstance(i, bool):
                raise TokenIdError(f"token ID must be an int, got {type(i).__name__}")
            if not 0 <= i < self.physical_vocab_size:
                raise TokenIdError(f"token ID {i} outside [0, {self.physical_vocab_size})")
            out.append(i)
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [i for i in self.check_ids(ids) if i < self.effective_vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def detokenizer(self) -> "StreamingDetokenizer":
        return StreamingDetokenizer(self)

    def to_mlx_lm(self):
        """An `mlx_lm.tokenizer_utils.TokenizerWrapper` over this tokenizer that stops on the whole
        stop set and streams text with this detokenizer. mlx-lm wraps any other tokenizer itself,
        and that wrapper stops on `eos_token_id` alone."""
        from mlx_lm.tokenizer_utils import TokenizerWrapper  # slow import (transformers): only here

        return TokenizerWrapper(self, StreamingDetokenizer, eos_token_ids=sorted(self.stop_token_ids))


class StreamingDetokenizer:
    """Incremental decode: text is released once the pending tokens end on a whole character.

    A multi-byte UTF-8 character split across tokens decodes to U+FFFD until its last byte
    arrives, so pending tokens are held while their decode ends in U+FFFD. `max_pending` bounds
    the wait for sequences that are invalid for good.
    """

    def __init__(self, tokenizer: TextTokenizer, max_pending: int = 8):
        self._tokenizer = tokenizer
        self.max_pending = max_pending
        self.reset()

    def reset(self):
        self.tokens: list[int] = []
        self._pending: list[int] = []
        self._text = ""
        self._last = ""

    def add_token(self, token: int):
        self.tokens.append(token)
        self._pending.append(token)
        text = self._tokenizer.decode(self._pending)
        if not text.endswith("\ufffd") or len(self._pending) >= self.max_pending:
            self._emit(text)

    def _emit(self, text):
        self._text += text
        self._last += text
        self._pending = []

    def finalize(self):
        if self._pending:
            self._emit(self._tokenizer.decode(self._pending))

    @property
    def text(self) -> str:
        return self._text

    @property
    def last_segment(self) -> str:
        """Text released since the previous call."""
        seg, self._last = self._last, ""
        return seg


CHUNK_CHARS = 4096  # one tokenizers call on this much text holds the GIL ~10-50 ms
_WINDOW = 256


def _chunked(text: str, pieces, chunk: int = CHUNK_CHARS, joined: bool = False) -> list[str]:
    """`pieces(text)` (a list of strings) computed chunk by chunk. Text is cut only before a
    single space between two non-space characters, and only where `pieces` of a window around
    the cut equals `pieces` of its two halves (their concatenation when `joined`, as for a
    normaliser): the split made there is local. With no such cut the rest goes in one call.
    tests/test_tokenizer_chunks.py checks the result equals one call's on the Qwen tokenizer."""
    same = (lambda a, b: "".join(a) == "".join(b)) if joined else (lambda a, b: a == b)
    if len(text) <= chunk:
        return pieces(text)
    out, start = [], 0
    while len(text) - start > chunk:
        cut = None
        p = text.rfind(" ", start + chunk // 2, start + chunk)
        while p > start + chunk // 4:
            if not text[p - 1].isspace() and not text[p + 1].isspace():
                lo, hi = max(start, p - _WINDOW), min(len(text), p + _WINDOW)
                if same(pieces(text[lo:hi]), pieces(text[lo:p]) + pieces(text[p:hi])):
                    cut = p
                    break
            p = text.rfind(" ", start + chunk // 4, p)
        if cut is None:
            break
        out += pieces(text[start:cut])
        start = cut
    return out + pieces(text[start:])


def _segment_pieces(segments) -> list[tuple[str, str]]:
    if isinstance(segments, Rendered):
        return segments.pieces()
    out = []
    for n, seg in enumerate(segments):
        try:
            kind, text = seg
        except (TypeError, ValueError):
            raise SegmentError(f"segment {n}: expected (kind, text), got {seg!r}") from None
        if kind not in (DATA, TRUSTED_CONTROL):
            raise SegmentError(f"segment {n}: unknown kind {kind!r}")
        if not isinstance(text, str) or not text:
            raise SegmentError(f"segment {n}: text must be a non-empty str")
        out.append((kind, text))
    return out


# -- loading ----------------------------------------------------------------------------------


@dataclass
class _Files:
    tokenizer_json: Path
    tokenizer_bytes: bytes
    tokenizer_config: dict | None
    generation_config: dict | None
    chat_template: str | None


def _reader(model_dir: Path, sources):
    """name -> bytes or None: from `sources` (the digest-checked bytes admission read) when given,
    else from the directory."""
    if sources is not None:
        return sources.get

    def read(name):
        # Regular, inside the directory, size-capped before it is read (artifact.untrusted).
        try:
            return untrusted.read_bytes(str(model_dir), name, field=str(model_dir / name), links=True)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TokenizerError(f"{model_dir / name}: cannot read ({e})") from None

    return read


def _read_json(data: bytes | None, path: Path) -> dict | None:
    if data is None:
        return None
    try:  # no duplicate keys, bounded nesting
        doc = untrusted.loads(data, str(path))
    except untrusted.UntrustedFileError as e:
        raise TokenizerError(f"{path}: cannot read JSON ({e.message})") from None
    if not isinstance(doc, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return doc


def _find_files(model_dir: Path, sources=None) -> _Files:
    read = _reader(model_dir, sources)
    tj = model_dir / "tokenizer.json"
    tokenizer_bytes = read(tj.name)
    if tokenizer_bytes is None:
        raise TokenizerError(f"no tokenizer in {model_dir}: looked for {tj.name}")
    tcfg = _read_json(read("tokenizer_config.json"), model_dir / "tokenizer_config.json")
    gcfg = _read_json(read("generation_config.json"), model_dir / "generation_config.json")
    template = None
    tbytes = read("chat_template.jinja")
    if tbytes is not None:
        try:
            template = tbytes.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{model_dir / 'chat_template.jinja'}: not UTF-8 ({e})") from None
    elif tcfg is not None and tcfg.get("chat_template") is not None:
        template = tcfg["chat_template"]
        if isinstance(template, list):
            # Named templates: [{"name": ..., "template": ...}]; the default one renders chat.
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            raise TokenizerError(f"{model_dir / 'tokenizer_config.json'}: chat_template has no default string")
        _check_template(template, f"{model_dir / 'tokenizer_config.json'}.chat_template")
    return _Files(tj, tokenizer_bytes, tcfg, gcfg, template)


def _check_template(template: str, field: str) -> None:
    # Embedded in a 16 MiB tokenizer_config.json it would escape the 1 MiB template cap (issue 22).
    try:
        untrusted.check_template(template, field)
    except untrusted.UntrustedFileError as e:
        raise TokenizerError(e.field, e.message) from None


def _eos_ids(gcfg: dict | None, where: Path) -> list[int]:
    if not gcfg or gcfg.get("eos_token_id") is None:
        return []
    eos = gcfg["eos_token_id"]
    eos = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if not isinstance(eos, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
        raise TokenizerError(f"{where}: eos_token_id must be an int or a list of ints, got {gcfg['eos_token_id']!r}")
    return eos


def _special_tokens_map(tcfg: dict | None) -> dict:
    out = {}
    for k, v in (tcfg or {}).items():
        if not k.endswith("_token"):
            continue
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[k] = v
    return out


def load_tokenizer(
    model_dir, physical_vocab_size: int, sources=None, *, eos_token: str | None = None, chat_template: str | None = None
) -> TextTokenizer:
    """Load tokenizer.json, tokenizer_config.json, chat template and generation_config.json.
    `sources` ({file name: bytes}, e.g. an admitted artifact's `Manifest.sources`): use exactly
    these bytes instead of reading the files again.

    mlx-lm's `tokenizer_config` overrides: `eos_token` (a token string) becomes the eos token and
    joins the stop set; `chat_template` (Jinja source) replaces the checkpoint's template."""
    model_dir = Path(model_dir)
    for field, value in (("eos_token", eos_token), ("chat_template", chat_template)):
        if value is not None and (not isinstance(value, str) or not value):
            raise TokenizerError(f"tokenizer_config.{field}", f"must be a non-empty string, got {value!r}")
    if chat_template is not None:
        _check_template(chat_template, "tokenizer_config.chat_template")
    files = _find_files(model_dir, sources)
    # Small files are checked before the large one is loaded.
    eos = _eos_ids(files.generation_config, model_dir / "generation_config.json")
    special = _special_tokens_map(files.tokenizer_config)
    try:
        tok = Tokenizer.from_str(files.tokenizer_bytes.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise TokenizerError(f"{files.tokenizer_json}: cannot load ({e})") from None
    if eos_token is not None:
        eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise TokenizerError("tokenizer_config.eos_token", f"{eos_token!r} is not one token of this tokenizer")
        special["eos_token"] = eos_token
        eos = [*eos, eos_id]
    return TextTokenizer(
        tok,
        physical_vocab_size,
        eos_token_ids=eos,
        chat_template=files.chat_template if chat_template is None else chat_template,
        special_tokens_map=special,
    )
