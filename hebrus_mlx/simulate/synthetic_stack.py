"""The synthetic real-geometry decode stack that `benchmarks/bench_stream.py --decode` and
`hebrus-mlx simulate --validate --stack decode` both time: records with the routed-expert geometry of
Qwen3.8-Flash-Next (gate|up|down of 2560x640, affine 4-bit, group 64, 4096-aligned) in a cold store,
and per layer a Gated DeltaNet -> router -> top-k -> resolve -> SwitchGLU + shared expert, one lazy
graph per token."""

from __future__ import annotations

import os

import numpy as np

HIDDEN, INTER, GROUP, BITS = 2560, 640, 64, 4


def record_bytes():
    # One matrix: packed weights + bf16 scales + bf16 biases, three matrices.
    weights = HIDDEN * INTER * BITS // 8
    scales = HIDDEN * INTER // GROUP * 2
    n = 3 * (weights + 2 * scales)
    return (n + 4095) // 4096 * 4096


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def part_bytes():
    w = HIDDEN * INTER * BITS // 8
    sb = HIDDEN * INTER // GROUP * 2  # bf16
    return [w, sb, sb] * 3


# The arena holds each record's bf16 scales and biases widened to fp32, as the loader's arenas do
# (StreamedExperts, dtype=float32): with bf16 ones MLX's CPU gather_qmm converts the whole arena's
# scales on every call, a cost that grows with the arena's rows (360 -> 545 -> 760 ms per token at
# 40 / 160 / 320 rows) and that the product does not pay.
EXPAND = [False, True, True] * 3


