"""A checkpoint source of any Qwen4Exp geometry whose weights are generated, not read: `convert`
runs at the real model's full size without a 360 GB checkpoint on disk.

The key inventory and shapes come from upstream code, not from our key tables: transformers'
`Qwen4ExpForConditionalGeneration` built on the meta device from the config (no weights are
allocated). Values follow the scale of transformers' own `_init_weights`: normal(0,
initializer_range) for projections and embeddings, zeros for the (1 + w) RMSNorms and the PLE
convolution, ones for `dt_bias` and plain norms, log(uniform(0.01, 16)) for `A_log`; the PLE
constant buffers are the upstream module's own values. Every tensor (every row range of one) is a
deterministic function of (seed, key, rows): a slice of one seeded pool of normal draws at an
offset hashed from the key, so generating a 2.5 GB fused expert tensor costs a copy, not an RNG pass.

A directory holding `config.json` and `synthetic.json` ({"seed": int}) is such a source
(`is_synthetic`); `convert.open_source` opens it with `SyntheticSource`."""

import json
import os
import zlib

import numpy as np

from ..convert.sources import Source

MARKER = "synthetic.json"
# Normal draws shared by every tensor (64 MiB of float32): long enough that no two tensors of a
# 48-layer model start at the same offset by more than chance, small enough to build in a second.
POOL_VALUES = 1 << 24
# Experts of a layer encoded for real (the rest are their masked copies, `expert_parts`), and the
# random words the masks are cut from (16 MiB).
TEMPLATES = 8
MASK_WORDS = 1 << 22


def is_synthetic(path):
    return os.path.isfile(os.path.join(path, MARKER))


