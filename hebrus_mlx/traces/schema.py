"""The versioned observation schema and the identities that pin a trace to its runtime.

An observation is one token fed to the model: (owner, generation, sequence ID, token ordinal =
logical position, token ID, kind) plus, per layer, the native top-k expert IDs in rank order and
their weights (the normalized router probabilities the experts were mixed with). Optionally the
router's input feature (the post-hyper-connection MLP input) for sampled positions.

Nothing about the runtime instance is recorded: no cache slots, file offsets or buffer addresses.
This module imports no MLX (export and the cache simulator run without it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..errors import HebrusError

SCHEMA = "hebrus-mlx.route-trace"
SCHEMA_VERSION = 1
EXPORT_SCHEMA = "hebrus-mlx.route-export"
EXPORT_SCHEMA_VERSION = 1

KIND_PREFILL = 0  # a prompt token consumed by a prefill chunk (teacher-forced)
KIND_DECODE = 1  # a token fed by the decode loop (the last prompt token, then sampled tokens)


class TraceError(HebrusError, ValueError):
    """Bad or inconsistent trace input; `field` names what failed."""


@dataclass(frozen=True)
class Identity:
    """What a trace was recorded against. Two traces are comparable only if these are equal."""

    artifact_digest: str
    tokenizer_digest: str
    template_digest: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "identity") -> Identity:
        if not isinstance(d, dict):
            raise TraceError(where, "is not an object")
        out = {}
        for f in fields(cls):
            if f.name not in d:
                raise TraceError(f"{where}.{f.name}", "missing")
            v = d[f.name]
            want = int if f.type in ("int", int) else str
            if not isinstance(v, want) or isinstance(v, bool):
                raise TraceError(f"{where}.{f.name}", f"expected {want.__name__}, got {v!r}")
            out[f.name] = v
        return cls(**out)

    def mismatch(self, other: Identity) -> str | None:
        """The first differing field as 'field: a != b', or None."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                return f"{f.name}: {a} != {b}"
        return None


def _sha256_file(path: Path, h=None):
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h


def artifact_digest(path) -> str:
    """sha256 of an artifact's manifest.json (which pins every store's digest), or, for an HF
    checkpoint dir (small models only: always resident), of config.json and every weight file."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return "manifest:" + _sha256_file(path / "manifest.json").hexdigest()
    h = hashlib.sha256()
    for p in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        h.update(p.name.encode() + b"\0")
        _sha256_file(p, h)
    return "hf:" + h.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """sha256 over the tokenizer's canonical JSON, its physical vocabulary and stop set."""
    h = hashlib.sha256(tokenizer._tok.to_str().encode())
    h.update(json.dumps([tokenizer.physical_vocab_size, sorted(tokenizer.stop_token_ids)]).encode())
    return h.hexdigest()


def template_digest(tokenizer) -> str:
    return hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()


def model_identity(model, tokenizer) -> Identity:
    source = getattr(model, "source_path", None)
    if source is None:
        raise TraceError("model", "has no source_path (load it with hebrus_mlx.load to record traces)")
    a = model.args
    return Identity(
        artifact_digest=artifact_digest(source),
        tokenizer_digest=tokenizer_digest(tokenizer),
        template_digest=template_digest(tokenizer),
        num_layers=a.num_hidden_layers,
        num_experts=a.num_experts,
        top_k=a.num_experts_per_tok,
        hidden_size=a.hidden_size,
    )
