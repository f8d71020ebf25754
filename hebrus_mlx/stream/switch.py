"""Streamed routed experts with the call shape of models/switch_layers.SwitchGLU (mlx-lm's).

``StreamedSwitchGLU(experts, layer)(x, indices)`` computes what
``SwitchGLU(x, indices)`` computes, but its expert weights are arena rows
that :meth:`StreamedExperts.resolve` streams in during graph evaluation:
the router's indices never leave the graph (no ``mx.eval``, ``.item()`` or
read-back), the op waits only for the records those indices name, and the
rows are unpinned once the layer output exists.

Wiring into a model (SparseMoE-style modules expose ``switch_mlp``)::

    experts = StreamedExperts(engine, reader, rows=...)
    attach([layer.mlp for layer in model.model.layers], experts)

With ``experts.prefetch_previous`` (default on) each layer issues the
previous token's top-k for itself as P1 when the layer starts: the model
passes each layer's input through :meth:`StreamedSwitchGLU.layer_start`
(via ``Model.streaming``, :class:`~hebrus_mlx.stream.streaming.Streaming`), which
makes the layer's first op depend on the hint, so the reads overlap the
layer's attention/GDN work that precedes the router. That is the
zero-training lookahead control (AFN-019) a real predictor has to beat.
Hints issued for every layer at token start crowd out layer 0's exact
misses; a hint hung on the previous layer's output is issued too late.

A one-token step streams as a wavefront (``experts.wavefront``, AFN-019 H4):
the op that issues the top-k reads does not wait, and each expert is
computed as soon as its record is ready, resident ones first, while the
later reads land. Each expert's output goes back to its route position
before the model's weighted sum, so that sum runs in the same order
whatever the arrival order: bitwise the resolve-all result.

Prefill chunks need ``rows >= min(num_experts, tokens * top_k)`` (every
distinct expert of the chunk is pinned at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..models.optimize import plain_block
from ..models.switch_layers import SORT_MIN_PAIRS, sort_by_expert, swiglu, unsort
from .engine import P1
from .experts import StreamedExperts


class StreamedSwitchGLU(nn.Module):
    def __init__(self, experts: StreamedExperts, layer: int):
        super().__init__()
        # A plain attribute: arena views are not this module's parameters.
        self._experts = experts
        self.layer = layer
        self.owner = 0
        self.generation = 0
        self._prev: mx.array | None = None
        self._ahead = None  # (target layer, candidates) set at this layer's router
        self._sweep = None  # a stream.sweep.PrefillSweep, set by Streaming.set_prefill_sweep

    def predict_after_resolve(self, target: int, candidates: mx.array) -> None:
        """Issue ``candidates`` (expert ids of layer ``target``, most probable first) as P1 once
        this layer's exact reads are resolved, before its expert compute (predict.Predictor)."""
        self._ahead = (target, candidates)

    def _project(self, name, x, rows, sorted_rows, weights=None):
        # This layer's arena views and this projection's own width (a per-layer store's differ).
        e = self._experts
        w = (e.layer_weights(self.layer) if weights is None else weights)[name]
        q = e.quant(self.layer, name)
        if q is not None:
            return mx.gather_qmm(
                x,
                w["weight"],
                w["scales"],
                w["biases"],
                rhs_indices=rows,
                transpose=True,
                group_size=q[1],
                bits=q[0],
                sorted_indices=sorted_rows,
            )
        return mx.gather_mm(x, w["weight"].swapaxes(-1, -2), rhs_indices=rows, sorted_indices=sorted_rows)

    def forget_routes(self):
        """Drop the previous token's routes (the P1 hint's source), e.g. after a cancelled or
        failed step whose routes must not be evaluated by the next sequence."""
        self._prev = None

    def prefetch_previous_at(self, priority: int) -> mx.array | None:
        """The previous token's routes of this layer requested at ``priority`` (a hint; None
        before this layer has routed a token)."""
        if self._prev is None:
            return None
        return self._experts.prefetch(self.layer, self._prev, priority)

    def layer_start(self, x: mx.array) -> mx.array:
        """``x`` (the layer's input), made to depend on the P1 hint."""
        if not self._experts.prefetch_previous or self._prev is None:
            return x
        return mx.depends(x, self._experts.prefetch(self.layer, self._prev, P1))

    def sweeping(self, tokens: int) -> bool:
        """Whether a forward of ``tokens`` positions runs this layer over the prefill sweep ring."""
        return self._sweep is not None and self._sweep.active(tokens)

    def _matmuls(self, x, indices, rows, weights=None):
        x = mx.expand_dims(x, (-2, -3))
        # Same data movement as SwitchGLU: many tokens are grouped by
        # expert (arena row) before the gathered matmuls.
        do_sort = indices.size >= SORT_MIN_PAIRS
        inv_order = None
        if do_sort:
            x, rows, inv_order = sort_by_expert(x, rows)
        x_up = self._project("up", x, rows, do_sort, weights)
        x_gate = self._project("gate", x, rows, do_sort, weights)
        y = self._project("down", swiglu(x_gate, x_up), rows, do_sort, weights)
        if do_sort:
            y = unsort(y, inv_order, indices.shape)
        # The last position's routes predict the next token's.
        self._prev = indices[..., -1, :] if indices.ndim > 1 else indices
        return y.squeeze(-2)

    def _issue_ahead(self, after: mx.array, x: mx.array) -> mx.array:
        """``x`` made to depend on the predicted reads (set by ``predict_after_resolve``), issued as
        P1 after ``after`` (this layer's P0 requests): they overlap the expert compute and the next
        layer's attention, never this layer's misses."""
        if self._ahead is None:
            return x
        target, cands = self._ahead
        self._ahead = None
        return mx.depends(x, self._experts.prefetch(target, mx.depends(cands, after), P1))

    def _wavefront(self, x, indices):
        # One token: take the routed records as they land, `wave_width` at a time, and compute
        # those experts (gather_qmm computes each rhs row on its own, as in the k-row call); the
        # outputs go back in route order, so the model's sum over experts ignores arrival order.
        # The P1 predictions are issued after the P0 requests, which the engine serves first.
        wave = self._experts.wave(self.layer, indices, self.owner, self.generation)
        x = mx.expand_dims(self._issue_ahead(wave.lease, x), (-2, -3))
        after, ys, positions = wave.lease, [], []
        k, width = indices.shape[-1], self._experts.wave_width
        for start in range(0, k, width):
            n = min(width, k - start)
            row, pos = wave.take(after, n)
            row = row.reshape(indices.shape[:-1] + (n,))
            up = self._project("up", x, row, False)
            after = self._project("down", swiglu(self._project("gate", x, row, False), up), row, False)
            ys.append(after)
            positions.append(pos)
        # ys in arrival order; argsort(positions)[p] is the arrival index of route position p.
        y = mx.take(mx.concatenate(ys, axis=-3), mx.argsort(mx.concatenate(positions)), axis=-3)
        self._prev = indices[..., -1, :] if indices.ndim > 1 else indices
        return self._experts.engine.release_after(y.squeeze(-2), wave.lease)

    def __call__(self, x, indices) -> mx.array:
        indices = mx.stop_gradient(indices)
        if self.sweeping(indices.size // indices.shape[-1]):
            # The whole extent is (being) read into the ring: wait for it, no slot reads.
            self._ahead = None
            sweep = self._sweep
            x = sweep.wait(self.layer, x)
            return self._matmuls(x, indices, sweep.rows(self.layer, indices), sweep.weights)
        if self._experts.wavefront and indices.size == indices.shape[-1]:
            return self._wavefront(x, indices)
        rows, lease = self._experts.resolve(self.layer, indices, self.owner, self.generation)
        # After this layer's P0 reads (rows), before its matmuls (x).
        x = self._issue_ahead(rows, x)
        return self._experts.engine.release_after(self._matmuls(x, indices, rows), lease)


def attach(
    moe_modules: Sequence[nn.Module], experts: StreamedExperts, layers: Sequence[int] | None = None
) -> list[StreamedSwitchGLU]:
    """Replace ``switch_mlp`` of each MoE module; ``layers`` names each module's layer (default:
    index = layer, every layer of the store; a pipeline stage passes only its own). Returns the
    new modules (their ``layer_start`` hooks, in layer order)."""
    layers = range(experts.num_layers) if layers is None else list(layers)
    if len(moe_modules) != len(layers) or any(not 0 <= i < experts.num_layers for i in layers):
        raise ValueError(
            f"moe_modules: {len(moe_modules)} modules for layers {list(layers)}, store has {experts.num_layers}"
        )
    switches = []
    for layer, moe in zip(layers, moe_modules):
        plain_block(moe)  # a resident-experts implementation the load-time pass may have swapped in
        moe.switch_mlp = StreamedSwitchGLU(experts, layer)
        switches.append(moe.switch_mlp)
    return switches
