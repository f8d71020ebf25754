"""Resident-graph speed: hebrus-mlx Qwen4Exp vs mlx-vlm's qwen4_exp (same checkpoint) and vs mlx-lm
qwen3_next at matched dims, one run.

1. mlx-vlm 0.7.10 `qwen4_exp` (the public MLX implementation of this model) on the same Qwen4Exp
   checkpoint: a transformers `save_pretrained` checkpoint at the bench dims (or `--checkpoint DIR`),
   both graphs holding the same weight arrays; each one's max |logit - transformers| beside its speed.
2. mlx-lm qwen3_next on random weights of the same shape (hidden, layers, heads, experts, top-k).
3. The QSA decode-step time at a long vs a short context (work bounded by the budget: AFN-016).

Decode is paired token by token (A/B alternation), prefill takes the best of interleaved repeats.
hebrus-mlx is measured twice in the same alternation: with its second CPU stream (half of the routed
experts on another core, in prefill also projections and half of the logits; the default on a CPU
with >= 2 cores) and on one stream, as the peers run; --cpu-streams 1 measures only the latter.
Targets (issue 14): decode and prefill >= 1.0x mlx-vlm and >= 1.0x mlx-lm; QSA step at 32K <= 1.5x 4K.
Run: python benchmarks/bench_graph.py [--layers 8 --hidden 512 ...] [--checkpoint DIR] [--skip-vlm] [--split-ablation | --options-ablation]

Against an earlier tree: `--record FILE` saves this run's rows (tok/s, ms, the load average) as JSON;
`--against FILE` prints each row beside that record with the ratio now/record, and the ratio of the
two runs' hebrus/peer ratios (the peer ran in both, so that one cancels a load change between them).
Alternate the trees run by run (A, B, A, B), each with --record, to compare two commits on a shared
machine: PYTHONPATH=<other tree> runs this script against that tree's hebrus_mlx.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from hebrus_mlx.models import optimize
from hebrus_mlx.models.options import GraphOptions
from hebrus_mlx.models.qwen4exp import Model, ModelArgs

# The bench's integer flags, one row each: (default, --help text); `--kv-heads` for kv_heads.
# The model's dims (the hebrus graph's; the peers' where they have the field):
DIMS = dict(
    hidden=(512, "hidden size"),
    layers=(8, "decoder layers"),
    heads=(8, "attention heads (linear attention: as many value heads, half as many key heads)"),
    kv_heads=(2, "key/value heads of full attention"),
    head_dim=(64, "head dimension (attention, linear attention and the QSA indexer)"),
    experts=(64, "routed experts per layer"),
    top_k=(8, "experts per token"),
    moe_inter=(256, "expert (and shared expert) intermediate size"),
    vocab=(8192, "vocabulary size"),
    hc_lowrank=(None, "hyper-connection low rank; default hidden/8, the real model's proportion"),
    budget=(2048, "QSA indexer budget (indexer_budget)"),
    ratio=(4, "QSA indexer compress ratio (indexer_compress_ratio)"),
)
# The work each measurement does:
WORKLOAD = dict(
    prompt=(256, "prompt tokens"),
    decode=(32, "decoded tokens"),
    short_context=(4096, "the QSA step's short context"),
    long_context=(32768, "the QSA step's long context"),
)


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


def hebrus_model_config(a):
    cfg = dims(a)
    cfg.update(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        hc_count=4,
        # hc_lowrank has no mlx-lm counterpart; default to the real proportion: hidden 2560 (the expert
        # geometry) over the pinned config default hc_lowrank 320.
        hc_lowrank=a.hc_lowrank or a.hidden // 8,
        ple_layer_ids=[1],
        ngram_vocab_size_base=4096,
        split_ngram_parts=4,
        heads_per_ngram=4,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=a.head_dim,
        indexer_budget=a.budget,
        indexer_compress_ratio=a.ratio,
        eos_token_id=0,
    )
    return cfg


def hebrus_model(a):
    return Model(ModelArgs.from_dict(hebrus_model_config(a)))


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


class Variant:
    """`model` run with some GraphOptions changed: the options are read while each graph is built, so
    they hold for the lazy evaluation that follows, alternating models or not."""

    def __init__(self, model, **changes):
        self.model, self.changes = model, changes

    def make_cache(self):
        return self.model.make_cache()

    def __call__(self, x, cache=None):
        saved = self.model.options
        self.model.options = saved.replace(**self.changes)
        try:
            return self.model(x, cache=cache)
        finally:
            self.model.options = saved


def OnStreams(model, n: int):
    return Variant(model, cpu_streams=n)


def variants(model, streams):
    """hebrus-mlx as measured: with the second CPU stream (the default on a CPU with >= 2 cores) and
    on one stream, as the peers run."""
    return [OnStreams(model, 2), OnStreams(model, 1)] if streams == 2 else [OnStreams(model, 1)]


class Splits(Variant):
    """Two CPU streams with only some split sites (the --split-ablation rows): `proj` the prefill
    projections, `head` the logits by positions; the routed-expert halves are always on."""

    def __init__(self, model, proj: bool, head: bool):
        super().__init__(model, cpu_streams=2)
        self.proj, self.head = proj, head

    def __call__(self, x, cache=None):
        project, logits = optimize.Projector.__call__, optimize.SplitLogitsModel.head_logits
        if not self.proj:
            optimize.Projector.__call__ = _one_stream(project)
        if not self.head:
            optimize.SplitLogitsModel.head_logits = _one_stream(logits)
        try:
            return super().__call__(x, cache)
        finally:
            optimize.Projector.__call__, optimize.SplitLogitsModel.head_logits = project, logits


def _one_stream(fn):
    """`fn` building its part of the graph on one CPU stream (the stream is chosen while building)."""
    from hebrus_mlx.models import options

    def call(*args):
        with options.use(options.active().replace(cpu_streams=1)):
            return fn(*args)

    return call


def built(a, **options):
    """The bench model with random weights, through the load-time pass with `options` (the default:
    what the loaders do)."""
    model = hebrus_model(a)
    init_weights(model)
    optimize.apply(model, GraphOptions(cpu_streams=2, **options))
    return model


def split_ablation(a):
    model = built(a)
    prompt = mx.array(np.random.default_rng(1).integers(1, a.vocab, size=(1, a.prompt)).astype(np.int32))
    rows = [
        ("1 CPU stream", OnStreams(model, 1)),
        ("2: routed-expert halves", Splits(model, False, False)),
        ("2: + logits by positions", Splits(model, False, True)),
        ("2: + prefill projections", OnStreams(model, 2)),
    ]
    decode, tokens = paired_decode([m for _, m in rows], prompt, a.decode)
    prefill = paired_prefill([m for _, m in rows], prompt)
    for (name, _), d, pf in zip(rows, decode, prefill):
        print(f"{name:26s} decode {d:7.1f} tok/s {d / decode[0]:.2f}x   prefill {pf:7.1f} tok/s {pf / prefill[0]:.2f}x")
    print(f"greedy tokens: {'identical' if all(t == tokens[0] for t in tokens) else 'DIFFER'}")


def options_ablation(a):
    """Each GraphOptions alternative against the defaults with only it switched, paired in one run
    (one CPU stream throughout, so the rows measure the option, not the second core)."""
    base = built(a)
    rows = [
        ("defaults (1 CPU stream)", Variant(base, cpu_streams=1)),
        ("compile=on", Variant(base, cpu_streams=1, compile=True)),
        ("compile=off", Variant(base, cpu_streams=1, compile=False)),
        ("rope_tables=off", Variant(base, cpu_streams=1, rope_tables=False)),
        ("dense_sdpa=off", Variant(base, cpu_streams=1, dense_sdpa=False)),
        ("join_projections=off", Variant(built(a, join_projections=False), cpu_streams=1)),
        ("in_major=off", Variant(built(a, in_major=False), cpu_streams=1)),
        ("plain (every option off)", Variant(built(a, **_plain()), cpu_streams=1)),
    ]
    prompt = mx.array(np.random.default_rng(1).integers(1, a.vocab, size=(1, a.prompt)).astype(np.int32))
    decode, tokens = paired_decode([m for _, m in rows], prompt, a.decode)
    prefill = paired_prefill([m for _, m in rows], prompt)
    for (name, _), d, pf in zip(rows, decode, prefill):
        print(f"{name:26s} decode {d:7.1f} tok/s {d / decode[0]:.2f}x   prefill {pf:7.1f} tok/s {pf / prefill[0]:.2f}x")
    print(f"greedy tokens: {'identical' if all(t == tokens[0] for t in tokens) else 'DIFFER'}")


def _plain():
    plain = GraphOptions.plain()
    return {
        k: getattr(plain, k)
        for k in ("compile", "join_projections", "in_major", "rope_tables", "dense_sdpa", "metal_kernels")
    }


def ratio_line(kind, ours, peer_name, peer):
    label = ["2 CPU streams", "1 CPU stream"][-len(ours) :]
    parts = [f"hebrus ({l}) {v:7.1f} tok/s {v / peer:.2f}x" for l, v in zip(label, ours)]
    return f"{kind:8s} {peer_name} {peer:7.1f} tok/s   " + "   ".join(parts)


def _logits(m, x, cache):
    out = m(x, cache=cache)
    return getattr(out, "logits", out)  # mlx-vlm returns an output object


def paired_decode(models, prompt, n_tokens):
    """Decode the models token-by-token in alternation (A/B, then B/A on the next token), so load
    on this shared machine hits all alike; returns (median tokens/s per model, greedy tokens)."""
    states = []
    for m in models:
        cache = m.make_cache()
        mx.eval(_logits(m, prompt, cache))
        states.append([cache, prompt[:, -1:]])
    times = [[] for _ in models]
    tokens = [[] for _ in models]
    for step in range(n_tokens):
        order = range(len(models)) if step % 2 == 0 else reversed(range(len(models)))
        for i in order:
            m = models[i]
            cache, token = states[i]
            t0 = time.perf_counter()
            token = mx.argmax(_logits(m, token, cache)[:, -1:], axis=-1).astype(mx.int32)
            mx.eval(token)
            times[i].append(time.perf_counter() - t0)
            states[i][1] = token
            tokens[i].append(token.item())
    return [1.0 / statistics.median(t) for t in times], tokens


def paired_prefill(models, prompt, repeats=4):
    best = [float("inf")] * len(models)
    for r in range(repeats):
        order = range(len(models)) if r % 2 == 0 else reversed(range(len(models)))
        for i in order:
            m = models[i]
            cache = m.make_cache()
            t0 = time.perf_counter()
            mx.eval(_logits(m, prompt, cache))
            best[i] = min(best[i], time.perf_counter() - t0)
    return [prompt.shape[1] / b for b in best]


# ---- mlx-vlm qwen4_exp on the same checkpoint -------------------------------------------------------


def build_checkpoint(a, out: Path, seed: int = 0):
    """transformers Qwen4ExpForCausalLM at the bench dims, randomised away from the zero/one inits
    (as tools/capture_reference.py does), saved with save_pretrained."""
    import torch
    from transformers.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    cfg = hebrus_model_config(a)
    cfg.pop("rope_parameters")
    config = Qwen4ExpTextConfig(
        **cfg, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    )
    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(
                    torch.randn(p.shape, generator=gen) * 0.2
                    + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
                )
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.5, generator=gen))
            elif name.endswith("dt_bias") or "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif "ngram_embedding" in name or "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    return model


def reference_logits(checkpoint: Path, ids: np.ndarray, model=None):
    import torch
    from transformers.models.qwen4_exp import Qwen4ExpForCausalLM

    if model is None:
        model = Qwen4ExpForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()


def vlm_comparison(a):
    """Returns rows (kind, hebrus tok/s, mlx-vlm tok/s) and a parity line, or None without the peer."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_mlx_vlm import PeerUnavailable, from_hebrus

    from hebrus_mlx.loader import load_hf_model

    with tempfile.TemporaryDirectory(prefix="bench-graph-") as tmp:
        checkpoint = Path(a.checkpoint) if a.checkpoint else Path(tmp)
        torch_model = None if a.checkpoint else build_checkpoint(a, checkpoint)
        hf_config = json.loads((checkpoint / "config.json").read_text())
        vocab = hf_config["vocab_size"]
        n_prompt = min(a.prompt, hf_config["max_position_embeddings"] - a.decode - 1)
        ids = np.random.default_rng(1).integers(3, vocab, size=(1, n_prompt)).astype(np.int32)
        ref = reference_logits(checkpoint, ids, torch_model)
        del torch_model
        ours = load_hf_model(checkpoint)
        try:
            peer = from_hebrus(ours, hf_config)
        except PeerUnavailable as e:
            print(f"mlx-vlm: skipped ({e})")
            return None
    prompt = mx.array(ids)
    parity = []
    models = [*variants(ours, a.cpu_streams), peer]
    for m in models:
        parity.append(float(np.abs(np.array(_logits(m, prompt, m.make_cache())) - ref).max()))
    decode, tokens = paired_decode(models, prompt, a.decode)
    prefill = paired_prefill(models, prompt)
    same = "identical" if all(t == tokens[-1] for t in tokens) else "DIFFER"
    return [("decode", decode[:-1], decode[-1]), ("prefill", prefill[:-1], prefill[-1])], (
        f"parity vs transformers (max |logit diff|, {n_prompt} tokens): hebrus "
        + " / ".join(f"{d:.2e}" for d in parity[:-1])
        + f"   mlx-vlm {parity[-1]:.2e}; "
        f"greedy tokens over {a.decode} steps: {same}"
    )


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
    for title, flags in (("model dims", DIMS), ("workload", WORKLOAD)):
        group = p.add_argument_group(title)
        for name, (default, text) in flags.items():
            shown = "" if default is None else f" (default {default})"
            group.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=text + shown)
    p.add_argument(
        "--checkpoint",
        default=None,
        help="HF Qwen4Exp checkpoint dir for the mlx-vlm comparison (default: one built at the bench dims)",
    )
    p.add_argument(
        "--cpu-streams",
        type=int,
        choices=(1, 2),
        default=2,
        help="2: measure hebrus-mlx with its second CPU stream and without; 1: without only",
    )
    p.add_argument(
        "--split-ablation",
        action="store_true",
        help="only: hebrus on 1 vs 2 CPU streams with the split sites switched on one by one",
    )
    p.add_argument(
        "--options-ablation",
        action="store_true",
        help="only: hebrus with each GraphOptions alternative switched against the defaults",
    )
    p.add_argument("--skip-vlm", action="store_true")
    p.add_argument("--skip-mlx-lm", action="store_true")
    p.add_argument("--skip-qsa", action="store_true")
    p.add_argument("--record", metavar="FILE", help="save this run's rows as JSON (for a later --against)")
    p.add_argument("--against", metavar="FILE", help="print each row beside a --record of an earlier run")
    a = p.parse_args(argv)
    if a.split_ablation:
        return split_ablation(a)
    if a.options_ablation:
        return options_ablation(a)
    against = None if a.against is None else json.loads(Path(a.against).read_text())
    rows: dict[str, float] = {}  # "kind: name" -> tok/s (or ms for the QSA step)

    if not a.skip_vlm:
        out = vlm_comparison(a)
        if out is not None:
            vlm_rows, parity = out
            for kind, h, v in vlm_rows:
                print(ratio_line(kind, h, "mlx-vlm qwen4_exp", v))
                rows.update(_named(kind, h, "mlx-vlm qwen4_exp", v, "vs mlx-vlm"))
            print(parity)
    if not a.skip_mlx_lm:
        prompt = mx.array(np.random.default_rng(1).integers(1, a.vocab, size=(1, a.prompt)).astype(np.int32))
        ours, theirs = built(a), mlx_lm_model(a)
        init_weights(theirs)
        print(
            f"dims: hidden={a.hidden} layers={a.layers} heads={a.heads}/{a.kv_heads} experts={a.experts} top-k={a.top_k}"
        )
        models = [*variants(ours, a.cpu_streams), theirs]
        decode, tokens = paired_decode(models, prompt, a.decode)
        results = {"decode": decode, "prefill": paired_prefill(models, prompt)}
        for kind, v in results.items():
            print(ratio_line(kind, v[:-1], "mlx-lm qwen3_next", v[-1]))
            rows.update(_named(kind, v[:-1], "mlx-lm qwen3_next", v[-1], "vs mlx-lm"))
        print(f"hebrus greedy tokens on 2 vs 1 CPU streams: {'identical' if tokens[0] == tokens[-2] else 'DIFFER'}")
        if not a.skip_qsa:
            short, long = paired_qsa_steps(a, [a.short_context, a.long_context])
            print(
                f"QSA decode step: {a.short_context} ctx {short * 1e3:.2f} ms, {a.long_context} ctx {long * 1e3:.2f} ms, "
                f"ratio {long / short:.2f}x (budget {a.budget}, ratio {a.ratio})"
            )
            rows[f"QSA step ms: {a.short_context} ctx"] = short * 1e3
            rows[f"QSA step ms: {a.long_context} ctx"] = long * 1e3
    record = {"rows": rows, "argv": sys.argv[1:] if argv is None else argv, "loadavg": list(os.getloadavg())}
    if a.record:
        Path(a.record).write_text(json.dumps(record, indent=1) + "\n")
    if against is not None:
        print(against_table(record, against))


