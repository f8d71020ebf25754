"""What the verbs write for the user (reports, tables, plots): published atomically, never over a
file hebrus-mlx did not write unless asked (artifact.atomic.publish_output), JSON carrying its
schema first so a later run recognises its own output."""

from __future__ import annotations

import json
from pathlib import Path

from .artifact.atomic import publish_output

PNG_METADATA = {"Software": "hebrus-mlx"}  # a tEXt chunk: how a later run recognises its own plot


def write_bytes_atomic(path, data: bytes, *, field: str = "--out", overwrite: bool = False) -> None:
    """temp + fsync + rename + directory fsync (the project's one publisher), never over a file
    hebrus-mlx did not write unless `overwrite` (artifact.atomic.publish_output, issue 22)."""

    publish_output(Path(path), data, field=field, overwrite=overwrite)


def write_text_atomic(path, text: str, *, field: str = "--out", overwrite: bool = False) -> None:
    write_bytes_atomic(path, text.encode(), field=field, overwrite=overwrite)


def json_bytes(obj, schema: str, sort_keys: bool = False) -> bytes:
    """JSON with a `schema` key first (how hebrus-mlx recognises its own output later)."""
    if sort_keys:  # nested keys sorted, the schema still first
        obj = json.loads(json.dumps(obj, sort_keys=True, default=float))
    if not (isinstance(obj.get("schema"), str) and obj["schema"].startswith("hebrus-mlx")):
        obj = {"schema": schema, **{k: v for k, v in obj.items() if k != "schema"}}
    else:
        obj = {"schema": obj["schema"], **obj}
    return (json.dumps(obj, indent=1, sort_keys=False, default=float) + "\n").encode()