def write(path, config, seed=0, files=()):
    """Make `path` a synthetic source of `config` (an HF config.json dict); `files`: paths of
    source files copied in beside it (tokenizer.json, which admission requires, a chat template)."""
    import shutil

    os.makedirs(path, exist_ok=True)
    for f in files:
        shutil.copy(f, path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump({"seed": seed}, f)


def meta_model(config):
    """transformers' model of `config` on the meta device (shapes, no storage)."""
    import torch
    from transformers import Qwen4ExpConfig, Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration, Qwen4ExpTextConfig

    if "text_config" in config:
        cls, cfg = Qwen4ExpForConditionalGeneration, Qwen4ExpConfig.from_dict(config)
    else:
        cls, cfg = Qwen4ExpForCausalLM, Qwen4ExpTextConfig.from_dict(config)
    with torch.device("meta"):
        return cls(cfg)


def _rules(model):
    """{state_dict key: (init rule, shape, constant or None)} mirroring `_init_weights`."""
    out = {}
    for mname, module in model.named_modules():
        kind = type(module).__name__
        for pname, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            key = f"{mname}.{pname}" if mname else pname
            shape = tuple(t.shape)
            if pname in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
                out[key] = ("const", shape, _ple_constant(module, pname))
            elif pname == "dt_bias":
                out[key] = ("ones", shape, None)
            elif pname == "A_log":
                out[key] = ("a_log", shape, None)
            elif kind == "Qwen4ExpTextRMSNorm":
                out[key] = ("zeros", shape, None)
            elif "Norm" in kind:  # LayerNorm / plain RMSNorm: weight 1, bias 0
                out[key] = ("ones" if pname == "weight" else "zeros", shape, None)
            elif pname == "bias":
                out[key] = ("zeros", shape, None)
            else:
                out[key] = ("normal", shape, None)
    # The PLE conv1d is a child module; _init_weights zeroes it from the PLE layer.
    for mname, module in model.named_modules():
        if type(module).__name__ == "Qwen4ExpTextPLELayer":
            out[f"{mname}.conv1d.weight"] = ("zeros", tuple(module.conv1d.weight.shape), None)
    state = set(model.state_dict())  # persistent tensors only (rotary inv_freq is not saved)
    return {k: v for k, v in out.items() if k in state}


def _ple_constant(module, name):
    from transformers.models.qwen4_exp import modeling_qwen4_exp as up

    if name == "layer_multipliers":
        t = up._build_layer_multipliers(
            module.unigram_vocab_size, module.ngram_size, module.ple_layer_index, module.seed
        )
        return np.asarray(t.tolist(), np.int64)
    return np.asarray(module.head_vocab_sizes if name == "ngram_heads_vocab_sizes" else module.head_offsets, np.int64)


def inventory(config):
    """{raw key: (rule, shape, constant)} of the checkpoint `config` describes, as save_pretrained
    lays it out: the PLE table split into `split_ngram_parts` shard tensors."""
    text = config.get("text_config", config)
    parts = text.get("split_ngram_parts", 512)
    out = {}
    for key, (rule, shape, const) in _rules(meta_model(config)).items():
        if key.endswith("ngram_embedding.weight"):
            rows, width = shape
            if rows % parts:
                raise ValueError(f"{key}: {rows} rows do not split into {parts} parts")
            stem = key[: -len("weight")]
            for s in range(parts):
                out[f"{stem}shard_{s}.weight"] = (rule, (rows // parts, width), None)
        else:
            out[key] = (rule, shape, const)
    return out


class SyntheticSource(Source):
    """`Source` whose reads generate the tensor instead of reading a shard."""

    def __init__(self, path, config=None):
        self.path = path
        with open(os.path.join(path, MARKER)) as f:
            self.seed = int(json.load(f)["seed"])
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        text = config.get("text_config", config)
        self.std = float(text.get("initializer_range", 0.02))
        self.rules = inventory(config)
        self.index = {
            k: (None, 0, {"dtype": "I64" if rule == "const" else "BF16", "shape": list(shape)})
            for k, (rule, shape, _) in self.rules.items()
        }
        self.fp8 = None
        self._pool = self._masks = None
        self._templates, self._templates_of = {}, None

    def pool(self):
        if self._pool is None:
            rng = np.random.default_rng(self.seed)
            self._pool = (rng.standard_normal(POOL_VALUES, np.float32) * np.float32(self.std)).astype(np.float32)
        return self._pool

    def masks(self):
        if self._masks is None:
            rng = np.random.default_rng(self.seed + 1)
            self._masks = rng.integers(0, 1 << 32, MASK_WORDS, np.uint32, endpoint=False)
        return self._masks

    def expert_parts(self, layer, e, fam, codec_name, layout):
        """Expert e of `layer`: template e % TEMPLATES of the layer goes through the real read and
        encode (`Source.expert_parts`); an affine record's packed codes are then XOR-ed with a
        seeded mask of (layer, e), so every record is distinct (any code word is a valid code) at a
        copy's cost instead of a quantization's. Scales and biases are the template's."""
        from ..artifact import constants as C

        t = e % TEMPLATES
        if not C.codec(codec_name).affine:
            return super().expert_parts(layer, e, fam, codec_name, layout)
        if self._templates_of != (layer, codec_name):
            self._templates, self._templates_of = {}, (layer, codec_name)  # one layer's held at a time
        cached = self._templates.get(t)
        if cached is None:
            cached = self._templates[t] = super().expert_parts(layer, t, fam, codec_name, layout)
        if e == t:
            return cached
        out = {}
        for comp, parts in cached.items():
            w = parts["weight"]
            at = zlib.crc32(f"{self.seed}:{layer}:{e}:{comp}".encode())
            mask = _take(self.masks(), at, w.size, np.uint32).reshape(w.shape)
            out[comp] = dict(parts, weight=w ^ mask)
        return out

    def read(self, key, start=None, stop=None):
        rule, shape, const = self.rules[key]
        shape = list(shape)
        if start is not None:
            shape[0] = stop - start
        else:
            start = 0
        n = int(np.prod(shape))
        row = n // shape[0] if shape and shape[0] else 0
        if rule == "const":
            return const.reshape(shape), "I64"
        if rule in ("zeros", "ones"):
            return np.full(shape, 0.0 if rule == "zeros" else 1.0, np.float32), "BF16"
        at = zlib.crc32(f"{self.seed}:{key}".encode()) + start * row
        if rule == "a_log":
            rng = np.random.default_rng(at)
            return np.log(rng.uniform(0.01, 16, n)).astype(np.float32).reshape(shape), "BF16"
        return _bf16_round(_take(self.pool(), at, n)).reshape(shape), "BF16"


def _take(pool, at, n, dtype=np.float32):
    """n values of `pool` from offset `at`, wrapping around."""
    out = np.empty(n, dtype)
    at %= len(pool)
    done = 0
    while done < n:
        k = min(n - done, len(pool) - at)
        out[done : done + k] = pool[at : at + k]
        done, at = done + k, 0
    return out


def _bf16_round(a):
    """Values a bf16 checkpoint holds: float32 with the low 16 bits cleared (convert reads "BF16")."""
    a.view(np.uint32)[...] &= np.uint32(0xFFFF0000)
    return a


def register_family(config):
    """The registered family of `config`: a registered one it matches exactly (the real family at the
    real PLE row count), else a new descriptor named after its PLE rows, registered in this process
    (a reduced PLE table is another geometry; every process that admits its artifact registers it)."""
    from ..artifact import constants as C
    from ..artifact import manifest as M

    constants = M.model_constants(config)
    for name in C.FAMILIES:
        try:
            return C.match_family(constants, name)
        except C.FamilyError:
            pass
    rows = "-".join(str(r) for r in C.derive_descriptor(constants, "x", 0).ple_rows)
    name = f"synthetic-{constants['num_hidden_layers']}l-{constants['num_experts']}e-ple{rows}"
    family_id = 0x5E000000 | (zlib.crc32(name.encode()) & 0xFFFFFF)
    return C.register_family(C.derive_descriptor(constants, name, family_id))


# The pinned real source's identity (Qwen/Qwen3.8-Flash-Next @ de4b8e4d43b9, AFN-001): what the
# generated inventory of `real_config` is checked against.
REAL_REVISION = "de4b8e4d43b917e7706784d8bb445c9af86a3540"
REAL_TENSORS, REAL_VISION_TENSORS, REAL_MTP_TENSORS = 1658, 333, 31
REAL_SHARDS, REAL_BYTES = 131, 359_999_963_128


def real_config(ngram_vocab_size_base=None, split_ngram_parts=128, **overrides):
    """HF config.json (conditional generation, text + vision) of Qwen3.8-Flash-Next as far as the repo
    pins it: the family descriptor's fields (layers, hidden, layer pattern, context, experts, PLE)
    and transformers' defaults for the rest. Not pinned anywhere here and chosen: the PLE layer
    (id 1), the indexer dims (16 heads of 128, budget 2048, ratio 4), the rope fields, and
    split_ngram_parts=128 (the value that makes the inventory 1,658 tensors: 320,001,536 rows split
    evenly either way). `ngram_vocab_size_base` below 20,000,000 shrinks the PLE table to fewer rows
    of the real width (another family, `register_family`). `overrides`: text-config fields replaced
    (a smaller smoke run of the same code path, e.g. num_hidden_layers with its layer_types)."""
    from transformers import Qwen4ExpConfig

    from ..artifact import constants as C

    f = C.QWEN38_FLASH_NEXT
    text = dict(
        vocab_size=f.vocab_size,
        hidden_size=f.hidden_size,
        num_hidden_layers=f.num_hidden_layers,
        layer_types=list(f.layer_types),
        max_position_embeddings=f.max_position_embeddings,
        hc_count=f.hc_count,
        num_experts=f.num_experts,
        num_experts_per_tok=f.num_experts_per_tok,
        moe_intermediate_size=f.moe_intermediate_size,
        ple_layer_ids=[1],
        ple_embed_dim=f.ple_embed_dim,
        ngram_size=f.ngram_size,
        heads_per_ngram=f.heads_per_ngram,
        ngram_vocab_size_base=ngram_vocab_size_base or f.ngram_vocab_size_base,
        make_ngram_vocab_size_divisible_by=f.ngram_row_alignment,
        split_ngram_parts=split_ngram_parts,
        eos_token_id=[248044, 248046],
        indexer_n_heads=16,
        indexer_kv_heads=1,
        indexer_head_dim=128,
        indexer_budget=2048,
        indexer_compress_ratio=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    text.update(overrides)
    return Qwen4ExpConfig(text_config=text).to_dict()
