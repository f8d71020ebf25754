"""Capture shards: chunked, self-checksummed safetensors files published atomically.

One shard holds a contiguous run of one sequence's observations. Its safetensors metadata carries
the schema version, the identity and a header (owner, generation, sequence ID, shard counter,
first position, count, sampling configuration) including `payload_sha256`, the sha256 over every
tensor's name, dtype, shape and bytes. Shards are written to a hidden temp, fsynced and renamed
(`artifact.atomic.publish_file`), so a crash leaves only complete shards (plus ignorable
dot-temps). Readers fail closed: partial shards, unknown versions, digest mismatches, identity
disagreements, counter regressions and position gaps are TraceErrors naming the shard and field.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .schema import KIND_DECODE, KIND_PREFILL, SCHEMA, SCHEMA_VERSION, Identity, TraceError

SHARD_SUFFIX = ".safetensors"
REQUIRED = {
    "token_ids": np.int32,
    "positions": np.int32,
    "kinds": np.uint8,
    "topk_ids": np.int32,
    "topk_weights": np.float32,
}
FEATURES = {"feature_positions": np.int32, "features": np.float32}  # both or neither
KINDS = (KIND_PREFILL, KIND_DECODE)


def payload_sha256(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def write_shard(path, tensors: dict, header: dict, faults=None) -> None:
    """Publish one shard atomically; `header` gains payload_sha256."""
    from safetensors.numpy import save

    from ..artifact.atomic import publish_file

    header = dict(header, payload_sha256=payload_sha256(tensors))
    data = save(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()},
        metadata={
            "schema": SCHEMA,
            "schema_version": str(SCHEMA_VERSION),
            "header": json.dumps(header, sort_keys=True),
        },
    )
    publish_file(str(path), lambda w: w.write(data), faults=faults)


@dataclass
class Sequence:
    """One sequence's observations in position order."""

    owner: str
    generation: int
    sequence_id: str
    sampling: dict
    feature_every: int
    positions: np.ndarray  # int32 [N]
    token_ids: np.ndarray  # int32 [N]
    kinds: np.ndarray  # uint8 [N]
    topk_ids: np.ndarray  # int32 [N, L, k]
    topk_weights: np.ndarray  # float32 [N, L, k]
    feature_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    features: np.ndarray | None = None  # float32 [M, L, H]
    shards: list = field(default_factory=list)


@dataclass
class TraceSet:
    identity: Identity
    sequences: list  # [Sequence], sorted by (owner, generation, sequence_id)

    @property
    def tokens(self) -> int:
        return sum(len(s.positions) for s in self.sequences)


