"""`Model.streaming`: the run-time face of a model whose routed experts and/or PLE pages stream
from the artifact (None when everything is resident). It implements the interface the model
declares (`models.streaming_protocol.Streaming`); the graph, generation, the server and pipeline
stages reach streaming only through it:

- the graph calls `layer_start(layer, x)` as each decoder layer starts (the previous-token P1
  hint, AFN-019) and `before_router(layer, streams, x)` at each MoE input (the cross-layer
  predictors of ``predict``);
- generation caps prefill chunks at `prefill_chunk_cap` and verify blocks by `max_chunk_tokens`,
  runs each request in a ticket scope (`request()`: retire after a rejected speculative suffix,
  cancel from any thread), `reset()`s between sequences and prints `summary()`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import mlx.core as mx

from ..errors import UsageError
from .engine import P2, StreamEngine, io_split_summary, io_summary, mirror_summary
from .experts import StreamedExperts
from .predict import Predictor, PrefetchSpec, parse_prefetch
from .sweep import CROSSOVER, PrefillSweep, SweepBudgetError, parse_mode
from .switch import StreamedSwitchGLU

# Streamed reads outside any request carry (IDLE_OWNER, 0); requests carry REQUEST_OWNER and a
# generation of their own, increasing over the Streaming's life (the engine keeps one entry).
IDLE_OWNER, REQUEST_OWNER = 0, 1


class TicketScope:
    """The expert-ticket identity of one request (AFN-019/020): every streamed read its steps issue
    carries (owner, generation). ``retire()`` (speculation, after a rejected suffix) moves the
    request to a fresh generation, so a read still in flight for the rejected tokens fails stale and
    can never be waited on by, or publish into, the new state; ``cancel()`` (from any thread: a
    client disconnect) fails every pending read of the request at once, and every later one."""

    def __init__(self, streaming: Streaming | None, owner: int, generation: int):
        self._streaming = streaming
        self.owner, self.generation = owner, generation
        self.cancelled = False

    def retire(self) -> None:
        if self._streaming is not None:
            self._streaming._retire(self)

    def cancel(self) -> None:
        if self._streaming is not None:
            self._streaming._cancel(self)


class _Request:
    """``Streaming.request()``: opens a scope, or shares the one already open (a speculative run
    inside a server request retires the request's own generations, so its cancel reaches them)."""

    def __init__(self, streaming: Streaming):
        self._streaming, self._opened = streaming, False

    def __enter__(self) -> TicketScope:
        st = self._streaming
        with st._lock:
            if st._scope is None:
                st._generation += 1
                st._scope = TicketScope(st, REQUEST_OWNER, st._generation)
                st._set_identity(st._scope)
                self._opened = True
            return st._scope

    def __exit__(self, *exc):
        st = self._streaming
        if self._opened:
            with st._lock:
                st._scope = None
                st._set_identity(None)
        return False


class Streaming:
    """``prefetch`` (a PrefetchSpec or its text) with ``layers`` (the decoder layers, whose routers
    and hyper-connections the predictors reuse); None keeps ``experts.prefetch_previous``.
    ``sweep_lifts_cap``: with a ring, prefill chunks past the arena are swept, so generation need
    not cap them (False for a pipeline stage: every rank must take rank 0's chunks, rings or not)."""

    def __init__(
        self,
        engine: StreamEngine,
        experts: StreamedExperts | None = None,
        switches: Sequence[StreamedSwitchGLU] = (),
        prefetch=None,
        layers=None,
        sweep_lifts_cap: bool = True,
    ):
        self.engine = engine
        self.experts = experts  # None when only PLE pages stream
        self.switches = list(switches)  # one per streamed layer (a pipeline stage: its own)
        self._by_layer = {s.layer: s for s in self.switches}
        self._predictor: Predictor | None = None
        self.prefetch: PrefetchSpec | None = None
        self._order = sorted(self._by_layer)  # streamed layers, in graph order
        self.sweep: PrefillSweep | None = None
        self.sweep_note: str | None = None  # why `auto` is not sweeping (the ring did not fit)
        self.crossover_source = f"built-in {CROSSOVER:.2f}"  # where auto's crossover came from (stream.crossover)
        self.sweep_lifts_cap = sweep_lifts_cap
        self._lock = threading.Lock()  # ticket identity: the worker retires, any thread cancels
        self._scope: TicketScope | None = None
        self._generation = 0
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
        for arena in e.arenas:  # a per-layer store has one arena per distinct layer codec
            self.engine.set_staging(arena, staging)
        self.prefetch = spec

    def set_prefill_sweep(
        self, mode, budget: int | None = None, crossover: float = CROSSOVER, crossover_source: str | None = None
    ) -> None:
        """``auto|on|off`` (stream.sweep). ``budget``: bytes the two-layer ring may take; a ring
        over it is refused for ``on`` (SweepBudgetError) and leaves ``auto`` off (``sweep_note``).
        ``crossover``: auto's unique-expert fraction, ``crossover_source`` where it came from (the
        sweep line prints it; stream.crossover.for_store gives both from the machine profile)."""
        mode = parse_mode(mode)
        self.crossover_source = crossover_source or (
            f"built-in {CROSSOVER:.2f}" if crossover == CROSSOVER else f"given {crossover:.2f}"
        )
        if self.experts is None:
            if mode == "on":
                raise UsageError("prefill_sweep", "only streamed routed experts are swept; experts are resident")
            return
        if getattr(self.experts, "per_layer", False):  # one record layout per layer codec: no one ring layout
            if mode == "on":
                raise UsageError("prefill_sweep", "a per-layer expert store (codec per layer) is not swept")
            self.sweep_note = None if mode == "off" else "prefill sweep off: per-layer expert codecs"
            return
        old, self.sweep, self.sweep_note = self.sweep, None, None
        for s in self.switches:
            s._sweep = None
        if old is not None:
            old.close()  # joins its reads before the ring's buffers go
        if mode == "off":
            return
        try:
            sweep = PrefillSweep(self.experts, mode, budget=budget, crossover=crossover, layers=self._order)
        except SweepBudgetError as err:
            if mode == "on":
                raise
            self.sweep_note = f"prefill sweep off: {err.message}"
            return
        self.sweep = sweep
        for s in self.switches:
            s._sweep = sweep

    def sweep_summary(self) -> str | None:
        """generate's stats line for the prefill sweep (None when it is off and nothing to say)."""
        if self.sweep is None:
            return self.sweep_note
        c = self.sweep.counters()
        how = f", crossover {self.crossover_source}" if self.sweep.mode == "auto" else ""
        return (
            f"Prefill sweep {self.sweep.mode}: {c['sweeps']} layer extents, {c['read_bytes'] / 1e9:.3f} GB read, "
            f"exposed wait {c['wait_ns'] / 1e9:.3f} s, ring {self.sweep.bytes / 1e9:.3f} GB{how}"
        )

    def summary(self) -> list[str]:
        """generate's stats lines: the prefill sweep (when there is something to say), the I/O line
        and, with a mirror, its read split."""
        lines = [] if self.sweep_summary() is None else [self.sweep_summary()]
        counters = self.engine.counters()
        split = io_split_summary(counters, self.engine.store_kinds)
        if split is not None:
            lines.append(split)
        lines.append(io_summary(counters, self.prefetch))  # last, as generate's stats always ended
        if self.experts is not None and self.experts.mirror is not None:
            lines.append(mirror_summary(self.engine.file_reads(self.experts.store)))
        return lines

    def counters(self) -> dict:
        """The engine's counters (StreamEngine.counters)."""
        return self.engine.counters()

    def memory(self) -> dict:
        """The engine's memory view (open tickets, pinned slots; StreamEngine.memory)."""
        return self.engine.memory()

    def prefetch_drafts(self) -> None:
        """Speculation is about to draft (speculative.protocol.Speculation.propose): request, in
        every streamed layer, the records the draft tokens are expected to route to, at P2. The
        prediction is the last token's routes (consecutive tokens share most of theirs; the
        control the P1 layer-start hint uses), issued before the drafter runs instead of as each
        layer of the verify forward starts. P2 is spare bandwidth only: the engine starts a P2
        read only while no P0 or P1 read is queued, and a P0 or P1 request for a record still
        queued at P2 moves that read up. Non-exact reads: a wrong guess is never pinned. Nothing
        with read-ahead off (``--prefetch off``: exact misses only)."""
        if self.prefetch is None or self.prefetch.kind == "off":
            return
        hints = [h for s in self.switches if (h := s.prefetch_previous_at(P2)) is not None]
        if hints:
            mx.async_eval(*hints)

    @property
    def streams_experts(self) -> bool:
        """Routed experts stream (else only PLE pages do)."""
        return self.experts is not None

    # -- tickets and sequences ------------------------------------------------------------------

    def request(self) -> _Request:
        """``with streaming.request() as scope:`` one request's ticket scope (TicketScope)."""
        return _Request(self)

    def _set_identity(self, scope: TicketScope | None) -> None:
        owner, generation = (IDLE_OWNER, 0) if scope is None else (scope.owner, scope.generation)
        for s in self.switches:  # read when each step's graph is built
            s.owner, s.generation = owner, generation

    def _retire(self, scope: TicketScope) -> None:
        with self._lock:
            if scope.cancelled or not self.streams_experts:
                return  # a cancelled request keeps its stale generation: its later reads fail too
            self._generation += 1
            scope.generation = self._generation
            self.engine.advance_generation(scope.owner, scope.generation)
            if scope is self._scope:
                self._set_identity(scope)

    def _cancel(self, scope: TicketScope) -> None:
        with self._lock:
            if scope.cancelled:
                return
            scope.cancelled = True
            # Later scopes start past this one's failed generation.
            self._generation = max(self._generation, scope.generation + 1)
            if self.streams_experts:
                self.engine.advance_generation(scope.owner, scope.generation + 1)

    def reset(self) -> None:
        """Forget what the last sequence left for the next one's lookahead: the P1 hint hangs on
        its last routes, which may come from a step that failed (e.g. a cancelled request's)."""
        for s in self.switches:
            s.forget_routes()

    def close(self) -> None:
        """Join the sweep's reads, then close the engine."""
        if self.sweep is not None:
            self.sweep.close()
            self.sweep = None
        self.engine.close()

    @property
    def max_chunk_tokens(self) -> int | None:
        """Tokens per forward the slot path always takes (every expert of a chunk pinned at once)."""
        return None if self.experts is None else self.experts.max_chunk_tokens

    @property
    def prefill_chunk_cap(self) -> int | None:
        """What generate caps prefill chunks at: None (no cap) with a sweep ring, which takes any
        chunk the arena cannot (PrefillSweep.active), else ``max_chunk_tokens``."""
        if self.sweep is not None and self.sweep_lifts_cap:
            return None
        return self.max_chunk_tokens

    def layer_start(self, layer: int, x: mx.array) -> mx.array:
        switch = self._by_layer.get(layer)
        if switch is None:
            return x
        if switch.sweeping(x.size // x.shape[-1]):
            # Two-layer ring: the first streamed layer issues its own extent, every layer the next
            # one's. ``x`` follows the previous layer's output, so the slot it shares with the next
            # layer (two streamed layers back) is no longer read.
            i = self._order.index(layer)
            if i == 0:
                x = self.sweep.issue(layer, x)
            if i + 1 < len(self._order):
                x = self.sweep.issue(self._order[i + 1], x)
            return x
        return switch.layer_start(x)

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
