"""Family descriptors of the test and benchmark checkpoints, registered with the product's family
registry on import (the product registry holds only the real family and the shipped demo).
Imported by conftest.py and by the fixture builders, so subprocesses that import those see them."""

from hebrus_mlx.artifact.constants import _GDN3_QSA, FamilyDescriptor, register_family

# Tiny family for tests: hidden 64, 4 layers (GDN x3, QSA), 8 experts top-2
# of width 64, one PLE table of 4 heads (primes after 999), 16 wide.
QWEN4EXP_TINY_TEST = FamilyDescriptor(
    name="qwen4exp-tiny-test",
    family_id=0x7E57,
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=_GDN3_QSA,
    max_position_embeddings=256,
    hc_count=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    ple_tables=1,
    ple_embed_dim=64,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=1000,
    ngram_row_alignment=128,
    ple_head_rows=(4062,),
    ple_rows=(4096,),
)

# The three reference checkpoints of tests/fixtures/parity (tools/capture_reference.py).
# Their geometry is deliberately irregular (hidden 80/48, expert width 24/32) so
# affine group-64 codecs must reject them (AFN-002).
QWEN4EXP_PARITY_A = FamilyDescriptor(
    name="qwen4exp-parity-a",
    family_id=0x7EA0,
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=_GDN3_QSA,
    max_position_embeddings=256,
    hc_count=4,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    ple_tables=1,
    ple_embed_dim=64,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=50,
    ngram_row_alignment=128,
    ple_head_rows=(240,),
    ple_rows=(256,),
)

QWEN4EXP_PARITY_B = FamilyDescriptor(
    name="qwen4exp-parity-b",
    family_id=0x7EB0,
    vocab_size=384,
    hidden_size=80,
    num_hidden_layers=8,
    layer_types=_GDN3_QSA * 2,
    max_position_embeddings=256,
    hc_count=4,
    num_experts=12,
    num_experts_per_tok=4,
    moe_intermediate_size=24,
    ple_tables=2,
    ple_embed_dim=48,
    ngram_size=3,
    heads_per_ngram=3,
    ngram_vocab_size_base=97,
    ngram_row_alignment=128,
    ple_head_rows=(630, 834),
    ple_rows=(640, 896),
)

QWEN4EXP_PARITY_C = FamilyDescriptor(
    name="qwen4exp-parity-c",
    family_id=0x7EC0,
    vocab_size=300,
    hidden_size=48,
    num_hidden_layers=4,
    layer_types=_GDN3_QSA,
    max_position_embeddings=256,
    hc_count=3,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    ple_tables=2,
    ple_embed_dim=48,
    ngram_size=2,
    heads_per_ngram=4,
    ngram_vocab_size_base=101,
    ngram_row_alignment=128,
    ple_head_rows=(420, 508),
    ple_rows=(512, 512),
)

# Expert-heavy synthetic family for the bounded-memory conversion evidence
# (tests/test_convert.py, benchmarks/bench_artifact.py): 4 layers x 256
# experts of [256 x 128], ~400 MB of f32 expert weights, small everything else.
QWEN4EXP_BULK_TEST = FamilyDescriptor(
    name="qwen4exp-bulk-test",
    family_id=0xB01C,
    vocab_size=512,
    hidden_size=128,
    num_hidden_layers=4,
    layer_types=_GDN3_QSA,
    max_position_embeddings=256,
    hc_count=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    ple_tables=1,
    ple_embed_dim=64,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=1000,
    ngram_row_alignment=128,
    ple_head_rows=(4062,),
    ple_rows=(4096,),
)


for _f in (QWEN4EXP_TINY_TEST, QWEN4EXP_PARITY_A, QWEN4EXP_PARITY_B, QWEN4EXP_PARITY_C, QWEN4EXP_BULK_TEST):
    register_family(_f)
