"""manifest.json: the artifact's identity, stores, exclusions and state.

The manifest is what loading reads instead of guessing from key names:
which family and profile, which codec each dense tensor carries, which stores
own which bytes, what was excluded and how many, and whether the profile's
parity gate has passed (`verified`) or not (`unverified`, AFN-013).

numpy/json only: admission imports this without MLX.
"""

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from ..format import checkpoint_keys as keys
from ..format.qwen4exp_config import (
    ModelArgs,
    mtp_layer_args,
    ple_head_offsets,
    ple_head_vocab_sizes,
    ple_layer_multipliers,
    ple_row_width,
    ple_table_rows,
)
from . import fast_check
from .constants import (
    MANIFEST_SCHEMA,
    MANIFEST_SCHEMA_VERSION,
    NORM_WEIGHTS_DEFAULT_V1,
    VERIFIED_PROFILES,
    FamilyDescriptor,
    codec,
    profile_codecs,
)
from .errors import AdmissionError

EXPERTS_PATH = "experts.hbem"
DENSE_PATH = "model.safetensors"
MTP_PATH = "mtp.safetensors"


def ple_path(table):
    return f"ple.{table}.hbpl"


# ------------------------------------------------------------ constants ---
# Exact types. JSON keeps int and float apart; bool is not an int here.
CONSTANT_TYPES = {
    "vocab_size": "int",
    "hidden_size": "int",
    "num_hidden_layers": "int",
    "num_attention_heads": "int",
    "num_key_value_heads": "int",
    "head_dim": "int",
    "max_position_embeddings": "int",
    "rms_norm_eps": "float",
    "rope_theta": "float",
    "partial_rotary_factor": "float",
    "layer_types": "str[]",
    "linear_conv_kernel_dim": "int",
    "linear_key_head_dim": "int",
    "linear_value_head_dim": "int",
    "linear_num_key_heads": "int",
    "linear_num_value_heads": "int",
    "moe_intermediate_size": "int",
    "shared_expert_intermediate_size": "int",
    "num_experts": "int",
    "num_experts_per_tok": "int",
    "norm_topk_prob": "bool",
    "hc_count": "int",
    "hc_lowrank": "int",
    "ple_layer_ids": "int[]",
    "ple_embed_dim": "int",
    "ple_conv_kernel_size": "int",
    "ngram_size": "int",
    "heads_per_ngram": "int",
    "ngram_vocab_size_base": "int",
    "make_ngram_vocab_size_divisible_by": "int",
    "seed": "int",
    "split_ngram_parts": "int",
    "indexer_n_heads": "int",
    "indexer_kv_heads": "int",
    "indexer_head_dim": "int",
    "indexer_budget": "int",
    "indexer_compress_ratio": "int",
    "eos_token_ids": "int[]",
    "ple_width": "int",
    "ple_rows": "int[]",
    "ple_head_vocab_sizes": "int[][]",
    "ple_head_offsets": "int[][]",
    "ple_layer_multipliers": "int[][]",
}


def model_args(config):
    return ModelArgs.from_dict(config)


def model_constants(config):
    """Typed constants of a config.json dict, including the derived PLE
    arrays (primes, offsets, multipliers, rows) per PLE table."""
    a = model_args(config)
    eos = a.eos_token_id if isinstance(a.eos_token_id, list) else ([] if a.eos_token_id is None else [a.eos_token_id])
    c = {name: getattr(a, name) for name in CONSTANT_TYPES if hasattr(a, name) and not callable(getattr(a, name))}
    tables = range(len(a.ple_layer_ids))
    c.update(
        rope_theta=float(a.rope_theta),
        partial_rotary_factor=float(a.partial_rotary_factor),
        rms_norm_eps=float(a.rms_norm_eps),
        layer_types=list(a.layer_types),
        ple_layer_ids=list(a.ple_layer_ids),
        eos_token_ids=list(eos),
        ple_width=ple_row_width(a) if a.ple_layer_ids else 0,
        ple_rows=[ple_table_rows(a, t) for t in tables],
        ple_head_vocab_sizes=[ple_head_vocab_sizes(a, t) for t in tables],
        ple_head_offsets=[ple_head_offsets(ple_head_vocab_sizes(a, t)) for t in tables],
        ple_layer_multipliers=[ple_layer_multipliers(a, t) for t in tables],
    )
    return {k: c[k] for k in CONSTANT_TYPES}


