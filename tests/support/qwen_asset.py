"""Shared helper: the pinned Qwen 248k tokenizer.json, built once into pytest's cache dir."""

import hashlib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHYSICAL_VOCAB = 248320  # Qwen3.8-Flash-Next lm_head rows (AFN-005)


def _tool():
    spec = importlib.util.spec_from_file_location("build_qwen_tokenizer", ROOT / "tools" / "build_qwen_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def qwen_tokenizer_dir(cache_root: Path) -> Path:
    """Directory holding the digest-checked tokenizer.json (built if missing or stale)."""
    tool = _tool()
    d = Path(cache_root) / f"qwen_tokenizer_{tool.EXPECTED_SHA256[:16]}"
    path = d / "tokenizer.json"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == tool.EXPECTED_SHA256:
        return d
    tool.build(d, check_digest=True)
    return d
