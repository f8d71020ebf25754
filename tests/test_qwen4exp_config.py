"""Malformed configs fail with a ValueError naming the field, before any weight is read."""

import copy
import io
import json
from contextlib import redirect_stderr

import pytest
from support.parity_fixtures import PARITY

from hebrus_mlx.format.qwen4exp_config import ConfigError, ModelArgs


def _base():
    return json.loads((PARITY / "tiny_a" / "config.json").read_text())


def _mutate(path, value):
    cfg = _base()
    target = cfg
    *parents, leaf = path
    for p in parents:
        target = target[p]
    if value is KeyError:
        del target[leaf]
    else:
        target[leaf] = value
    return cfg


CASES = [
    (("layer_types", 1), "sliding_attention", "layer_types[1]"),
    (("layer_types",), ["linear_attention"] * 3, "layer_types"),
    (("indexer_kv_heads",), 2, "indexer_kv_heads"),
    (("indexer_budget",), 10, "indexer_budget"),
    (("indexer_head_dim",), KeyError, "indexer_head_dim"),
    (("ple_layer_ids",), [4], "ple_layer_ids"),
    (("ple_layer_ids",), [9], "ple_layer_ids"),
    (("eos_token_id",), None, "eos_token_id"),
    (("eos_token_id",), [], "eos_token_id"),
    (("ple_embed_dim",), 30, "ple_embed_dim"),
    (("hc_count",), 1, "hc_count"),
    (("hidden_act",), "gelu", "hidden_act"),
    (("output_gate_type",), "tanh", "output_gate_type"),
    (("num_experts_per_tok",), 9, "num_experts_per_tok"),
    (("num_experts",), "8", "num_experts"),
    (("num_key_value_heads",), 3, "num_key_value_heads"),
    (("rope_parameters", "rope_type"), "yarn", "rope_parameters.rope_type"),
    (("rope_parameters", "partial_rotary_factor"), 1.5, "rope_parameters.partial_rotary_factor"),
    (("tie_word_embeddings",), True, "tie_word_embeddings"),
    (("rms_norm_eps",), "1e-6", "rms_norm_eps"),
    (("rms_norm_eps",), [], "rms_norm_eps"),
    (("rope_parameters", "rope_theta"), None, "rope_parameters.rope_theta"),
    (("rope_parameters", "rope_theta"), "1e4", "rope_parameters.rope_theta"),
]


@pytest.mark.parametrize("path,value,field", CASES, ids=[c[2] + "-" + str(i) for i, c in enumerate(CASES)])
def test_malformed_config_names_the_field(path, value, field):
    with pytest.raises(ConfigError) as info:
        ModelArgs.from_dict(_mutate(path, value))
    assert info.value.field == "config." + field
    assert str(info.value).startswith(f"config.{field}: ")


def test_base_config_is_accepted():
    """Control: the unmutated config passes, so each failure above is the mutation's."""
    args = ModelArgs.from_dict(_base())
    assert args.layer_types[-1] == "indexed_attention"


def test_conditional_generation_config_uses_text_config():
    text = _base()
    outer = {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "text_config": copy.deepcopy(text),
        "vision_config": {"depth": 2},
    }
    assert ModelArgs.from_dict(outer) == ModelArgs.from_dict(text)


def test_full_attention_spelling_maps_to_indexed():
    cfg = _base()
    cfg["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
    assert ModelArgs.from_dict(cfg).layer_types[3] == "indexed_attention"


def test_config_errors_come_before_weights(tmp_path):
    """load_hf_model reads config.json first: a bad config fails even with no weights present."""
    from hebrus_mlx.loader import load_hf_model

    (tmp_path / "config.json").write_text(json.dumps(_mutate(("indexer_kv_heads",), 2)))
    with pytest.raises(ConfigError, match="indexer_kv_heads"):
        load_hf_model(tmp_path)


def test_another_model_type_is_named_not_a_missing_field(tmp_path):
    """An mlx-lm user's Qwen3 or Llama directory: the one line says its model_type is not supported,
    not which Qwen4Exp field the other architecture lacks (exit 2, before any weight is read)."""
    from hebrus_mlx.cli import main

    llama = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["generate", "--model", str(tmp_path), "-p", "hi"]) == 2
    assert err.getvalue() == (
        "hebrus-mlx generate: error: config.model_type: model_type 'llama' is not supported "
        "(hebrus-mlx runs Qwen4Exp: qwen4_exp, qwen4_exp_text)\n"
    )
    outer = {"model_type": "qwen4_exp", "text_config": dict(_base(), model_type="qwen3_next")}
    with pytest.raises(ConfigError, match="model_type 'qwen3_next' is not supported") as info:
        ModelArgs.from_dict(outer)
    assert info.value.field == "config.text_config.model_type"
