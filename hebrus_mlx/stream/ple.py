"""PLE n-gram rows streamed from an artifact's page stores (AFN-003).

``StreamedNGramTable`` replaces ``NGramEmbedding.ngram_embedding`` (an
``nn.Embedding`` called with row ids): each call issues the pages its row
ids name as exact P0 reads the moment the ids exist - they depend only on
token ids and the n-gram context, so the requests go out while the rest of
the token's graph is still being built (exact lookahead) - then
``gather_rows`` copies the rows out of verified single-snapshot pages.

    attach_ple(model, artifact)   # every PLE layer of the model

``load(..., ple_cache_gb=...)`` (or the automatic plan, :func:`plan_ple`,
when the tables do not fit memory) does this at load time: the page stores
are then never read into memory.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from .engine import P0, StreamEngine

GIB = 1 << 30


def plan_ple(
    table_bytes: int,
    page_bytes: int,
    num_pages: int,
    available: int,
    reserve: int,
    ple_cache_gb: Optional[float] = None,
) -> Optional[int]:
    """Resident or streamed PLE tables: None keeps them resident (their
    in-memory ``table_bytes`` fit in ``available - reserve`` and no cache
    size was forced); otherwise the slab-cache bytes to stream the pages
    through (whole pages, at most ``num_pages``). ``ple_cache_gb`` (the
    ``--ple-cache-gb`` flag) forces streaming. gather_rows works in waves, so
    one page is enough for correctness; fewer raises ValueError naming the
    field."""
    if ple_cache_gb is None:
        budget = available - reserve
        if table_bytes <= budget:
            return None
        field = "available memory"
    else:
        if not ple_cache_gb > 0:
            raise ValueError(f"ple_cache_gb: must be > 0, got {ple_cache_gb}")
        budget = int(ple_cache_gb * GIB)
        field = "ple_cache_gb"
    pages = min(budget // page_bytes, num_pages)
    if pages < 1:
        raise ValueError(
            f"{field}: {budget / GIB:.4f} GiB holds no {page_bytes}-byte PLE page"
        )
    return int(pages * page_bytes)


class StreamedNGramTable(nn.Module):
    """Args:
        engine: the StreamEngine (its slab cache holds the pages).
        reader: an open ``PleReader`` (validated header and page digests).
        dtype: rows are cast to it (like the resident loader); None keeps
            the stored dtype.
    """

    def __init__(self, engine: StreamEngine, reader, dtype=mx.float32):
        super().__init__()
        from ..artifact import constants as C

        g = reader.geometry
        self._engine = engine
        store = engine.add_store(reader.path, reader.payload_sha.hex())
        self.table = engine.register_table(
            store,
            [g.payload_offset + p * g.page_stride for p in range(g.num_pages)],
            [g.page_stride] * g.num_pages,
            [reader.digests[32 * p: 32 * p + 32] for p in range(g.num_pages)],
        )
        self.rows_per_page = g.rows_per_page
        self.row_bytes = g.row_bytes
        self.header_bytes = C.PLE_PAGE_HEADER_BYTES
        self.stored = mx.bfloat16 if g.codec.name == "bf16" else mx.float32
        self.dtype = dtype
        self.dims = g.row_bytes // (2 if g.codec.name == "bf16" else 4)

    def __call__(self, rows: mx.array) -> mx.array:
        rows = rows.astype(mx.uint32)
        pages = (rows // self.rows_per_page).reshape(-1)
        # Evaluated now, not with the layer: the pages are known exactly.
        mx.async_eval(self._engine.prefetch(self.table, pages, priority=P0, exact=True))
        out = self._engine.gather_rows(
            self.table, rows, self.rows_per_page, self.row_bytes, self.header_bytes
        )
        out = out.view(self.stored).reshape(*rows.shape, self.dims)
        return out if self.dtype is None else out.astype(self.dtype)


def attach_ple(model, artifact: str, engine: Optional[StreamEngine] = None,
               dtype=mx.float32, threads: int = 2, layers=None) -> StreamEngine:
    """Swap the resident table of every PLE layer (of ``layers``, default all)
    for a streamed one over the artifact's page stores. Returns the engine
    (counters)."""
    from ..artifact import constants as C
    from ..artifact.ple_pages import PleReader

    with open(os.path.join(artifact, C.MANIFEST_NAME), "rb") as f:
        m = json.loads(f.read())
    fam = C.family(m["family"])
    stores = [s for s in m["stores"] if s["role"] == "ple" and (layers is None or s["layer"] in layers)]
    readers = [PleReader(os.path.join(artifact, s["path"]), fam, s["codec"]) for s in stores]
    try:
        if engine is None:
            # Room for one call's distinct pages of every table at once.
            page = max(r.geometry.page_stride for r in readers)
            engine = StreamEngine(cache_bytes=256 * page, threads=threads)
        for s, r in zip(stores, readers):
            emb = model.model.layers[s["layer"]].ple.ple_embedding
            emb.ngram_embedding = StreamedNGramTable(engine, r, dtype)
    finally:
        for r in readers:
            r.close()
    return engine
