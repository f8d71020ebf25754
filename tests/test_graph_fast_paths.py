"""The resident speed paths (compiled elementwise graphs, fused-SDPA dense QSA, mx.fast.rope / one
shared rope table, joined same-input projections, the folded norm scale) keep greedy tokens identical
to the plain ops path (exactness is the product)."""

import json

import mlx.core as mx
import numpy as np

from hebrus_mlx.models.options import GraphOptions

DEMO_VOCAB = 4105
# Every alternative on (compile too, whatever the backend default), against every one off.
FAST = GraphOptions(
    compile=True, join_projections=True, in_major=True, rope_tables=True, dense_sdpa=True, cpu_streams=2
)


def _greedy(options):
    from hebrus_mlx.generate import generate_step
    from hebrus_mlx.loader import load_model, resolve_model_path

    model = load_model(resolve_model_path("demo"), dtype=mx.float32, options=options)
    prompt = mx.array(list(range(5, 45)), dtype=mx.int32)
    tokens, last = [], None
    # The demo tokenizer's effective vocabulary (4105 of 4224 rows): the vocabulary mask is on.
    for tok, logprobs in generate_step(prompt, model, effective_vocab_size=DEMO_VOCAB, max_tokens=36):
        tokens.append(tok)
        last = logprobs
    return model, tokens, np.array(last)


def test_fast_paths_keep_greedy_tokens_across_the_dense_to_sparse_boundary():
    # demo: budget 64, ratio 8 -> the dense regime ends at 71 tokens; 40 + 36 crosses it
    plain_model, plain, plain_last = _greedy(GraphOptions.plain())
    fast_model, fast, fast_last = _greedy(FAST)
    # the plain model kept every block's one implementation; the fast one had them swapped
    swapped = [
        {type(m).__name__ for _, m in model.named_modules() if type(m).__module__.endswith(".optimize")}
        for model in (plain_model, fast_model)
    ]
    assert swapped[0] == set() and plain_model.options == GraphOptions.plain()
    assert swapped[1] == {
        "OneGraphHyperConnection",
        "OneGraphPLELayer",
        "FastQSAAttention",
        "SplitSparseMoE",
        "SplitLogitsModel",
    }
    assert fast == plain
    np.testing.assert_allclose(fast_last, plain_last, atol=1e-4)
    assert plain_model.args.vocab_size > DEMO_VOCAB and np.isneginf(plain_last[DEMO_VOCAB:]).all()


def test_options_refuse_a_bad_value_naming_the_field():
    import pytest

    from hebrus_mlx.errors import UsageError

    with pytest.raises(UsageError, match="cpu_streams"):
        GraphOptions(cpu_streams=3)
    with pytest.raises(UsageError, match="compile"):
        GraphOptions(compile="yes")


def test_folded_norm_scale_follows_weight_replacement():
    from hebrus_mlx.models.qwen4exp import ZeroCenteredRMSNorm

    norm = ZeroCenteredRMSNorm(8, 1e-6)
    x = mx.random.normal((2, 8), key=mx.random.key(0))
    before = norm(x)
    norm.load_weights([("weight", mx.full((8,), 0.5))])
    np.testing.assert_allclose(np.array(norm(x)), np.array(before) * 1.5, rtol=1e-6)
    assert "_folded" not in dict(norm.parameters())  # not a parameter: keys and checkpoints unchanged


def test_rope_at_offset_is_bit_identical_to_the_reference_tables():
    from hebrus_mlx.models.qwen4exp import Rotary

    rot = Rotary(32, 1e7)
    x = mx.random.normal((1, 4, 5, 64), key=mx.random.key(1))
    for offset in (0, 7, 40_000):
        cos, sin = rot.tables(offset + mx.arange(5))
        assert mx.array_equal(rot.at_offset(x, offset), rot.apply(x, cos, sin)).item()


def _decode(model, ids, n):
    cache = model.make_cache()
    logits = [model(ids, cache=cache)[:, -1:]]
    tokens = []
    for _ in range(n):
        tokens.append(mx.argmax(logits[-1], axis=-1).astype(mx.int32))
        logits.append(model(tokens[-1], cache=cache))
    mx.eval(logits, tokens)
    return [t.item() for t in tokens], np.concatenate([np.array(x) for x in logits], axis=1)


