"""Recording routes during generation (opt-in; off by default).

`TraceRecorder` builds a `models.qwen4exp.Capture` for every model call, stacks the per-layer
top-k IDs/weights (and sampled router inputs) into a few lazy arrays that are evaluated with the
step's own outputs, and reads them back once per decode step or prefill chunk, never per layer.
Capturing only adds reads of values the graph computes anyway, so tokens and logits are
unchanged (tests: bit-identical with and without capture, resident and streamed).

An observation belongs to the token that was *fed*: prefill chunks record the prompt tokens they
consume (kind prefill); the decode loop records the last prompt token and every sampled token it
feeds back (kind decode). The final sampled token is never fed, so it has no observation.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..models.qwen4exp import Capture
from .schema import KIND_DECODE, KIND_PREFILL, Identity, TraceError, model_identity
from .shards import ShardWriter

__all__ = ["TraceRecorder", "KIND_PREFILL", "KIND_DECODE", "stack_capture"]


def stack_capture(capture: Capture, num_layers: int):
    """(ids [B, T, L, k] int32, weights [B, T, L, k] float32), lazy."""
    if len(capture.routes) != num_layers:
        raise TraceError("capture", f"routes for {len(capture.routes)} layers, expected {num_layers}")
    ids = mx.stack([capture.routes[i] for i in range(num_layers)], axis=-2).astype(mx.int32)
    w = mx.stack([capture.route_weights[i] for i in range(num_layers)], axis=-2).astype(mx.float32)
    return ids, w


@dataclass
class Staged:
    positions: np.ndarray
    kind: int
    arrays: list  # [token_ids, topk_ids, topk_weights] (+ features) lazy
    feature_positions: np.ndarray | None


class TraceRecorder:
    """One sequence's route trace, published as shards under `directory`."""

    def __init__(
        self,
        directory,
        identity: Identity,
        *,
        owner: str = "local",
        generation: int = 0,
        sequence_id: str | None = None,
        sampling: dict | None = None,
        feature_every: int = 0,
        shard_tokens: int = 4096,
    ):
        if not isinstance(feature_every, int) or feature_every < 0:
            raise TraceError("trace_features", f"must be an int >= 0 (0 = off), got {feature_every!r}")
        self.identity = identity
        self.feature_every = feature_every
        self.sequence_id = sequence_id or uuid.uuid4().hex  # opaque: carries no content
        self.writer = ShardWriter(
            directory,
            identity,
            owner=owner,
            generation=generation,
            sequence_id=self.sequence_id,
            sampling=dict(sampling or {}),
            feature_every=feature_every,
            shard_tokens=shard_tokens,
        )
        self._next = None  # position of the next staged token; set by begin()

    @classmethod
    def for_model(cls, directory, model, tokenizer, **kwargs) -> TraceRecorder:
        return cls(directory, model_identity(model, tokenizer), **kwargs)

    def begin(self, first_position: int) -> None:
        if self._next is not None:
            raise TraceError("trace", "a TraceRecorder records one sequence; make a new one per generation")
        self._next = self.writer.position = int(first_position)

    def capture(self) -> Capture:
        return Capture(hidden=False, router_inputs=self.feature_every > 0)

    def stage(self, capture: Capture, ids: mx.array, kind: int) -> Staged:
        """Lazy per-call record for the tokens `ids` [T] just fed (in feeding order)."""
        if self._next is None:
            self.begin(0)
        n = ids.shape[-1]
        positions = np.arange(self._next, self._next + n, dtype=np.int32)
        self._next += n
        topk, w = stack_capture(capture, self.identity.num_layers)
        arrays = [ids.reshape(-1).astype(mx.int32), topk[0], w[0]]
        fpos = None
        if self.feature_every:
            sel = np.flatnonzero(positions % self.feature_every == 0)
            fpos = positions[sel]
            if sel.size:
                L = self.identity.num_layers
                feats = mx.stack([capture.router_inputs[i][0] for i in range(L)], axis=1)
                arrays.append(feats[mx.array(sel)].astype(mx.float32))
        return Staged(positions, kind, arrays, fpos)

    def commit(self, staged: Staged) -> None:
        """Read the staged record back (one host transfer) and buffer it for the next shard."""
        host = [np.array(a) for a in staged.arrays]
        n = len(staged.positions)
        feats = host[3] if len(host) > 3 else None
        self.writer.add(
            staged.positions,
            host[0],
            np.full(n, staged.kind, np.uint8),
            host[1],
            host[2],
            staged.feature_positions,
            feats,
        )

    def close(self) -> list:
        """Publish the remaining observations; returns every shard path written."""
        self.writer.flush()
        return list(self.writer.published)
