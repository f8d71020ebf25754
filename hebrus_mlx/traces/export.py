"""Export validated capture shards as a trainer-ready dataset (no MLX needed).

OUT/ holds `manifest.json` and safetensors shards, one split per shard:

- `token_ids`, `sequence_ids` (index into manifest["sequences"]), `positions`: int32 [N]
- `topk_ids` [N, L, k] int16 (or int32), native rank order; `topk_weights` [N, L, k] float32/16
- with router features: `feature_rows` int32 [M] (rows of this shard) and `router_inputs` float32 [M, L, H]

Split membership is decided per owner or per sequence (never per window) from sha256 of that key,
so it is deterministic and no sequence lands in two splits. Exporting twice gives identical
bytes. The directory is published atomically; readers fail closed (TraceError) on partial shards,
unknown schema versions, digest mismatches and counts that disagree with the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..artifact.atomic import publish_dir, publish_file
from .schema import EXPORT_SCHEMA, EXPORT_SCHEMA_VERSION, KIND_DECODE, SCHEMA_VERSION, Identity, TraceError
from .shards import read_trace

SPLITS = ("train", "validation", "test")
EXPORT_TENSORS = ("token_ids", "sequence_ids", "positions", "topk_ids", "topk_weights")


def write_json(path, obj) -> None:
    data = (json.dumps(obj, indent=1, sort_keys=True, default=float) + "\n").encode()
    publish_file(str(path), lambda w: w.write(data))


def write_report_json(path, obj, *, field: str, overwrite: bool, schema: str) -> None:
    """A user-named report (replay/eval --json): never over a file hebrus-mlx did not write."""
    from ..output_files import json_bytes, write_bytes_atomic

    write_bytes_atomic(path, json_bytes(obj, schema, sort_keys=True), field=field, overwrite=overwrite)


def split_of(key: str, fractions) -> str:
    u = int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) / 2.0**64
    acc = 0.0
    for name, f in zip(SPLITS, fractions):
        acc += f
        if u < acc:
            return name
    return SPLITS[-1]


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def export(
    trace_dir,
    out,
    *,
    split_by="sequence",
    fractions=(0.8, 0.1, 0.1),
    shard_tokens=65536,
    id_dtype="int16",
    weight_dtype="float32",
) -> dict:
    from safetensors.numpy import save

    from ..artifact.atomic import check_replaceable

    def replaceable(path):  # OUT may be new, empty or an earlier export; never anything else
        check_replaceable(
            path, overwrite=True, is_ours=_earlier_export, protect=(trace_dir,), what="trace export", field="--out"
        )

    replaceable(out)
    traces = read_trace(trace_dir)
    ident = traces.identity
    if id_dtype == "int16" and ident.num_experts > np.iinfo(np.int16).max:
        raise TraceError("id_dtype", f"int16 cannot hold {ident.num_experts} expert IDs")
    seqs = []
    for i, s in enumerate(traces.sequences):
        key = s.owner if split_by == "owner" else f"{s.owner}\0{s.generation}\0{s.sequence_id}"
        seqs.append((split_of(key, fractions), i, s))
    table = [
        {
            "index": i,
            "sequence_id": s.sequence_id,
            "owner": s.owner,
            "generation": s.generation,
            "tokens": int(len(s.positions)),
            "decode_tokens": int((s.kinds == KIND_DECODE).sum()),
            "split": sp,
            "sampling": s.sampling,
        }
        for sp, i, s in seqs
    ]
    shards, splits = [], {}
    plan = []  # (file, tensors)
    for sp in SPLITS:
        members = [(i, s) for name, i, s in seqs if name == sp]
        splits[sp] = {
            "sequences": [i for i, _ in members],
            "tokens": int(sum(len(s.positions) for _, s in members)),
            "shards": [],
        }
        if not members:
            continue
        cols = {
            "token_ids": np.concatenate([s.token_ids for _, s in members]).astype(np.int32),
            "sequence_ids": np.concatenate([np.full(len(s.positions), i, np.int32) for i, s in members]),
            "positions": np.concatenate([s.positions for _, s in members]).astype(np.int32),
            "topk_ids": np.concatenate([s.topk_ids for _, s in members]).astype(id_dtype),
            "topk_weights": np.concatenate([s.topk_weights for _, s in members]).astype(weight_dtype),
        }
        has_feat = any(s.features is not None and len(s.feature_positions) for _, s in members)
        if has_feat:
            rows, feats, base = [], [], 0
            for _, s in members:
                if s.features is not None and len(s.feature_positions):
                    rows.append(base + np.searchsorted(s.positions, s.feature_positions).astype(np.int64))
                    feats.append(s.features)
                base += len(s.positions)
            feat_rows, feat_vals = np.concatenate(rows), np.concatenate(feats).astype(np.float32)
        n = len(cols["token_ids"])
        for j, a in enumerate(range(0, n, shard_tokens)):
            b = min(n, a + shard_tokens)
            t = {k: v[a:b] for k, v in cols.items()}
            if has_feat:
                sel = (feat_rows >= a) & (feat_rows < b)
                t["feature_rows"] = (feat_rows[sel] - a).astype(np.int32)
                t["router_inputs"] = feat_vals[sel]
            name = f"{sp}-{j:05d}.safetensors"
            plan.append((name, t))
            splits[sp]["shards"].append(name)
    counts = {
        "tokens": traces.tokens,
        "sequences": len(table),
        "decode_tokens": int(sum(r["decode_tokens"] for r in table)),
        "feature_rows": int(sum(len(t.get("feature_rows", ())) for _, t in plan)),
    }
    manifest = {
        "schema": EXPORT_SCHEMA,
        "schema_version": EXPORT_SCHEMA_VERSION,
        "trace_schema_version": SCHEMA_VERSION,
        **{k: v for k, v in ident.to_dict().items()},
        "split_by": split_by,
        "fractions": list(fractions),
        "counts": counts,
        "splits": splits,
        "sequences": table,
        "id_dtype": id_dtype,
        "weight_dtype": weight_dtype,
        "shards": shards,
        "sensitive": "token_ids are reversible to text; handle as the source transcripts",
    }

    def build(tmp):
        for name, t in plan:
            data = save({k: np.ascontiguousarray(v) for k, v in t.items()})
            publish_file(os.path.join(tmp, name), lambda w, data=data: w.write(data))
            shards.append(
                {
                    "file": name,
                    "split": name.split("-")[0],
                    "tokens": int(len(t["token_ids"])),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            )
        write_json(os.path.join(tmp, "manifest.json"), manifest)

    publish_dir(str(out), build, verify=read_export, replace=replaceable)
    return manifest


def _earlier_export(path) -> str | None:
    """None when directory `path` is a trace export whose manifest owns every entry in it."""
    from ..artifact import untrusted

    try:
        m = untrusted.read_json(str(path), "manifest.json")
    except (OSError, untrusted.UntrustedFileError) as e:
        return f"manifest.json: {getattr(e, 'message', e)}"
    if not isinstance(m, dict) or m.get("schema") != EXPORT_SCHEMA:
        return "manifest.json is not a trace export manifest"
    owned = {"manifest.json"} | {s.get("file") for s in m.get("shards") or [] if isinstance(s, dict)}
    extra = sorted(set(os.listdir(path)) - owned)
    return f"{extra[0]!r} is not a file of its manifest" if extra else None


def _check_shard_entry(sh, where: str) -> None:
    if not isinstance(sh, dict):
        raise TraceError(where, "not an object")
    for key, want in (("file", str), ("split", str), ("sha256", str), ("tokens", int)):
        if type(sh.get(key)) is not want:
            raise TraceError(f"{where}.{key}", f"expected {want.__name__}, got {sh.get(key)!r}")
    if sh["split"] not in SPLITS:
        raise TraceError(f"{where}.split", f"expected one of {', '.join(SPLITS)}, got {sh['split']!r}")


def read_export(out, verify_digests: bool = True) -> dict:
    """Validate OUT and return {"manifest", "identity", "splits": {name: {tensor: array}}} (fails closed)."""
    from safetensors import safe_open

    out = Path(out)
    mpath = out / "manifest.json"
    if not mpath.is_file():
        raise TraceError("manifest.json", f"missing in {out}")
    from ..artifact.untrusted import UntrustedFileError, read_json, resolve

    try:  # bounded and strict, symlinks refused: an export may be handed to us (issue 22)
        m = read_json(str(out), "manifest.json")
    except UntrustedFileError as e:
        raise TraceError(e.field if e.field.startswith("manifest") else "manifest.json", e.message) from None
    if not isinstance(m, dict):
        raise TraceError("manifest.json", "not a JSON object")
    if m.get("schema") != EXPORT_SCHEMA:
        raise TraceError("manifest.schema", f"expected {EXPORT_SCHEMA!r}, got {m.get('schema')!r}")
    if m.get("schema_version") != EXPORT_SCHEMA_VERSION:
        raise TraceError(
            "manifest.schema_version",
            f"unknown version {m.get('schema_version')!r} (this build reads {EXPORT_SCHEMA_VERSION})",
        )
    ident = Identity.from_dict({k: m.get(k) for k in Identity.__dataclass_fields__}, "manifest")
    L, k = ident.num_layers, ident.top_k
    data = {sp: {} for sp in SPLITS}
    total = 0
    shards = m.get("shards")
    if not isinstance(shards, list):
        raise TraceError("manifest.shards", "not a list")
    for i, sh in enumerate(shards):
        _check_shard_entry(sh, f"manifest.shards[{i}]")
        try:  # a plain name of a regular file in OUT: never `../x`, a symlink or a FIFO
            p = resolve(str(out), sh["file"], f"manifest.shards[{i}].file")
        except FileNotFoundError:
            raise TraceError(f"shards.{sh['file']}", "missing") from None
        except UntrustedFileError as e:
            raise TraceError(e.field, e.message) from None
        if verify_digests and _sha256(p) != sh["sha256"]:
            raise TraceError(f"shards.{sh['file']}.sha256", "digest mismatch (partial or changed shard)")
        try:
            with safe_open(p, framework="numpy") as f:
                t = {key: f.get_tensor(key) for key in f.keys()}
        except Exception as e:
            raise TraceError(f"shards.{sh['file']}", f"partial or corrupt ({type(e).__name__})") from None
        missing = [key for key in EXPORT_TENSORS if key not in t]
        if missing:
            raise TraceError(f"shards.{sh['file']}.{missing[0]}", "missing tensor")
        n = len(t["token_ids"])
        if n != sh["tokens"] or t["topk_ids"].shape != (n, L, k):
            raise TraceError(
                f"shards.{sh['file']}.tokens", f"holds {n} rows / {t['topk_ids'].shape}, manifest says {sh['tokens']}"
            )
        if n and t["token_ids"].min() < 0:
            raise TraceError(f"shards.{sh['file']}.token_ids", f"negative token ID {int(t['token_ids'].min())}")
        for key, v in t.items():
            data[sh["split"]].setdefault(key, []).append(v)
        total += n
    counts = m.get("counts")
    if not isinstance(counts, dict) or type(counts.get("tokens")) is not int:
        raise TraceError("manifest.counts.tokens", "missing or not an int")
    if total != m["counts"]["tokens"]:
        raise TraceError("manifest.counts.tokens", f"shards hold {total} tokens, manifest says {m['counts']['tokens']}")
    splits = {}
    for sp, cols in data.items():
        if not cols:
            continue
        offs = np.cumsum([0] + [len(a) for a in cols["token_ids"]])
        merged = {key: np.concatenate(v) for key, v in cols.items() if key != "feature_rows"}
        if "feature_rows" in cols:
            merged["feature_rows"] = np.concatenate([r + o for r, o in zip(cols["feature_rows"], offs)])
        seq, pos = merged["sequence_ids"], merged["positions"]
        # Counter regression: within a sequence positions must run 0, 1, 2, ... in order.
        for s in np.unique(seq):
            ps = pos[seq == s]
            if ps[0] != 0 or np.any(np.diff(ps) != 1):
                raise TraceError(
                    f"splits.{sp}.positions", f"sequence {int(s)} positions are not 0, 1, 2, ... (regression or gap)"
                )
        splits[sp] = merged
    return {"manifest": m, "identity": ident, "splits": splits}