def test_joined_projections_match_the_per_linear_matmuls():
    """A float32 checkpoint (sparse QSA from 11 tokens, chunked GDN prefill, PLE): the loader joins
    every same-input projection group (used for decode steps and short blocks). Short-block prefill +
    greedy decode agree with a load that keeps the per-Linear matmuls (bit for bit on this CPU), and
    still do after new weights are loaded into both (Model.update runs the pass again: a joint weight
    made from the old arrays would give other logits)."""
    from mlx.utils import tree_flatten
    from support.parity_fixtures import PARITY, capture

    from hebrus_mlx.loader import load_hf_model

    model = load_hf_model(PARITY / "tiny_a", options=GraphOptions(join_projections=True, cpu_streams=1))
    plain = load_hf_model(PARITY / "tiny_a", options=GraphOptions(join_projections=False, cpu_streams=1))
    layers = model.layers
    joined = [
        layers[0].linear_attn,
        layers[0].mlp,
        layers[0].attn_hyper_connection,
        next(l.self_attn for l in layers if not l.is_linear),
        next(l.ple for l in layers if l.has_ple),
    ]
    assert all(m.__dict__["_projector"].joined is not None for m in joined)
    assert "_projector" not in plain.layers[0].mlp.__dict__
    ids = mx.array(capture("tiny_a")["input_ids"]).reshape(1, -1)[:, :12]  # <= FUSE_MAX_TOKENS
    for _ in range(2):
        fused_tokens, fused_logits = _decode(model, ids, 24)
        plain_tokens, plain_logits = _decode(plain, ids, 24)
        assert fused_tokens == plain_tokens
        np.testing.assert_allclose(fused_logits, plain_logits, rtol=0, atol=1e-5)
        print("max |fused - per-linear| logit diff:", float(np.abs(fused_logits - plain_logits).max()))
        scaled = [(k, v * 1.25) for k, v in tree_flatten(plain.parameters()) if "proj" in k]
        for m in (model, plain):
            m.load_weights(scaled, strict=False)
    assert all(m.__dict__["_projector"].joined is not None for m in joined)


def test_decode_regions_are_bit_identical_to_the_per_part_blocks():
    """One CPU stream (Metal's choice), compiled: each decode step's MoE after its projections is one
    graph (OneGraphSparseMoE) and the attention hyper-connection's inject runs with the MoE one's mix
    (inject_then_mix). The same model with those blocks put back to the per-part classes decodes the
    same logits bit for bit, before and after its expert weights are replaced by a load (the one graph
    reads the new ones)."""
    from mlx.utils import tree_flatten
    from support.parity_fixtures import PARITY, capture

    from hebrus_mlx.loader import load_hf_model
    from hebrus_mlx.models import optimize
    from hebrus_mlx.models import qwen4exp as q

    model = load_hf_model(PARITY / "tiny_a", options=GraphOptions(compile=True, cpu_streams=1))
    blocks = optimize.implementations(model)["blocks"]
    assert set(blocks["SparseMoE"]) == {"OneGraphSparseMoE"} and set(blocks["HyperConnection"]) == {
        "OneGraphHyperConnection"
    }
    ids = mx.array(capture("tiny_a")["input_ids"]).reshape(1, -1)[:, :12]
    swapped = [
        m for _, m in model.named_modules() if type(m) in (optimize.OneGraphSparseMoE, optimize.OneGraphHyperConnection)
    ]

    def both():
        fast = _decode(model, ids, 12)
        for m in swapped:
            m.__class__ = type(m).__mro__[1]
        parts = _decode(model, ids, 12)
        for m in swapped:
            m.__class__ = optimize.OneGraphSparseMoE if isinstance(m, q.SparseMoE) else optimize.OneGraphHyperConnection
        assert fast[0] == parts[0] and np.array_equal(fast[1], parts[1])
        return fast[1]

    before = both()
    # Replaced through load_weights (Model.update runs the pass again: the one graph's arguments are
    # made from the new arrays).
    halved = [(k, v * 0.5) for k, v in tree_flatten(model.parameters()) if k.endswith("switch_mlp.down_proj.weight")]
    model.load_weights(halved, strict=False)
    assert set(map(type, swapped)) == {optimize.OneGraphSparseMoE, optimize.OneGraphHyperConnection}
    assert not np.array_equal(both(), before)


