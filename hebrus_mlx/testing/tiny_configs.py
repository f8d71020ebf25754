"""The tiny Qwen4Exp text config (transformers `config.json` fields) that tests, benchmarks and tools
build their small models from: each user takes it whole or with a few fields overridden
(`dict(TINY_QWEN4EXP, field=value)`), so the shared geometry is written once.

It is the config of the tests' tiny checkpoint (tests/support/artifact_fixture.py: `save_pretrained` of a
seeded transformers model) and of its converted artifact; changing a value changes every model built
from it. Plain data only; nothing here reads hebrus-mlx code."""

TINY_QWEN4EXP = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    hc_count=4,
    hc_lowrank=8,
    ple_layer_ids=[1],
    ple_embed_dim=64,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=1000,
    split_ngram_parts=4,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=8,
    indexer_compress_ratio=4,
    eos_token_id=1,
    max_position_embeddings=256,
)

# The tiny vision tower of the conditional-generation (text + vision) checkpoints, the fields both
# readers share; each adds its own patch geometry (transformers' and mlx-vlm's spell it differently).
TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    num_heads=2,
    out_hidden_size=64,  # the tiny text models' hidden size
    num_position_embeddings=16,
)
