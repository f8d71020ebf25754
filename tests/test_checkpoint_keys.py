"""Checkpoint key mapping: every tensor consumed or excluded by a named rule; missing and
unexpected tensors are named. Layouts: CausalLM, ConditionalGeneration prefix, fused experts."""

import json

import mlx.core as mx
import numpy as np
import pytest
from support.parity_fixtures import PARITY, capture, model

from hebrus_mlx.format.checkpoint_keys import CheckpointKeyError, check_key_set
from hebrus_mlx.models.qwen4exp import Model, ModelArgs
from hebrus_mlx.testing.tiny_configs import TINY_VISION


def _weights():
    return dict(mx.load(str(PARITY / "tiny_a" / "model.safetensors")))


def _args():
    return ModelArgs.from_dict(json.loads((PARITY / "tiny_a" / "config.json").read_text()))


def _logits(weights, dtype=mx.float32):
    m = Model(_args())
    w = m.sanitize(weights)
    m.load_weights(
        [(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in w.items()], strict=True
    )
    return np.array(m(mx.array(capture("tiny_a")["input_ids"].astype(np.int32))).astype(mx.float32))


def test_conditional_generation_layout_with_vision_and_mtp_excluded():
    base = _weights()
    cg = {("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in base.items()}
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
        gate_up = [
            mx.concatenate([base[f"{p}{e}.gate_proj.weight"], base[f"{p}{e}.up_proj.weight"]])
            for e in range(args.num_experts)
        ]
        fused[p + "gate_up_proj"] = mx.stack(gate_up)
        fused[p + "down_proj"] = mx.stack([base[f"{p}{e}.down_proj.weight"] for e in range(args.num_experts)])
    assert check_key_set(fused.keys(), args)["expert_layout"] == "fused"
    np.testing.assert_array_equal(_logits(fused), _logits(base))


def test_missing_tensor_is_named():
    w = _weights()
    del w["model.layers.3.self_attn.indexer.k_layernorm.weight"]
    with pytest.raises(
        CheckpointKeyError, match=r"missing tensor 'model\.layers\.3\.self_attn\.indexer\.k_layernorm\.weight'"
    ):
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


CG_KEYS = json.loads((PARITY / "conditional_generation_keys.json").read_text())


def test_real_conditional_generation_key_set_is_fully_classified():
    """Upstream-captured CG key set: text tensors consumed, vision tensors excluded and counted."""
    keys = CG_KEYS["tensors"]
    report = check_key_set(keys.keys(), _args())
    n_visual = sum(k.startswith("model.visual.") for k in keys)
    assert n_visual > 0 and report["excluded"] == {"vision": n_visual}
    assert report["consumed"] == len(_weights())


def _build_cg(tmp_path):
    import torch
    from transformers.models.qwen4_exp import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    text = json.loads((PARITY / "tiny_a" / "config.json").read_text())
    for k in ("architectures", "transformers_version", "dtype", "model_type"):
        text.pop(k, None)
    vision = dict(TINY_VISION, intermediate_size=64, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
    torch.manual_seed(3)
    ref = Qwen4ExpForConditionalGeneration(Qwen4ExpConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape) * 0.2)
    ref.save_pretrained(tmp_path)
    return ref


def test_live_conditional_generation_checkpoint_matches_reference(tmp_path):
    """Live lane: save a real Qwen4ExpForConditionalGeneration, load it with hebrus-mlx, compare
    text logits with the reference and the key set with the committed capture."""
    pytest.importorskip("transformers")
    import torch

    from hebrus_mlx.loader import load_hf_model

    ref = _build_cg(tmp_path)
    ids = capture("tiny_a")["input_ids"]
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids)).logits.numpy()
    got = np.array(load_hf_model(tmp_path)(mx.array(ids.astype(np.int32))))
    assert np.abs(got - want).max() <= 1e-4
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        live = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    assert live == CG_KEYS["tensors"]
