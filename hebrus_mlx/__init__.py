"""hebrus-mlx: an MLX runtime for Qwen4Exp (Qwen3.8-Flash-Next)."""

__version__ = "0.1.0"
