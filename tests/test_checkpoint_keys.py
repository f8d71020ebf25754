"""Checkpoint key mapping: every tensor consumed or excluded by a named rule; missing and
unexpected tensors are named. Layouts: CausalLM, ConditionalGeneration prefix, fused experts."""

import json

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx.models.checkpoint_keys import CheckpointKeyError, check_key_set
from hebrus_mlx.models.qwen4exp import Model, ModelArgs
from parity_fixtures import PARITY, capture, model


def _weights():
    return dict(mx.load(str(PARITY / "tiny_a" / "model.safetensors")))


def _args():
    return ModelArgs.from_dict(json.loads((PARITY / "tiny_a" / "config.json").read_text()))


def _logits(weights, dtype=mx.float32):
    m = Model(_args())
    w = m.sanitize(weights)
    m.load_weights([(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in w.items()], strict=True)
    return np.array(m(mx.array(capture("tiny_a")["input_ids"].astype(np.int32))).astype(mx.float32))


def test_conditional_generation_layout_with_vision_and_mtp_excluded():
    base = _weights()
    cg = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in base.items()}
    cg["model.visual.blocks.0.attn.qkv.weight"] = mx.zeros((4, 4))
    cg["model.visual.merger.mlp.0.weight"] = mx.zeros((4, 4))
    cg["mtp.layers.0.mlp.gate.weight"] = mx.zeros((4, 4))
    report = check_key_set(cg.keys(), _args())
    assert report["excluded"] == {"vision": 2, "mtp": 1}
    assert report["consumed"] == len(base)
    np.testing.assert_array_equal(_logits(cg), _logits(base))


def test_fused_expert_layout_loads_identically():
    base = _weights()
    args = _args()
    fused = {k: v for k, v in base.items() if ".mlp.experts." not in k}
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = [mx.concatenate([base[f"{p}{e}.gate_proj.weight"], base[f"{p}{e}.up_proj.weight"]]) for e in range(args.num_experts)]
        fused[p + "gate_up_proj"] = mx.stack(gate_up)
        fused[p + "down_proj"] = mx.stack([base[f"{p}{e}.down_proj.weight"] for e in range(args.num_experts)])
    assert check_key_set(fused.keys(), args)["expert_layout"] == "fused"
    np.testing.assert_array_equal(_logits(fused), _logits(base))


def test_missing_tensor_is_named():
    w = _weights()
    del w["model.layers.3.self_attn.indexer.k_layernorm.weight"]
    with pytest.raises(CheckpointKeyError, match=r"missing tensor 'model\.layers\.3\.self_attn\.indexer\.k_layernorm\.weight'"):
        Model(_args()).sanitize(w)


def test_unexpected_tensor_is_named():
    w = _weights()
    w["model.layers.0.self_attn.q_proj.weight"] = mx.zeros((4, 4))  # layer 0 is linear attention
    with pytest.raises(CheckpointKeyError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        Model(_args()).sanitize(w)


def test_expert_index_out_of_range_is_named():
    w = _weights()
    w["model.layers.1.mlp.experts.8.up_proj.weight"] = w["model.layers.1.mlp.experts.0.up_proj.weight"]
    with pytest.raises(CheckpointKeyError, match="expert 8 >= num_experts=8"):
        Model(_args()).sanitize(w)


def test_ple_constant_mismatch_is_rejected():
    w = _weights()
    key = "model.layers.0.ple.ple_embedding.layer_multipliers"
    w[key] = w[key] + 2
    with pytest.raises(CheckpointKeyError, match="layer_multipliers"):
        Model(_args()).sanitize(w)


def test_sanitize_is_idempotent():
    m = Model(_args())
    once = m.sanitize(_weights())
    twice = m.sanitize(once)
    assert once.keys() == twice.keys()
    assert all(once[k] is twice[k] for k in once)


def test_bf16_checkpoint_loads_and_stays_close():
    base = _weights()
    bf16 = {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in base.items()}
    got = _logits(bf16)
    want = np.array(model("tiny_a")(mx.array(capture("tiny_a")["input_ids"].astype(np.int32))))
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
