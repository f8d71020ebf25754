"""Tiny checkpoints with an MTP head, and mlx-vlm 0.7.10's drafter as the independent oracle.

`mtp_checkpoint`: a transformers-written tiny Qwen4Exp checkpoint (tests/support/fixtures/parity, made by
`save_pretrained`) plus random `mtp.*` tensors in the released layout (per-expert or fused
experts). Provenance (AFN-014): the text-model tensors are the committed upstream checkpoint; the
MTP tensors are a contract control (seeded noise, shapes from the key tables).

`mlx_vlm_drafter`: mlx-vlm's `Qwen4ExpMTPDraftModel` loaded from the same file through its own
config and sanitize; hebrus-mlx code only stacks per-expert tensors into the fused layout that
sanitize reads. mlx-vlm is imported without its package `__init__` files (see
/work/shared/design/peers.md).
"""

import importlib
import json
import os
import shutil
import sys
import types
from pathlib import Path

import numpy as np

from hebrus_mlx.testing.bare_packages import register_bare_packages
from support.parity_fixtures import PARITY

MLX_VLM = Path(os.environ.get("MLX_VLM_ROOT", "/work/pkgs/mlx_vlm_0710"))  # .ci/run unpacks it


def mtp_tensors(config: dict, seed: int = 0, layout: str = "unfused", scale: float = 0.1) -> dict:
    from hebrus_mlx.artifact import manifest as M
    from hebrus_mlx.format import checkpoint_keys as keys
    from hebrus_mlx.format.qwen4exp_config import ModelArgs, mtp_layer_args

    args = ModelArgs.from_dict(config)
    shapes = M.dense_shapes(mtp_layer_args(args))
    H, W = args.hidden_size, args.hc_count * args.hidden_size
    rng = np.random.default_rng(seed)

    def noise(shape):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {}
    top = {
        "pre_fc_norm_embedding.weight": (H,),
        "pre_fc_norm_hidden.weight": (W,),
        "fc_embedding.weight": (H, H),
        "fc_hidden.weight": (H, H),
    }
    for name in keys.MTP_GLOBAL_TEMPLATES:
        shape = top.get(name) or shapes["model." + name]
        out["mtp." + name] = noise(shape)
    for name in keys.MTP_LAYER_TEMPLATES:
        out["mtp.layers.0." + name] = noise(shapes["model.layers.0." + name])
    E, m = args.num_experts, args.moe_intermediate_size
    gate, up, down = noise((E, m, H)), noise((E, m, H)), noise((E, H, m))
    if layout == "fused":
        out["mtp.layers.0.mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        out["mtp.layers.0.mlp.experts.down_proj"] = down
    else:
        for e in range(E):
            p = f"mtp.layers.0.mlp.experts.{e}."
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"], out[p + "down_proj.weight"] = (
                gate[e],
                up[e],
                down[e],
            )
    return out


def add_mtp_tensors(d, seed: int = 0, layout: str = "unfused"):
    """Add a random MTP head to the single-file checkpoint in `d` (written by save_pretrained)."""
    from safetensors.numpy import load_file, save_file

    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors.update(mtp_tensors(config, seed, layout))
    save_file(tensors, path)
    return d


def mtp_checkpoint(d, name: str = "tiny_a", seed: int = 0, layout: str = "unfused"):
    """Copy parity checkpoint `name` into `d` and add an MTP head to its safetensors."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(d, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        shutil.copy(PARITY / name / f, d)
    with open(PARITY / name / "config.json") as f:
        config = json.load(f)
    tensors = load_file(str(PARITY / name / "model.safetensors"))
    tensors.update(mtp_tensors(config, seed, layout))
    save_file(tensors, os.path.join(d, "model.safetensors"))
    return d


def _import_mlx_vlm():
    # Bare packages: their __init__ files import the whole VLM stack (processors, PIL).
    register_bare_packages(
        str(MLX_VLM),
        (
            "mlx_vlm",
            "mlx_vlm.models",
            "mlx_vlm.models.qwen4_exp",
            "mlx_vlm.models.qwen3_vl",
            "mlx_vlm.models.qwen3_5",
            "mlx_vlm.models.qwen3_5_moe",
            "mlx_vlm.speculative",
            "mlx_vlm.speculative.drafters",
            "mlx_vlm.speculative.drafters.qwen4_exp_mtp",
        ),
    )
    stub = "PIL" not in sys.modules and importlib.util.find_spec("PIL") is None
    if stub:  # models/base.py imports PIL.Image at the top; unused here
        pil = types.ModuleType("PIL")
        pil.__path__ = []
        pil.Image = types.SimpleNamespace(Image=object)
        sys.modules["PIL"], sys.modules["PIL.Image"] = pil, pil.Image
    try:
        drafter = importlib.import_module("mlx_vlm.speculative.drafters.qwen4_exp_mtp.qwen4_exp_mtp")
        config = importlib.import_module("mlx_vlm.speculative.drafters.qwen4_exp_mtp.config")
    finally:
        if stub:  # later imports (transformers) must not see a fake PIL
            sys.modules.pop("PIL", None)
            sys.modules.pop("PIL.Image", None)
    return drafter, config


def mlx_vlm_available() -> bool:
    return (MLX_VLM / "mlx_vlm" / "speculative" / "drafters" / "qwen4_exp_mtp").is_dir()


def mlx_vlm_drafter(ckpt_dir):
    """(drafter, target namespace with embed_tokens / lm_head) from mlx-vlm, on ckpt_dir's weights."""
    import mlx.core as mx
    import mlx.nn as nn

    drafter_mod, config_mod = _import_mlx_vlm()
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        text = json.load(f)
    text = dict(text, model_type="qwen4_exp")
    text["output_gate_type"] = text.get("output_gate_type") or "silu"  # HF null means silu
    text["layer_types"] = ["qwen_sparse_attention" if t == "indexed_attention" else t for t in text["layer_types"]]
    rope = dict(text["rope_parameters"])
    if "mrope_section" not in rope:  # required by its config; text positions are equal on all axes
        half = int(text["head_dim"] * rope["partial_rotary_factor"]) // 2
        rope["mrope_section"] = [half - 2 * (half // 4), half // 4, half // 4]
    text["rope_parameters"] = rope
    cfg = config_mod.Qwen4ExpMTPConfig.from_dict({"text_config": text})
    model = drafter_mod.Qwen4ExpMTPDraftModel(cfg)
    raw = mx.load(os.path.join(ckpt_dir, "model.safetensors"))
    mtp = {k: v for k, v in raw.items() if k.startswith("mtp.")}
    E = text["num_experts"]
    if "mtp.layers.0.mlp.experts.0.gate_proj.weight" in mtp:  # its sanitize reads the fused layout
        p = "mtp.layers.0.mlp.experts."
        gate_up = [
            mx.concatenate([mtp.pop(f"{p}{e}.gate_proj.weight"), mtp.pop(f"{p}{e}.up_proj.weight")]) for e in range(E)
        ]
        mtp[p + "gate_up_proj"] = mx.stack(gate_up)
        mtp[p + "down_proj"] = mx.stack([mtp.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    model.load_weights(list(model.sanitize(mtp).items()), strict=True)
    mx.eval(model.parameters())
    target = types.SimpleNamespace(
        embed_tokens=nn.Embedding(*raw["model.embed_tokens.weight"].shape),
        lm_head=nn.Linear(raw["lm_head.weight"].shape[1], raw["lm_head.weight"].shape[0], bias=False),
    )
    target.embed_tokens.weight = raw["model.embed_tokens.weight"]
    target.lm_head.weight = raw["lm_head.weight"]
    model.reset(target)
    return model, target