def _typed(value, spec):
    if spec == "int":
        return type(value) is int
    if spec == "float":
        return type(value) is float
    if spec == "bool":
        return type(value) is bool
    if spec.endswith("[]"):
        return type(value) is list and all(_typed(v, spec[:-2]) for v in value)
    return type(value) is str


def check_constants(got, want, prefix="model_constants"):
    """Exact equality with exact types; names the first bad field."""
    if type(got) is not dict:
        raise AdmissionError(prefix, "must be an object")
    for name, spec in CONSTANT_TYPES.items():
        field = f"{prefix}.{name}"
        if name not in got:
            raise AdmissionError(field, "missing")
        if not _typed(got[name], spec):
            raise AdmissionError(field, f"must be {spec}, got {type(got[name]).__name__} {got[name]!r}")
        if got[name] != want[name]:
            g, w = got[name], want[name]
            if isinstance(w, list) and isinstance(g, list) and len(g) == len(w):
                i = next(i for i, (x, y) in enumerate(zip(g, w)) if x != y)
                raise AdmissionError(f"{field}[{i}]", f"{g[i]!r} != config {w[i]!r}")
            raise AdmissionError(field, f"{g!r} != config {w!r}")
    extra = sorted(set(got) - set(CONSTANT_TYPES))
    if extra:
        raise AdmissionError(f"{prefix}.{extra[0]}", "unknown constant")


