"""QSA decode step at long contexts (AFN-016): one indexed-attention layer, one new token, over a
cache of context - 1 tokens, at 4K / 32K / 128K / 262K.

Per context it prints: ms per decode step of the whole layer (projections, append, group scoring,
selection, gather, online softmax) and of the sparse attention alone (gather + online softmax for
the step's selection), bytes gathered per step (the K/V rows `mx.take` returns, summed by wrapping
it), bytes of pooled group keys scored (the O(context / ratio) candidate scan), the resident cache,
and the step's peak memory above what was resident before it (`mx.reset_peak_memory` /
`mx.get_peak_memory`), against the size one float32 mask row of the whole context would take.

The cache is not prefilled (a 262K prefill is far too slow on a small CPU): the layer's K, V, raw
index keys (random bfloat16) and pooled group keys (random float32) are set straight into its
state (`AttentionCache.state`), the shapes and dtypes a prefill leaves. Each timed step is followed
by `trim(1)`, so every step sees the same context; the first (untimed) step grows the buffers
(by 1.25x, capped at the 262,144 limit). All contexts are held at once and timed round-robin, so
machine noise lands on each alike; the "x first" columns are ratios to the first context.

Layer geometry: hidden 2560, 16 query heads, 2 KV heads, head_dim 256 (a quarter rotated), indexer
16 heads x 128,
budget 2048 keys (512 groups of 4, so at most 2,051 selected keys), bfloat16, random weights. The
indexer heads/width are assumed (not pinned in this repository); the rest follows the model card.

    python benchmarks/bench_long_context.py [--contexts 4096,32768,131072,262144] [--steps 10]
"""

import argparse
import statistics
import time

import mlx.core as mx
from mlx.utils import tree_map

from hebrus_mlx.models import qwen4exp as q
from hebrus_mlx.models.cache import AttentionCache
from hebrus_mlx.testing.tiny_configs import TINY_QWEN4EXP

LIMIT = 262_144

GEOMETRY = dict(
    TINY_QWEN4EXP,
    hidden_size=2560,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    indexer_n_heads=16,
    indexer_head_dim=128,
    indexer_budget=2048,
    indexer_compress_ratio=4,
    max_position_embeddings=LIMIT,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
)


class GatherCounter:
    """Sums the bytes of every array `mx.take` returns while installed (the sparse path's gathers)."""

    def __init__(self):
        self.bytes = 0
        self._take = mx.take

    def __enter__(self):
        def take(*a, **k):
            out = self._take(*a, **k)
            self.bytes += out.nbytes
            return out

        mx.take = take
        return self

    def __exit__(self, *exc):
        mx.take = self._take


def filled_cache(args, n, dtype):
    """A layer cache holding n tokens of random rows: K, V and raw index keys in `dtype`, pooled group
    keys in float32 (what a prefill leaves: they come out of the float32 rotary tables)."""
    r, hkv = args.indexer_compress_ratio, args.num_key_value_heads
    c = AttentionCache()
    c.state = [
        mx.random.normal((1, hkv, n, args.head_dim), dtype=dtype),
        mx.random.normal((1, hkv, n, args.head_dim), dtype=dtype),
        mx.random.normal((1, n, args.indexer_head_dim), dtype=dtype),
        mx.random.normal((1, n // r, args.indexer_head_dim)),
        n,
        n // r,
        0,
        r,
    ]
    c.max_length = LIMIT
    mx.eval(c.state[:4])
    return c


def live(c):
    return [c.keys, c.values, c.raw_keys, c.block_keys]


class Context:
    """One context's cache (context - 1 tokens; the step decodes the last one) and its samples."""

    def __init__(self, attn, args, context, dtype):
        self.context = context
        self.cache = filled_cache(args, context - 1, dtype)
        self.x = mx.random.normal((1, 1, args.hidden_size), dtype=dtype)
        mx.eval(self.x, attn(self.x, self.cache), *live(self.cache))  # grows the buffers once
        self.cache.trim(1)
        # One selection of this context, for timing the sparse attention alone.
        self.queries = mx.random.normal((1, args.num_attention_heads, 1, args.head_dim), dtype=dtype)
        index_q = mx.random.normal((1, args.indexer_n_heads, 1, args.indexer_head_dim), dtype=dtype)
        self.idx, self.ok = attn.indexer.select(index_q, self.cache.block_keys_view(), context - 1, context)
        mx.eval(self.queries, self.idx, self.ok)
        self.layer_ms, self.attend_ms, self.gathered, self.peaks = [], [], [], []

    def step(self, attn):
        c = self.cache
        mx.synchronize()
        mx.reset_peak_memory()
        resident = mx.get_active_memory()
        t0 = time.perf_counter()
        with GatherCounter() as g:
            mx.eval(attn(self.x, c), *live(c))
        self.layer_ms.append((time.perf_counter() - t0) * 1e3)
        self.peaks.append(mx.get_peak_memory() - resident)
        self.gathered.append(g.bytes)
        c.trim(1)
        k, v = c.keys[:, :, : self.context - 1], c.values[:, :, : self.context - 1]
        t0 = time.perf_counter()
        mx.eval(attn.attend(self.queries, k, v, self.idx, self.ok, self.context))
        self.attend_ms.append((time.perf_counter() - t0) * 1e3)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,32768,131072,262144")
    p.add_argument("--steps", type=int, default=10, help="rounds (each times every context once)")
    a = p.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    args = q.ModelArgs.from_dict(GEOMETRY)
    dtype = mx.bfloat16
    mx.random.seed(0)
    attn = q.QSAAttention(args)
    attn.update(tree_map(lambda w: (w * 0.02).astype(dtype), attn.parameters()))
    mx.eval(attn.parameters())
    ctxs = [Context(attn, args, context, dtype) for context in contexts]
    # Contexts interleaved round by round, so machine noise lands on all of them alike.
    for _ in range(a.steps):
        for c in ctxs:
            c.step(attn)
    base = statistics.median(ctxs[0].layer_ms)
    base_attend = statistics.median(ctxs[0].attend_ms)
    mb = 1 << 20
    print(
        "| context | layer ms/step (median) | x first | sparse attention ms (median) | x first | selected keys "
        "| bytes gathered/step | group keys scored (bytes) | cache buffers (MiB) | step peak above resident (bytes) "
        "| f32 [1,S] mask row (bytes) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in ctxs:
        layer, attend = statistics.median(c.layer_ms), statistics.median(c.attend_ms)
        scored = c.cache.n_groups * args.indexer_head_dim * c.cache.block_keys.dtype.size
        buffers = sum(x.nbytes for x in live(c.cache))
        print(
            f"| {c.context:,} | {layer:.1f} | {layer / base:.2f} | {attend:.1f} | {attend / base_attend:.2f} | "
            f"{c.idx.shape[-1]:,} | {max(c.gathered):,} | {scored:,} | {buffers / mb:.0f} | {max(c.peaks):,} | "
            f"{c.context * 4:,} |"
        )


if __name__ == "__main__":
    main()
