"""Explicit key tables between Qwen4Exp HF checkpoints and hebrus-mlx runtime names.

Every tensor in a checkpoint is classified by exactly one rule: a dense template, a routed-expert
template, a PLE shard, a PLE constant, or a named exclusion. Both the direct HF loader
(`Model.sanitize`) and `hebrus-mlx convert` walk checkpoints through `classify`, and both assert
that the set of keys they saw equals `expected_hf_keys(args)` (nothing silently ignored).

Runtime names follow the HF module tree except for three places:
  routed experts   -> model.layers.{i}.mlp.switch_mlp.{gate,up,down}_proj.weight  [E, out, in]
  PLE table        -> model.layers.{i}.ple.ple_embedding.ngram_embedding.weight    (shards concatenated)
  depthwise convs  -> same key, MLX layout [C, K, 1] instead of HF [C, 1, K]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import HebrusError

# Prefix written by Qwen4ExpForConditionalGeneration; the text model lives below it.
CONDITIONAL_PREFIX = "model.language_model."

# Named exclusion rules: (rule name, regex on the *raw* checkpoint key).
EXCLUSION_RULES = (
    ("vision", re.compile(r"^(model\.)?visual\.")),
    ("mtp", re.compile(r"^(model\.)?mtp\.")),
)

# Dense tensors present in every layer: template relative to "model.layers.{i}.".
HC_TEMPLATES = tuple(
    f"{block}.{name}"
    for block in ("attn_hyper_connection", "mlp_hyper_connection")
    for name in (
        "hc_norm.weight",
        "input_mix_weight_down.weight",
        "input_mix_weight_up.weight",
        "block_inject_weight.weight",
    )
)
MOE_DENSE_TEMPLATES = (
    "mlp.gate.weight",
    "mlp.shared_expert.gate_proj.weight",
    "mlp.shared_expert.up_proj.weight",
    "mlp.shared_expert.down_proj.weight",
    "mlp.shared_expert_gate.weight",
)
LINEAR_ATTN_TEMPLATES = (
    "linear_attn.A_log",
    "linear_attn.dt_bias",
    "linear_attn.conv1d.weight",
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight",
    "linear_attn.in_proj_a.weight",
    "linear_attn.in_proj_b.weight",
    "linear_attn.norm.weight",
    "linear_attn.out_proj.weight",
)
INDEXED_ATTN_TEMPLATES = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "self_attn.indexer.index_qk_proj.weight",
    "self_attn.indexer.q_layernorm.weight",
    "self_attn.indexer.k_layernorm.weight",
)
PLE_DENSE_TEMPLATES = (
    "ple.key_proj.weight",
    "ple.value_proj.weight",
    "ple.norm_key.weight",
    "ple.norm_query.weight",
    "ple.norm_conv.weight",
    "ple.conv1d.weight",
)
# Integer buffers save_pretrained writes; they are re-derived from the config and checked.
PLE_CONSTANT_NAMES = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")
GLOBAL_TEMPLATES = (
    "model.embed_tokens.weight",
    "model.hyper_connection_mixer.hc_norm.weight",
    "model.hyper_connection_mixer.input_mix_weight_down.weight",
    "model.hyper_connection_mixer.input_mix_weight_up.weight",
)
EXPERT_COMPONENTS = ("gate_proj", "up_proj", "down_proj")
# Keys whose HF layout [C, 1, K] becomes MLX [C, K, 1].
DEPTHWISE_CONV_SUFFIXES = ("linear_attn.conv1d.weight", "ple.conv1d.weight")

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_RE = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")
_PLE_SHARD_RE = re.compile(r"^ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")
_PLE_CONST_RE = re.compile(r"^ple\.ple_embedding\.(" + "|".join(PLE_CONSTANT_NAMES) + r")$")


class CheckpointKeyError(HebrusError, ValueError):
    """A checkpoint key is unknown, missing, duplicated or inconsistent with the config."""

    default_field = "checkpoint"


@dataclass(frozen=True)
class KeyClass:
    """What one checkpoint tensor is.

    kind: "dense" | "expert" | "fused_expert" | "ple_shard" | "ple_constant" | "excluded"
    """

    kind: str
    runtime_key: str | None = None
    layer: int | None = None
    expert: int | None = None
    component: str | None = None  # gate_proj/up_proj/down_proj, gate_up_proj, or a PLE constant name
    shard: int | None = None
    rule: str | None = None  # exclusion rule name
    depthwise_conv: bool = False


def strip_prefix(key: str) -> str:
    """Map a conditional-generation key onto the text-model key space."""
    if key.startswith(CONDITIONAL_PREFIX):
        return "model." + key[len(CONDITIONAL_PREFIX) :]
    return key


def exclusion_rule(key: str) -> str | None:
    for name, pattern in EXCLUSION_RULES:
        if pattern.match(key):
            return name
    return None


def layer_templates(args, layer: int) -> tuple[str, ...]:
    kind = args.layer_types[layer]
    names = HC_TEMPLATES + MOE_DENSE_TEMPLATES
    names += LINEAR_ATTN_TEMPLATES if kind == "linear_attention" else INDEXED_ATTN_TEMPLATES
    if args.ple_index(layer) is not None:
        names += PLE_DENSE_TEMPLATES
    return names


def classify(raw_key: str, args) -> KeyClass:
    """Classify one checkpoint key against the config; unknown keys raise CheckpointKeyError."""
    rule = exclusion_rule(raw_key)
    if rule is not None:
        return KeyClass("excluded", rule=rule)
    key = strip_prefix(raw_key)
    if key == "lm_head.weight" or key in GLOBAL_TEMPLATES:
        return KeyClass("dense", runtime_key=key)
    match = _LAYER_RE.match(key)
    if not match:
        raise CheckpointKeyError(f"unexpected tensor {raw_key!r}: matches no key rule")
    layer, rest = _index(match, raw_key, "layer", "num_hidden_layers", args.num_hidden_layers), match.group(2)
    prefix = f"model.layers.{layer}."
    if rest in layer_templates(args, layer):
        return KeyClass("dense", runtime_key=key, layer=layer, depthwise_conv=rest in DEPTHWISE_CONV_SUFFIXES)
    m = _EXPERT_RE.match(rest)
    if m:
        expert = _index(m, raw_key, "expert", "num_experts", args.num_experts)
        component = m.group(2)
        return KeyClass(
            "expert",
            runtime_key=prefix + f"mlp.switch_mlp.{component}.weight",
            layer=layer,
            expert=expert,
            component=component,
        )
    m = _FUSED_RE.match(rest)
    if m:
        return KeyClass("fused_expert", layer=layer, component=m.group(1))
    if args.ple_index(layer) is not None:
        m = _PLE_SHARD_RE.match(rest)
        if m:
            shard = _index(m, raw_key, "shard", "split_ngram_parts", args.split_ngram_parts)
            return KeyClass(
                "ple_shard", runtime_key=prefix + "ple.ple_embedding.ngram_embedding.weight", layer=layer, shard=shard
            )
        m = _PLE_CONST_RE.match(rest)
        if m:
            return KeyClass("ple_constant", layer=layer, component=m.group(1))
    raise CheckpointKeyError(f"unexpected tensor {raw_key!r}: matches no key rule for layer {layer}")


def _index(m, raw_key, what, limit_name, limit) -> int:
    """The index a key rule matched (group 1), refused at or past `limit`."""
    i = int(m.group(1))
    if i >= limit:
        raise CheckpointKeyError(f"unexpected tensor {raw_key!r}: {what} {i} >= {limit_name}={limit}")
    return i


def expected_hf_keys(args, expert_layout: str = "unfused") -> set[str]:
    """The exact text-model key set (without the conditional prefix) a checkpoint must hold.

    expert_layout "mlx" is the mlx-lm / mlx-vlm layout (`convert/mlx_source.py`): experts stacked as
    `mlp.switch_mlp.{gate,up,down}_proj.weight`, PLE shards as `ngram_embedding.shards.{s}.weight`;
    one key per module (a quantized module's .scales/.biases are parts of it, not counted)."""
    if expert_layout not in ("unfused", "fused", "mlx"):
        raise ValueError(f"expert_layout must be 'unfused', 'fused' or 'mlx', got {expert_layout!r}")
    keys = set(GLOBAL_TEMPLATES)
    keys.add("lm_head.weight")
    for layer in range(args.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        keys.update(prefix + name for name in layer_templates(args, layer))
        if expert_layout == "unfused":
            keys.update(
                f"{prefix}mlp.experts.{e}.{c}.weight" for e in range(args.num_experts) for c in EXPERT_COMPONENTS
            )
        elif expert_layout == "fused":
            keys.update({prefix + "mlp.experts.gate_up_proj", prefix + "mlp.experts.down_proj"})
        else:
            keys.update(f"{prefix}mlp.switch_mlp.{c}.weight" for c in EXPERT_COMPONENTS)
        if args.ple_index(layer) is not None:
            shard = "shards." if expert_layout == "mlx" else "shard_"
            keys.update(
                f"{prefix}ple.ple_embedding.ngram_embedding.{shard}{s}.weight" for s in range(args.split_ngram_parts)
            )
            keys.update(f"{prefix}ple.ple_embedding.{n}" for n in PLE_CONSTANT_NAMES)
    return keys


def detect_expert_layout(keys) -> str:
    """Which routed-expert layout a key set uses; mixing both is an error."""
    stripped = [strip_prefix(k) for k in keys]
    fused = any(_FUSED_RE.match(m.group(2)) for k in stripped if (m := _LAYER_RE.match(k)))
    unfused = any(_EXPERT_RE.match(m.group(2)) for k in stripped if (m := _LAYER_RE.match(k)))
    if fused and unfused:
        raise CheckpointKeyError("checkpoint mixes fused (gate_up_proj) and per-expert expert tensors")
    return "fused" if fused else "unfused"


def check_key_set(raw_keys, args) -> dict:
    """Classify all keys; raise naming the first missing/unexpected tensor. Returns exclusion counts."""
    layout = detect_expert_layout(raw_keys)
    seen = set()
    excluded: dict[str, int] = {}
    for raw in sorted(raw_keys):
        cls = classify(raw, args)
        if cls.kind == "excluded":
            excluded[cls.rule] = excluded.get(cls.rule, 0) + 1
            continue
        key = strip_prefix(raw)
        if key in seen:
            raise CheckpointKeyError(f"duplicate tensor {raw!r} (text and conditional prefixes both present)")
        seen.add(key)
    expected = expected_hf_keys(args, layout)
    missing = sorted(expected - seen)
    if missing:
        raise CheckpointKeyError(f"missing tensor {missing[0]!r} ({len(missing)} missing in total)")
    extra = sorted(seen - expected)
    if extra:
        raise CheckpointKeyError(f"unexpected tensor {extra[0]!r} ({len(extra)} unexpected in total)")
    return {"expert_layout": layout, "consumed": len(seen), "excluded": excluded}


# ---- MTP head (`mtp.*`) ----------------------------------------------------------------------------
# The released checkpoint ships a one-layer multi-token-prediction head beside the text model. The
# main tables above exclude it (rule "mtp"); these tables map it onto runtime names under "mtp."
# for the optional MTP component. Layout learnt from mlx-vlm 0.7.10's qwen4_exp_mtp drafter:
# norms/projections at the top, one indexed-attention decoder layer (no PLE) under layers.0, and a
# stream mixer without injection.
MTP_PREFIXES = ("model.mtp.", "mtp.")
MTP_GLOBAL_TEMPLATES = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "fc_embedding.weight",
    "fc_hidden.weight",
    "hyper_connection_mixer.hc_norm.weight",
    "hyper_connection_mixer.input_mix_weight_down.weight",
    "hyper_connection_mixer.input_mix_weight_up.weight",
)
MTP_LAYER_TEMPLATES = HC_TEMPLATES + MOE_DENSE_TEMPLATES + INDEXED_ATTN_TEMPLATES


def mtp_relative(raw_key: str) -> str | None:
    """The key below the MTP prefix, or None for a non-MTP key."""
    for prefix in MTP_PREFIXES:
        if raw_key.startswith(prefix):
            return raw_key[len(prefix) :]
    return None


def classify_mtp(raw_key: str, args) -> KeyClass:
    """Classify one `mtp.*` key; runtime keys are "mtp." + the module path of `MTPHead`."""
    rest = mtp_relative(raw_key)
    if rest is None:
        raise CheckpointKeyError(f"{raw_key!r} is not an MTP tensor")
    if rest in MTP_GLOBAL_TEMPLATES:
        return KeyClass("dense", runtime_key="mtp." + rest)
    match = re.match(r"^layers\.(\d+)\.(.+)$", rest)
    if not match:
        raise CheckpointKeyError(f"unexpected MTP tensor {raw_key!r}: matches no key rule")
    layer, sub = int(match.group(1)), match.group(2)
    if layer != 0:
        raise CheckpointKeyError(f"unexpected MTP tensor {raw_key!r}: the MTP head has exactly one layer")
    if sub in MTP_LAYER_TEMPLATES:
        return KeyClass("dense", runtime_key="mtp.layers.0." + sub, layer=0)
    m = _EXPERT_RE.match(sub)
    if m:
        expert = int(m.group(1))
        if expert >= args.num_experts:
            raise CheckpointKeyError(
                f"unexpected MTP tensor {raw_key!r}: expert {expert} >= num_experts={args.num_experts}"
            )
        return KeyClass(
            "expert",
            runtime_key=f"mtp.layers.0.mlp.switch_mlp.{m.group(2)}.weight",
            layer=0,
            expert=expert,
            component=m.group(2),
        )
    m = _FUSED_RE.match(sub)
    if m:
        return KeyClass("fused_expert", layer=0, component=m.group(1))
    raise CheckpointKeyError(f"unexpected MTP tensor {raw_key!r}: matches no key rule")


def expected_mtp_keys(args, expert_layout: str = "unfused") -> set[str]:
    """The exact MTP key set (with the bare "mtp." prefix) a checkpoint's head must hold."""
    keys = {"mtp." + k for k in MTP_GLOBAL_TEMPLATES}
    keys.update("mtp.layers.0." + k for k in MTP_LAYER_TEMPLATES)
    if expert_layout == "unfused":
        keys.update(
            f"mtp.layers.0.mlp.experts.{e}.{c}.weight" for e in range(args.num_experts) for c in EXPERT_COMPONENTS
        )
    else:
        keys.update({"mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"})
    return keys


def check_mtp_key_set(raw_keys, args) -> dict | None:
    """None when the checkpoint has no MTP tensors; else classify them all and check the exact set."""
    mtp = [k for k in raw_keys if mtp_relative(k) is not None]
    if not mtp:
        return None
    normal = {}
    for raw in sorted(mtp):
        classify_mtp(raw, args)
        key = "mtp." + mtp_relative(raw)
        if key in normal:
            raise CheckpointKeyError(f"duplicate MTP tensor {raw!r} (two prefixes)")
        normal[key] = raw
    fused = any(".mlp.experts.gate_up_proj" in k or k.endswith(".mlp.experts.down_proj") for k in normal)
    unfused = any(_EXPERT_RE.match(k[len("mtp.layers.0.") :]) for k in normal if k.startswith("mtp.layers.0."))
    if fused and unfused:
        raise CheckpointKeyError("MTP head mixes fused (gate_up_proj) and per-expert expert tensors")
    layout = "fused" if fused else "unfused"
    expected = expected_mtp_keys(args, layout)
    missing = sorted(expected - set(normal))
    if missing:
        raise CheckpointKeyError(f"missing MTP tensor {missing[0]!r} ({len(missing)} missing in total)")
    return {"expert_layout": layout, "consumed": len(normal), "keys": normal}
