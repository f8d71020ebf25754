"""`Model.streaming`: the declared run-time face of a model whose routed experts and/or PLE pages
stream from the artifact (None when everything is resident).

The graph calls `layer_start(layer, x)` as each decoder layer starts (the previous-token P1 hint,
AFN-019); generate reads `max_chunk_tokens` (a streamed chunk pins every expert it routes to) and
`engine` (the I/O line).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from .engine import StreamEngine
from .experts import StreamedExperts
from .switch import StreamedSwitchGLU


class Streaming:
    def __init__(self, engine: StreamEngine, experts: Optional[StreamedExperts] = None,
                 switches: Sequence[StreamedSwitchGLU] = ()):
        self.engine = engine
        self.experts = experts  # None when only PLE pages stream
        self.switches = list(switches)  # one per streamed layer (a pipeline stage: its own)
        self._by_layer = {s.layer: s for s in self.switches}

    @property
    def max_chunk_tokens(self) -> Optional[int]:
        return None if self.experts is None else self.experts.max_chunk_tokens

    def layer_start(self, layer: int, x: mx.array) -> mx.array:
        switch = self._by_layer.get(layer)
        return switch.layer_start(x) if switch is not None else x
