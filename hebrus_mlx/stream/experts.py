"""Routed experts of an ExpertMajor store, streamed into a slot arena.

Glue between the artifact reader (record table: offsets, lengths, SHA-256
per record, part layout), the admitted manifest's fast digests (XXH3-128 per
record, what every read is checked against when the artifact has them) and
the engine: one arena part per record part, so
each part is a zero-copy ``[rows, *shape]`` view that ``gather_qmm`` indexes
with the slot rows ``resolve`` returns. The reader is only consulted here, at
construction; the engine itself knows nothing of the store format.

A per-layer store (routed experts with a codec per layer and projection,
artifact/expert_major.py version 3) has one record layout per distinct
(gate, up, down) codec: each gets its own arena of ``rows`` rows and its own
record table over its layers' records (an arena row holds one layout), and
``layer_weights`` / ``quant`` give each layer its arena views and each
projection its own bits and group size. Such a store is not swept
(stream.sweep lays one layout out per ring).
"""

from __future__ import annotations

import mlx.core as mx

from ..admission import admit, admit_mirror
from ..artifact import constants as C
from ..artifact.expert_major import ExpertMajorReader
from ..artifact.manifest import Manifest
from .engine import P1, StreamEngine

# A wave's exact misses are due this long after they are issued (a decode layer's budget).
WAVE_DEADLINE_S = 0.05
# Experts computed per wavefront step (AFN-019 H4: widths 1, 2, 4 ... trade op count against waits).
WAVE_WIDTH = 1

# Store dtypes -> MLX; uint16 parts are bf16 bit patterns (artifact convention).
_MX_DTYPES = {"uint32": mx.uint32, "uint16": mx.bfloat16, "float32": mx.float32}


