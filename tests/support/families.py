"""Family descriptors of the test and benchmark checkpoints, registered with the product's family
registry on import (the product registry holds only the real family and the shipped demo).
Imported by conftest.py and by the fixture builders, so subprocesses that import those see them.

Pinned as literals (AFN-003): admission derives a descriptor from each checkpoint's config and
must find exactly these.
  tiny: hidden 64, 4 layers (GDN x3, QSA), 8 experts top-2 of width 64, one PLE table of 4 heads
        (primes after 999), 16 wide.
  parity a/b/c: the reference checkpoints of tests/support/fixtures/parity (tools/capture_reference.py);
        deliberately irregular (hidden 80/48, expert width 24/32) so affine group-64 codecs must
        reject them (AFN-002).
  bulk: expert-heavy synthetic family for the bounded-memory conversion evidence
        (tests/test_convert.py, benchmarks/bench_artifact.py): 4 layers x 256 experts of
        [256 x 128], ~400 MB of f32 expert weights, small everything else.
"""

from hebrus_mlx.artifact.constants import _GDN3_QSA as L4
from hebrus_mlx.artifact.constants import FamilyDescriptor as F
from hebrus_mlx.artifact.constants import register_family

# Fields in FamilyDescriptor order:
#   name, family_id, vocab, hidden, layers, layer_types, max_pos, hc, experts, top_k, moe_width,
#   ple_tables, ple_dim, ngram, heads_per_ngram, ngram_base, row_align, ple_head_rows, ple_rows
QWEN4EXP_TINY_TEST = F(
    "qwen4exp-tiny-test", 0x7E57, 512, 64, 4, L4, 256, 4, 8, 2, 64, 1, 64, 3, 2, 1000, 128, (4062,), (4096,)
)
QWEN4EXP_PARITY_A = F(
    "qwen4exp-parity-a", 0x7EA0, 320, 64, 4, L4, 256, 4, 8, 3, 32, 1, 64, 3, 2, 50, 128, (240,), (256,)
)
QWEN4EXP_PARITY_B = F(
    "qwen4exp-parity-b", 0x7EB0, 384, 80, 8, L4 * 2, 256, 4, 12, 4, 24, 2, 48, 3, 3, 97, 128, (630, 834), (640, 896)
)
QWEN4EXP_PARITY_C = F(
    "qwen4exp-parity-c", 0x7EC0, 300, 48, 4, L4, 256, 3, 16, 2, 32, 2, 48, 2, 4, 101, 128, (420, 508), (512, 512)
)
QWEN4EXP_BULK_TEST = F(
    "qwen4exp-bulk-test", 0xB01C, 512, 128, 4, L4, 256, 4, 256, 8, 256, 1, 64, 3, 2, 1000, 128, (4062,), (4096,)
)

for _f in (QWEN4EXP_TINY_TEST, QWEN4EXP_PARITY_A, QWEN4EXP_PARITY_B, QWEN4EXP_PARITY_C, QWEN4EXP_BULK_TEST):
    register_family(_f)