def _read_one(path: Path):
    from safetensors import safe_open

    from ..artifact.untrusted import UntrustedFileError, resolve

    name = path.name
    try:  # a FIFO or device named like a shard would block or never end: regular files only
        real = resolve(str(path.parent), name, links=True)
    except UntrustedFileError as e:
        raise TraceError(name, e.message) from None
    try:
        with safe_open(real, framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises untyped errors on truncated/corrupt files
        raise TraceError(name, f"partial or corrupt shard ({type(e).__name__}: {str(e)[:80]})") from None
    if meta.get("schema") != SCHEMA:
        raise TraceError(f"{name}.schema", f"expected {SCHEMA!r}, got {meta.get('schema')!r}")
    if meta.get("schema_version") != str(SCHEMA_VERSION):
        raise TraceError(
            f"{name}.schema_version",
            f"unknown version {meta.get('schema_version')!r} (this build reads {SCHEMA_VERSION})",
        )
    from ..artifact.untrusted import loads

    try:  # strict and bounded: a shard may be handed to us (issue 22)
        header = loads(meta["header"], f"{name}.header")
    except KeyError:
        raise TraceError(f"{name}.header", "missing or not JSON") from None
    except UntrustedFileError as e:
        raise TraceError(f"{name}.header", e.message) from None
    if not isinstance(header, dict):
        raise TraceError(f"{name}.header", "not a JSON object")
    if payload_sha256(tensors) != header.get("payload_sha256"):
        raise TraceError(f"{name}.payload_sha256", "digest mismatch (the shard's tensors were changed)")
    for key, dtype in REQUIRED.items():
        if key not in tensors:
            raise TraceError(f"{name}.{key}", "missing tensor")
        if tensors[key].dtype != dtype:
            raise TraceError(f"{name}.{key}", f"dtype {tensors[key].dtype}, expected {np.dtype(dtype)}")
    extra = sorted(set(tensors) - set(REQUIRED) - set(FEATURES))
    if extra:
        raise TraceError(f"{name}.{extra[0]}", "not a tensor of the route-trace schema")
    for key in ("owner", "sequence_id"):
        if not isinstance(header.get(key), str) or not header[key]:
            raise TraceError(f"{name}.{key}", "missing")
    for key in ("generation", "counter", "first_position", "count", "feature_every"):
        if not isinstance(header.get(key), int) or isinstance(header.get(key), bool) or header[key] < 0:
            raise TraceError(f"{name}.{key}", f"expected an int >= 0, got {header.get(key)!r}")
    return header, tensors


def _check_values(name: str, tensors: dict, identity: Identity) -> None:
    """Token IDs, kinds and the optional router features of one shard (shapes already checked).
    Token IDs are checked against the model's vocabulary where one is loaded (replay)."""
    tok = tensors["token_ids"]
    if tok.size and tok.min() < 0:
        raise TraceError(f"{name}.token_ids", f"negative token ID {int(tok.min())}")
    kinds = tensors["kinds"]
    unknown = np.setdiff1d(kinds, KINDS)
    if unknown.size:
        raise TraceError(f"{name}.kinds", f"unknown kind {int(unknown[0])} (known: {', '.join(map(str, KINDS))})")
    have = [key for key in FEATURES if key in tensors]
    if not have:
        return
    if len(have) == 1:
        raise TraceError(f"{name}.{have[0]}", "present without the other router-feature tensor")
    for key, dtype in FEATURES.items():
        if tensors[key].dtype != dtype:
            raise TraceError(f"{name}.{key}", f"dtype {tensors[key].dtype}, expected {np.dtype(dtype)}")
    fp, f = tensors["feature_positions"], tensors["features"]
    m = len(fp)
    want = (m, identity.num_layers, identity.hidden_size)
    if fp.shape != (m,) or f.shape != want:
        raise TraceError(f"{name}.features", f"shapes {fp.shape} and {f.shape}, expected ({m},) and {want}")
    if not np.isin(fp, tensors["positions"]).all() or np.any(np.diff(fp) <= 0):
        raise TraceError(f"{name}.feature_positions", "not increasing positions of this shard")


def read_trace(directory) -> TraceSet:
    """Read and validate every shard in `directory` (fails closed)."""
    d = Path(directory)
    if not d.is_dir():
        raise TraceError("trace", f"no trace directory at {d}")
    paths = sorted(p for p in d.iterdir() if p.name.endswith(SHARD_SUFFIX) and not p.name.startswith("."))
    if not paths:
        raise TraceError("trace", f"no shards in {d}")
    identity = None
    by_seq: dict[str, list] = {}
    for p in paths:
        header, tensors = _read_one(p)
        ident = Identity.from_dict(header.get("identity"), f"{p.name}.identity")
        if identity is None:
            identity = ident
        elif ident != identity:
            raise TraceError(f"{p.name}.identity", f"differs from the other shards ({ident.mismatch(identity)})")
        n = header["count"]
        L, k = identity.num_layers, identity.top_k
        for key in ("token_ids", "positions", "kinds"):
            if tensors[key].shape != (n,):
                raise TraceError(f"{p.name}.{key}", f"shape {tensors[key].shape}, expected ({n},)")
        for key in ("topk_ids", "topk_weights"):
            if tensors[key].shape != (n, L, k):
                raise TraceError(f"{p.name}.{key}", f"shape {tensors[key].shape}, expected {(n, L, k)}")
        ids = tensors["topk_ids"]
        if ids.size and (ids.min() < 0 or ids.max() >= identity.num_experts):
            raise TraceError(f"{p.name}.topk_ids", f"expert ID outside [0, {identity.num_experts})")
        _check_values(p.name, tensors, identity)
        by_seq.setdefault(header["sequence_id"], []).append((header, tensors, p.name))
    sequences = []
    for sid, parts in by_seq.items():
        parts.sort(key=lambda t: (t[0]["counter"], t[2]))
        h0 = parts[0][0]
        for h, _, name in parts:
            if (h["owner"], h["generation"]) != (h0["owner"], h0["generation"]):
                raise TraceError(f"{name}.owner", f"sequence ID {sid} reused across owners/generations")
        expect_pos = h0["first_position"]
        for i, (h, t, name) in enumerate(parts):
            if h["counter"] != i:
                what = "duplicate" if i and h["counter"] == parts[i - 1][0]["counter"] else "missing shard before"
                raise TraceError(
                    f"{name}.counter", f"counter regression in sequence {sid}: {what} counter {h['counter']}"
                )
            if h["first_position"] != expect_pos:
                raise TraceError(
                    f"{name}.first_position",
                    f"counter regression in sequence {sid}: shard starts at {h['first_position']}, "
                    f"the previous one ended at {expect_pos}",
                )
            pos = t["positions"]
            steps = np.diff(np.concatenate([[expect_pos - 1], pos.astype(np.int64)]))
            bad = np.flatnonzero(steps != 1)
            if bad.size:
                j = int(bad[0])
                prev = expect_pos - 1 if j == 0 else int(pos[j - 1])
                kind = "dropped token" if steps[j] > 1 else "position regression"
                raise TraceError(
                    f"{name}.positions", f"{kind} in sequence {sid}: position {prev} is followed by {int(pos[j])}"
                )
            expect_pos += h["count"]
        cat = lambda key: np.concatenate([t[key] for _, t, _ in parts])  # noqa: E731
        feats = [t for _, t, _ in parts if "features" in t]
        seq = Sequence(
            owner=h0["owner"],
            generation=h0["generation"],
            sequence_id=sid,
            sampling=h0.get("sampling", {}),
            feature_every=h0["feature_every"],
            positions=cat("positions"),
            token_ids=cat("token_ids"),
            kinds=cat("kinds"),
            topk_ids=cat("topk_ids"),
            topk_weights=cat("topk_weights"),
            shards=[name for _, _, name in parts],
        )
        if feats:
            seq.feature_positions = np.concatenate([t["feature_positions"] for t in feats])
            seq.features = np.concatenate([t["features"] for t in feats])
        sequences.append(seq)
    sequences.sort(key=lambda s: (s.owner, s.generation, s.sequence_id))
    return TraceSet(identity=identity, sequences=sequences)


def shard_name(sequence_id: str, counter: int) -> str:
    return f"{sequence_id}-{counter:06d}{SHARD_SUFFIX}"


class ShardWriter:
    """Buffers one sequence's committed observations and publishes a shard every `shard_tokens`."""

    def __init__(
        self,
        directory,
        identity: Identity,
        *,
        owner: str,
        generation: int,
        sequence_id: str,
        sampling: dict,
        feature_every: int,
        shard_tokens: int = 4096,
        first_position: int = 0,
    ):
        if not owner or not isinstance(owner, str):
            raise TraceError("trace_owner", f"must be a non-empty string, got {owner!r}")
        if not isinstance(generation, int) or generation < 0:
            raise TraceError("trace_generation", f"must be an int >= 0, got {generation!r}")
        if shard_tokens < 1:
            raise TraceError("shard_tokens", f"must be >= 1, got {shard_tokens}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.owner, self.generation, self.sequence_id = owner, generation, sequence_id
        self.sampling, self.feature_every, self.shard_tokens = sampling, feature_every, shard_tokens
        self.counter = 0
        self.position = first_position  # first position of the buffered run
        self._buf: list = []
        self.published: list = []

    def add(self, positions, token_ids, kinds, topk_ids, topk_weights, feature_positions=None, features=None):
        self._buf.append((positions, token_ids, kinds, topk_ids, topk_weights, feature_positions, features))
        if sum(len(b[0]) for b in self._buf) >= self.shard_tokens:
            self.flush()

    def flush(self):
        if not self._buf:
            return
        cols = list(zip(*self._buf))
        self._buf = []
        tensors = {
            "positions": np.concatenate(cols[0]).astype(np.int32),
            "token_ids": np.concatenate(cols[1]).astype(np.int32),
            "kinds": np.concatenate(cols[2]).astype(np.uint8),
            "topk_ids": np.concatenate(cols[3]).astype(np.int32),
            "topk_weights": np.concatenate(cols[4]).astype(np.float32),
        }
        fp = [a for a in cols[5] if a is not None]
        if self.feature_every:
            tensors["feature_positions"] = np.concatenate(fp).astype(np.int32) if fp else np.zeros(0, np.int32)
            fs = [a for a in cols[6] if a is not None]
            L, H = self.identity.num_layers, self.identity.hidden_size
            tensors["features"] = np.concatenate(fs).astype(np.float32) if fs else np.zeros((0, L, H), np.float32)
        n = len(tensors["positions"])
        header = {
            "identity": self.identity.to_dict(),
            "owner": self.owner,
            "generation": self.generation,
            "sequence_id": self.sequence_id,
            "counter": self.counter,
            "first_position": self.position,
            "count": n,
            "sampling": self.sampling,
            "feature_every": self.feature_every,
            "wall_time": time.time(),  # diagnostic only
        }
        path = self.dir / shard_name(self.sequence_id, self.counter)
        write_shard(path, tensors, header)
        self.published.append(path)
        self.counter += 1
        self.position += n
