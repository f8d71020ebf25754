"""An MLX-quantized Qwen4Exp checkpoint written by mlx-vlm 0.7.10's own code.

Provenance (AFN-014): the float weights are the tiny transformers checkpoint
(`artifact_fixture.tiny_checkpoint`, `save_pretrained`, seed 0), renamed to
the conditional-generation layout the real release uses (`model.` ->
`model.language_model.`). Everything after that is mlx-vlm's code, in the
order its `convert` runs it: `Model.sanitize` (stacks experts into
`switch_mlp`, renames PLE shards, moves conv axes), the cast to bfloat16,
`quant_utils.quantize_model` with the model's own `quant_predicate` behind
convert's multimodal skip, then `utils.save_weights` and `utils.save_config`.
The vision tower is a tiny random one (text-only conversions exclude it).

mlx-vlm is unpacked read-only at MLX_VLM_ROOT (not pip-installed); its heavy
package `__init__`s are bypassed by registering bare parent packages, and PIL
(absent here) is stubbed after transformers has been imported without it.
Tests skip when it is not there.
"""

import importlib
import json
import os
import struct
import sys
import types
from pathlib import Path

from hebrus_mlx.testing.bare_packages import register_bare_packages
from hebrus_mlx.testing.tiny_configs import TINY_VISION

MLX_VLM_ROOT = os.environ.get("MLX_VLM_ROOT", "/work/pkgs/mlx_vlm_0710")


def available():
    return os.path.isdir(os.path.join(MLX_VLM_ROOT, "mlx_vlm", "models", "qwen4_exp"))


def import_mlx_vlm():
    """(qwen4_exp module, quant_utils, utils) of the unpacked mlx-vlm."""
    register_bare_packages(MLX_VLM_ROOT, ("mlx_vlm", "mlx_vlm.speculative", "mlx_vlm.speculative.drafters"))
    import transformers.processing_utils  # noqa: F401  (imported before the PIL stub: it must see no PIL)

    try:
        import PIL  # noqa: F401
    except ImportError:
        pil = types.ModuleType("PIL")
        pil.Image = types.ModuleType("PIL.Image")
        pil.Image.Image = type("Image", (), {})
        pil.ImageOps = types.ModuleType("PIL.ImageOps")
        sys.modules.update({"PIL": pil, "PIL.Image": pil.Image, "PIL.ImageOps": pil.ImageOps})
    # tests/support/mtp_fixture.py registers model packages bare (its drafter needs only submodules): import
    # them for real here, whatever ran first.
    for name in [
        n
        for n, m in sys.modules.items()
        if n.startswith("mlx_vlm.models.") and n.count(".") == 2 and getattr(m, "__file__", None) is None
    ]:
        del sys.modules[name]
    return (
        importlib.import_module("mlx_vlm.models.qwen4_exp"),
        importlib.import_module("mlx_vlm.quant_utils"),
        importlib.import_module("mlx_vlm.utils"),
    )


# mlx-vlm's spelling of the tiny vision tower's patch geometry.
VISION_CONFIG = dict(
    TINY_VISION,
    intermediate_size=32,
    patch_size=2,
    spatial_patch_size=2,
    temporal_patch_size=1,
    fullatt_block_indexes=[],
    in_channels=3,
)


def conditional_config(hf_config):
    """The HF text config as the real release's conditional config: indexed
    layers spelled "full_attention" (both readers accept it), the output gate
    explicit (mlx-vlm reads a missing one as sigmoid, transformers null as
    silu), rope with the mrope section mlx-vlm requires (text positions make
    it plain rope)."""
    text = {k: v for k, v in hf_config.items() if k not in ("architectures", "transformers_version", "dtype")}
    text["model_type"] = "qwen4_exp_text"
    text["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in hf_config["layer_types"]]
    text["output_gate_type"] = hf_config.get("output_gate_type") or "silu"
    rope = dict(hf_config["rope_parameters"])
    rope.setdefault("partial_rotary_factor", 1.0)
    rope.setdefault("mrope_section", [3, 3, 2])
    text["rope_parameters"] = rope
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "text_config": text,
        "vision_config": dict(VISION_CONFIG),
        "eos_token_id": hf_config["eos_token_id"],
        "torch_dtype": "bfloat16",
    }


