"""QSA attention over the selected keys (prefill and decode), one threadgroup per (query, head).

Input is the indexer's compact selection: idx [L, W] cache indices (the chosen blocks in
chronological order, then the tail block — AFN-017) and ok [L, W] validity. NSG SIMD groups split
the W keys (lane-strided); each thread keeps an online softmax (running max, sum, D accumulators),
the SIMD group merges with simd_max / simd_sum, and the groups merge through threadgroup memory.
The ops path is `QSAAttention.sparse_attention` (gather + tiled online softmax).

Lengths (L, W) and the K/V strides are read at run time (`q_shape`, `idx_shape`, `k_strides`,
`v_strides`), not template arguments: the cache grows every decode token, and a length in the
template would compile a new Metal library each time. K/V are the cache's views over its growable
buffers, so the kernel reads them through their strides instead of MLX copying each one
row-contiguous per layer per step (`ROW_CONTIGUOUS = False`). Not verified on Metal here.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from . import make_kernel

NAME = "qsa_attention"
INPUTS = ("q", "k", "v", "idx", "ok", "scale")
OUTPUTS = ("out",)
NSG = 2  # SIMD groups per threadgroup
ROW_CONTIGUOUS = False  # k / v are read through their strides; q, idx, ok are made contiguous

SOURCE = """
    uint lane = thread_index_in_simdgroup;
    uint sg = simdgroup_index_in_threadgroup;
    uint h = threadgroup_position_in_grid.y;
    uint qi = threadgroup_position_in_grid.z;
    uint kvh = h / (HQ / HKV);
    const uint L = q_shape[1];
    const int W = idx_shape[1];
    const int64_t ks = k_strides[1], kd = k_strides[2];
    const int64_t vs = v_strides[1], vd = v_strides[2];
    const device T* qp = q + (h * L + qi) * D;
    float m = -INFINITY;
    float l = 0.0f;
    float acc[D];
    for (int d = 0; d < D; ++d) acc[d] = 0.0f;
    for (uint j = sg * 32 + lane; j < uint(W); j += 32 * NSG) {
        if (!ok[qi * W + j]) continue;
        uint t = uint(idx[qi * W + j]);
        const device T* kp = k + kvh * k_strides[0] + t * ks;
        const device T* vp = v + kvh * v_strides[0] + t * vs;
        float s = 0.0f;
        for (int d = 0; d < D; ++d) s += float(qp[d]) * float(kp[d * kd]);
        s *= scale[0];
        float nm = metal::max(m, s);
        float c = (m == -INFINITY) ? 0.0f : metal::exp(m - nm);
        float p = metal::exp(s - nm);
        l = l * c + p;
        for (int d = 0; d < D; ++d) acc[d] = acc[d] * c + p * float(vp[d * vd]);
        m = nm;
    }
    // Merge the lanes of this SIMD group.
    float gm = simd_max(m);
    float c = (m == -INFINITY) ? 0.0f : metal::exp(m - gm);
    float gl = simd_sum(l * c);
    threadgroup float tg_m[NSG];
    threadgroup float tg_l[NSG];
    threadgroup float tg_acc[NSG * D];
    for (int d = 0; d < D; ++d) {
        float a = simd_sum(acc[d] * c);
        if (lane == 0) tg_acc[sg * D + d] = a;
    }
    if (lane == 0) { tg_m[sg] = gm; tg_l[sg] = gl; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Merge the SIMD groups; each thread finishes a strided subset of the D channels.
    float M = -INFINITY;
    for (int g = 0; g < NSG; ++g) M = metal::max(M, tg_m[g]);
    float total = 0.0f;
    for (int g = 0; g < NSG; ++g) total += (tg_m[g] == -INFINITY) ? 0.0f : tg_l[g] * metal::exp(tg_m[g] - M);
    for (uint d = thread_index_in_threadgroup; d < uint(D); d += 32 * NSG) {
        float a = 0.0f;
        for (int g = 0; g < NSG; ++g)
            a += (tg_m[g] == -INFINITY) ? 0.0f : tg_acc[g * D + d] * metal::exp(tg_m[g] - M);
        out[(qi * HQ + h) * D + d] = T(a / total);
    }
"""


def launch(L: int, hq: int, hkv: int, D: int, dtype):
    """Grid, threadgroup and template of a call: the template holds only what is fixed per model
    (dtype, heads, head_dim), so every decode step reuses one compiled kernel."""
    return dict(
        grid=(32 * NSG, hq, L),
        threadgroup=(32 * NSG, 1, 1),
        template=[("T", dtype), ("HQ", hq), ("HKV", hkv), ("D", D), ("NSG", NSG)],
    )


@cache
def kernel_object():
    return make_kernel(NAME, INPUTS, OUTPUTS, SOURCE, ensure_row_contiguous=ROW_CONTIGUOUS)


def metal(queries, keys, values, idx, ok, scale: float):
    """queries [B, Hq, L, D]; keys/values [B, Hkv, S, D]; idx/ok [B, L, W] -> [B, L, Hq * D]."""
    B, hq, L, D = queries.shape
    hkv = keys.shape[1]
    p = launch(L, hq, hkv, D, queries.dtype)
    small = [mx.contiguous(queries), mx.contiguous(idx.astype(mx.int32)), mx.contiguous(ok)]
    outs = []
    for b in range(B):
        q_b, idx_b, ok_b = (a[b] for a in small)
        (o,) = kernel_object()(
            inputs=[q_b, keys[b], values[b], idx_b, ok_b, mx.array([scale], mx.float32)],
            output_shapes=[(L, hq * D)],
            output_dtypes=[queries.dtype],
            **p,
        )
        outs.append(o)
    return mx.stack(outs)