class StreamedExperts:
    """Args:
    engine: the StreamEngine doing the reads.
    reader: an open ``ExpertMajorReader`` (validated header and table).
    rows: arena slots; must cover every record one resolve needs at once
        (tokens x top-k for one layer) plus prefetch headroom.
    prefetch_previous: StreamedSwitchGLU issues the previous token's
        top-k of each layer as P1 (off: exact misses only, the baseline
        the lookahead is measured against).
    dtype: ``mx.float32`` (default, like ``load``) holds bf16 parts
        (affine scales/biases, bf16 weights) as fp32 in the arena, so
        results equal the resident loader's; None keeps them bf16.
    mirror: the path of a byte-identical copy of the store file
        (``admission.admit_mirror``) the engine alternates reads with
        (``--expert-mirror``; not verified on two disks here).
    fast_digests: one XXH3-128 digest per record (``Manifest.fast_table``):
        every read is checked against it; None checks each read against
        the record's SHA-256 (artifacts without fast digests).
    wavefront: a one-token step computes each routed expert as its record
        lands (resident ones first) instead of waiting for all top-k
        (StreamedSwitchGLU; AFN-019 H4). None (default): on when the default
        device is the CPU (on the GPU each expert would cost a host round
        trip the GPU waits on; not measured there). False: the resolve-all
        path. It pays where an expert's compute is long against a read
        (real geometry: exposed wait x0.18-0.20); the demo's experts compute
        in microseconds and its decode is slower with it (docs/BENCHMARKS.md).
    """

    def __init__(
        self,
        engine: StreamEngine,
        reader,
        rows: int,
        prefetch_previous: bool = True,
        dtype=mx.float32,
        mirror: str | None = None,
        fast_digests: list | None = None,
        wavefront: bool | None = None,
    ):
        wide = dtype is not None
        if wide and dtype != mx.float32:
            raise ValueError(f"dtype: must be mx.float32 or None, got {dtype}")
        g = reader.geometry
        E = reader.family.num_experts
        self.engine = engine
        self.num_experts = reader.family.num_experts
        self.num_layers = reader.family.num_hidden_layers
        self.top_k = reader.family.num_experts_per_tok
        self.rows = rows
        self.prefetch_previous = prefetch_previous
        self.wavefront = mx.default_device() == mx.cpu if wavefront is None else bool(wavefront)
        # P0 deadline of a wave's exact misses (the engine counts reads published later).
        self.wave_deadline_s = WAVE_DEADLINE_S
        # Records per wavefront step: one gather_qmm call per projection for this many experts.
        self.wave_width = WAVE_WIDTH
        self.store_path = str(reader.path)
        store = engine.add_store(reader.path, reader.header["payload_sha256"].hex(), kind="experts")
        self.store = store
        self.mirror = mirror
        if mirror is not None:  # admitted by admission.admit_mirror
            engine.add_mirror(store, mirror)
        self.check = "xxh3-128" if fast_digests is not None else "sha256"
        self.per_layer = g.per_layer
        # One arena + record table per distinct layer codec (a uniform store: one for all layers).
        groups = {}
        for layer, row in enumerate(g.layer_codecs):
            groups.setdefault(row, []).append(layer)
        self._groups = []  # (table, weights, {comp: (bits, group) | None})
        self._where = [None] * self.num_layers  # layer -> (group index, local layer)
        self.arenas = []  # engine arena ids, one per group
        for row, layers in groups.items():
            layout = g.layer_layout(layers[0])
            expand = [wide and d == "uint16" for _, _, d, *_ in layout]
            arena, parts = engine.create_arena([n for *_, n in layout], rows, expand)
            ids = [layer * E + e for layer in layers for e in range(E)]
            table = engine.register_table(
                store,
                [g.record_offset(i) for i in ids],
                [g.record_size(i) for i in ids],
                None if fast_digests is not None else [reader.digests[i] for i in ids],
                arena=arena,
                fast_digests=None if fast_digests is None else [fast_digests[i] for i in ids],
            )
            # weights[component][part]: [rows, *shape] views of the arena.
            weights = {}
            for part_bytes, w, (comp, part, stored, shape, _, _) in zip(parts, expand, layout):
                view = part_bytes.view(mx.float32 if w else _MX_DTYPES[stored]).reshape(rows, *shape)
                weights.setdefault(comp, {})[part] = view
            # Affine codecs stream through gather_qmm; float codecs gather_mm.
            quant = {}
            for comp, name in zip(C.EXPERT_COMPONENTS, row):
                c = C.codec(name)
                quant[comp] = (c.bits, c.group_size) if c.affine else None
            for local, layer in enumerate(layers):
                self._where[layer] = (len(self._groups), local)
            self._groups.append((table, weights, quant))
            self.arenas.append(arena)
            if not self.per_layer:
                # What a prefill sweep ring (stream.sweep) needs to lay out the same rows.
                self.part_bytes = [n for *_, n in layout]
                self.expand = expand
                self.layout = [(comp, part, stored, tuple(shape)) for comp, part, stored, shape, *_ in layout]
                self.arena, self.table, self.weights = arena, table, weights
                self.bits, self.group_size = quant["gate"] or (None, None)
        if self.per_layer:  # no one table / layout / width: use layer_weights, quant, resolve
            self.part_bytes = self.expand = self.layout = self.arena = self.table = self.weights = None
            self.bits = self.group_size = None

    def layer_weights(self, layer: int) -> dict:
        """weights[component][part] ([rows, *shape] arena views) that ``layer``'s rows index."""
        return self._groups[self._where[layer][0]][1]

    def quant(self, layer: int, comp: str):
        """(bits, group_size) of ``layer``'s ``comp`` projection, or None for a float codec."""
        return self._groups[self._where[layer][0]][2][comp]

    @property
    def max_chunk_tokens(self) -> int:
        """Tokens per forward call that always fit: every distinct expert one
        layer routes to is pinned at once (generate caps prefill chunks)."""
        return max(1, self.rows // self.top_k)

    @classmethod
    def from_artifact(
        cls,
        artifact: str | Manifest,
        rows: int,
        threads: int = 8,
        prefetch_previous: bool = True,
        dtype=mx.float32,
        engine: StreamEngine | None = None,
        mirror: str | None = None,
        wavefront: bool | None = None,
    ) -> StreamedExperts:
        """Open an artifact's expert store (``artifact``: the admitted
        manifest, or a directory, which is admitted first) and stream it
        through a ``rows``-record arena (see ``loading.plan.plan_experts``).
        ``engine``: share one (e.g. with streamed PLE pages); by default a
        new one. ``mirror``: a directory holding a copy of the store (admitted here)."""
        m = artifact if isinstance(artifact, Manifest) else admit(artifact)  # admission: exactly one expert store
        if mirror is not None:
            mirror = admit_mirror(m, mirror)
        reader = ExpertMajorReader(m.file(m.experts), m.family, m.experts.expert_codec)
        owned = None
        try:
            # The arena is the cache; the slab budget only backs copying ops.
            if engine is None:
                engine = owned = StreamEngine(cache_bytes=reader.geometry.record_stride, threads=threads)
            return cls(engine, reader, rows, prefetch_previous, dtype, mirror, m.fast_table(m.experts), wavefront)
        except BaseException:
            if owned is not None:
                owned.close()  # joins its reader threads now, not at GC
            raise
        finally:
            reader.close()  # the engine has its own descriptors

    def _table(self, layer: int):
        """(record table of ``layer``'s arena, the layer's first record index in it)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: {layer} out of range [0, {self.num_layers})")
        group, local = self._where[layer]
        return self._groups[group][0], local * self.num_experts

    def _records(self, layer: int, indices: mx.array) -> mx.array:
        return indices.astype(mx.uint32) + self._table(layer)[1]

    def resolve(self, layer: int, indices: mx.array, owner: int = 0, generation: int = 0):
        """(rows, lease) for this layer's routed ``indices`` (P0 exact).
        Feed ``rows`` to gather_qmm as ``rhs_indices`` over ``self.layer_weights(layer)``
        and pass its output with ``lease`` to ``engine.release_after``."""
        return self.engine.resolve(self._table(layer)[0], self._records(layer, indices), owner, generation, layer)

    def wave(self, layer: int, indices: mx.array, owner: int = 0, generation: int = 0):
        """A wave over this layer's routed ``indices`` (P0 exact, with the
        ``wave_deadline_s`` deadline): ``take`` each record in arrival order
        (``StreamEngine.resolve_wave``)."""
        return self.engine.resolve_wave(
            self._table(layer)[0], self._records(layer, indices), owner, generation, layer, self.wave_deadline_s
        )

    def prefetch(self, layer: int, indices: mx.array, priority: int = P1, confidence: float = 1.0) -> mx.array:
        """Non-blocking hint, e.g. the previous token's top-k for ``layer``; ids outside
        ``[0, num_experts)`` are skipped (predict.candidates marks low-probability ones so)."""
        indices = indices.astype(mx.uint32)
        records = mx.where(indices < self.num_experts, self._records(layer, indices), mx.array(0xFFFFFFFF, mx.uint32))
        return self.engine.prefetch(
            self._table(layer)[0],
            records,
            priority,
            confidence,
            layer=layer,
        )
