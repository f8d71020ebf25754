"""Resident-graph speed: hebrus-mlx Qwen4Exp vs mlx-lm qwen3_next at matched dims, one run.

Prints decode and prefill tokens/s of both graphs on random weights of the same shape (hidden,
layers, heads, experts, top-k), their ratios, and the QSA decode-step time at a long vs a short
context (work must be bounded by the budget, not the context: AFN-016).

Targets (issue 2): decode >= 0.8x mlx-lm; QSA step at 32K <= 1.5x the step at 4K.
Run: python benchmarks/bench_graph.py [--layers 8 --hidden 512 ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hebrus_mlx.models.qwen4exp import Model, ModelArgs


def dims(a):
    return dict(
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        linear_num_key_heads=a.heads // 2,
        linear_num_value_heads=a.heads,
        linear_key_head_dim=a.head_dim,
        linear_value_head_dim=a.head_dim,
        linear_conv_kernel_dim=4,
        num_experts=a.experts,
        num_experts_per_tok=a.top_k,
        moe_intermediate_size=a.moe_inter,
        shared_expert_intermediate_size=a.moe_inter,
        vocab_size=a.vocab,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        norm_topk_prob=True,
    )


def hebrus_model(a):
    cfg = dims(a)
    cfg.update(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        hc_count=4,
        # hc_lowrank has no mlx-lm counterpart; default to the real proportion: hidden 2560 (the expert
        # geometry) over the pinned config default hc_lowrank 320.
        hc_lowrank=a.hc_lowrank or a.hidden // 8,
        ple_layer_ids=[1],
        ngram_vocab_size_base=4096,
        heads_per_ngram=4,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=a.head_dim,
        indexer_budget=a.budget,
        indexer_compress_ratio=a.ratio,
        eos_token_id=0,
    )
    return Model(ModelArgs.from_dict(cfg))


def mlx_lm_model(a):
    from mlx_lm.models import qwen3_next

    cfg = dims(a)
    cfg.update(
        model_type="qwen3_next",
        intermediate_size=a.moe_inter,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
    )
    return qwen3_next.Model(qwen3_next.ModelArgs.from_dict(cfg))


def init_weights(model, seed=0):
    """Same random distribution for both graphs so routing spreads similarly."""
    mx.random.seed(seed)
    params = nn.utils.tree_flatten(model.parameters())
    model.update(nn.utils.tree_unflatten([(k, mx.random.normal(v.shape) * 0.02) for k, v in params]))
    mx.eval(model.parameters())


def paired_decode(models, prompt, n_tokens):
    """Decode both models token-by-token in alternation, so load on this shared machine hits
    both alike; returns median tokens/s per model."""
    states = []
    for m in models:
        cache = m.make_cache()
        mx.eval(m(prompt, cache=cache))
        states.append([cache, prompt[:, -1:]])
    times = [[] for _ in models]
    for _ in range(n_tokens):
        for i, m in enumerate(models):
            cache, token = states[i]
            t0 = time.perf_counter()
            token = mx.argmax(m(token, cache=cache)[:, -1:], axis=-1).astype(mx.int32)
            mx.eval(token)
            times[i].append(time.perf_counter() - t0)
            states[i][1] = token
    return [1.0 / statistics.median(t) for t in times]


def paired_prefill(models, prompt, repeats=4):
    best = [float("inf")] * len(models)
    for _ in range(repeats):
        for i, m in enumerate(models):
            cache = m.make_cache()
            t0 = time.perf_counter()
            mx.eval(m(prompt, cache=cache))
            best[i] = min(best[i], time.perf_counter() - t0)
    return [prompt.shape[1] / b for b in best]


def qsa_layer_state(a, context):
    """One QSA layer plus `context` tokens of synthetic cached state (with spare capacity)."""
    model = hebrus_model(a)
    init_weights(model)
    layer_idx = model.args.layer_types.index("indexed_attention")
    attn = model.layers[layer_idx].self_attn
    cache = model.make_cache()[layer_idx]
    rng = np.random.default_rng(0)
    B, Hkv, D, Di = 1, a.kv_heads, a.head_dim, a.head_dim
    cap = context + 256  # spare capacity, as a cache that grew by appends has
    cache.keys = mx.array(rng.standard_normal((B, Hkv, cap, D), dtype=np.float32))
    cache.values = mx.array(rng.standard_normal((B, Hkv, cap, D), dtype=np.float32))
    cache.raw_keys = mx.array(rng.standard_normal((B, cap, Di), dtype=np.float32))
    cache.block_keys = mx.array(rng.standard_normal((B, cap // a.ratio, Di), dtype=np.float32))
    cache.length, cache.n_groups = context, context // a.ratio
    mx.eval(cache.keys, cache.values, cache.raw_keys, cache.block_keys)
    return attn, cache, cache.snapshot()


def paired_qsa_steps(a, contexts, steps=40):
    """Median decode-step time of one QSA layer at each context, steps interleaved."""
    states = [qsa_layer_state(a, c) for c in contexts]
    x = mx.array(np.random.default_rng(2).standard_normal((1, 1, a.hidden), dtype=np.float32))
    times = [[] for _ in contexts]
    for step in range(steps + 3):
        for i, (attn, cache, snap) in enumerate(states):
            cache.restore(snap)
            t0 = time.perf_counter()
            mx.eval(attn(x, cache))
            if step >= 3:
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-inter", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hc-lowrank", type=int, default=None, help="default hidden/8, the real model's proportion")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--ratio", type=int, default=4)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--short-context", type=int, default=4096)
    p.add_argument("--long-context", type=int, default=32768)
    a = p.parse_args(argv)

    prompt = mx.array(np.random.default_rng(1).integers(1, a.vocab, size=(1, a.prompt)).astype(np.int32))
    ours, theirs = hebrus_model(a), mlx_lm_model(a)
    init_weights(ours)
    init_weights(theirs)
    print(f"dims: hidden={a.hidden} layers={a.layers} heads={a.heads}/{a.kv_heads} experts={a.experts} top-k={a.top_k}")
    results = {
        "decode": paired_decode([ours, theirs], prompt, a.decode),
        "prefill": paired_prefill([ours, theirs], prompt),
    }
    for kind, (h, m) in results.items():
        print(f"{kind:8s} hebrus {h:8.1f} tok/s   mlx-lm qwen3_next {m:8.1f} tok/s   ratio {h / m:.2f}x")
    short, long = paired_qsa_steps(a, [a.short_context, a.long_context])
    print(
        f"QSA decode step: {a.short_context} ctx {short * 1e3:.2f} ms, {a.long_context} ctx {long * 1e3:.2f} ms, "
        f"ratio {long / short:.2f}x (budget {a.budget}, ratio {a.ratio})"
    )


if __name__ == "__main__":
    main()
