"""PLE n-gram hash + row gather in one pass.

For the last n_new tokens of `history` (one sequence, int64 ids incl. the carried context), every
n-gram head's row id is the XOR of (token at shift p) * multiplier[p] for p < n (n = 2 + head //
heads_per_ngram), taken modulo the head's vocabulary size (floor modulo, as mx.remainder) plus the
head's offset; a shifted token is EOS when an EOS lies between it and the current token or before the
sequence start (AFN-012 segment rule). The kernel writes the row ids and the gathered table rows.
The ops path is `NGramEmbedding.row_ids` + the embedding lookup.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from . import make_kernel

NAME = "ple_gather"
INPUTS = ("history", "multipliers", "sizes", "offsets", "table")
OUTPUTS = ("rows", "emb")

SOURCE = """
    uint col = thread_position_in_grid.x;
    uint head = thread_position_in_grid.y;
    uint j = thread_position_in_grid.z;          // j-th new token
    int t = int(CTX) + int(j);                   // its position in history
    int n = 2 + int(head) / HEADS_PER_NGRAM;     // n-gram order of this head
    ulong mixed = 0;
    bool boundary = false;                       // an EOS between the shifted token and t
    for (int p = 0; p < n; ++p) {
        long tok;
        if (p == 0) {
            tok = history[t];
        } else {
            int src = t - p;
            if (src < 0 || history[src] == long(EOS)) boundary = true;
            tok = boundary ? long(EOS) : history[src];
        }
        ulong term = ulong(tok) * ulong(multipliers[p]);   // wraps like int64 multiply
        mixed = (p == 0) ? term : (mixed ^ term);
    }
    long size = sizes[head];
    long r = long(mixed) % size;
    if (r < 0) r += size;                        // floor modulo
    long row = r + offsets[head];
    if (col == 0) rows[j * HEADS + head] = row;
    emb[(j * HEADS + head) * DIM + col] = table[row * DIM + col];
"""


def launch(n_new: int, context: int, heads: int, heads_per_ngram: int, dim: int, eos: int, dtype):
    tg = next(d for d in (32, 16, 8, 4, 2, 1) if dim % d == 0)
    return dict(
        grid=(dim, heads, n_new),
        threadgroup=(tg, 1, 1),
        template=[
            ("T", dtype),
            ("CTX", context),
            ("HEADS", heads),
            ("HEADS_PER_NGRAM", heads_per_ngram),
            ("DIM", dim),
            ("EOS", eos),
        ],
    )


def ops(embedding, history: mx.array, n_new: int):
    """(rows [B, n_new, heads], emb [B, n_new, heads * dim]) through the graph's NGramEmbedding."""
    rows = embedding.row_ids(history, n_new)
    B = history.shape[0]
    return rows, embedding.ngram_embedding(rows).reshape(B, n_new, -1)


@cache
def kernel_object():
    return make_kernel(NAME, INPUTS, OUTPUTS, SOURCE)


def _args(embedding):
    return (embedding._multipliers, embedding._head_sizes, embedding._head_offsets, embedding.ngram_embedding.weight)


def metal(embedding, history: mx.array, n_new: int):
    multipliers, sizes, offsets, table = _args(embedding)
    heads, dim = sizes.shape[0], table.shape[1]
    rows, embs = [], []
    for b in range(history.shape[0]):  # one sequence per launch: the segment rule is per row
        p = launch(n_new, history.shape[1] - n_new, heads, embedding.heads_per_ngram, dim, embedding.eos, table.dtype)
        r, e = kernel_object()(
            inputs=[history[b], multipliers, sizes, offsets, table],
            output_shapes=[(n_new, heads), (n_new, heads * dim)],
            output_dtypes=[mx.int64, table.dtype],
            **p,
        )
        rows.append(r)
        embs.append(e)
    return mx.stack(rows), mx.stack(embs)
