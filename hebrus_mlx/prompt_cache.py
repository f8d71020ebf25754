"""Prefix reuse across requests: snapshots of whole sequence state at prefix boundaries.

Hybrid state (GDN recurrent + conv tails, PLE n-gram context and conv tail, QSA K/V and block
keys) cannot be trimmed back to a shorter prefix (AFN-010), so reuse is by exact prefix only: a
snapshot taken after `key` tokens serves any later prompt that starts with `key` and is longer.
Two boundaries are kept per request: the prompt minus its last token (the next turn of a chat
re-sends it) and prompt + generated tokens (the next turn continues from the reply when the
client sends it back verbatim). Entries are evicted least recently used by bytes.

`save_prompt_cache` / `load_prompt_cache` keep one sequence's state in mlx-lm's prompt-cache file
(written by `mlx_lm.models.cache.save_prompt_cache`: every layer's protocol `state`), bound to the
artifact it was computed with: a file from another model, dtype or layer layout is refused with a
typed error, never restored. mlx-lm's own `load_prompt_cache` rebuilds only classes defined in
mlx-lm, so the reader is ours; it maps the two recorded class names to hebrus's layer caches and
nothing else (a file names no code to run).

mlx-lm's `LRUPromptCache` is not used: it trims entries to shorter prefixes, which recurrent state
cannot do, deep-copies whole caches, and cannot see a pipeline's remote layers (`detach` does).
"""

from __future__ import annotations

import importlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_unflatten

from .errors import HebrusError
from .models.cache import AttentionCache, CacheHoleError, CacheStateError, LinearCache, SequenceCache

_gen = importlib.import_module("hebrus_mlx.generate")  # the package attribute is the function


@dataclass
class _Entry:
    snapshot: tuple
    nbytes: int


