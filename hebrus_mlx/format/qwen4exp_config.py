"""Qwen4Exp model arguments and the PLE constants derived from them.

Kept free of MLX imports on purpose: CPU-only admission (AFN-004) validates configs and PLE
constants without loading any accelerator code. `qwen4exp.py` re-exports `ModelArgs`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..errors import HebrusError

LAYER_TYPES = ("linear_attention", "indexed_attention")
QSA_FIELDS = (
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
)


# The model types this runtime builds: the text model and the conditional-generation wrapper around it.
MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")


class ConfigError(HebrusError, ValueError):
    """A config.json field is malformed or unsupported; `field` is ``config.<name>``."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"config.{field_name}", message)


def _check_model_type(params: dict, where: str = "") -> None:
    # Before any field check: another architecture's config would otherwise fail on the first
    # Qwen4Exp field it lacks, which tells the user nothing. A config without one is taken as Qwen4Exp.
    kind = params.get("model_type")
    if kind is not None and kind not in MODEL_TYPES:
        raise ConfigError(
            where + "model_type",
            f"model_type {kind!r} is not supported (hebrus-mlx runs Qwen4Exp: {', '.join(MODEL_TYPES)})",
        )


def _require_int(name, value, minimum=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(name, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")


def _positive_number(value):
    return type(value) in (int, float) and 0 < value < math.inf


@dataclass
class ModelArgs:
    model_type: str = "qwen4_exp_text"
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_parameters: dict | None = None
    layer_types: list | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True
    output_gate_type: str | None = None
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list = field(default_factory=list)
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    eos_token_id: Any = None
    full_attention_interval: int = 4

    @classmethod
    def from_dict(cls, config: dict) -> ModelArgs:
        """Build from an HF config.json dict: a bare text config or a conditional-generation one."""
        if not isinstance(config, dict):
            raise ConfigError("config", f"must be a JSON object, got {type(config).__name__}")
        params = dict(config)
        _check_model_type(params)
        if "text_config" in params:
            text = params["text_config"]
            if not isinstance(text, dict):
                raise ConfigError("text_config", "must be a JSON object")
            outer_eos = params.get("eos_token_id")
            params = dict(text)
            _check_model_type(params, "text_config.")
            if params.get("eos_token_id") is None and outer_eos is not None:
                params["eos_token_id"] = outer_eos
        names = inspect.signature(cls).parameters
        args = cls(**{k: v for k, v in params.items() if k in names})
        args.validate()
        return args

    # ---- derived values -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def partial_rotary_factor(self) -> float:
        return float((self.rope_parameters or {}).get("partial_rotary_factor", 1.0))

    @property
    def rope_theta(self) -> float:
        return float((self.rope_parameters or {}).get("rope_theta", 10000.0))

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def eos_id(self) -> int | None:
        """The EOS id PLE hashing uses: the first one when the config lists several."""
        eos = self.eos_token_id
        if isinstance(eos, list):
            return eos[0] if eos else None
        return eos

    @property
    def qsa_window(self) -> int:
        """Most keys one QSA query can attend: budget + compress_ratio - 1 (AFN-011/016)."""
        return self.indexer_budget + self.indexer_compress_ratio - 1

    def ple_index(self, layer: int) -> int | None:
        """Position of a zero-indexed layer among the PLE layers, or None."""
        one_indexed = layer + 1
        return self.ple_layer_ids.index(one_indexed) if one_indexed in self.ple_layer_ids else None

    # ---- validation ------------------------------------------------------------------------
    def validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "num_experts",
            "num_experts_per_tok",
            "hc_lowrank",
            "ple_conv_kernel_size",
            "ngram_size",
            "heads_per_ngram",
            "ngram_vocab_size_base",
            "make_ngram_vocab_size_divisible_by",
            "split_ngram_parts",
        ):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("hc_count", self.hc_count, minimum=2)
        _require_int("seed", self.seed, minimum=0)
        if not _positive_number(self.rms_norm_eps):
            raise ConfigError("rms_norm_eps", f"must be a positive number, got {self.rms_norm_eps!r}")
        if self.hidden_act != "silu":
            raise ConfigError("hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")
        gate = self.output_gate_type or self.hidden_act
        if gate not in ("silu", "sigmoid"):
            raise ConfigError("output_gate_type", f"must be 'silu' or 'sigmoid', got {gate!r}")
        if self.attention_bias:
            raise ConfigError("attention_bias", "Qwen4Exp attention has no bias")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings", "Qwen4Exp keeps a separate lm_head")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_key_value_heads", "must divide num_attention_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_key_heads", "must divide linear_num_value_heads")
        if not self.num_experts_per_tok <= self.num_experts:
            raise ConfigError("num_experts_per_tok", f"must be <= num_experts={self.num_experts}")
        self._validate_rope()
        self._validate_layer_types()
        self._validate_qsa()
        self._validate_ple()

    def _validate_rope(self):
        rope = self.rope_parameters if self.rope_parameters is not None else {}
        if not isinstance(rope, dict):
            raise ConfigError("rope_parameters", "must be an object")
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError("rope_parameters.rope_type", f"only 'default' is supported, got {rope_type!r}")
        if not _positive_number(rope.get("rope_theta", 10000.0)):
            raise ConfigError("rope_parameters.rope_theta", f"must be a positive number, got {rope['rope_theta']!r}")
        factor = rope.get("partial_rotary_factor", 1.0)
        if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ConfigError("rope_parameters.partial_rotary_factor", f"must be in (0, 1], got {factor!r}")
        if self.rotary_dim % 2:
            raise ConfigError("rope_parameters.partial_rotary_factor", "rotary dimension must be even")

    def _validate_layer_types(self):
        if self.layer_types is None:
            _require_int("full_attention_interval", self.full_attention_interval, minimum=1)
            self.layer_types = [
                "linear_attention" if (i + 1) % self.full_attention_interval else "indexed_attention"
                for i in range(self.num_hidden_layers)
            ]
        if not isinstance(self.layer_types, list):
            raise ConfigError("layer_types", "must be a list")
        # Real checkpoints spell indexed layers "full_attention".
        self.layer_types = ["indexed_attention" if t == "full_attention" else t for t in self.layer_types]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError("layer_types", f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"layer_types[{i}]", f"unknown layer type {kind!r}")

    def _validate_qsa(self):
        values = {name: getattr(self, name) for name in QSA_FIELDS}
        if "indexed_attention" not in self.layer_types and all(v is None for v in values.values()):
            return
        for name, value in values.items():
            if value is None:
                raise ConfigError(name, "is required for indexed_attention layers (QSA)")
            _require_int(name, value, minimum=1)
        if self.indexer_kv_heads != 1:
            raise ConfigError("indexer_kv_heads", f"Qwen4Exp QSA requires 1, got {self.indexer_kv_heads}")
        if self.indexer_budget % self.indexer_compress_ratio:
            raise ConfigError(
                "indexer_budget",
                f"{self.indexer_budget} is not divisible by indexer_compress_ratio={self.indexer_compress_ratio}",
            )
        if self.rotary_dim > self.indexer_head_dim:
            raise ConfigError(
                "indexer_head_dim",
                f"rotary dim {self.rotary_dim} does not fit indexer_head_dim {self.indexer_head_dim}",
            )

    def _validate_ple(self):
        ids = self.ple_layer_ids if self.ple_layer_ids is not None else []
        if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ConfigError("ple_layer_ids", "must be a list of integers")
        self.ple_layer_ids = sorted(set(ids))
        if self.ple_embed_dim is None:
            self.ple_embed_dim = self.hidden_size
        if not self.ple_layer_ids:
            return
        _require_int("ple_embed_dim", self.ple_embed_dim, minimum=1)
        if self.ple_embed_dim % self.ngram_heads:
            raise ConfigError(
                "ple_embed_dim", f"{self.ple_embed_dim} is not divisible by the {self.ngram_heads} n-gram heads"
            )
        for layer_id in self.ple_layer_ids:
            if not 1 <= layer_id <= self.num_hidden_layers:
                raise ConfigError("ple_layer_ids", f"id {layer_id} outside [1, {self.num_hidden_layers}] (one-indexed)")
            if self.layer_types[layer_id - 1] != "linear_attention":
                raise ConfigError("ple_layer_ids", f"PLE on layer {layer_id}, which is not a linear_attention layer")
        eos = self.eos_token_id
        if eos is None or (isinstance(eos, list) and not eos):
            raise ConfigError("eos_token_id", "must be set when PLE layers are enabled")
        for e in eos if isinstance(eos, list) else [eos]:
            _require_int("eos_token_id", e, minimum=0)


