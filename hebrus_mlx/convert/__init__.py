"""Checkpoint -> hebrus-mlx artifact (`hebrus-mlx convert`, like mlx_lm.convert).

build: the conversion of a whole checkpoint, published atomically and admitted; sources: one
tensor at a time out of an HF checkpoint and the store encoders; fp8: block-FP8 checkpoints;
mlx_source: MLX-quantized conversions imported without requantizing; hub_shards: a Hub repo
converted shard by shard (`--stream-shards`).
"""

from .build import add_mtp, artifact_bytes, convert, expert_spec, plan

__all__ = ["add_mtp", "artifact_bytes", "convert", "expert_spec", "plan"]