def _named(kind, ours, peer_name, peer, group):
    """One run's rows by name: each hebrus variant and the peer it ran beside."""
    label = ["2 CPU streams", "1 CPU stream"][-len(ours) :]
    out = {f"{kind} {group}: hebrus ({l})": v for l, v in zip(label, ours)}
    out[f"{kind} {group}: {peer_name}"] = peer
    return out


def against_table(now: dict, then: dict) -> str:
    """Each row of this run beside the record: now/record (for ms rows record/now, so > 1 is faster
    either way), and for hebrus rows the same ratio over the peer's, which cancels a load change."""
    lines = [f"{'row':58s} {'now':>9s} {'record':>9s} {'speed':>7s} {'vs peer':>8s}"]
    peers = {k.split(": ")[0]: v for k, v in now["rows"].items() if "hebrus" not in k and "QSA" not in k}
    peers_then = {k.split(": ")[0]: v for k, v in then["rows"].items() if "hebrus" not in k and "QSA" not in k}
    for name, v in now["rows"].items():
        old = then["rows"].get(name)
        if old is None:
            continue
        speed = old / v if name.startswith("QSA") else v / old
        group = name.split(": ")[0]
        relative = ""
        if "hebrus" in name and group in peers and group in peers_then:
            relative = f"{speed / (peers[group] / peers_then[group]):7.2f}x"
        lines.append(f"{name:58s} {v:9.2f} {old:9.2f} {speed:6.2f}x {relative:>8s}")
    load = lambda r: "/".join(f"{x:.1f}" for x in r.get("loadavg", []))  # noqa: E731
    lines.append(f"load average (1/5/15 min) at the end: now {load(now)}, record {load(then)}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
