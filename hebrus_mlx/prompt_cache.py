"""Prefix reuse across requests: snapshots of whole sequence state at prefix boundaries.

Hybrid state (GDN recurrent + conv tails, PLE n-gram context and conv tail, QSA K/V and block
keys) cannot be trimmed back to a shorter prefix (AFN-010), so reuse is by exact prefix only: a
snapshot taken after `key` tokens serves any later prompt that starts with `key` and is longer.
Two boundaries are kept per request: the prompt minus its last token (the next turn of a chat
re-sends it) and prompt + generated tokens (the next turn continues from the reply when the
client sends it back verbatim). Entries are evicted least recently used by bytes.

`save_prompt_cache` / `load_prompt_cache` keep one sequence's state in mlx-lm's prompt-cache file
(written by `mlx_lm.models.cache.save_prompt_cache`: every layer's protocol `state` in an mlx-lm
`ArraysCache`, so mlx-lm's own loader and saver round-trip the file), bound to the artifact it was
computed with: a file from another model, dtype or layer layout, or whose state is not exactly a
layer cache's, is refused with a typed error, never restored. The reader is ours: it maps
`ArraysCache` and hebrus's two class names (what mlx-lm's saver writes for a hebrus cache) to
hebrus's layer caches and nothing else (a file names no code to run).

mlx-lm's `LRUPromptCache` is not used: it trims entries to shorter prefixes, which recurrent state
cannot do, deep-copies whole caches, and cannot see a pipeline's remote layers (`detach` does).
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .errors import HebrusError
from .generate import (
    DEFAULT_PREFILL_STEP_SIZE,
    GenerationError,
    GenerationResponse,
    context_limit,
    prefill,
    stream_generate,
)
from .models.cache import AttentionCache, CacheHoleError, CacheStateError, LinearCache, SequenceCache


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
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    cancelled: Callable[[], bool] = lambda: False,
    usage: Usage | None = None,
    draft_model=None,
    num_draft_tokens: int | None = None,
    logits_processors: list | None = None,
    seed: int | None = None,
) -> Iterator[GenerationResponse]:
    """`stream_generate` over a prompt whose longest cached prefix is restored instead of
    prefilled. Fills `usage` as it goes. Stops early (no error) when `cancelled()` turns true.
    `draft_model` / `num_draft_tokens` decode speculatively as `stream_generate` does (the drafter
    sees the tokens from the last cached position on, so a prompt-lookup drafter finds fewer
    matches after a long cached prefix; the tokens are the same either way). `logits_processors`
    see the whole prompt then the generated tokens, as in `generate_step` over the full prompt
    (the restored and prefilled prefix is prepended to the history the decode loop keeps).
    `seed`: the request's own random key (generate_step's)."""
    ids = list(ids)
    limit = context_limit(model)
    if not ids:
        raise GenerationError("prompt is empty")
    if limit is not None and len(ids) + max_tokens > limit:
        raise GenerationError(f"max_tokens {max_tokens} + prompt {len(ids)} tokens exceeds the model context {limit}")
    tic = time.perf_counter()
    if prompt_cache is not None:
        cache, n = prompt_cache.fetch(model, ids)
    else:
        cache, n = model.make_cache(), 0
    if usage is not None:
        usage.prompt_tokens, usage.cached_tokens = len(ids), n
    # generate's prefill (chunk cap, rollback); the last token is the decode loop's first input.
    if not prefill(model, mx.array(ids[n:-1], dtype=mx.int32), cache, prefill_step_size, cancelled):
        return
    # The prompt's state is stored once its first token's logits came out finite (AFN-010).
    staged = prompt_cache is not None and len(ids) - 1 > n
    if staged and getattr(cache, "pipe", None) is not None:
        # A pipeline's other ranks take a snapshot only with the next forward and cannot be put back
        # to one they never took (pipeline/stage.py), so the restore dance below would lose their
        # state: the prompt's state is stored at once there, before its first token is checked.
        prompt_cache.insert(ids[:-1], cache)
        staged = False
    prefix = cache.snapshot() if staged else None
    extra = {} if draft_model is None else {"draft_model": draft_model, "num_draft_tokens": num_draft_tokens}
    if logits_processors:
        extra["logits_processors"] = _with_prefix(logits_processors, ids[:-1])
    steps = stream_generate(
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
CONTAINER = "ArraysCache"  # the mlx-lm class each layer's state is saved in (mlx-lm rebuilds it)
_RESERVED = ("format", "artifact_digest", "dtype", "offset", "start_position", "tokens")


class PromptCacheFileError(HebrusError, ValueError):
    """A prompt-cache file that cannot be written, read, or does not belong to this model."""

    default_field = "prompt_cache_file"


def model_artifact_digest(model) -> str:
    from .traces.schema import artifact_digest

    source = getattr(model, "source_path", None)
    if source is None:
        raise PromptCacheFileError(
            "model", "has no source_path: load it with hebrus_mlx.load so the file can name the artifact it belongs to"
        )
    return artifact_digest(source)


def runtime_dtype(model) -> str:
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
        artifact_digest=model_artifact_digest(model),
        dtype=runtime_dtype(model),
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

    from mlx_lm.models.cache import ArraysCache
    from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save  # slow import: only when saving

    mx.eval(cache.arrays)
    layers = []
    for layer in cache:  # in containers mlx-lm's load_prompt_cache rebuilds (it knows no hebrus class)
        box = ArraysCache(0)
        box.cache = list(layer.state)
        layers.append(box)
    buf = io.BytesIO()
    mlx_lm_save(buf, layers, meta)
    return buf.getvalue()


def save_prompt_cache(
    path,
    cache: SequenceCache,
    model,
    tokens: Sequence[int] | None = None,
    metadata: dict[str, str] | None = None,
    overwrite: bool = True,
    field: str = "prompt_cache_file",
) -> Path:
    """Write `cache` (one single-process sequence of `model`) to `path` in mlx-lm's layout,
    published atomically (artifact.atomic: temp + fsync + rename; a failure leaves `path` as it
    was). Never over a symlink or anything but a regular file, and over a regular file only with
    `overwrite` (UsageError naming `field`). Returns the path."""
    from .artifact.atomic import check_output_file, publish_file_by_path
    from .artifact.errors import PublishError

    payload = serialize_prompt_cache(cache, model, tokens, metadata)
    path = Path(path)
    check_output_file(path, overwrite=overwrite, field=field)

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


_MAX_KEY_PARTS = 8  # dotted metadata / array keys: our files use at most 4 parts


def _unflatten(flat: dict, field: str):
    """mlx's `tree_unflatten` for untrusted keys: bounded depth, list indices bounded by the number
    of items (a key "0.99999999999" does not allocate a list that long), a key that is both a leaf
    and a branch refused."""
    root: dict = {}
    for key, value in flat.items():
        parts = key.split(".")
        if len(parts) > _MAX_KEY_PARTS:
            raise PromptCacheFileError(field, f"key {key[:80]!r} is nested deeper than {_MAX_KEY_PARTS} parts")
        node = root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise PromptCacheFileError(field, f"key {key[:80]!r} is both a value and a container")
        if parts[-1] in node:
            raise PromptCacheFileError(field, f"key {key[:80]!r} is both a value and a container")
        node[parts[-1]] = value
    return _listify(root, len(flat), field)


def _listify(node, bound: int, field: str):
    if not isinstance(node, dict):
        return node
    if node and all(k.isascii() and k.isdigit() and (k == "0" or k[0] != "0") for k in node):
        n = max(int(k) for k in node) + 1
        if n > bound:
            raise PromptCacheFileError(field, f"list index {n - 1} past the {bound} items of the file")
        return [_listify(node[str(i)], bound, field) if str(i) in node else {} for i in range(n)]
    return {k: _listify(v, bound, field) for k, v in node.items()}


def _decode_scalars(arrays: dict, scalars) -> dict:
    """Undo mlx-lm's encoding of non-array state items (ints and None as small arrays): a layer
    state holds nothing else, so strings and floats are refused."""
    if not scalars or scalars[0] != "":
        raise PromptCacheFileError("prompt_cache_file.scalars", "not mlx-lm's scalar list")
    for entry in scalars[1:]:  # the first entry is mlx-lm's placeholder
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
            raise PromptCacheFileError("prompt_cache_file.scalars", f"unreadable entry {str(entry)[:80]}")
        key, kind = entry
        a = arrays.get(key)
        if not isinstance(a, mx.array):
            raise PromptCacheFileError("prompt_cache_file.scalars", f"{key[:80]!r} names no array of the file")
        if kind == "scalar" and a.size == 1 and mx.issubdtype(a.dtype, mx.integer):
            arrays[key] = int(a.item())
        elif kind == "none" and a.size == 0:
            arrays[key] = None
        else:
            raise PromptCacheFileError(
                f"prompt_cache_file.{key}",
                f"{kind!r} of shape {tuple(a.shape)}: a layer state holds ints and None only",
            )
    return arrays


def _read(f, name: str):
    """(metadata, classes, states) of the prompt-cache file open as `f`."""
    try:
        arrays, flat_meta = mx.load(f, format="safetensors", return_metadata=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise PromptCacheFileError(f"{name}: not a readable safetensors file ({e})") from None
    meta = _unflatten(flat_meta, "prompt_cache_file.metadata")
    if not (
        isinstance(meta, list)
        and len(meta) == 3
        and isinstance(meta[0], dict)
        and all(isinstance(v, str) for v in meta[0].values())
        and isinstance(meta[1], list)
        and all(isinstance(c, str) for c in meta[1])
        and isinstance(meta[2], list)
    ):
        raise PromptCacheFileError(f"{name}: not an mlx-lm prompt-cache file (metadata, classes, scalars)")
    user, classes, scalars = meta
    states = _unflatten(_decode_scalars(dict(arrays), scalars), "prompt_cache_file.layers") if arrays else []
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


def _layer_states(classes, states, expected) -> list:
    """Each layer's own state: the file names hebrus's classes (mlx-lm's `save_prompt_cache` on a
    hebrus cache), or holds each state in an mlx-lm `ArraysCache` (what `save_prompt_cache` here
    writes, so mlx-lm's own loader reads it)."""
    n = len(expected)
    if not isinstance(states, list) or len(states) != n or len(classes) != n:
        raise PromptCacheFileError("prompt_cache_file.layers", f"the file holds {classes}, the model has {expected}")
    if classes == expected:
        return states
    if classes != [CONTAINER] * n:
        raise PromptCacheFileError("prompt_cache_file.layers", f"the file holds {classes}, the model has {expected}")
    out = []
    for i, state in enumerate(states):
        # ArraysCache.state: (its arrays, left_padding, lengths); one unpadded sequence has neither
        if not (isinstance(state, list) and len(state) == 3 and state[1] is None and state[2] is None):
            raise PromptCacheFileError(f"prompt_cache_file.layers.{i}", f"not an unpadded {CONTAINER} state")
        out.append(state[0])
    return out


_ARRAYS = {  # field: (dims, axis counted by `length` (or `n_groups`), None: not counted)
    AttentionCache: {"keys": (4, 2), "values": (4, 2), "raw_keys": (3, 1), "block_keys": (3, 1)},
    LinearCache: {
        "conv_state": (3, None),
        "recurrent_state": (4, None),
        "ngram_context": (2, None),
        "ple_conv_state": (3, None),
    },
}


def _model_shapes(model) -> list[dict] | None:
    """Per layer, the shape of each state array this model keeps (None on the axis its counters
    count) and the indexer's group ratio, read from its modules; None for a model that does not
    expose them (then only the file's own consistency is checked)."""
    try:
        out = []
        for layer in model.layers:
            if layer.is_linear:
                g = layer.linear_attn
                d = {
                    "conv_state": (1, g.conv_kernel_size - 1, g.conv_dim),
                    "recurrent_state": (1, g.num_v_heads, g.head_v_dim, g.head_k_dim),
                }
            else:
                a, ix = layer.self_attn, layer.self_attn.indexer
                kv = (1, a.n_kv_heads, None, a.head_dim)
                d = {"keys": kv, "values": kv, "raw_keys": (1, None, ix.head_dim), "block_keys": (1, None, ix.head_dim)}
                d["ratio"] = ix.ratio
            ple = getattr(layer, "ple", None)
            if ple is not None:
                d["ngram_context"] = (1, ple.ple_embedding.ngram_size - 1)
                d["ple_conv_state"] = (1, ple.state_len, ple.hc_count * ple.hidden_size)
            out.append(d)
        return out
    except AttributeError:
        return None


def _check_layers(layers, offset: int, shapes: list[dict] | None):
    """As strictly as an artifact's tensors: every array has its layer's rank, batch 1, exactly the
    rows its counters say, the other dimensions this model's layer keeps (and every layer of its
    kind in the file has), and finite values; a layer holds each state it keeps exactly when the
    sequence is not empty. A file that passes continues generation as the run that saved it would."""
    seen: dict = {}  # (class, field) -> (shape without the counted axis, dtype, first layer)
    for i, layer in enumerate(layers):
        where = f"prompt_cache_file.layers.{i}"
        want = shapes[i] if shapes is not None else None
        if isinstance(layer, AttentionCache) and layer.ratio is not None:
            if want is not None and layer.ratio != want["ratio"]:
                raise PromptCacheFileError(f"{where}.ratio", f"{layer.ratio}, the model groups {want['ratio']} keys")
            if layer.n_groups != layer.length // layer.ratio:
                raise PromptCacheFileError(
                    where, f"n_groups {layer.n_groups} != length {layer.length} // ratio {layer.ratio}"
                )
        if isinstance(layer, LinearCache):
            kept = want if want is not None else {"conv_state": 0, "recurrent_state": 0}
            for name in LinearCache.fields:
                a = getattr(layer, name)
                if name in kept and (a is None) != (offset == 0):
                    raise PromptCacheFileError(
                        f"{where}.{name}", f"{'missing' if offset else 'present'} at offset {offset}"
                    )
                if want is not None and name not in kept and a is not None:
                    raise PromptCacheFileError(f"{where}.{name}", "this model's layer keeps no such state")
        for name, (dims, axis) in _ARRAYS[type(layer)].items():
            a = getattr(layer, name)
            if a is None:
                continue
            field = f"{where}.{name}"
            if a.ndim != dims or a.shape[0] != 1:
                raise PromptCacheFileError(field, f"shape {tuple(a.shape)}: expected {dims} dimensions, batch 1")
            if axis is not None:
                rows = layer.n_groups if name == "block_keys" else layer.length
                if a.shape[axis] != rows:
                    raise PromptCacheFileError(field, f"{a.shape[axis]} rows, its counters say {rows}")
            if want is not None and any(w is not None and w != d for w, d in zip(want[name], a.shape)):
                shown = tuple("L" if w is None else w for w in want[name])
                raise PromptCacheFileError(field, f"shape {tuple(a.shape)}, this model keeps {shown}")
            sig = (tuple(d for k, d in enumerate(a.shape) if k != axis), a.dtype)
            first = seen.setdefault((type(layer), name), (*sig, i))
            if first[:2] != sig:
                raise PromptCacheFileError(
                    field, f"shape {tuple(a.shape)} {a.dtype}, layer {first[2]} holds {first[0]} {first[1]}"
                )
            if name == "ngram_context":
                if not mx.issubdtype(a.dtype, mx.integer) or (a.size and mx.min(a).item() < 0):
                    raise PromptCacheFileError(field, "must hold token IDs >= 0")
            elif not mx.issubdtype(a.dtype, mx.floating) or not mx.all(mx.isfinite(a)).item():
                raise PromptCacheFileError(field, f"must hold finite floats ({a.dtype})")


def load_prompt_cache(path, model, return_metadata: bool = False):
    """The `SequenceCache` saved in `path`, ready to continue generation on `model`; with
    `return_metadata`, also the file's metadata (`tokens`, when recorded, decoded to a list).

    Refused with PromptCacheFileError naming the field: anything but a regular file, a file not
    bound to this artifact (`artifact_digest`), computed in another dtype (`dtype`), with another
    layer layout (`layers`), or with state that does not describe a layer cache exactly
    (`layers.I.FIELD`: rank, rows against its counters, finite values)."""
    import stat

    path = Path(path)
    try:  # O_NONBLOCK: a FIFO does not hang the open (refused next)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise PromptCacheFileError(f"{path}: no such file") from None
    except OSError as e:
        raise PromptCacheFileError(f"{path}: cannot open ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PromptCacheFileError(f"{path}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        os.set_blocking(fd, True)
        return read_prompt_cache(f, model, return_metadata, str(path))


def read_prompt_cache(f, model, return_metadata: bool = False, name: str = "prompt cache"):
    """`load_prompt_cache` of a binary file object (e.g. bytes already checked by their owner)."""
    meta, classes, states = _read(f, name)
    if meta.get("format") != FORMAT:
        raise PromptCacheFileError(
            "prompt_cache_file.format",
            f"expected {FORMAT!r}, got {meta.get('format')!r} "
            "(write it with hebrus_mlx.prompt_cache.save_prompt_cache or its metadata)",
        )
    for key, want in (("artifact_digest", model_artifact_digest(model)), ("dtype", runtime_dtype(model))):
        if meta.get(key) != want:
            raise PromptCacheFileError(
                f"prompt_cache_file.{key}", f"the file was computed with {meta.get(key)!r}, this model is {want!r}"
            )
    expected = [type(layer).__name__ for layer in model.make_cache()]
    layers = []
    for i, (name, state) in enumerate(zip(expected, _layer_states(classes, states, expected))):
        try:
            layers.append(_LAYERS[name].from_state(state))
        except CacheStateError as e:
            raise PromptCacheFileError(f"prompt_cache_file.layers.{i}", e.message) from None
    offset = _int_field(meta, "offset")
    try:
        cache = SequenceCache.from_layers(layers, offset, _int_field(meta, "start_position"))
    except CacheHoleError as e:
        raise PromptCacheFileError(f"prompt_cache_file.{e.field}", e.message) from None
    _check_layers(layers, cache.offset, _model_shapes(model))
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
