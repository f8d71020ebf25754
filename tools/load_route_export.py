"""Load a `hebrus-mlx traces export` directory without hebrus-mlx (numpy + safetensors only).

from load_route_export import load_export
manifest, splits = load_export("OUT")      # splits["train"]["topk_ids"] -> [N, layers, k]
"""

import hashlib
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

SCHEMA, VERSION = "hebrus-mlx.route-export", 1


def load_export(out):
    out = Path(out)
    m = json.loads((out / "manifest.json").read_text())
    if m.get("schema") != SCHEMA or m.get("schema_version") != VERSION:
        raise ValueError(f"manifest.schema_version: unsupported {m.get('schema')!r} v{m.get('schema_version')!r}")
    parts = {}
    for sh in m["shards"]:
        raw = (out / sh["file"]).read_bytes()
        if hashlib.sha256(raw).hexdigest() != sh["sha256"]:
            raise ValueError(f"{sh['file']}: sha256 mismatch")
        t = load_file(str(out / sh["file"]))
        if "feature_rows" in t:  # rows are shard-local; make them split-global
            t["feature_rows"] = t["feature_rows"] + sum(len(p["token_ids"]) for p in parts.get(sh["split"], []))
        parts.setdefault(sh["split"], []).append(t)
    splits = {sp: {k: np.concatenate([p[k] for p in ps]) for k in ps[0]} for sp, ps in parts.items()}
    return m, splits
