"""QSA decode step at long contexts (AFN-016): one indexed-attention layer, one new token, over a
cache of context - 1 tokens, at 4K / 32K / 128K / 262K.

Per context it prints: ms per decode step of the whole layer (projections, append, group scoring,
selection, gather, online softmax) and of the sparse attention alone (gather + online softmax for
the step's selection), bytes gathered per step (the K/V rows `mx.take` returns, summed by wrapping
it), bytes of pooled group keys scored (the O(context / ratio) candidate scan), the resident cache,
and the step's peak memory above what was resident before it (`mx.reset_peak_memory` /
`mx.get_peak_memory`), against the size one float32 mask row of the whole context would take.

The cache is not prefilled (a 262K prefill is far too slow on a small CPU): the layer's K, V, raw
index keys and pooled group keys are filled straight into its state with random bfloat16 values
(`AttentionCache.state`), which has the same shapes and dtypes a prefill leaves. Each timed step is
followed by `trim(1)`, so every step sees the same context; the first (untimed) step grows the
buffers to the context limit.

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
    r, hkv = args.indexer_compress_ratio, args.num_key_value_heads
    c = AttentionCache()
    c.state = [
        mx.random.normal((1, hkv, n, args.head_dim), dtype=dtype),
        mx.random.normal((1, hkv, n, args.head_dim), dtype=dtype),
        mx.random.normal((1, n, args.indexer_head_dim), dtype=dtype),
        mx.random.normal((1, n // r, args.indexer_head_dim), dtype=dtype),
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


def measure(attn, args, context, steps, dtype):
    cache = filled_cache(args, context - 1, dtype)
    x = mx.random.normal((1, 1, args.hidden_size), dtype=dtype)
    mx.eval(x)
    mx.eval(attn(x, cache), *live(cache))  # grows the buffers once
    cache.trim(1)
    layer_ms, attend_ms, gathered, peaks = [], [], [], []
    for _ in range(steps):
        mx.synchronize()
        mx.reset_peak_memory()
        resident = mx.get_active_memory()
        t0 = time.perf_counter()
        with GatherCounter() as g:
            out = attn(x, cache)
            mx.eval(out, *live(cache))
        layer_ms.append((time.perf_counter() - t0) * 1e3)
        peaks.append(mx.get_peak_memory() - resident)
        gathered.append(g.bytes)
        cache.trim(1)
    # The sparse attention alone, for one selection of this context.
    queries = mx.random.normal((1, args.num_attention_heads, 1, args.head_dim), dtype=dtype)
    index_q = mx.random.normal((1, args.indexer_n_heads, 1, args.indexer_head_dim), dtype=dtype)
    idx, ok = attn.indexer.select(index_q, cache.block_keys_view(), context - 1, context)
    mx.eval(queries, idx, ok)
    k, v = cache.keys[:, :, : context - 1], cache.values[:, :, : context - 1]
    for _ in range(steps):
        t0 = time.perf_counter()
        mx.eval(attn.attend(queries, k, v, idx, ok, context))
        attend_ms.append((time.perf_counter() - t0) * 1e3)
    resident = sum(a.nbytes for a in live(cache))
    scored = cache.n_groups * args.indexer_head_dim * mx.float32.size
    return dict(
        context=context,
        layer_ms=statistics.median(layer_ms),
        attend_ms=statistics.median(attend_ms),
        gathered=max(gathered),
        width=idx.shape[-1],
        scored=scored,
        resident=resident,
        peak=max(peaks),
        mask_row=context * 4,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,32768,131072,262144")
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    args = q.ModelArgs.from_dict(GEOMETRY)
    dtype = mx.bfloat16
    mx.random.seed(0)
    attn = q.QSAAttention(args)
    attn.update(tree_map(lambda w: (w * 0.02).astype(dtype), attn.parameters()))
    mx.eval(attn.parameters())
    rows = []
    for context in contexts:
        rows.append(measure(attn, args, context, a.steps, dtype))
        mx.clear_cache()
    base = rows[0]
    mb = 1 << 20
    print(
        "| context | layer ms/step | x first | sparse attention ms | selected keys | bytes gathered/step "
        "| group keys scored (bytes) | resident cache (MiB) | step peak above resident | f32 [1,S] mask row |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['context']:,} | {r['layer_ms']:.2f} | {r['layer_ms'] / base['layer_ms']:.2f} | "
            f"{r['attend_ms']:.2f} | {r['width']:,} | {r['gathered']:,} | {r['scored']:,} | "
            f"{r['resident'] / mb:.0f} | {r['peak']:,} | {r['mask_row']:,} |"
        )


if __name__ == "__main__":
    main()