def build_model(config):
    q4, _, _ = import_mlx_vlm()
    import copy

    return q4.Model(q4.ModelConfig.from_dict(copy.deepcopy(config)))


def shard_tensors(d):
    """{key: ndarray} of every safetensors shard in directory `d`, read here from the header with
    numpy (not with the product's reader); BF16 as uint16 bits. The tests' oracle for the bytes
    mlx-vlm wrote (and for what an import copied)."""
    import numpy as np

    dtypes = {"U32": np.uint32, "BF16": np.uint16, "F32": np.float32, "I64": np.int64}
    out = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".safetensors"):
            with open(os.path.join(d, name), "rb") as f:
                raw = f.read()
            (n,) = struct.unpack("<Q", raw[:8])
            header = json.loads(raw[8 : 8 + n])
            header.pop("__metadata__", None)
            for k, e in header.items():
                a, b = e["data_offsets"]
                out[k] = np.frombuffer(raw[8 + n + a : 8 + n + b], dtypes[e["dtype"]]).reshape(e["shape"])
    return out


def mlx_vlm_checkpoint(
    hf_dir, out_dir, bits=4, group_size=64, expert_bits=None, expert_layers=None, expert_recipe=None
):
    """Quantize the HF checkpoint at `hf_dir` with mlx-vlm into `out_dir`;
    returns the quantized mlx-vlm model (bf16, as saved). expert_bits: the routed experts
    (`switch_mlp` projections; of `expert_layers` only, default all) at their own width,
    recorded per module in the config's `quantization` block as mlx-lm's mixed recipes do.
    expert_recipe: an mlx-lm mixed recipe ("mixed_3_6", ...) whose own predicate
    (`mlx_lm.convert.mixed_quant_predicate_builder`) picks each routed-expert projection's
    width (the dense modules keep mlx-vlm's predicate at `bits`)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    q4, quant_utils, utils = import_mlx_vlm()
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = conditional_config(json.load(f))
    model = build_model(config)
    weights = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in mx.load(os.path.join(hf_dir, "model.safetensors")).items()
    }
    model.load_weights(list(model.sanitize(weights).items()), strict=False)  # vision stays random
    cast = model.cast_predicate
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(mx.bfloat16) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    model_predicate = model.quant_predicate
    recipe = None
    if expert_recipe is not None:
        from mlx_lm.convert import mixed_quant_predicate_builder

        class _Text:  # what the builder reads: the layer list and the full model's module paths
            layers = model.language_model.model.layers

            def named_modules(self):
                return [(k, m) for k, m in model.named_modules() if k.startswith("language_model.")]

        recipe = mixed_quant_predicate_builder(expert_recipe, _Text(), group_size)

    def base_quant_predicate(path, module):  # mlx_vlm.convert's, verbatim in behaviour
        if utils.skip_multimodal_module(path):
            return False
        if recipe is not None and ".switch_mlp." in path:
            return recipe(path, module)
        if (
            expert_bits is not None
            and ".switch_mlp." in path
            and (expert_layers is None or int(path.split(".layers.")[1].split(".")[0]) in expert_layers)
        ):
            return {"group_size": group_size, "bits": expert_bits, "mode": "affine"}
        return model_predicate(path, module)

    model, qconfig = quant_utils.quantize_model(model, config, group_size, bits, quant_predicate=base_quant_predicate)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    utils.save_weights(out, model, donate_weights=False)
    utils.save_config(qconfig, config_path=out / "config.json")
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        if os.path.exists(os.path.join(hf_dir, name)):
            with open(os.path.join(hf_dir, name), "rb") as f, open(out / name, "wb") as g:
                g.write(f.read())
    return model
