"""Artifact constants: magic numbers, versions, codecs, profiles and the
closed family descriptors (AFN-001, AFN-002, AFN-003).

A family is admitted only when the descriptor derived from a config equals a
registered descriptor field for field. Nothing here accepts "any geometry".
"""

from dataclasses import dataclass, field, fields

from ..format.qwen4exp_config import ngram_head_primes, padded_rows, ple_head_offsets
from .errors import CodecError, FamilyError

# ---------------------------------------------------------------- layout ---
ALIGNMENT = 4096  # direct-I/O alignment of every record and page
SHA256_BYTES = 32

EXPERT_MAJOR_MAGIC = b"HBXEXPM\x00"
EXPERT_MAJOR_VERSION = 2
# A store whose routed experts have a codec per layer and projection (mlx-lm's mixed recipes):
# version 3, header codec_id EXPERT_MAJOR_PER_LAYER_ID, its manifest entry's `layer_codecs`
# ([gate, up, down] codec names per layer) bound by a SHA-256 in the header's reserved bytes.
# Uniform stores stay version 2, byte for byte.
EXPERT_MAJOR_PER_LAYER_VERSION = 3
EXPERT_MAJOR_PER_LAYER_ID = 0xFFFFFFFF
PER_LAYER = "per-layer"  # manifest codecs.experts / the experts store's codec of such an artifact
EXPERT_MAJOR_HEADER_BYTES = 256
EXPERT_MAJOR_ENTRY_BYTES = 128
EXPERT_MAJOR_MAX_LAYERS = 256
EXPERT_MAJOR_MAX_EXPERTS = 512
EXPERT_COMPONENTS = ("gate", "up", "down")
AFFINE_PARTS = ("weight", "scales", "biases")

PLE_MAGIC = b"HBXPLEP\x00"
PLE_VERSION = 1
PLE_HEADER_BYTES = 512
PLE_PAGE_MAGIC = b"PLEP"
PLE_PAGE_HEADER_BYTES = 64
PLE_MAX_HEADS = 32
PLE_MAX_PAGES = 1 << 28  # digest table <= 8 GiB; far above any real profile
PLE_MAX_ROWS_PER_PAGE = 1 << 20
PLE_DEFAULT_PAGE_BYTES = 64 * 1024

U32_MAX = (1 << 32) - 1
OFF_T_MAX = (1 << 63) - 1

MANIFEST_NAME = "manifest.json"
MANIFEST_SCHEMA = "hebrus-mlx.artifact"
MANIFEST_SCHEMA_VERSION = 1

# manifest.norm_weights: how the stored ZeroCenteredRMSNorm weights relate to the scale the norm
# applies. "zero_centered": stored as the checkpoint has them (scale = 1 + w; the loader folds once
# at load); "folded": stored as the scale itself (the loader uses them as is). Schema v1 rule: a
# manifest without the field means "zero_centered" -- every v1 writer before the field existed
# copied the source's norm weights unchanged, and every accepted source layout (HF, HF fp8,
# mlx-vlm) stores them zero-centred.
NORM_WEIGHTS = ("zero_centered", "folded")
NORM_WEIGHTS_DEFAULT_V1 = "zero_centered"

# Source identity files copied into the artifact; their digests bind it.
SOURCE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