# ---------------------------------------------------------- dense shapes ---
def dense_shapes(args):
    """Logical runtime shape of every dense tensor the key tables name.

    Depthwise convs use the MLX layout [C, K, 1]. Routed experts and PLE rows
    live in their own stores and are not listed.
    """
    H, hc, r = args.hidden_size, args.hc_count, args.hc_lowrank
    hcH = hc * H
    nk, nv, dk, dv = (
        args.linear_num_key_heads,
        args.linear_num_value_heads,
        args.linear_key_head_dim,
        args.linear_value_head_dim,
    )
    conv_dim = 2 * nk * dk + nv * dv
    nh, nkv, hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    S, E, P = args.shared_expert_intermediate_size, args.num_experts, args.ple_embed_dim
    per_layer = {
        "attn_hyper_connection.hc_norm.weight": (hcH,),
        "attn_hyper_connection.input_mix_weight_down.weight": (r, hcH),
        "attn_hyper_connection.input_mix_weight_up.weight": (hcH, r),
        "attn_hyper_connection.block_inject_weight.weight": (hc, hcH),
        "mlp.gate.weight": (E, H),
        "mlp.shared_expert.gate_proj.weight": (S, H),
        "mlp.shared_expert.up_proj.weight": (S, H),
        "mlp.shared_expert.down_proj.weight": (H, S),
        "mlp.shared_expert_gate.weight": (1, H),
        "linear_attn.A_log": (nv,),
        "linear_attn.dt_bias": (nv,),
        "linear_attn.conv1d.weight": (conv_dim, args.linear_conv_kernel_dim, 1),
        "linear_attn.in_proj_qkv.weight": (conv_dim, H),
        "linear_attn.in_proj_z.weight": (nv * dv, H),
        "linear_attn.in_proj_a.weight": (nv, H),
        "linear_attn.in_proj_b.weight": (nv, H),
        "linear_attn.norm.weight": (dv,),
        "linear_attn.out_proj.weight": (H, nv * dv),
        "self_attn.q_proj.weight": (2 * nh * hd, H),
        "self_attn.k_proj.weight": (nkv * hd, H),
        "self_attn.v_proj.weight": (nkv * hd, H),
        "self_attn.o_proj.weight": (H, nh * hd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "ple.key_proj.weight": (hcH, P),
        "ple.value_proj.weight": (H, P),
        "ple.norm_key.weight": (hcH,),
        "ple.norm_query.weight": (hcH,),
        "ple.norm_conv.weight": (hcH,),
        "ple.conv1d.weight": (hcH, args.ple_conv_kernel_size, 1),
    }
    for name in (
        "hc_norm.weight",
        "input_mix_weight_down.weight",
        "input_mix_weight_up.weight",
        "block_inject_weight.weight",
    ):
        per_layer["mlp_hyper_connection." + name] = per_layer["attn_hyper_connection." + name]
    if args.indexer_n_heads is not None:
        ihd = args.indexer_head_dim
        per_layer["self_attn.indexer.index_qk_proj.weight"] = ((args.indexer_n_heads + args.indexer_kv_heads) * ihd, H)
        per_layer["self_attn.indexer.q_layernorm.weight"] = (ihd,)
        per_layer["self_attn.indexer.k_layernorm.weight"] = (ihd,)
    shapes = {
        "model.embed_tokens.weight": (args.vocab_size, H),
        "lm_head.weight": (args.vocab_size, H),
        "model.hyper_connection_mixer.hc_norm.weight": (hcH,),
        "model.hyper_connection_mixer.input_mix_weight_down.weight": (r, hcH),
        "model.hyper_connection_mixer.input_mix_weight_up.weight": (hcH, r),
    }
    for layer in range(args.num_hidden_layers):
        for name in keys.layer_templates(args, layer):
            shapes[f"model.layers.{layer}.{name}"] = per_layer[name]
    return shapes


# Dense weights an affine profile quantizes (as mlx_lm does for Linear and
# Embedding). Routers, hyper-connection mixers, decay inputs, norms and convs
# stay float: they are small and steer routing/gating.
QUANTIZED_SUFFIXES = (
    "embed_tokens.weight",
    "lm_head.weight",
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "index_qk_proj.weight",
    "in_proj_qkv.weight",
    "in_proj_z.weight",
    "out_proj.weight",
    "shared_expert.gate_proj.weight",
    "shared_expert.up_proj.weight",
    "shared_expert.down_proj.weight",
    "ple.key_proj.weight",
    "ple.value_proj.weight",
)


def dense_codec(key, shape, profile):
    """Codec of one dense tensor under `profile`."""
    name = profile_codecs(profile)["dense"]
    c = codec(name)
    if not c.affine:
        return name
    if key.endswith(QUANTIZED_SUFFIXES) and len(shape) == 2 and shape[1] % c.group_size == 0:
        return name
    return "f32"


_ST_DTYPES = {"uint32": "U32", "uint16": "BF16", "float32": "F32"}


def _stored_parts(key, shape, name, lead=()):
    """{stored name: (safetensors dtype, shape)} of one logical tensor under codec `name`; `lead`
    prefixes stacked axes (routed experts [E, rows, cols])."""
    c = codec(name)
    if not c.affine:
        return {key: ("BF16" if name == "bf16" else "F32", tuple(lead) + tuple(shape))}
    stem = key[: -len("weight")]
    return {
        stem + part: (_ST_DTYPES[dtype], tuple(lead) + pshape)
        for part, dtype, pshape in c.parts(shape[0], shape[1], key)
    }


def stored_tensors(args, profile):
    """{stored name: (safetensors dtype, shape)} the dense file must hold.
    An affine tensor `x.weight` is stored as x.weight / x.scales / x.biases."""
    out = {}
    for key, shape in sorted(dense_shapes(args).items()):
        out.update(_stored_parts(key, shape, dense_codec(key, shape, profile)))
    return out


# ------------------------------------------------------------ MTP head ---
def mtp_dense_shapes(args):
    """Logical shape of every dense tensor of the MTP head, by runtime name ("mtp." + module path)."""
    base = dense_shapes(mtp_layer_args(args))
    H, W = args.hidden_size, args.hc_count * args.hidden_size
    shapes = {
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (W,),
        "mtp.fc_embedding.weight": (H, H),
        "mtp.fc_hidden.weight": (H, H),
    }
    for name in keys.MTP_GLOBAL_TEMPLATES:
        if name.startswith("hyper_connection_mixer."):
            shapes["mtp." + name] = base["model." + name]
    for name in keys.MTP_LAYER_TEMPLATES:
        shapes["mtp.layers.0." + name] = base["model.layers.0." + name]
    return shapes


def mtp_weights(args, profile):
    """[(runtime weight key, logical shape, codec, expert component or None)] of the MTP head:
    dense tensors with their profile codec, the routed experts stacked [E, rows, cols] with the
    profile's expert codec (the same codecs the text model's tensors get)."""
    out = [(k, s, dense_codec(k, s, profile), None) for k, s in sorted(mtp_dense_shapes(args).items())]
    m, H = args.moe_intermediate_size, args.hidden_size
    for comp, shape in (("gate", (m, H)), ("up", (m, H)), ("down", (H, m))):
        out.append((f"mtp.layers.0.mlp.switch_mlp.{comp}_proj.weight", shape, profile_codecs(profile)["experts"], comp))
    return out


def mtp_stored_tensors(args, profile):
    """{stored name: (safetensors dtype, shape, codec)} the MTP store must hold."""
    out = {}
    for key, shape, name, comp in mtp_weights(args, profile):
        lead = (args.num_experts,) if comp else ()
        out.update({k: (d, s, name) for k, (d, s) in _stored_parts(key, shape, name, lead).items()})
    return dict(sorted(out.items()))


# -------------------------------------------------------------- manifest ---
def sha256_file(path, chunk=8 << 20, progress=None):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
            if progress is not None:
                progress(len(b))
    return h.hexdigest()


def support_status(profile):
    return "verified" if profile in VERIFIED_PROFILES else "unverified"


def build(
    *,
    family,
    profile,
    source_files,
    revision,
    repo,
    constants,
    stores,
    tensors,
    exclusions,
    consumed,
    state="complete",
    mtp=False,
    norm_weights="zero_centered",
):
    """Assemble a manifest dict. `stores` entries: role, path, format,
    codec, size, sha256 (+ table, layer, rows_per_page for PLE). `norm_weights`
    (constants.NORM_WEIGHTS) records how the dense and MTP stores hold the
    ZeroCenteredRMSNorm weights; the converters copy them unchanged ("zero_centered")."""
    return {
        "norm_weights": norm_weights,
        "schema": MANIFEST_SCHEMA,
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "family": family,
        "profile": profile,
        "support": support_status(profile),
        "source": {"repo": repo, "revision": revision, "files": dict(sorted(source_files.items()))},
        "model_constants": constants,
        "codecs": profile_codecs(profile),
        "stores": stores,
        "tensors": tensors,
        "policy": {"modalities": ["text"], "mtp": "included" if mtp else "excluded"},
        "exclusions": {
            rule: 0 if (mtp and rule == "mtp") else exclusions.get(rule, 0) for rule, _ in keys.EXCLUSION_RULES
        },
        "conversion": {"state": state, "source_tensors_consumed": consumed},
    }


def dumps(manifest):
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def shape_bytes(dtype, shape):
    return {"U32": 4, "BF16": 2, "F32": 4}[dtype] * math.prod(shape)


# ------------------------------------------------------- admitted object ---
@dataclass(frozen=True)
class Store:
    """One store of an admitted manifest (``stores[i]``)."""

    role: str  # dense | experts | ple | mtp
    path: str  # plain file name inside the artifact
    format: str
    codec: str
    size: int
    sha256: str
    table: int | None = None  # PLE only
    layer: int | None = None  # PLE only: the zero-indexed layer it feeds
    rows_per_page: int | None = None  # PLE only
    tensors: Mapping[str, Mapping] | None = None  # MTP only: the head's tensor inventory
    source_tensors: int | None = None  # MTP only: source tensors consumed
    # experts/ple/mtp: the XXH3-128 digest table's entry (artifact/fast_check.py); None in
    # artifacts from before the fast check (their reads are checked by SHA-256).
    fast_check: Mapping | None = None
    # experts of a per-layer store (codec constants.PER_LAYER): one (gate, up, down) codec name
    # per layer; None for a store with one codec.
    layer_codecs: tuple | None = None

    @property
    def expert_codec(self):
        """What ExpertMajorReader / Geometry take: the codec name, or the per-layer table."""
        return self.codec if self.layer_codecs is None else self.layer_codecs


@dataclass(frozen=True)
class Manifest:
    """What `admission.admit` returns: the manifest it validated, typed, with the config and
    family it was checked against. Loading, verify and streaming use this object instead of
    re-reading manifest.json or config.json after admission (no check-then-use window)."""

    directory: str
    family: FamilyDescriptor
    profile: str
    support: str
    codecs: Mapping[str, str]
    stores: tuple[Store, ...]
    tensors: Mapping[str, Mapping]  # stored dense name -> dtype, shape, data_offsets, codec
    constants: Mapping[str, object]
    config: Mapping[str, object]  # config.json as admitted (digest-checked bytes)
    sources: Mapping[str, bytes]  # source identity file -> the digest-checked bytes (tokenizer, templates)
    args: ModelArgs
    report: Mapping[str, object]  # the JSON ownership report (`hebrus-mlx admit`)
    # Stored dense name -> SHA-256 of its bytes (`tensors.<name>.sha256`), so a pipeline stage reads
    # and verifies only its own tensors; None for artifacts written before per-tensor digests.
    dense_digests: Mapping[str, str] | None = None
    # constants.NORM_WEIGHTS: "zero_centered" (the loader folds 1 + w) or "folded" (used as is)
    norm_weights: str = NORM_WEIGHTS_DEFAULT_V1
    # Store path -> its admitted XXH3-128 digest table (16 bytes per unit, artifact/fast_check.py):
    # what streaming checks each read against. None: SHA-256 per read (an older artifact).
    fast_digests: Mapping[str, bytes] | None = None

    def fast_table(self, store: Store) -> list | None:
        """The per-unit XXH3-128 digests of `store`, or None (check reads by SHA-256)."""
        table = (self.fast_digests or {}).get(store.path)
        return None if table is None else fast_check.digests(table)

    def file(self, store: Store) -> str:
        return os.path.join(self.directory, store.path)

    def _only(self, role):
        (store,) = [s for s in self.stores if s.role == role]
        return store

    @property
    def dense(self) -> Store:
        return self._only("dense")

    @property
    def experts(self) -> Store:
        return self._only("experts")

    @property
    def mtp(self) -> Store | None:
        """The optional MTP head store, None when the artifact has none."""
        found = [s for s in self.stores if s.role == "mtp"]
        return found[0] if found else None

    @property
    def ple(self) -> tuple[Store, ...]:
        """PLE stores in table order."""
        return tuple(sorted((s for s in self.stores if s.role == "ple"), key=lambda s: s.table))


def store_from_dict(s) -> Store:
    out = {f.name: s.get(f.name) for f in fields(Store)}
    if out["layer_codecs"] is not None:
        out["layer_codecs"] = tuple(tuple(row) for row in out["layer_codecs"])
    return Store(**out)