def glu_weights(parts, rows):
    """Typed views of an arena created with `part_bytes()` and `EXPAND`."""
    import mlx.core as mx

    shapes = [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    out = []
    for c, (o, i) in enumerate(shapes):
        w = parts[3 * c].view(mx.uint32).reshape(rows, o, i * BITS // 32)
        sc = parts[3 * c + 1].view(mx.float32).reshape(rows, o, i // GROUP)
        b = parts[3 * c + 2].view(mx.float32).reshape(rows, o, i // GROUP)
        out.append((w, sc, b))
    return out


def switch_glu(x, weights, rows):
    import mlx.core as mx

    def proj(k, h):
        w, sc, b = weights[k]
        return mx.gather_qmm(h, w, sc, b, rhs_indices=rows, transpose=True, group_size=GROUP, bits=BITS)

    g = proj(0, x)
    return proj(2, g * mx.sigmoid(g) * proj(1, x))


def build_decode_store(path, n_records, rec):
    """Like build_store, but scales/biases are valid bf16 (zero-mean
    dequantized weights of std ~ 1/sqrt(fan-in)), so activations stay finite
    and the routes depend on them."""
    size = n_records * rec
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    rng = np.random.default_rng(1)
    pb = part_bytes()

    def bf16(a):
        return (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()

    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for _ in range(n_records):
            out = []
            for c in range(3):
                fan_in = INTER if c == 2 else HIDDEN
                n = pb[3 * c + 1] // 2
                scale = rng.uniform(0.5, 1.5, n) * np.sqrt(12.0 / fan_in) / 16
                out += [rng.integers(0, 256, pb[3 * c], dtype=np.uint8).tobytes(), bf16(scale), bf16(-7.5 * scale)]
            body = b"".join(out)
            f.write(body + bytes(rec - len(body)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def make_mixers(layers):
    """Per layer the resident work that precedes and accompanies the routed
    experts in the real model: a Gated DeltaNet with Qwen3.8-Flash-Next's
    dimensions (hidden 2560, 16 key / 32 value heads of 128) and the shared
    expert (2560x512), both affine4-g64 as a converted artifact holds them."""
    import mlx.core as mx
    import mlx.nn as nn

    from hebrus_mlx.format.qwen4exp_config import ModelArgs
    from hebrus_mlx.models.qwen4exp import GatedDeltaNet, SharedExpert

    args = ModelArgs.from_dict(
        dict(
            model_type="qwen4_exp_text",
            hidden_size=HIDDEN,
            num_hidden_layers=1,
            vocab_size=256,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=INTER,
            shared_expert_intermediate_size=512,
            layer_types=["linear_attention"],
            ple_layer_ids=[],
        )
    )
    mx.random.seed(11)
    mixers = []
    for _ in range(layers):
        gdn, shared = GatedDeltaNet(args), SharedExpert(HIDDEN, 512)
        nn.quantize(gdn, group_size=GROUP, bits=BITS)
        nn.quantize(shared, group_size=GROUP, bits=BITS)
        mx.eval(gdn.parameters(), shared.parameters())
        mixers.append((gdn, shared))
    return mixers


def rms(x):
    import mlx.core as mx

    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class DecodeStack:
    """--layers decoder layers (issue 6 (c)): GDN mixer -> router -> top-k ->
    resolve -> SwitchGLU + shared expert, the routed experts streamed from
    one arena table. With prefetch, the previous token's top-k of layer l
    is issued as P1 when layer l starts (its input depends on the hint), as
    StreamedSwitchGLU.layer_start does in the model. With wavefront, each layer's
    routed experts are computed one by one as their records land (resolve_wave, as
    StreamedSwitchGLU does for a one-token step) instead of after all top-k."""

    def __init__(self, eng, table, weights, layers, experts, top_k, prefetch, mixers, wavefront=False):
        import mlx.core as mx

        from hebrus_mlx.models.cache import LinearCache
        from hebrus_mlx.stream.predict import parse_prefetch

        self.eng, self.table, self.weights = eng, table, weights
        self.layers, self.experts, self.top_k = layers, experts, top_k
        # True/False: the previous-token control / off (the timeline's modes); or a --prefetch
        # value (router-reuse:D as in stream.predict; hyper-reuse needs hyper-connections).
        spec = parse_prefetch({True: "previous", False: "off"}.get(prefetch, prefetch))
        if spec.kind == "hyper-reuse":
            raise SystemExit("--prefetch-modes: the synthetic stack has no hyper-connections (hyper-reuse)")
        self.spec = spec
        self.prefetch, self.mixers = spec.kind == "previous", mixers
        self.wavefront = wavefront
        self.caches = [LinearCache() for _ in range(layers)]
        key = mx.random.key(3)
        self.routers = [
            mx.random.normal((HIDDEN, experts), key=mx.random.split(key, layers)[l]) / HIDDEN**0.5
            for l in range(layers)
        ]
        mx.eval(self.routers)
        self.prev = None

    def _route(self, l, x):
        import mlx.core as mx

        gdn, _ = self.mixers[l]
        x = x + gdn(rms(x), self.caches[l])
        h = rms(x)
        logits = (h @ self.routers[l]).reshape(1, self.experts)
        idx = mx.argpartition(-logits, self.top_k - 1, axis=-1)[:, : self.top_k].astype(mx.uint32)
        return x, h, idx

    def _experts(self, l, x, h, rows, lease):
        _, shared = self.mixers[l]
        y = self.eng.release_after(switch_glu(h.reshape(1, 1, 1, HIDDEN), self.weights, rows), lease)
        return x + shared(h) + y.mean(axis=1).reshape(1, 1, HIDDEN)

    def _wave_experts(self, l, x, h, wave):
        import mlx.core as mx

        _, shared = self.mixers[l]
        after, ys, positions = wave.lease, [], []
        for _ in range(self.top_k):
            row, pos = wave.take(after)
            after = switch_glu(h.reshape(1, 1, 1, HIDDEN), self.weights, row.reshape(1, 1))
            ys.append(after)
            positions.append(pos)
        # Back in route order, so the mean sums in one order whatever the arrival order.
        y = mx.take(mx.concatenate(ys, axis=1), mx.argsort(mx.concatenate(positions)), axis=1)
        y = self.eng.release_after(y, wave.lease)
        return x + shared(h) + y.mean(axis=1).reshape(1, 1, HIDDEN)

    def layer(self, l, x):
        import mlx.core as mx

        from hebrus_mlx.stream.predict import candidates

        if self.prefetch and self.prev is not None:
            x = mx.depends(x, self.eng.prefetch(self.table, self.prev[l] + l * self.experts, priority=1, layer=l))
        x, h, idx = self._route(l, x)
        if self.wavefront:
            wave = self.eng.resolve_wave(self.table, idx + l * self.experts, layer=l, deadline_s=0.05)
            rows = lease = wave.lease  # what later ops are ordered after
        else:
            rows, lease = self.eng.resolve(self.table, idx + l * self.experts, layer=l)
        target = l + self.spec.depth
        if self.spec.kind == "router-reuse" and target < self.layers:
            # Layer l+D's router on layer l's router input, issued after l's exact reads and
            # before its expert compute (as StreamedSwitchGLU does).
            probs = mx.softmax((h @ self.routers[target]).reshape(1, self.experts), axis=-1)
            cand = mx.depends(candidates(probs, self.top_k, 0.0), rows) + target * self.experts
            h = mx.depends(h, self.eng.prefetch(self.table, cand, priority=1, layer=target))
        if self.wavefront:
            return self._wave_experts(l, x, h, wave), idx
        return self._experts(l, x, h, rows, lease), idx

    def snapshot(self):
        return [c.snapshot() for c in self.caches]

    def restore(self, snap):
        for c, s in zip(self.caches, snap):
            c.restore(s)

    def token(self, h):
        """One token's graph, evaluated once (no per-layer sync)."""
        import mlx.core as mx

        x, idxs = h, []
        for l in range(self.layers):
            x, idx = self.layer(l, x)
            idxs.append(idx)
        mx.eval(x, *idxs, *[c.arrays for c in self.caches])
        self.prev = idxs
        return [np.array(i).ravel().tolist() for i in idxs]


def token_inputs(n, rho=0.9, seed=5):
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    h = rng.standard_normal(HIDDEN)
    out = []
    for _ in range(n):
        h = rho * h + (1 - rho * rho) ** 0.5 * rng.standard_normal(HIDDEN)
        out.append(mx.array(h.astype(np.float32)).reshape(1, 1, HIDDEN))
    return out
