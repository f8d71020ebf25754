"""Prefill sweep (issue 13): read a layer's whole expert extent when a chunk routes to most of it.

A long prefill chunk touches most of a layer's experts, and the slot path then reads every missed
record on its own, exactly when the router names it. With the sweep, the layer's extent (its
``num_experts`` consecutive records of the expert-major store) is read by a few threads with large
sequential ``preadv``'s into one slot of a two-slot ring, and layer l+1's extent is read while layer
l computes: the read for layer l+1 is issued when layer l starts (its input depends on layer l-1's
output, so the slot layer l-1 used is free), and layer l waits for its own slot only at its MoE.
The grouped matmuls (``gather_qmm``) then run over the ring rows ``slot * num_experts + expert``,
i.e. the same bytes, widened the same way, as the arena rows of the slot path: the outputs are
bit-identical (tests/test_prefill_sweep.py).

Every record is SHA-256-checked against the table digest before its slot is marked ready; a
mismatch, a short read or an I/O error fails the chunk with the engine's typed error (generate rolls
the chunk back). One-token forwards (decode) never sweep. The ring is
``2 * num_experts * record`` bytes (fp32-widened parts counted), allocated once through MLX's
allocator and accounted in :attr:`PrefillSweep.bytes`; a ring that does not fit the memory budget is
refused (``on``) or not used (``auto``).

``--prefill-sweep auto|on|off`` (default ``auto``): ``on`` sweeps every multi-token forward, ``auto``
sweeps a chunk whose expected unique-expert fraction per layer, ``1 - (1 - k/E)^T`` for ``T`` tokens
of top-``k`` routing over ``E`` experts, reaches the crossover (this machine's, measured by
``hebrus-mlx qualify`` and read from the machine profile by ``stream.crossover``; else the built-in
:data:`CROSSOVER`), and every
chunk larger than the slot arena can pin (``StreamedExperts.max_chunk_tokens``). With a ring, generate
no longer caps prefill chunks at the arena (``Streaming.prefill_chunk_cap``): a long prompt is
prefilled in ``prefill_step_size`` chunks, as the resident path does, instead of re-reading every
layer once per arena-sized chunk.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import HebrusError, UsageError
from . import engine

MODES = ("auto", "on", "off")
DEFAULT = "auto"
# Unique-expert fraction above which reading a layer's whole extent beats reading its misses one
# record at a time, for a chunk the arena could take. `python benchmarks/bench_prefill.py --crossover`
# (cold store, real 2560x640 affine4 records, 512 per layer) on the Linux VM this was built on: the
# sweep never won (slot path 0.35-0.46 GiB/s at every fraction, the sweep 0.35 GiB/s; f=1.0: sweep/slot
# 1.12; session 5 on a faster day, 1.29 vs 1.35 GiB/s, f=1.0: 1.04), so auto sweeps only the chunks
# the arena cannot take. Public Mac runs found the sequential reads much faster there (unverified
# here, AFN-013): `hebrus-mlx qualify` measures it on the target machine and the loader uses that
# value where the profile stands for the store (stream.crossover); this one is the fallback.
CROSSOVER = 1.0
_MX_DTYPES = {"uint32": mx.uint32, "uint16": mx.bfloat16, "float32": mx.float32}


class SweepBudgetError(HebrusError, MemoryError):
    """The sweep ring does not fit the memory budget."""

    default_field = "prefill_sweep"


def parse_mode(value) -> str:
    mode = DEFAULT if value is None else str(value)
    if mode not in MODES:
        raise UsageError("prefill_sweep", f"must be one of {', '.join(MODES)}, got {value!r}")
    return mode


def expected_unique_fraction(tokens: int, top_k: int, num_experts: int) -> float:
    """Expected fraction of a layer's experts ``tokens`` top-``top_k`` routes touch (uniform routes)."""
    return 1.0 - (1.0 - top_k / num_experts) ** tokens


def ring_bytes(experts, slots: int = 2) -> int:
    """Bytes of a ``slots``-layer ring for ``experts`` (a StreamedExperts), fp32-widened parts counted."""
    record = sum(2 * n if w else n for n, w in zip(experts.part_bytes, experts.expand))
    return slots * experts.num_experts * record


class PrefillSweep:
    """The ring and the per-chunk decision for one StreamedExperts.

    ``budget``: bytes the ring may take (None: no limit checked here; the loader passes what is
    left of available memory). ``crossover``: the unique-expert fraction ``auto`` switches at."""

    def __init__(
        self,
        experts,
        mode: str = DEFAULT,
        threads: int = 4,
        budget: int | None = None,
        crossover: float = CROSSOVER,
        layers=None,
    ):
        self.mode = parse_mode(mode)
        if not 0.0 <= crossover <= 1.0:
            raise UsageError("crossover", f"must be in [0, 1], got {crossover}")
        self.crossover = crossover
        self.experts = experts
        self.num_experts = experts.num_experts
        self.top_k = experts.top_k
        # Ring slot per streamed layer, alternating in layer order (a pipeline stage: its own).
        layers = range(experts.num_layers) if layers is None else sorted(layers)
        self._slots = {layer: i % 2 for i, layer in enumerate(layers)}
        self.bytes = ring_bytes(experts)
        if budget is not None and self.bytes > budget:
            raise SweepBudgetError(
                f"the two-layer ring needs {self.bytes / 2**30:.3f} GiB, "
                f"the budget leaves {max(budget, 0) / 2**30:.3f} GiB"
            )
        self._ring = engine.native().SweepRing(
            experts.engine._e,
            experts.table,
            experts.store_path,
            list(experts.part_bytes),
            [int(w) for w in experts.expand],
            experts.num_experts,
            2,
            threads,
        )
        self.weights = {}
        rows = 2 * self.num_experts
        for buf, wide, (comp, part, stored, shape) in zip(self._ring.parts(), experts.expand, experts.layout):
            view = buf.view(mx.float32 if wide else _MX_DTYPES[stored]).reshape(rows, *shape)
            self.weights.setdefault(comp, {})[part] = view

    def active(self, tokens: int) -> bool:
        """Whether a forward of ``tokens`` positions sweeps (never for one token)."""
        if tokens <= 1 or self.mode == "off":
            return False
        if self.mode == "on" or tokens > self.experts.max_chunk_tokens:
            return True  # (past the arena's chunk the slot path cannot take it whole)
        return expected_unique_fraction(tokens, self.top_k, self.num_experts) >= self.crossover

    def slot(self, layer: int) -> int:
        return self._slots[layer]

    def _first(self, layer: int) -> int:
        return layer * self.num_experts

    def issue(self, layer: int, dep: mx.array) -> mx.array:
        """``dep`` unchanged; evaluating it starts reading ``layer``'s extent (non-blocking). ``dep``
        must come after every read of the slot's previous layer (two streamed layers back)."""
        return engine.native().sweep_issue(self._ring, dep, self.slot(layer), self._first(layer))

    def wait(self, layer: int, value: mx.array) -> mx.array:
        """``value`` unchanged; evaluating it blocks until ``layer``'s extent is read and verified."""
        return engine.native().sweep_wait(self._ring, value, self.slot(layer), self._first(layer))

    def rows(self, layer: int, indices: mx.array) -> mx.array:
        """Ring rows of ``layer``'s routed expert ids."""
        return indices.astype(mx.uint32) + self.slot(layer) * self.num_experts

    def counters(self) -> dict:
        return self._ring.counters()

    def close(self) -> None:
        self._ring.close()