class PromptCache:
    """LRU of detached `SequenceCache` snapshots keyed by the exact token prefix they hold."""

    def __init__(self, max_bytes: int):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.disk = None  # a prompt_cache_disk.DiskPromptCache: snapshots that survive restarts

    def __len__(self):
        return len(self._entries)

    def fetch(self, model, ids: Sequence[int]):
        """(cache, n): a cache holding the longest stored prefix of `ids` shorter than `ids`
        (n tokens), or a fresh cache and 0."""
        ids = tuple(ids)
        best = None
        for key in self._entries:
            if len(key) < len(ids) and (best is None or len(key) > len(best)) and ids[: len(key)] == key:
                best = key
        if self.disk is not None:
            on_disk = self.disk.longest(ids, len(best) if best is not None else 0)
            loaded = None if on_disk is None else self.disk.load(on_disk)
            if loaded is not None:  # longer than any in memory: keep it here too
                self.hits += 1
                self._remember(on_disk, loaded)
                return loaded, len(on_disk)
        cache = model.make_cache()
        if best is None:
            self.misses += 1
            return cache, 0
        self.hits += 1
        self._entries.move_to_end(best)
        cache.restore(self._entries[best].snapshot)
        return cache, len(best)

    def insert(self, ids: Sequence[int], cache) -> bool:
        """Store a detached snapshot of `cache`, which must hold exactly `ids` (and publish it to
        the disk tier, when there is one)."""
        key = tuple(ids)
        if not key or not hasattr(cache, "detach") or (self.max_bytes == 0 and self.disk is None):
            return False
        if getattr(cache, "offset", None) != len(key):
            raise ValueError(f"cache holds {getattr(cache, 'offset', None)} tokens, key has {len(key)}")
        if self.disk is not None:
            self.disk.save(key, cache)
        return self._remember(key, cache)

    def _remember(self, key: tuple[int, ...], cache) -> bool:
        if self.max_bytes == 0:
            return False
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        snap = cache.detach()
        mx.eval(snap)  # a tree of arrays and counters
        nbytes = cache.nbytes  # the live rows the detached snapshot holds (mlx-lm's protocol)
        if nbytes > self.max_bytes:
            return False
        self._entries[key] = _Entry(snap, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def clear(self):
        self._entries.clear()
        self.nbytes = 0


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int = 0
    prompt_seconds: float = 0.0  # until the first token is known
    generation_seconds: float = 0.0


def stream_with_cache(
    model,
    tokenizer,
    ids: Sequence[int],
    prompt_cache: PromptCache | None,
    max_tokens: int,
    sampler=None,
    prefill_step_size: int = _gen.DEFAULT_PREFILL_STEP_SIZE,
    cancelled: Callable[[], bool] = lambda: False,
    usage: Usage | None = None,
    draft_model=None,
    num_draft_tokens: int | None = None,
    logits_processors: list | None = None,
    seed: int | None = None,
) -> Iterator[_gen.GenerationResponse]:
    """`stream_generate` over a prompt whose longest cached prefix is restored instead of
    prefilled. Fills `usage` as it goes. Stops early (no error) when `cancelled()` turns true.
    `draft_model` / `num_draft_tokens` decode speculatively as `stream_generate` does (the drafter
    sees the tokens from the last cached position on, so a prompt-lookup drafter finds fewer
    matches after a long cached prefix; the tokens are the same either way). `logits_processors`
    see the whole prompt then the generated tokens, as in `generate_step` over the full prompt
    (the restored and prefilled prefix is prepended to the history the decode loop keeps).
    `seed`: the request's own random key (generate_step's)."""
    ids = list(ids)
    limit = _gen.context_limit(model)
    if not ids:
        raise _gen.GenerationError("prompt is empty")
    if limit is not None and len(ids) + max_tokens > limit:
        raise _gen.GenerationError(
            f"max_tokens {max_tokens} + prompt {len(ids)} tokens exceeds the model context {limit}"
        )
    tic = time.perf_counter()
    if prompt_cache is not None:
        cache, n = prompt_cache.fetch(model, ids)
    else:
        cache, n = model.make_cache(), 0
    if usage is not None:
        usage.prompt_tokens, usage.cached_tokens = len(ids), n
    # generate's prefill (chunk cap, rollback); the last token is the decode loop's first input.
    if not _gen.prefill(model, mx.array(ids[n:-1], dtype=mx.int32), cache, prefill_step_size, cancelled):
        return
    # The prompt's state is stored once its first token's logits came out finite (AFN-010).
    prefix = cache.snapshot() if prompt_cache is not None and len(ids) - 1 > n else None
    extra = {} if draft_model is None else {"draft_model": draft_model, "num_draft_tokens": num_draft_tokens}
    if logits_processors:
        extra["logits_processors"] = _with_prefix(logits_processors, ids[:-1])
    steps = _gen.stream_generate(
        model,
        tokenizer,
        ids[-1:],
        max_tokens=max_tokens,
        sampler=sampler,
        prompt_cache=cache,
        prefill_step_size=prefill_step_size,
        seed=seed,
        **extra,
    )
    tokens: list[int] = []
    finished = False
    try:
        for r in steps:
            if prefix is not None:
                live = cache.snapshot()
                cache.restore(prefix)
                prompt_cache.insert(ids[:-1], cache)
                cache.restore(live)
                prefix = None
            tokens.append(r.token)
            if usage is not None:
                if len(tokens) == 1:
                    usage.prompt_seconds = time.perf_counter() - tic
                    tic = time.perf_counter()
                usage.completion_tokens = len(tokens)
                usage.generation_seconds = time.perf_counter() - tic
            yield r
            finished = r.finish_reason is not None
            if cancelled():
                return
    finally:
        steps.close()
        # Every token handed out has been fed (generate_step queues the next step before it
        # yields), so the cache holds prompt + tokens unless a step failed part way.
        if prompt_cache is not None and (finished or not cancelled()) and cache.offset == len(ids) + len(tokens):
            mx.eval(cache.arrays)
            prompt_cache.insert(ids + tokens, cache)


def _with_prefix(processors, prefix: Sequence[int]) -> list:
    """`processors` seeing `prefix` before the history the decode loop passes them."""
    if not prefix:
        return list(processors)
    head = mx.array(list(prefix), dtype=mx.int32)

    def wrap(proc):
        return lambda tokens, logits: proc(mx.concatenate([head, tokens.astype(mx.int32)]), logits)

    return [wrap(p) for p in processors]


# -- one sequence on disk, in mlx-lm's prompt-cache layout ---------------------------------------------

FORMAT = "hebrus-mlx/prompt-cache/1"
_LAYERS = {"LinearCache": LinearCache, "AttentionCache": AttentionCache}  # the only names a file may use
_RESERVED = ("format", "artifact_digest", "dtype", "offset", "start_position", "tokens")


class PromptCacheFileError(HebrusError, ValueError):
    """A prompt-cache file that cannot be written, read, or does not belong to this model."""

    default_field = "prompt_cache_file"


def _artifact_digest(model) -> str:
    from .traces.schema import artifact_digest

    source = getattr(model, "source_path", None)
    if source is None:
        raise PromptCacheFileError(
            "model", "has no source_path: load it with hebrus_mlx.load so the file can name the artifact it belongs to"
        )
    return artifact_digest(source)


def _runtime_dtype(model) -> str:
    # The dtype the model computes in (float32 on CPU by default, the stored one on Metal): the state
    # of one run does not continue another.
    return str(model.model.embed_tokens(mx.array([[0]])).dtype)


def prompt_cache_metadata(
    model, cache: SequenceCache, tokens: Sequence[int] | None = None, metadata: dict[str, str] | None = None
) -> dict[str, str]:
    """The metadata that binds a saved `cache` to `model` (pass it to mlx-lm's
    `save_prompt_cache(file, cache, metadata=...)`, or use `save_prompt_cache` here). `tokens`: the
    IDs the cache holds, recorded so a later run can match its prompt against them."""
    out = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise PromptCacheFileError("metadata", f"keys and values must be strings, got {k!r}: {v!r}")
        if k in _RESERVED:
            raise PromptCacheFileError("metadata", f"{k!r} is written by hebrus-mlx itself")
        out[k] = v
    out.update(
        format=FORMAT,
        artifact_digest=_artifact_digest(model),
        dtype=_runtime_dtype(model),
        offset=str(cache.offset),
        start_position=str(cache.start_position),
    )
    if tokens is not None:
        tokens = [int(t) for t in tokens]
        if len(tokens) != cache.offset:
            raise PromptCacheFileError("tokens", f"{len(tokens)} IDs given, the cache holds {cache.offset} tokens")
        out["tokens"] = json.dumps(tokens)
    return out


def serialize_prompt_cache(
    cache: SequenceCache, model, tokens: Sequence[int] | None = None, metadata: dict[str, str] | None = None
) -> bytes:
    """`cache` (one single-process sequence of `model`) as the bytes of a prompt-cache file (mlx-lm's
    `save_prompt_cache` layout, bound to the artifact by `prompt_cache_metadata`)."""
    if type(cache) is not SequenceCache:  # a pipeline's cache keeps other ranks' layers elsewhere
        raise PromptCacheFileError("cache", f"expected a SequenceCache of one process, got {type(cache).__name__}")
    meta = prompt_cache_metadata(model, cache, tokens, metadata)
    import io

    from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save  # slow import: only when saving

    mx.eval(cache.arrays)
    buf = io.BytesIO()
    mlx_lm_save(buf, cache, meta)
    return buf.getvalue()


def save_prompt_cache(
    path, cache: SequenceCache, model, tokens: Sequence[int] | None = None, metadata: dict[str, str] | None = None
) -> Path:
    """Write `cache` (one single-process sequence of `model`) to `path` in mlx-lm's layout,
    published atomically (artifact.atomic: temp + fsync + rename; a failure leaves `path` as it
    was). Returns the path."""
    from .artifact.atomic import publish_file_by_path
    from .artifact.errors import PublishError

    payload = serialize_prompt_cache(cache, model, tokens, metadata)
    path = Path(path)

    def write(tmp):
        with open(tmp, "r+b") as f:  # our locked temp, written in place (its inode is kept)
            f.truncate(0)
            f.write(payload)

    try:
        # The one publisher (temp + fsync + rename, locked while written): a later save cleans the
        # temporaries a killed save left (AFN-010, issue 22), never a live writer's.
        publish_file_by_path(path, write, suffix=".safetensors")
    except OSError as e:
        raise PromptCacheFileError(f"{path}: cannot write ({e.strerror or e})") from None
    except PublishError as e:
        raise PromptCacheFileError(f"{path}: cannot write ({e.message})") from None
    return path


def _decode_scalars(arrays: dict, scalars) -> dict:
    """Undo mlx-lm's encoding of non-array state items (ints, strings and None as small arrays)."""
    for entry in scalars[1:]:  # the first entry is mlx-lm's placeholder
        if not isinstance(entry, list) or len(entry) != 2 or entry[0] not in arrays:
            raise PromptCacheFileError(f"unreadable scalar entry {entry!r}")
        key, kind = entry
        a = arrays[key]
        if kind == "scalar":
            arrays[key] = a.item()
        elif kind == "none":
            arrays[key] = None
        elif kind == "string":
            arrays[key] = "".join(chr(c) for c in a.tolist())
        else:
            raise PromptCacheFileError(f"unknown scalar kind {kind!r}")
    return arrays


def _read(path: Path):
    try:
        arrays, flat_meta = mx.load(str(path), format="safetensors", return_metadata=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise PromptCacheFileError(f"{path}: not a readable safetensors file ({e})") from None
    meta = tree_unflatten(list(flat_meta.items()))
    if not (
        isinstance(meta, list)
        and len(meta) == 3
        and isinstance(meta[0], dict)
        and isinstance(meta[1], list)
        and isinstance(meta[2], list)
    ):
        raise PromptCacheFileError(f"{path}: not an mlx-lm prompt-cache file (metadata, classes, scalars)")
    user, classes, scalars = meta
    states = tree_unflatten(list(_decode_scalars(dict(arrays), scalars).items())) if arrays else []
    return user, classes, states


def _int_field(meta, key) -> int:
    try:
        value = int(meta[key])
    except (KeyError, ValueError):
        raise PromptCacheFileError(
            f"prompt_cache_file.{key}", f"missing or not an integer: {meta.get(key)!r}"
        ) from None
    if value < 0:
        raise PromptCacheFileError(f"prompt_cache_file.{key}", f"must be >= 0, got {value}")
    return value


def load_prompt_cache(path, model, return_metadata: bool = False):
    """The `SequenceCache` saved in `path`, ready to continue generation on `model`; with
    `return_metadata`, also the file's metadata (`tokens`, when recorded, decoded to a list).

    Refused with PromptCacheFileError naming the field: a file not bound to this artifact
    (`artifact_digest`), computed in another dtype (`dtype`), with another layer layout (`layers`)
    or with state that does not describe a layer cache."""
    path = Path(path)
    if not path.is_file():
        raise PromptCacheFileError(f"{path}: no such file")
    meta, classes, states = _read(path)
    if meta.get("format") != FORMAT:
        raise PromptCacheFileError(
            "prompt_cache_file.format",
            f"expected {FORMAT!r}, got {meta.get('format')!r} "
            "(write it with hebrus_mlx.prompt_cache.save_prompt_cache or its metadata)",
        )
    for key, want in (("artifact_digest", _artifact_digest(model)), ("dtype", _runtime_dtype(model))):
        if meta.get(key) != want:
            raise PromptCacheFileError(
                f"prompt_cache_file.{key}", f"the file was computed with {meta.get(key)!r}, this model is {want!r}"
            )
    expected = [type(layer).__name__ for layer in model.make_cache()]
    if classes != expected or len(states) != len(expected):
        raise PromptCacheFileError("prompt_cache_file.layers", f"the file holds {classes}, the model has {expected}")
    layers = []
    for i, (name, state) in enumerate(zip(classes, states)):
        try:
            layers.append(_LAYERS[name].from_state(state))
        except CacheStateError as e:
            raise PromptCacheFileError(f"prompt_cache_file.layers.{i}", e.message) from None
    try:
        cache = SequenceCache.from_layers(layers, _int_field(meta, "offset"), _int_field(meta, "start_position"))
    except CacheHoleError as e:
        raise PromptCacheFileError(f"prompt_cache_file.{e.field}", e.message) from None
    if not return_metadata:
        return cache
    out = dict(meta)
    if "tokens" in out:
        from .artifact.untrusted import UntrustedFileError, loads

        try:  # strict and bounded: a cache file may be handed to us (issue 22)
            tokens = loads(out["tokens"], "prompt_cache_file.tokens")
        except UntrustedFileError:
            tokens = None
        if (
            not isinstance(tokens, list)
            or len(tokens) != cache.offset
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
        ):
            raise PromptCacheFileError("prompt_cache_file.tokens", f"must be a JSON list of {cache.offset} token IDs")
        out["tokens"] = tokens
    return cache, out
