"""PLE n-gram rows streamed from an artifact's page stores (AFN-003).

``StreamedNGramTable`` replaces ``NGramEmbedding.ngram_embedding`` (an
``nn.Embedding`` called with row ids): each call issues the pages its row
ids name as exact P0 reads the moment the ids exist - they depend only on
token ids and the n-gram context, so the requests go out while the rest of
the token's graph is still being built (exact lookahead) - then
``gather_rows`` copies the rows out of verified single-snapshot pages.

    attach_ple(model, artifact)   # every PLE layer of the model

``load(..., ple_cache_gb=...)`` (or the automatic plan, ``loading.plan.plan_ple``,
when the tables do not fit memory) does this at load time: the page stores
are then never read into memory.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..admission import admit
from ..artifact import constants as C
from ..artifact.manifest import Manifest
from ..artifact.ple_pages import PleReader
from ..models.optimize import plain_block
from ..models.qwen4exp import dequantize_ple_rows
from .engine import P0, StreamEngine


class StreamedNGramTable(nn.Module):
    """Args:
    engine: the StreamEngine (its slab cache holds the pages).
    reader: an open ``PleReader`` (validated header and page digests).
    dtype: rows are cast to it (like the resident loader); None keeps
        the stored dtype.
    fast_digests: one XXH3-128 digest per page (``Manifest.fast_table``),
        what each page read is checked against; None: its SHA-256.
    """

    def __init__(self, engine: StreamEngine, reader, dtype=mx.float32, fast_digests=None):
        super().__init__()
        g = reader.geometry
        self._engine = engine
        store = engine.add_store(reader.path, reader.payload_sha.hex(), kind="ple")
        self.table = engine.register_table(
            store,
            [g.payload_offset + p * g.page_stride for p in range(g.num_pages)],
            [g.page_stride] * g.num_pages,
            None if fast_digests is not None else [reader.digests[32 * p : 32 * p + 32] for p in range(g.num_pages)],
            fast_digests=fast_digests,
        )
        self.rows_per_page = g.rows_per_page
        self.row_bytes = g.row_bytes
        self.header_bytes = C.PLE_PAGE_HEADER_BYTES
        self.dtype = dtype
        # affine rows: (bits, group, width), decoded like the resident QuantizedNGramTable
        self.affine = (g.codec.bits, g.group_size, g.width) if g.codec.affine else None
        self.stored = mx.bfloat16 if g.codec.name == "bf16" else mx.float32
        self.dims = g.width

    def __call__(self, rows: mx.array) -> mx.array:
        rows = rows.astype(mx.uint32)
        pages = (rows // self.rows_per_page).reshape(-1)
        # Evaluated now, not with the layer: the pages are known exactly.
        mx.async_eval(self._engine.prefetch(self.table, pages, priority=P0, exact=True))
        out = self._engine.gather_rows(self.table, rows, self.rows_per_page, self.row_bytes, self.header_bytes)
        if self.affine is not None:
            out = dequantize_ple_rows(out.reshape(*rows.shape, self.row_bytes), *self.affine)
        else:
            out = out.view(self.stored).reshape(*rows.shape, self.dims)
        return out if self.dtype is None else out.astype(self.dtype)


def attach_ple(
    model, artifact: str | Manifest, engine: StreamEngine | None = None, dtype=mx.float32, threads: int = 2, layers=None
) -> StreamEngine:
    """Swap the resident table of every PLE layer (of ``layers``, default all)
    for a streamed one over the artifact's page stores (``artifact``: the
    admitted manifest, or a directory, which is admitted first). Returns the
    engine (counters)."""
    m = artifact if isinstance(artifact, Manifest) else admit(artifact)
    stores = [s for s in m.ple if layers is None or s.layer in layers]
    readers = []
    try:
        for s in stores:
            readers.append(PleReader(m.file(s), m.family, s.codec))
        if engine is None:
            # Room for one call's distinct pages of every table at once.
            page = max(r.geometry.page_stride for r in readers)
            engine = StreamEngine(cache_bytes=256 * page, threads=threads)
        for s, r in zip(stores, readers):
            emb = model.model.layers[s.layer].ple.ple_embedding
            plain_block(emb)  # an in-memory-table kernel the load-time pass may have swapped in
            emb.ngram_embedding = StreamedNGramTable(engine, r, dtype, m.fast_table(s))
    finally:
        for r in readers:
            r.close()
    return engine
