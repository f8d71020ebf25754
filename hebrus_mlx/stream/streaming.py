"""`Model.streaming`: the declared run-time face of a model whose routed experts and/or PLE pages
stream from the artifact (None when everything is resident).

The graph calls `layer_start(layer, x)` as each decoder layer starts (the previous-token P1 hint,
AFN-019) and `before_router(layer, streams, x)` at each MoE input (the cross-layer predictors of
``predict``); generate reads `max_chunk_tokens` (a streamed chunk pins every expert it routes to),
`engine` and `prefetch` (the I/O line).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from ..errors import UsageError
from .engine import StreamEngine
from .experts import StreamedExperts
from .predict import PrefetchSpec, Predictor, parse_prefetch
from .switch import StreamedSwitchGLU


class Streaming:
    """``prefetch`` (a PrefetchSpec or its text) with ``layers`` (the decoder layers, whose routers
    and hyper-connections the predictors reuse); None keeps ``experts.prefetch_previous``."""

    def __init__(self, engine: StreamEngine, experts: Optional[StreamedExperts] = None,
                 switches: Sequence[StreamedSwitchGLU] = (), prefetch=None, layers=None):
        self.engine = engine
        self.experts = experts  # None when only PLE pages stream
        self.switches = list(switches)  # one per streamed layer (a pipeline stage: its own)
        self._by_layer = {s.layer: s for s in self.switches}
        self._predictor: Optional[Predictor] = None
        self.prefetch: Optional[PrefetchSpec] = None
        if experts is not None and prefetch is None:
            prefetch = "previous" if experts.prefetch_previous else "off"
        if prefetch is not None:
            self.set_prefetch(prefetch, layers)

    def set_prefetch(self, prefetch, layers=None) -> None:
        spec = parse_prefetch(prefetch)
        if self.experts is None:
            if spec.kind != "off":
                raise UsageError("prefetch", "only streamed routed experts are read ahead; experts are resident")
            return
        if spec.ahead and layers is None:
            raise UsageError("prefetch", f"{spec.name} needs the decoder layers (their routers)")
        e = self.experts
        e.prefetch_previous = spec.kind == "previous"
        self._predictor = Predictor(spec, layers, e.top_k) if spec.ahead else None
        # Rows the predictions may hold (they never displace an exact record): the read-ahead of
        # `depth` layers, at most a quarter of the arena.
        staging = 0 if spec.kind == "off" else min((spec.budget or e.top_k) * spec.depth, e.rows // 4)
        self.engine.set_staging(e.arena, staging)
        self.prefetch = spec

    @property
    def max_chunk_tokens(self) -> Optional[int]:
        return None if self.experts is None else self.experts.max_chunk_tokens

    def layer_start(self, layer: int, x: mx.array) -> mx.array:
        switch = self._by_layer.get(layer)
        return switch.layer_start(x) if switch is not None else x

    def before_router(self, layer: int, streams: mx.array, x: mx.array) -> mx.array:
        """``x`` unchanged; queues this layer's prediction for a later layer (issued by the
        layer's StreamedSwitchGLU right after its exact reads). Only within this stage's
        streamed layers (a pipeline stage does not predict for the next stage's)."""
        switch = self._by_layer.get(layer)
        if self._predictor is not None and switch is not None:
            p = self._predictor.predict(layer, streams, x)
            if p is not None and p[0] in self._by_layer:
                switch.predict_after_resolve(*p)
        return x
