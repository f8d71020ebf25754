"""mlx-vlm 0.7.10's `qwen4_exp` text model (the public MLX implementation of the same model) as a
benchmark peer, built on exactly the weights of a hebrus-mlx model.

mlx-vlm is read from its unpacked wheel (default /work/pkgs/mlx_vlm_0710, or $MLX_VLM_ROOT) without
running its package `__init__` files (they import the vision stack); PIL, which its `models/base.py`
imports at the top but the text path never uses, is stubbed only when it is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

from hebrus_mlx.testing.bare_packages import register_bare_packages

DEFAULT_ROOT = "/work/pkgs/mlx_vlm_0710"


class PeerUnavailable(RuntimeError):
    """mlx-vlm's qwen4_exp could not be imported from the given root."""


def import_qwen4_exp(root: str | None = None):
    """Return (language module, config module) of mlx_vlm.models.qwen4_exp."""
    root = root or os.environ.get("MLX_VLM_ROOT", DEFAULT_ROOT)
    if not os.path.isdir(os.path.join(root, "mlx_vlm", "models", "qwen4_exp")):
        raise PeerUnavailable(f"mlx-vlm qwen4_exp not found under {root} (set MLX_VLM_ROOT)")
    register_bare_packages(
        root,
        (
            "mlx_vlm",
            "mlx_vlm.models",
            "mlx_vlm.models.qwen4_exp",
            "mlx_vlm.speculative",
            "mlx_vlm.speculative.drafters",
        ),
    )
    if "PIL" not in sys.modules and importlib.util.find_spec("PIL") is None:
        import transformers.feature_extraction_utils  # noqa: F401  (decides PIL is absent before the stub exists)

        pil, image = types.ModuleType("PIL"), types.ModuleType("PIL.Image")
        image.Image = type("Image", (), {})
        pil.Image = image
        sys.modules["PIL"], sys.modules["PIL.Image"] = pil, image
    try:
        language = importlib.import_module("mlx_vlm.models.qwen4_exp.language")
        config = importlib.import_module("mlx_vlm.models.qwen4_exp.config")
    except Exception as e:  # noqa: BLE001  (any import failure means no peer)
        raise PeerUnavailable(f"importing mlx-vlm qwen4_exp failed: {e}") from e
    return language, config


def text_config(config_module, hf_config: dict):
    """mlx-vlm's TextConfig for a transformers Qwen4Exp text config dict."""
    cfg = dict(hf_config)
    cfg["model_type"] = "qwen4_exp"
    # transformers writes null for the default silu gate; mlx-vlm would read null as sigmoid.
    cfg["output_gate_type"] = cfg.get("output_gate_type") or "silu"
    cfg["layer_types"] = ["qwen_sparse_attention" if t == "indexed_attention" else t for t in cfg["layer_types"]]
    rope = dict(cfg.get("rope_parameters") or {})
    # Text-only positions are equal on every M-RoPE section, so any split is plain RoPE.
    rotary = int(
        cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) * rope.get("partial_rotary_factor", 1.0)
    )
    rope.setdefault("mrope_section", [rotary // 2, 0, 0])
    cfg["rope_parameters"] = rope
    return config_module.TextConfig.from_dict(cfg)


def from_hebrus(model, hf_config: dict, root: str | None = None):
    """An mlx-vlm LanguageModel holding the same weights as the hebrus-mlx `model`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    language, config = import_qwen4_exp(root)
    text = text_config(config, hf_config)
    # The language model reads the vision config's merge size even for text-only M-RoPE positions.
    full = config.ModelConfig(
        text_config=text,
        vision_config=config.VisionConfig(),
        model_type="qwen4_exp",
        vocab_size=text.vocab_size,
        eos_token_id=text.eos_token_id,
    )
    peer = language.LanguageModel(text, full)
    ours = dict(tree_flatten(model.parameters()))
    theirs = dict(tree_flatten(peer.parameters()))
    weights = []
    for key, value in theirs.items():
        if key in ours:
            if ours[key].shape != value.shape:
                raise ValueError(f"{key}: hebrus {ours[key].shape} vs mlx-vlm {value.shape}")
            # A row-major copy: the layout mlx-vlm's own loader holds (ours may be re-stored [in, out]
            # by models/optimize.apply on the CPU backend; sharing it would hand the peer that speed-up).
            weights.append((key, mx.contiguous(ours[key])))
        elif ".ngram_embedding.shards." in key:
            # mlx-vlm keeps the PLE table in row shards; slice ours the same way.
            prefix, shard = key.split(".shards.")
            table = ours[prefix + ".weight"]
            emb = peer
            for part in prefix.split("."):
                emb = emb[int(part)] if part.isdigit() else getattr(emb, part)
            lo = emb.shard_offsets[int(shard.split(".")[0])]
            weights.append((key, table[lo : lo + value.shape[0]]))
        # else: constants mlx-vlm derives from the config itself (PLE multipliers / sizes / offsets)
    peer.load_weights(weights, strict=False)
    mx.eval(peer.parameters())
    peer.eval()
    return peer


def logits(peer, inputs, cache):
    return peer(inputs, cache=cache).logits