# ---- PLE hashing constants (the scheme of the pinned reference, re-derived here) -----------------
_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007
_INT64_MAX = (1 << 63) - 1


def _mix64(value: int) -> int:
    value = (value + _GOLDEN_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX_1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX_2) & _MASK64
    return value ^ (value >> 31)


def ple_layer_multipliers(args: ModelArgs, ple_index: int) -> list[int]:
    """Odd per-position multipliers, bounded so token_id * multiplier never overflows int64."""
    half_bound = max(1, (_INT64_MAX // max(args.vocab_size, 1)) // 2)
    layer_seed = args.seed + _LAYER_SEED_STRIDE * ple_index
    return [
        2 * (_mix64((layer_seed + _GOLDEN_GAMMA * (position + 1)) & _MASK64) % half_bound) + 1
        for position in range(args.ngram_size)
    ]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@lru_cache(maxsize=64)
def ngram_head_primes(base: int, heads: int, table_index: int) -> tuple[int, ...]:
    """Prime vocabulary size of each hashed head of PLE table `table_index`: distinct primes
    >= base numbered globally across tables; head h takes the (table_index*heads + h + 1)-th."""
    sizes = []
    first_global = table_index * heads
    prime = base - 1
    count = 0
    while len(sizes) < heads:
        prime += 1
        while not _is_prime(prime):
            prime += 1
        count += 1
        if count > first_global:
            sizes.append(prime)
    return tuple(sizes)


def ple_head_vocab_sizes(args: ModelArgs, ple_index: int) -> list[int]:
    return list(ngram_head_primes(args.ngram_vocab_size_base, args.ngram_heads, ple_index))


def ple_head_offsets(sizes: list[int]) -> list[int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


def padded_rows(head_sizes, divisor: int) -> int:
    """Rows of a PLE table: the sum of its head primes padded to the divisor."""
    return -(-sum(head_sizes) // divisor) * divisor


def ple_table_rows(args: ModelArgs, ple_index: int) -> int:
    return padded_rows(ple_head_vocab_sizes(args, ple_index), args.make_ngram_vocab_size_divisible_by)


def ple_constants(args: ModelArgs, ple_index: int) -> dict:
    """The PLE constant tensors a checkpoint carries for one PLE layer (checkpoint_keys'
    PLE_CONSTANT_NAMES), as derived from the config; conversion and sanitize check them."""
    sizes = ple_head_vocab_sizes(args, ple_index)
    return {
        "layer_multipliers": ple_layer_multipliers(args, ple_index),
        "ngram_heads_vocab_sizes": sizes,
        "ngram_heads_offsets": ple_head_offsets(sizes),
    }


def ple_row_width(args: ModelArgs) -> int:
    return args.ple_embed_dim // args.ngram_heads


def mtp_layer_args(args: ModelArgs) -> ModelArgs:
    """Arguments of the MTP head's single decoder layer: indexed attention, no PLE, same widths."""
    from dataclasses import replace

    if args.indexer_n_heads is None:
        raise ConfigError("indexer_n_heads", "the MTP head's QSA layer needs the indexer fields")
    return replace(args, num_hidden_layers=1, layer_types=["indexed_attention"], ple_layer_ids=[])
