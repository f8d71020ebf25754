"""One decode step for several sequences at once (continuous batching).

Each sequence keeps its own `SequenceCache` (its own positions, QSA keys and recurrent state).
A step joins the B sequences' next tokens into one [B, 1] input and runs the model's own block
modules over it:

- the position-independent, weight-heavy parts (embedding, hyper-connection mixes, norms, PLE
  projections, the Gated DeltaNet projections and recurrence, the MoE router, routed and shared
  experts, lm_head) once over all B rows, so every weight (and every streamed expert record) is
  read once per step for the whole batch;
- the QSA attention per row, against that row's cache at that row's position (rows differ in
  length, so their keys cannot share one buffer);
- Gated DeltaNet and PLE state (fixed-size per sequence) stacked along the batch axis for the
  step and handed back to each row's cache afterwards.

Every op is row-independent (elementwise, per-row recurrences and convolutions, gathers, and
matmuls, whose per-row results the CPU backend gives bit for bit the same at M=1 and M=B:
tests/test_batch.py), so a row's tokens and logits are its solo run's; docs/GENERATION.md says
where that is measured and where it is not (Metal).

Streamed experts: the B rows' routes of a layer go to the engine in one `resolve`, which pins
each distinct record once, so an expert two sequences route to is read and checked once.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .models.cache import LinearCache, SequenceCache

__all__ = ["batch_forward", "supports_batching", "max_batch_rows"]

_STACKED_FIELDS = ("conv_state", "recurrent_state", "ngram_context", "ple_conv_state")


def supports_batching(model) -> bool:
    """Whether `model` has the Qwen4Exp block stack this module composes (else `batch_forward`
    runs each row as its own forward: still one step for the caller, no shared reads)."""
    from .models.qwen4exp import TextModel

    inner = getattr(model, "model", None)
    return isinstance(inner, TextModel) and not getattr(model, "last_row_logits", False)


def max_batch_rows(model) -> int | None:
    """Rows one batched step may take: a streamed model pins every expert a step routes to in its
    arena at once (`Streaming.max_chunk_tokens`); None when unbounded (resident)."""
    streaming = getattr(model, "streaming", None)
    return None if streaming is None else streaming.max_chunk_tokens


class _Stacked(LinearCache):
    """The rows' fixed-size states of one layer, stacked on the batch axis for one step.

    All rows must agree on which fields are set (a sequence's first forward creates them):
    `batch_forward` groups rows so they do."""

    def __init__(self, rows: list):
        super().__init__()
        self.rows = rows
        for f in _STACKED_FIELDS:
            values = [getattr(r, f, None) for r in rows]
            if all(v is not None for v in values):
                setattr(self, f, values[0] if len(values) == 1 else mx.concatenate(values, axis=0))
            elif any(v is not None for v in values):
                raise ValueError(f"rows disagree on whether {f} is set; group them by cache state")

    def scatter(self):
        """Hand each row its slice of the updated state."""
        for f in _STACKED_FIELDS:
            value = getattr(self, f)
            if value is None:
                continue
            for b, r in enumerate(self.rows):
                setattr(r, f, value[b : b + 1])


def _attention_rows(layer, h, caches):
    """QSA attention of each row against its own cache (own length, own rope offset)."""
    outs = [layer.self_attn(h[b : b + 1], c, None, layer.layer) for b, c in enumerate(caches)]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def _layer(layer, streams, ids, caches, streaming):
    """DecoderLayer.__call__ over B rows, each with its own layer cache (see the module doc)."""
    stacked = _Stacked(caches) if (layer.is_linear or layer.has_ple) else None
    if layer.has_ple:
        streams = streams + layer.ple(streams, ids, stacked)
    if layer.is_linear:
        mixer = lambda h: layer.linear_attn(h, stacked)  # noqa: E731
    else:
        mixer = lambda h: _attention_rows(layer, h, caches)  # noqa: E731
    streams = layer.attn_hyper_connection(streams, mixer)
    if stacked is not None:
        stacked.scatter()

    def mlp(h):
        if streaming is not None:
            h = streaming.before_router(layer.layer, streams, h)
        return layer.mlp(h)

    return layer.mlp_hyper_connection(streams, mlp)


def _grouped_by_state(caches: Sequence[SequenceCache]) -> list[list[int]]:
    """Row groups whose recurrent states are all set or all unset (a fresh sequence's first
    forward creates them): each group is one batched forward."""
    fresh = [i for i, c in enumerate(caches) if c.offset == 0]
    warm = [i for i, c in enumerate(caches) if c.offset != 0]
    return [g for g in (warm, fresh) if g]


def batch_forward(model, tokens, caches: Sequence[SequenceCache]) -> mx.array:
    """Feed one token to each of B sequences: tokens [B] (ids) with caches[b] the state of row b.
    Returns logits [B, V] (lazy); each cache advances by one. Raises, before any work, when an
    append would pass the context (the row's own error)."""
    tokens = mx.array(tokens, dtype=mx.int32) if not isinstance(tokens, mx.array) else tokens.astype(mx.int32)
    if tokens.ndim != 1 or tokens.size != len(caches) or not caches:
        raise ValueError(f"tokens must be [B] for B={len(caches)} caches, got shape {tokens.shape}")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("each row needs its own cache")
    if not supports_batching(model):
        outs = [model(tokens[b : b + 1][None], cache=c)[0, -1:] for b, c in enumerate(caches)]
        return mx.concatenate(outs, axis=0)
    limit = model.args.max_position_embeddings
    for c in caches:
        c.check_append(1, limit)
    groups = _grouped_by_state(caches)
    if len(groups) == 1:
        return _forward(model, tokens, caches)
    out = [None] * len(caches)
    for g in groups:
        logits = _forward(model, tokens[mx.array(g)], [caches[i] for i in g])
        for j, i in enumerate(g):
            out[i] = logits[j : j + 1]
    return mx.concatenate(out, axis=0)


def _forward(model, tokens, caches):
    text = model.model
    streaming = text.streaming
    ids = tokens[:, None]  # [B, 1]
    h = text.embed_tokens(ids)
    streams = mx.concatenate([h] * text.args.hc_count, axis=-1)
    for i, layer in enumerate(text.layers):
        if streaming is not None:
            streams = streaming.layer_start(i, streams)
        streams = _layer(layer, streams, ids, [c[i] for c in caches], streaming)
        if streaming is None or not streaming.streams_experts:
            mx.async_eval(streams)  # as TextModel: build the next layer while this one computes
    mixed, _ = text.hyper_connection_mixer.mix(streams)
    for c in caches:
        c.advance(1)
    # The rows as one sequence axis: `head_logits` splits a multi-row input between the two CPU
    # streams (each row's product is the same matmul either way).
    return model.head_logits(mixed.reshape(1, len(caches), -1))[0]
