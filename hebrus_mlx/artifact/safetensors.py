"""The safetensors header of an untrusted file: every bound checked before anything is allocated
(format layer; no MLX)."""

import math
import struct

from . import untrusted as U
from .errors import AdmissionError

_ST_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def read_safetensors_header(path):
    """(header_len, {name: entry}, metadata) with every bound checked before
    the header is allocated; offsets are relative to the data region. The caps (header bytes,
    entries) are untrusted.LIMITS["safetensors_header"] and untrusted.SAFETENSORS_MAX_ENTRIES."""
    cap = U.LIMITS["safetensors_header"]
    f, size = U.open_regular(path, "tensors.header")
    with f:
        raw = U.read_exact(f, 8)
        if len(raw) != 8:
            raise AdmissionError("tensors.header", f"{size}-byte file has no safetensors header length")
        (n,) = struct.unpack("<Q", raw)
        if n > cap or 8 + n > size:
            raise AdmissionError(
                "tensors.header",
                f"header length {n} exceeds the cap of {cap} bytes "
                f"(untrusted.LIMITS['safetensors_header']) or file size {size}",
            )
        body = U.read_exact(f, n)
    if len(body) != n:
        raise AdmissionError("tensors.header", f"file shrank while reading its {n}-byte header")
    # Every entry carries "data_offsets": an upper bound on the entry count, before any parse.
    entries = body.count(b'"data_offsets"')
    if entries > U.SAFETENSORS_MAX_ENTRIES:
        raise AdmissionError(
            "tensors.header",
            f"{entries} entries exceed the cap of {U.SAFETENSORS_MAX_ENTRIES} (untrusted.SAFETENSORS_MAX_ENTRIES)",
        )
    try:
        header = U.loads(body, "tensors.header")
    except U.UntrustedFileError as e:
        raise AdmissionError("tensors.header", e.message) from None
    if type(header) is not dict:
        raise AdmissionError("tensors.header", "must be a JSON object")
    meta = header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, e in header.items():
        field = f"tensors.{name}"
        if type(e) is not dict or set(e) != {"dtype", "shape", "data_offsets"}:
            raise AdmissionError(field, "entry must have exactly dtype, shape, data_offsets")
        if e["dtype"] not in _ST_BYTES:
            raise AdmissionError(f"{field}.dtype", f"unknown dtype {e['dtype']!r}")
        shape, offs = e["shape"], e["data_offsets"]
        if type(shape) is not list or not all(type(d) is int and 0 <= d < 1 << 48 for d in shape):
            raise AdmissionError(f"{field}.shape", f"bad shape {shape!r}")
        if type(offs) is not list or len(offs) != 2 or not all(type(o) is int for o in offs):
            raise AdmissionError(f"{field}.data_offsets", f"bad offsets {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end <= data_bytes:
            raise AdmissionError(f"{field}.data_offsets", f"[{begin}, {end}) outside data region of {data_bytes} bytes")
        if end - begin != _ST_BYTES[e["dtype"]] * math.prod(shape):
            raise AdmissionError(f"{field}.length", f"{end - begin} bytes for {e['dtype']}{shape}")
    return n, header, meta
