"""Per-sequence state for Qwen4Exp: one SequenceCache per sequence, one entry per layer.

Recurrent state (DeltaNet, PLE convolution tail, n-gram context) cannot be trimmed, so rollback is
by `snapshot()` / `restore()` of the whole sequence. MLX arrays are immutable values, so a snapshot
is a set of references plus host counters: taking one copies nothing.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import mlx.core as mx
import numpy as np

from ..errors import HebrusError

_GROW = 256  # attention buffers grow in steps of this many tokens


class ContextLengthError(HebrusError, ValueError):
    """The request would pass max_position_embeddings; raised before any allocation."""

    default_field = "context"


class CacheHoleError(HebrusError, ValueError):
    """An append does not continue the cached position run, or layers disagree (AFN-018)."""

    default_field = "position"


class LinearCache:
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


class AttentionCache:
    """QSA layer state: rotated K/V, raw index keys, and pooled block keys of complete groups."""

    def __init__(self):
        self.keys = None  # [B, Hkv, cap, D]
        self.values = None
        self.raw_keys = None  # [B, cap, Di]
        self.block_keys = None  # [B, gcap, Di]
        self.length = 0
        self.n_groups = 0
        self.start_position = 0

    @staticmethod
    def _grow(buf, needed, axis, like):
        if buf is not None and buf.shape[axis] >= needed:
            return buf
        cap = ((needed + _GROW - 1) // _GROW) * _GROW
        shape = list(like.shape)
        shape[axis] = cap
        fresh = mx.zeros(shape, dtype=like.dtype)
        if buf is None:
            return fresh
        index = [slice(None)] * len(shape)
        index[axis] = slice(0, buf.shape[axis])
        fresh[tuple(index)] = buf
        return fresh

    def append(self, keys, values, raw_keys):
        """Write new rows; returns the K/V views over the whole cached run."""
        prev, L = self.length, keys.shape[2]
        end = prev + L
        self.keys = self._grow(self.keys, end, 2, keys)
        self.values = self._grow(self.values, end, 2, values)
        self.raw_keys = self._grow(self.raw_keys, end, 1, raw_keys)
        self.keys[:, :, prev:end] = keys
        self.values[:, :, prev:end] = values
        self.raw_keys[:, prev:end] = raw_keys
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def pending_groups(self, ratio):
        """(first new group, raw keys of the newly completed groups) or None."""
        complete = self.length // ratio
        if complete <= self.n_groups:
            return None
        return self.n_groups, self.raw_keys[:, self.n_groups * ratio : complete * ratio]

    def add_block_keys(self, block_keys):
        end = self.n_groups + block_keys.shape[1]
        self.block_keys = self._grow(self.block_keys, end, 1, block_keys)
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
            n, g, self.start_position,
        )


class SequenceCache(list):
    """All layer caches of one sequence plus its logical position run."""

    def __init__(self, layers):
        super().__init__(layers)
        self.offset = 0  # tokens consumed
        self.start_position = 0  # logical position of the first cached token

    @property
    def next_position(self) -> int:
        return self.start_position + self.offset

    def check_append(self, n_tokens: int, max_positions: int, position: Optional[int] = None):
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
        return (self.offset, self.start_position,
                tuple(layer.detach() if isinstance(layer, AttentionCache) else layer.snapshot() for layer in self))

    @property
    def arrays(self):
        return [a for layer in self for a in layer.arrays]

    def digest(self) -> str:
        """SHA-256 over every live state array and the position counters (for equality tests)."""
        h = hashlib.sha256(f"{self.offset}:{self.start_position}".encode())
        arrays = self.arrays
        mx.eval(arrays)
        for a in arrays:
            h.update(str(a.shape).encode())
            h.update(np.asarray(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a).tobytes())
        return h.hexdigest()