def test_in_major_weights_keep_logits_bit_identical():
    """With GraphOptions.in_major (the CPU default) the loaders re-store resident float weights [in, out].
    Prefill (per-Linear matmuls, chunked GDN, resident routed experts) and decode logits equal a load
    that keeps the checkpoint's [out, in] arrays, bit for bit."""
    from support.parity_fixtures import PARITY, capture

    from hebrus_mlx.loader import load_hf_model

    model = load_hf_model(PARITY / "tiny_a", options=GraphOptions(in_major=True, cpu_streams=1))
    plain = load_hf_model(PARITY / "tiny_a", options=GraphOptions(in_major=False, cpu_streams=1))
    layer, plain_layer = model.layers[0], plain.layers[0]
    stored = [layer.linear_attn.out_proj.weight, layer.mlp.switch_mlp.gate_proj.weight, model.lm_head.weight]
    assert not any(np.array(w).flags["C_CONTIGUOUS"] for w in stored)
    assert all(
        np.array(w).flags["C_CONTIGUOUS"] for w in (plain_layer.linear_attn.out_proj.weight, plain.lm_head.weight)
    )
    ids = mx.array(capture("tiny_a")["input_ids"]).reshape(1, -1)[:, :24]  # > FUSE_MAX_TOKENS
    in_major_tokens, in_major_logits = _decode(model, ids, 8)
    plain_tokens, plain_logits = _decode(plain, ids, 8)
    assert in_major_tokens == plain_tokens
    assert np.array_equal(in_major_logits, plain_logits)


def test_grouped_recurrence_is_bit_identical_to_mx_fast():
    from hebrus_mlx.models import gated_delta

    keys = iter(mx.random.split(mx.random.key(3), 6))
    for T in (1, 3):
        B, Hk, Hv, Dk, Dv = 2, 2, 4, 16, 8
        q, k = (gated_delta.l2_normalize(mx.random.normal((B, T, Hk, Dk), key=next(keys))) for _ in range(2))
        v = mx.random.normal((B, T, Hv, Dv), key=next(keys))
        g = -mx.random.uniform(shape=(B, T, Hv), key=next(keys))
        beta = mx.random.uniform(shape=(B, T, Hv), key=next(keys))
        state = mx.random.normal((B, Hv, Dv, Dk), key=next(keys))
        out, new_state = gated_delta._grouped_steps(q, k, v, mx.exp(g), beta, state)
        ref_out, ref_state = mx.fast.gated_delta_update(q, k, v, mx.exp(g), beta, state)
        assert mx.array_equal(out, ref_out).item() and mx.array_equal(new_state, ref_state).item()
        keys = iter(mx.random.split(mx.random.key(4 + T), 6))


def test_one_graph_hyper_connection_mix_is_bit_identical_to_the_per_part_path():
    from support.parity_fixtures import PARITY

    from hebrus_mlx.models import optimize, options
    from hebrus_mlx.models.qwen4exp import HyperConnection, ModelArgs

    args = ModelArgs.from_dict(json.loads((PARITY / "tiny_a" / "config.json").read_text()))
    for compiled in (False, True):
        for inject in (True, False):
            hc = HyperConnection(args, inject=inject)
            hc.hc_norm.weight = mx.random.normal(hc.hc_norm.weight.shape, key=mx.random.key(8)) * 0.3
            opts = optimize.apply(hc, GraphOptions(compile=compiled, cpu_streams=1))
            assert type(hc) is optimize.OneGraphHyperConnection
            streams = mx.random.normal((2, 3, args.hc_count * args.hidden_size), key=mx.random.key(9))
            with options.use(opts):
                assert streams.shape[-2] <= opts.join_max_tokens and hc.__dict__["_plans"][1][inject] is not None
                fast = hc.mix(streams, inject=inject)
                plain = HyperConnection.mix(hc, streams, inject=inject)  # the per-part path
            assert all(mx.array_equal(a, b).item() for a, b in zip(fast, plain))
