"""Per-sequence state for Qwen4Exp: one SequenceCache per sequence, one entry per layer.

Recurrent state (DeltaNet, PLE convolution tail, n-gram context) cannot be trimmed, so rollback is
by `snapshot()` / `restore()` of the whole sequence. MLX arrays are immutable values, so a snapshot
is a set of references plus host counters: taking one copies nothing.

Each layer cache also speaks mlx-lm's cache protocol (`state`, `meta_state`, `from_state`,
`is_trimmable`, `trim`, `size`, `empty`, `nbytes`), so `mlx_lm.models.cache.save_prompt_cache`,
`can_trim_prompt_cache` and `trim_prompt_cache` work on a `SequenceCache` (see docs/MLX_LM.md).
mlx-lm 0.32.2 keeps a cache's scalars in `state` (it serialises ints and None itself), so `state`
carries the counters too and `meta_state` is the same counters as strings.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np

from ..errors import HebrusError

_GROW = 256  # attention buffers hold a multiple of this many tokens
# Attention buffers grow by this factor: filling n rows copies at most n / (_GROWTH - 1) rows in all
# (a fixed step copies O(n^2)), and at most a quarter of a buffer is spare.
_GROWTH = 1.25


class ContextLengthError(HebrusError, ValueError):
    """The request would pass max_position_embeddings; raised before any allocation."""

    default_field = "context"


class CacheHoleError(HebrusError, ValueError):
    """An append does not continue the cached position run, or layers disagree (AFN-018)."""

    default_field = "position"


class CacheTrimError(HebrusError, ValueError):
    """A trim the state cannot honour: Gated DeltaNet and PLE state fold every token in."""

    default_field = "trim"


class CacheStateError(HebrusError, ValueError):
    """A `state` / `meta_state` that does not describe this kind of layer cache."""

    default_field = "state"


def _counters(meta_state, n, cls):
    try:
        values = tuple(None if v in ("None", "") else int(v) for v in meta_state)
    except (TypeError, ValueError):
        values = ()
    if len(values) != n:
        raise CacheStateError(f"{cls.__name__}.meta_state must be {n} integers as strings, got {meta_state!r}")
    return values


def _check_state(state, n, cls):
    if not isinstance(state, (list, tuple)) or len(state) != n:
        raise CacheStateError(
            f"{cls.__name__}.state must be a sequence of {n} items, got {type(state).__name__}"
            f"{'' if not isinstance(state, (list, tuple)) else f' of {len(state)}'}"
        )
    for v in state:
        if v is not None and not isinstance(v, (mx.array, int)):
            raise CacheStateError(f"{cls.__name__}.state holds a {type(v).__name__}; expected arrays, ints or None")
    return list(state)


class _FromState:
    @classmethod
    def from_state(cls, state, meta_state=None):
        """mlx-lm's load_prompt_cache builds each layer's cache this way."""
        obj = cls()
        obj.state = state
        if meta_state:
            obj.meta_state = meta_state
        return obj


class LinearCache(_FromState):
    """Gated DeltaNet conv + recurrent state; for PLE layers also the n-gram context and conv tail."""

    fields = ("conv_state", "recurrent_state", "ngram_context", "ple_conv_state")

    def __init__(self):
        self.conv_state = None
        self.recurrent_state = None
        self.ngram_context = None
        self.ple_conv_state = None

    @property
    def arrays(self):
        return [getattr(self, f) for f in self.fields if getattr(self, f) is not None]

    def snapshot(self):
        return tuple(getattr(self, f) for f in self.fields)

    def restore(self, snap):
        for f, value in zip(self.fields, snap):
            setattr(self, f, value)

    # -- mlx-lm's cache protocol ---------------------------------------------------------------------
    @property
    def state(self):
        return [getattr(self, f) for f in self.fields]

    @state.setter
    def state(self, v):
        v = _check_state(v, len(self.fields), type(self))
        if any(isinstance(a, int) for a in v):
            raise CacheStateError("LinearCache.state holds arrays or None only")
        for f, value in zip(self.fields, v):
            setattr(self, f, value)

    @property
    def meta_state(self):
        return ()

    @meta_state.setter
    def meta_state(self, v):
        if v:
            raise CacheStateError(f"LinearCache has no meta_state, got {v!r}")

    def is_trimmable(self) -> bool:
        return False  # the recurrent state and conv tails fold every token in; nothing to cut off

    def trim(self, n: int) -> int:
        if n == 0:
            return 0
        raise CacheTrimError(
            "a Gated DeltaNet / PLE layer's state cannot be trimmed (it folds every token in); "
            "roll back with SequenceCache.snapshot() / restore()"
        )

    def size(self) -> int:
        return 0  # this layer does not count tokens (mlx-lm's convention); SequenceCache.offset does

    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in self.fields)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class AttentionCache(_FromState):
    """QSA layer state: rotated K/V, raw index keys, and pooled block keys of complete groups."""

    def __init__(self):
        self.keys = None  # [B, Hkv, cap, D]
        self.values = None
        self.raw_keys = None  # [B, cap, Di]
        self.block_keys = None  # [B, gcap, Di]
        self.length = 0
        self.n_groups = 0
        self.start_position = 0
        self.ratio = None  # tokens per indexer group, known once a group completes (for trim)
        self.max_length = None  # rows the context can reach (set by SequenceCache.check_append)

    @staticmethod
    def _grow(buf, needed, axis, like, limit=None):
        """`buf`, or a fresh buffer holding its live rows with room for `needed`.

        Capacity grows geometrically (`_GROWTH`, capped at `limit`: the most rows the context can
        reach), so filling n rows one token at a time reallocates O(log n) times and copies O(n)
        rows in all; a fixed step would copy O(n^2) rows on the way to a 262K context.
        """
        old = 0 if buf is None else buf.shape[axis]
        if old >= needed:
            return buf
        cap = max(needed, int(old * _GROWTH))
        cap = ((cap + _GROW - 1) // _GROW) * _GROW
        if limit is not None:
            cap = max(needed, min(cap, limit))
        shape = list(like.shape)
        shape[axis] = cap
        fresh = mx.zeros(shape, dtype=like.dtype)
        if buf is None:
            return fresh
        index = [slice(None)] * len(shape)
        index[axis] = slice(0, old)
        fresh[tuple(index)] = buf
        return fresh

    def append(self, keys, values, raw_keys):
        """Write new rows; returns the K/V views over the whole cached run."""
        prev, L = self.length, keys.shape[2]
        end = prev + L
        self.keys = self._grow(self.keys, end, 2, keys, self.max_length)
        self.values = self._grow(self.values, end, 2, values, self.max_length)
        self.raw_keys = self._grow(self.raw_keys, end, 1, raw_keys, self.max_length)
        self.keys[:, :, prev:end] = keys
        self.values[:, :, prev:end] = values
        self.raw_keys[:, prev:end] = raw_keys
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def pending_groups(self, ratio):
        """(first new group, raw keys of the newly completed groups) or None."""
        self.ratio = ratio
        complete = self.length // ratio
        if complete <= self.n_groups:
            return None
        return self.n_groups, self.raw_keys[:, self.n_groups * ratio : complete * ratio]

    def add_block_keys(self, block_keys):
        end = self.n_groups + block_keys.shape[1]
        limit = None if self.max_length is None or not self.ratio else self.max_length // self.ratio
        self.block_keys = self._grow(self.block_keys, end, 1, block_keys, limit)
        self.block_keys[:, self.n_groups : end] = block_keys
        self.n_groups = end

    def block_keys_view(self):
        if self.block_keys is None:
            return mx.zeros((self.raw_keys.shape[0], 0, self.raw_keys.shape[-1]), dtype=self.raw_keys.dtype)
        return self.block_keys[:, : self.n_groups]

    @property
    def arrays(self):
        out = []
        if self.length:
            out += [self.keys[:, :, : self.length], self.values[:, :, : self.length], self.raw_keys[:, : self.length]]
        if self.n_groups:
            out.append(self.block_keys[:, : self.n_groups])
        return out

    def snapshot(self):
        return (self.keys, self.values, self.raw_keys, self.block_keys, self.length, self.n_groups, self.start_position)

    def restore(self, snap):
        (self.keys, self.values, self.raw_keys, self.block_keys, self.length, self.n_groups, self.start_position) = snap

    def detach(self):
        """A snapshot that later appends cannot reach: buffers cut to the live rows.

        `snapshot()` shares the growable buffers, which appends write in place past `length`;
        that is fine for rolling back one sequence but not for a second sequence that continues
        from the same prefix. A restored detached snapshot has no spare capacity, so its first
        append copies into a fresh buffer.
        """
        n, g = self.length, self.n_groups
        return (
            None if not n else self.keys[:, :, :n],
            None if not n else self.values[:, :, :n],
            None if not n else self.raw_keys[:, :n],
            None if not g else self.block_keys[:, :g],
            n,
            g,
            self.start_position,
        )

    # -- mlx-lm's cache protocol ---------------------------------------------------------------------
    _STATE_ARRAYS = 4  # keys, values, raw_keys, block_keys; then length, n_groups, start_position, ratio

    @property
    def offset(self) -> int:
        return self.length

    @property
    def state(self):
        """The live rows (views, no copy) and the counters; a cache rebuilt from it has no spare
        capacity, so its first append copies and never writes into this one's buffers."""
        return [*self.detach()[:4], self.length, self.n_groups, self.start_position, self.ratio]

    @state.setter
    def state(self, v):
        v = _check_state(v, self._STATE_ARRAYS + 4, type(self))
        arrays, (length, n_groups, start, ratio) = v[:4], v[4:]
        if not all(isinstance(c, int) and c >= 0 for c in (length, n_groups, start)) or not (
            ratio is None or (isinstance(ratio, int) and ratio > 0)
        ):
            raise CacheStateError(f"AttentionCache.state counters must be ints >= 0, got {v[4:]!r}")
        if (
            (arrays[0] is None) != (length == 0)
            or (arrays[3] is None) != (n_groups == 0)
            or (n_groups and ratio is None)
        ):
            raise CacheStateError(f"AttentionCache.state: arrays do not match length={length}, n_groups={n_groups}")
        for a, axis, n in zip(arrays, (2, 2, 1, 1), (length, length, length, n_groups)):
            if a is not None and (not isinstance(a, mx.array) or a.ndim <= axis or a.shape[axis] < n):
                raise CacheStateError(f"AttentionCache.state: an array holds fewer than {n} rows")
        self.keys, self.values, self.raw_keys, self.block_keys = arrays
        self.length, self.n_groups, self.start_position, self.ratio = length, n_groups, start, ratio

    @property
    def meta_state(self):
        return tuple(str(c) for c in (self.length, self.n_groups, self.start_position, self.ratio))

    @meta_state.setter
    def meta_state(self, v):
        self.length, self.n_groups, self.start_position, self.ratio = _counters(v, 4, type(self))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens (at most all); returns how many were dropped. Rows past `length`
        are rewritten by the next append; block keys of groups no longer complete are dropped
        (each group's key depends on its own rows only)."""
        if not isinstance(n, int) or n < 0:
            raise CacheTrimError(f"must trim an int >= 0 tokens, got {n!r}")
        n = min(n, self.length)
        self.length -= n
        if self.n_groups:
            self.n_groups = min(self.n_groups, self.length // self.ratio)
        return n

    def size(self) -> int:
        return self.length

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class SequenceCache(list):
    """All layer caches of one sequence plus its logical position run."""

    def __init__(self, layers):
        super().__init__(layers)
        self.offset = 0  # tokens consumed
        self.start_position = 0  # logical position of the first cached token

    @property
    def next_position(self) -> int:
        return self.start_position + self.offset

    def check_append(self, n_tokens: int, max_positions: int, position: int | None = None):
        """Validate an append of n_tokens before any graph work (AFN-018, AFN-011).

        Everything is checked first; only an accepted append may set the run's anchor.
        """
        if n_tokens < 1:
            raise ValueError("cannot append an empty chunk")
        start = self.start_position
        if position is not None:
            if self.offset == 0:
                if position < 0:
                    raise CacheHoleError(f"position must be >= 0, got {position}")
                start = position
            elif position != self.next_position:
                raise CacheHoleError(
                    f"append at position {position} does not continue the cached run ending at "
                    f"{self.next_position - 1}: a hole or overlap inside a sequence is rejected"
                )
        for i, layer in enumerate(self):
            if isinstance(layer, AttentionCache) and layer.length != self.offset:
                raise CacheHoleError(f"layer {i} holds {layer.length} tokens but the sequence holds {self.offset}")
        if start + self.offset + n_tokens > max_positions:
            raise ContextLengthError(
                f"context of {start + self.offset + n_tokens} tokens exceeds max_position_embeddings={max_positions}"
            )
        self.start_position = start
        for layer in self:
            if isinstance(layer, AttentionCache):
                layer.start_position = start
                layer.max_length = max_positions - start

    def advance(self, n_tokens: int):
        self.offset += n_tokens

    def snapshot(self):
        return (self.offset, self.start_position, tuple(layer.snapshot() for layer in self))

    def restore(self, snap):
        self.offset, self.start_position, layers = snap
        for layer, state in zip(self, layers):
            layer.restore(state)

    def detach(self):
        """A snapshot another sequence may `restore()` and continue from (prefix reuse) without
        the two sequences writing into each other's attention buffers. Recurrent state is
        replaced, never written in place, so its references are shared as they are."""
        return (
            self.offset,
            self.start_position,
            tuple(layer.detach() if isinstance(layer, AttentionCache) else layer.snapshot() for layer in self),
        )

    @property
    def arrays(self):
        return [a for layer in self for a in layer.arrays]

    # -- mlx-lm's protocol, for the sequence as a whole ----------------------------------------------
    def is_trimmable(self) -> bool:
        return all(layer.is_trimmable() for layer in self)

    def trim(self, n: int) -> int:
        """Refused with a typed error when any layer is recurrent (Qwen4Exp's are): mlx-lm's
        `trim_prompt_cache` sees `is_trimmable()` False and leaves the cache as it is instead."""
        fixed = [i for i, layer in enumerate(self) if not layer.is_trimmable()]
        if fixed and n:
            raise CacheTrimError(
                f"layers {fixed} hold Gated DeltaNet / PLE state, which cannot be trimmed; "
                "roll back with snapshot() / restore()"
            )
        trimmed = [layer.trim(n) for layer in self]
        n = trimmed[0] if trimmed else 0
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self)

    @classmethod
    def from_layers(cls, layers, offset: int | None = None, start_position: int | None = None):
        """A sequence over `layers` (e.g. a list rebuilt by `from_state`), its position run read from
        the attention layers (as mlx-lm reads a model's offset from its KV caches); `offset` and
        `start_position`, when given, must agree with them."""
        seq = cls(layers)
        attention = [layer for layer in layers if isinstance(layer, AttentionCache)]
        runs = {(a.length, a.start_position) for a in attention}
        if len(runs) > 1:
            raise CacheHoleError(f"attention layers disagree on the cached run: {sorted(runs)}")
        if runs:
            ((length, start),) = runs
            for name, want, have in (("offset", offset, length), ("start_position", start_position, start)):
                if want is not None and want != have:
                    raise CacheHoleError(name, f"given {want}, the attention layers hold {have}")
        elif offset is None:
            raise CacheHoleError("offset", "no attention layer records the cached length; pass offset")
        else:
            length, start = offset, start_position or 0
        seq.offset, seq.start_position = length, start
        return seq

    def copy(self) -> SequenceCache:
        """An independent sequence continuing from this one's state (what `restore(detach())` into a
        fresh cache gives), built through the protocol."""
        return SequenceCache.from_layers(
            [type(layer).from_state(layer.state) for layer in self], self.offset, self.start_position
        )

    def digest(self) -> str:
        """SHA-256 over every live state array and the position counters (for equality tests)."""
        h = hashlib.sha256(f"{self.offset}:{self.start_position}".encode())
        arrays = self.arrays
        mx.eval(arrays)
        for a in arrays:
            h.update(str(a.shape).encode())
            h.update(np.asarray(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a).tobytes())
        return h.hexdigest()