# ---------------------------------------------------------------- codecs ---
@dataclass(frozen=True)
class Codec:
    name: str
    codec_id: int
    bits: int
    group_size: int  # 0 for plain float codecs

    @property
    def affine(self):
        return self.group_size > 0

    def parts(self, rows, cols, field_name="codec"):
        """(part, dtype, shape) of one encoded [rows, cols] matrix.

        Affine parts are exactly what `mx.quantize(w, group_size, bits)`
        returns for a bf16 `w`: uint32 packed weights, bf16 scales and biases
        (stored as raw uint16 bit patterns so readers stay numpy-only).
        A group that does not cover a row exactly is rejected, never padded.
        """
        if rows <= 0 or cols <= 0:
            raise CodecError(field_name, f"empty matrix [{rows}, {cols}]")
        if not self.affine:
            dtype = "uint16" if self.bits == 16 else "float32"
            return (("weight", dtype, (rows, cols)),)
        if cols % self.group_size:
            raise CodecError(
                field_name,
                f"{self.name}: row width {cols} is not a multiple of group {self.group_size}",
            )
        if (cols * self.bits) % 32:
            raise CodecError(field_name, f"{self.name}: row width {cols} does not pack into uint32")
        groups = cols // self.group_size
        return (
            ("weight", "uint32", (rows, cols * self.bits // 32)),
            ("scales", "uint16", (rows, groups)),
            ("biases", "uint16", (rows, groups)),
        )

    def nbytes(self, rows, cols, field_name="codec"):
        total = 0
        for _, dtype, shape in self.parts(rows, cols, field_name):
            total += shape[0] * shape[1] * DTYPE_BYTES[dtype]
        return total


DTYPE_BYTES = {"uint32": 4, "uint16": 2, "float32": 4}

# Affine widths and group sizes MLX's quantize / gather_qmm run (affine mode; bf16 scales and
# biases). 4- and 8-bit at group 64 keep the ids of the first artifacts; every other pair gets
# 0x100 | bits << 4 | group index, so an id names exactly one (bits, group).
AFFINE_BITS = (2, 3, 4, 6, 8)
AFFINE_GROUPS = (32, 64, 128)
_LEGACY_AFFINE_IDS = {(4, 64): 1, (8, 64): 2}


def affine_name(bits, group_size):
    return f"affine{bits}-g{group_size}"


def _affine_codecs():
    for bits in AFFINE_BITS:
        for g in AFFINE_GROUPS:
            cid = _LEGACY_AFFINE_IDS.get((bits, g), 0x100 | bits << 4 | AFFINE_GROUPS.index(g))
            yield Codec(affine_name(bits, g), cid, bits, g)


# PLE row codecs below 16 bits (AFN-003's codec fields): affine rows, each row self-contained as
# [packed values][bf16 scales][bf16 biases] so one page read decodes it. Group 32: the largest MLX
# group dividing the real table's 160-value rows (one scale per 160 values lets a single outlier
# widen every step of a 16-level row); a row narrower than 32 is one group. Only PLE stores take
# them (not an MLX quantize layout: the demo's 8-value rows are below MLX's smallest group).
PLE_AFFINE_BITS = (4, 8)
PLE_AFFINE_GROUP = 32


def ple_affine_name(bits):
    return f"ple-affine{bits}"


CODECS = {
    c.name: c
    for c in sorted(
        (
            *_affine_codecs(),
            Codec("bf16", 3, 16, 0),
            Codec("f32", 4, 32, 0),
            *(Codec(ple_affine_name(b), 0x200 | b << 4, b, PLE_AFFINE_GROUP) for b in PLE_AFFINE_BITS),
        ),
        key=lambda c: c.codec_id,
    )
}
CODECS_BY_ID = {c.codec_id: c for c in CODECS.values()}
assert len(CODECS_BY_ID) == len(CODECS)
PLE_AFFINE_CODECS = tuple(ple_affine_name(b) for b in PLE_AFFINE_BITS)
PLE_CODECS = ("bf16", "f32", *PLE_AFFINE_CODECS)  # PLE row codecs
# `convert --ple-dtype` values -> PLE codec
PLE_DTYPES = {"bfloat16": "bf16", "float32": "f32", "q8": ple_affine_name(8), "q4": ple_affine_name(4)}
COMPONENTS = ("dense", "experts", "ple")  # what a profile gives a codec (manifest.codecs)


def _registered(table, key, error, field_name, unknown):
    """table[key], else `error(field_name, unknown)`: the lookups of the codec and family registries."""
    if key not in table:
        raise error(field_name, unknown)
    return table[key]


def codec(name, field_name="codec"):
    return _registered(CODECS, name, CodecError, field_name, f"unknown codec {name!r}; known: {sorted(CODECS)}")


def codec_by_id(codec_id, field_name="codec_id"):
    return _registered(CODECS_BY_ID, codec_id, CodecError, field_name, f"unknown codec id {codec_id}")


# A profile binds one codec to each store. Dense: codec of the quantizable
# linear weights (norms, biases and small vectors stay float). The named profiles
# use one width everywhere; a profile with per-component widths (e.g. 4-bit dense,
# 3-bit experts) is named by `profile_name` ("text-mixed/dense=..,experts=..,ple=..").
PROFILES = {
    **{
        f"text-{affine_name(b, g)}": {"dense": affine_name(b, g), "experts": affine_name(b, g), "ple": "bf16"}
        for b in AFFINE_BITS
        for g in AFFINE_GROUPS
    },
    "text-bf16": {"dense": "bf16", "experts": "bf16", "ple": "bf16"},
    "text-f32": {"dense": "f32", "experts": "f32", "ple": "f32"},
}
MIXED_PREFIX = "text-mixed/"


def profile_name(codecs, field_name="profile"):
    """The one name of the profile giving `codecs` ({dense, experts, ple} -> codec name): a named
    profile when one has exactly these codecs, else the canonical mixed name."""
    if type(codecs) is not dict or sorted(codecs) != sorted(COMPONENTS):
        raise CodecError(field_name, f"codecs must name exactly {list(COMPONENTS)}")
    for comp in COMPONENTS:
        if not (comp == "experts" and codecs[comp] == PER_LAYER):
            codec(codecs[comp], f"{field_name}.{comp}")
        if comp != "ple" and codecs[comp] in PLE_AFFINE_CODECS:
            raise CodecError(f"{field_name}.{comp}", f"{codecs[comp]!r} is a PLE row codec only")
    if codecs["ple"] not in PLE_CODECS:
        raise CodecError(f"{field_name}.ple", f"{codecs['ple']!r} is not a PLE row codec {PLE_CODECS}")
    for name, c in PROFILES.items():
        if c == codecs:
            return name
    return MIXED_PREFIX + ",".join(f"{comp}={codecs[comp]}" for comp in COMPONENTS)


def profile_codecs(name, field_name="profile"):
    """{dense, experts, ple} -> codec of profile `name`; a mixed name must be canonical (exactly
    what `profile_name` writes for its codecs), anything else is refused naming the field."""
    if type(name) is not str:
        raise CodecError(field_name, f"must be a string, got {type(name).__name__}")
    if name in PROFILES:
        return dict(PROFILES[name])
    if not name.startswith(MIXED_PREFIX):
        raise CodecError(
            field_name,
            f"unknown profile {name!r}; known: text-affine{{{','.join(map(str, AFFINE_BITS))}}}"
            f"-g{{{','.join(map(str, AFFINE_GROUPS))}}}, text-bf16, text-f32, "
            f"{MIXED_PREFIX}dense=..,experts=..,ple=..",
        )
    codecs = {}
    for item in name[len(MIXED_PREFIX) :].split(","):
        comp, eq, value = item.partition("=")
        if not eq or comp not in COMPONENTS or comp in codecs:
            raise CodecError(field_name, f"{name!r}: {item!r} is not one of dense=, experts=, ple= (once each)")
        codecs[comp] = value
    if profile_name(codecs, field_name) != name:
        raise CodecError(
            field_name, f"{name!r} is not the canonical name of its codecs ({profile_name(codecs, field_name)!r})"
        )
    return codecs


# Profiles whose parity gate passed. Empty until a gate promotes one (AFN-013).
VERIFIED_PROFILES = frozenset()


# -------------------------------------------------------------- families ---
@dataclass(frozen=True)
class FamilyDescriptor:
    """The closed geometry of one model family. Equality is the admission
    test; every field participates."""

    name: str
    family_id: int
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    max_position_embeddings: int
    hc_count: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    ple_tables: int
    ple_embed_dim: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    ngram_row_alignment: int
    # PLE per-table geometry, pinned as literals for the real family so a
    # derivation bug cannot silently move them (AFN-003).
    ple_head_rows: tuple[int, ...] = field(default=())
    ple_rows: tuple[int, ...] = field(default=())

    @property
    def ple_heads(self):
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_width(self):
        return self.ple_embed_dim // self.ple_heads

    def ple_head_sizes(self, table):
        return ngram_head_primes(self.ngram_vocab_size_base, self.ple_heads, table)

    def ple_head_offsets(self, table):
        return tuple(ple_head_offsets(self.ple_head_sizes(table)))

    def component_shapes(self):
        """[rows, in] of each routed-expert projection (HF weight layout)."""
        m, h = self.moe_intermediate_size, self.hidden_size
        return {"gate": (m, h), "up": (m, h), "down": (h, m)}


def _ple_rows(base, heads, tables, align):
    sizes = [ngram_head_primes(base, heads, t) for t in range(tables)]
    return tuple(sum(s) for s in sizes), tuple(padded_rows(s, align) for s in sizes)


# Descriptor fields that a model-constants dict holds under the same name, as they are (model, experts, PLE).
_SAME_NAMED = (
    *("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "hc_count"),
    *("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    *("ple_embed_dim", "ngram_size", "heads_per_ngram", "ngram_vocab_size_base"),
)


def derive_descriptor(constants, name, family_id):
    """Descriptor implied by a model-constants dict (see manifest.py)."""
    c = constants
    ple_tables = len(c["ple_layer_ids"])
    heads = (c["ngram_size"] - 1) * c["heads_per_ngram"]
    if ple_tables and (heads <= 0 or c["ple_embed_dim"] % heads):
        raise FamilyError("ple_embed_dim", f"{c['ple_embed_dim']} not divisible by {heads} heads")
    head_rows, rows = _ple_rows(c["ngram_vocab_size_base"], heads, ple_tables, c["make_ngram_vocab_size_divisible_by"])
    return FamilyDescriptor(
        name=name,
        family_id=family_id,
        layer_types=tuple(c["layer_types"]),
        ple_tables=ple_tables,
        ngram_row_alignment=c["make_ngram_vocab_size_divisible_by"],
        ple_head_rows=head_rows,
        ple_rows=rows,
        **{k: c[k] for k in _SAME_NAMED},
    )


def first_mismatch(a, b):
    """Name of the first descriptor field on which a and b differ."""
    for f in fields(FamilyDescriptor):
        if getattr(a, f.name) != getattr(b, f.name):
            return f.name, getattr(a, f.name), getattr(b, f.name)
    return None


_GDN3_QSA = ("linear_attention",) * 3 + ("indexed_attention",)

# The product's two families, positional in FamilyDescriptor order (as tests/support/families.py writes its own),
# a line for the model and its experts, a line for the PLE tables:
#   name, family_id, vocab, hidden, layers, layer_types, max_pos, hc, experts, top_k, moe_width,
#   ple_tables, ple_dim, ngram, heads_per_ngram, ngram_base, row_align, ple_head_rows, ple_rows
#
# Qwen/Qwen3.8-Flash-Next @ de4b8e4d: GDN,GDN,GDN,QSA x 12; 512 experts top-10 of width 640; one PLE table
# of 16 prime heads, 320,001,446 rows padded to 320,001,536 rows of 160 values (AFN-001..003).
QWEN38_FLASH_NEXT = FamilyDescriptor(
    *("qwen3.8-flash-next", 4, 248320, 2560, 48, _GDN3_QSA * 12, 262144, 4, 512, 10, 640),
    *(1, 2560, 3, 8, 20_000_000, 128, (320_001_446,), (320_001_536,)),
)
# The demo model of tools/train_demo.py (DemoDims defaults): hidden 128, 8 layers, 64 experts top-4 of
# width 64, PLE on layers 1 and 5 (16 heads of width 8, primes after 2047).
QWEN4EXP_DEMO = FamilyDescriptor(
    *("qwen4exp-demo", 0xDE70, 4224, 128, 8, _GDN3_QSA * 2, 4096, 4, 64, 4, 64),
    *(2, 128, 3, 8, 2048, 128, (33682, 35824), (33792, 35840)),
)

# The product's registry: the real family and the shipped demo. Tests and tools that build other
# checkpoints register their own descriptors (register_family).
FAMILIES = {}
FAMILIES_BY_ID = {}


def register_family(descriptor):
    """Admit artifacts of `descriptor` from now on. Registering the identical descriptor again is
    a no-op; another descriptor under a registered name or id is refused."""
    for key, table in ((descriptor.name, FAMILIES), (descriptor.family_id, FAMILIES_BY_ID)):
        if table.get(key, descriptor) != descriptor:
            raise FamilyError("family", f"{key!r} is already registered with another geometry")
    FAMILIES[descriptor.name] = FAMILIES_BY_ID[descriptor.family_id] = descriptor
    return descriptor


register_family(QWEN38_FLASH_NEXT)
register_family(QWEN4EXP_DEMO)


def family(name, field_name="family"):
    return _registered(
        FAMILIES, name, FamilyError, field_name, f"unregistered family {name!r}; known: {sorted(FAMILIES)}"
    )


def family_by_id(family_id, field_name="family_id"):
    return _registered(FAMILIES_BY_ID, family_id, FamilyError, field_name, f"unregistered family id {family_id}")


def match_family(constants, name):
    """The registered family `name`, provided the descriptor derived from
    `constants` equals it exactly; else FamilyError naming the field."""
    registered = family(name)
    derived = derive_descriptor(constants, registered.name, registered.family_id)
    diff = first_mismatch(derived, registered)
    if diff is not None:
        fname, got, want = diff
        raise FamilyError(f"family.{fname}", f"derived {got!r} != registered {want!r}")
    return registered


def align_up(n, a=ALIGNMENT):
    return -(-n // a) * a
