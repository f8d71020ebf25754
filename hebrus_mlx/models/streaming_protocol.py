"""What the model and everything that drives it may use of streamed weights: `Model.streaming`
(implemented by hebrus_mlx.stream.streaming.Streaming; None when everything is resident).

The graph, generation (plain and speculative), the prompt cache, trace replay, the server and
pipeline stages reach streaming only through these members; the engine, the streamed experts and
their switches are the implementation's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import mlx.core as mx


class TicketScope(Protocol):
    """One request's expert-ticket identity (AFN-019/020)."""

    owner: int
    generation: int
    cancelled: bool

    def retire(self) -> None:
        """Move to a fresh generation: reads still in flight for a rejected speculative suffix
        fail stale (the request's thread)."""

    def cancel(self) -> None:
        """Fail every pending and later read of the request at once (any thread)."""


class Streaming(Protocol):
    # -- the graph
    streams_experts: bool  # routed experts stream (else only PLE pages): the graph orders their reads

    def layer_start(self, layer: int, x: mx.array) -> mx.array:
        """``x`` made to depend on the lookahead reads the layer issues as it starts."""

    def before_router(self, layer: int, streams: mx.array, x: mx.array) -> mx.array:
        """``x`` unchanged; the cross-layer predictors see the MoE input and its streams."""

    # -- generation
    max_chunk_tokens: int | None  # tokens one forward may take (a chunk pins every expert it routes to)
    prefill_chunk_cap: int | None  # what prefill chunks are capped at (None with a prefill sweep ring)

    def prefetch_drafts(self) -> None:
        """Speculation is about to draft: request the records the draft tokens are expected to
        route to at P2 (spare read bandwidth only, never ahead of a P0 or P1 read)."""

    def request(self) -> AbstractContextManager[TicketScope]:
        """``with streaming.request() as scope:`` the ticket scope of one request; a request
        opened inside another shares its scope."""

    def reset(self) -> None:
        """Forget the last sequence's lookahead state before an unrelated one."""

    def counters(self) -> dict:
        """The engine's counters (exact misses, exposed wait, bytes, ...)."""

    def memory(self) -> dict:
        """Open tickets and pinned slots (the server's health endpoint)."""

    def summary(self) -> list[str]:
        """Stats lines (prefill sweep, I/O, mirror) for generate's verbose output."""

    # -- configuration (the loader, benchmarks)
    prefetch: Any  # the PrefetchSpec in use (None: experts are resident)

    def set_prefetch(self, prefetch, layers=None) -> None: ...

    def set_prefill_sweep(
        self, mode, budget: int | None = None, crossover: float = ..., crossover_source: str | None = None
    ) -> None: ...

    def close(self) -> None:
        """Join outstanding reads and close the engine."""
