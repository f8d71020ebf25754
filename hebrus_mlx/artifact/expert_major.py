"""ExpertMajor v2: one store for every routed expert (AFN-002).

Layout (little-endian):

    [0, 256)              header: magic, version, family id, closed geometry,
                          codec, table/payload extents, three SHA-256 digests
    [256, 256 + 128*N)    record table, N = layers * experts, layer-major
    pad to 4096
    payload               N records, each gate | up | down contiguous (each
                          component weight | scales | biases for affine
                          codecs), every record starting on a 4096 boundary

Every field is implied by (family, codec), so the reader recomputes the whole
expected layout and requires the file to equal it: entries are contiguous and
non-overlapping by construction, and a single disagreeing byte is a typed
error naming its field. numpy only: admission must not import MLX.
"""

import hashlib
import struct

import numpy as np

from . import atomic, fast_check
from .constants import (
    AFFINE_PARTS,
    ALIGNMENT,
    DTYPE_BYTES,
    EXPERT_COMPONENTS,
    EXPERT_MAJOR_ENTRY_BYTES,
    EXPERT_MAJOR_HEADER_BYTES,
    EXPERT_MAJOR_MAGIC,
    EXPERT_MAJOR_MAX_EXPERTS,
    EXPERT_MAJOR_MAX_LAYERS,
    EXPERT_MAJOR_VERSION,
    U32_MAX,
    align_up,
    codec,
)
from .errors import DigestError, GeometryError, HeaderError, TruncatedError
from .store_file import StoreFile, header_prelude

_HEADER = struct.Struct("<8s10I6Q32s32s32s")
_ENTRY = struct.Struct("<2I2Q18I32s")
_ZERO32 = bytes(32)
assert _HEADER.size <= EXPERT_MAJOR_HEADER_BYTES and _ENTRY.size == EXPERT_MAJOR_ENTRY_BYTES

_HEADER_FIELDS = (
    "magic",
    "version",
    "header_bytes",
    "family_id",
    "codec_id",
    "num_layers",
    "num_experts",
    "top_k",
    "hidden_size",
    "moe_intermediate_size",
    "alignment",
    "table_offset",
    "table_bytes",
    "payload_offset",
    "payload_bytes",
    "record_bytes",
    "record_stride",
    "table_sha256",
    "payload_sha256",
    "header_sha256",
)


def record_layout(family, codec_name):
    """[(component, part, dtype, shape, offset, nbytes)] of one record."""
    c = codec(codec_name)
    layout, off = [], 0
    for comp, (rows, cols) in family.component_shapes().items():
        for part, dtype, shape in c.parts(rows, cols, f"experts.{comp}"):
            n = shape[0] * shape[1] * DTYPE_BYTES[dtype]
            layout.append((comp, part, dtype, shape, off, n))
            off += n
    return layout


def _extents(layout):
    """The 9 (offset, length) pairs of an entry: gate|up|down x weight|scales|biases."""
    by = {(comp, part): (off, n) for comp, part, _, _, off, n in layout}
    out = []
    for comp in EXPERT_COMPONENTS:
        for part in AFFINE_PARTS:
            out.extend(by.get((comp, part), (0, 0)))
    return out


class Geometry:
    """The complete expected layout for (family, codec)."""

    def __init__(self, family, codec_name):
        self.family = family
        self.codec = codec(codec_name)
        if family.num_hidden_layers > EXPERT_MAJOR_MAX_LAYERS or family.num_experts > EXPERT_MAJOR_MAX_EXPERTS:
            raise GeometryError("experts.geometry", "family exceeds ExpertMajor v2 structural maximum")
        self.layout = record_layout(family, codec_name)
        self.record_bytes = sum(n for *_, n in self.layout)
        if self.record_bytes > U32_MAX:
            raise GeometryError("experts.record_bytes", "record exceeds 4 GiB")
        self.record_stride = align_up(self.record_bytes)
        self.count = family.num_hidden_layers * family.num_experts
        self.table_offset = EXPERT_MAJOR_HEADER_BYTES
        self.table_bytes = self.count * EXPERT_MAJOR_ENTRY_BYTES
        self.payload_offset = align_up(self.table_offset + self.table_bytes)
        self.payload_bytes = self.count * self.record_stride
        self.file_bytes = self.payload_offset + self.payload_bytes
        self.extents = _extents(self.layout)

    def index(self, layer, expert):
        f = self.family
        if not (0 <= layer < f.num_hidden_layers and 0 <= expert < f.num_experts):
            raise GeometryError("experts.index", f"(layer {layer}, expert {expert}) out of range")
        return layer * f.num_experts + expert

    def record_offset(self, i):
        return self.payload_offset + i * self.record_stride

    def header_values(self):
        f = self.family
        return {
            **header_prelude(EXPERT_MAJOR_MAGIC, EXPERT_MAJOR_VERSION, EXPERT_MAJOR_HEADER_BYTES, f, self.codec),
            "num_layers": f.num_hidden_layers,
            "num_experts": f.num_experts,
            "top_k": f.num_experts_per_tok,
            "hidden_size": f.hidden_size,
            "moe_intermediate_size": f.moe_intermediate_size,
            "alignment": ALIGNMENT,
            "table_offset": self.table_offset,
            "table_bytes": self.table_bytes,
            "payload_offset": self.payload_offset,
            "payload_bytes": self.payload_bytes,
            "record_bytes": self.record_bytes,
            "record_stride": self.record_stride,
        }


def _pack_header(values, table_sha, payload_sha):
    raw = _HEADER.pack(*[values[k] for k in _HEADER_FIELDS[:17]], table_sha, payload_sha, _ZERO32)
    raw = raw.ljust(EXPERT_MAJOR_HEADER_BYTES, b"\0")
    digest = hashlib.sha256(raw).digest()
    return raw[: _HEADER.size - 32] + digest + raw[_HEADER.size :]


def encode_record(geom, parts):
    """Concatenate one expert's arrays in layout order, checking each exactly."""
    out = bytearray(geom.record_bytes)
    for comp, part, dtype, shape, off, n in geom.layout:
        try:
            a = parts[comp][part]
        except (KeyError, TypeError):
            raise GeometryError(f"experts.{comp}.{part}", "missing array") from None
        if not isinstance(a, np.ndarray) or a.dtype != np.dtype(dtype) or a.shape != shape:
            got = (getattr(a, "dtype", type(a).__name__), getattr(a, "shape", None))
            raise GeometryError(f"experts.{comp}.{part}", f"expected {dtype}{list(shape)}, got {got}")
        out[off : off + n] = np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes()
    extra = {(c, p) for c in parts for p in parts[c]} - {(c, p) for c, p, *_ in geom.layout}
    if extra:
        raise GeometryError("experts.parts", f"unexpected arrays {sorted(extra)}")
    return bytes(out)


def write(w, family, codec_name, records, progress=None):
    """Stream records through AtomicWriter `w`.

    records: iterable of (layer, expert, {component: {part: ndarray}}) in
    layer-major order; memory stays at one record plus the table.
    """
    geom = Geometry(family, codec_name)
    w.write(bytes(geom.payload_offset))
    table = bytearray(geom.table_bytes)
    payload = hashlib.sha256()
    pad = bytes(geom.record_stride - geom.record_bytes)
    i = -1
    for i, (layer, expert, parts) in enumerate(records):
        if i >= geom.count or geom.index(layer, expert) != i:
            raise GeometryError(
                "experts.order", f"record {i} is (layer {layer}, expert {expert}); expected layer-major order"
            )
        rec = encode_record(geom, parts)
        digest = hashlib.sha256(rec).digest()
        _ENTRY.pack_into(
            table,
            i * EXPERT_MAJOR_ENTRY_BYTES,
            layer,
            expert,
            geom.record_offset(i),
            geom.record_bytes,
            *geom.extents,
            digest,
        )
        w.write(rec)
        w.write(pad)
        payload.update(rec)
        payload.update(pad)
        if progress is not None:
            progress(geom.record_stride)
    if i + 1 != geom.count:
        raise GeometryError("experts.count", f"{i + 1} records written, family needs {geom.count}")
    table_sha = hashlib.sha256(table).digest()
    w.pwrite(table, geom.table_offset)
    w.pwrite(_pack_header(geom.header_values(), table_sha, payload.digest()), 0)
    return geom


def publish(path, family, codec_name, records, faults=None, progress=None, fast=None):
    """Atomically publish a store, verifying every record before rename. `fast`
    (fast_check.Collector) gets each record's bytes from that verify pass."""
    return atomic.publish_file(
        path,
        lambda w: write(w, family, codec_name, records, progress),
        verify=lambda tmp: ExpertMajorReader(tmp, family, codec_name).verify_all(fast=fast),
        faults=faults,
    )


class ExpertMajorReader(StoreFile):
    """Validate an untrusted store on open (header + table, no payload read).

    family / codec_name: if given, the header must name exactly these.
    fast: the admitted per-record XXH3-128 digests (Manifest.fast_table): record reads are then
    checked by the fast check instead of SHA-256 (verify_all always checks SHA-256).
    """

    def __init__(self, path, family=None, codec_name=None, fast=None):
        self._fast = fast_check.checker(fast)
        super().__init__(path, family, codec_name)

    def _open(self, family, codec_name):
        size, raw = self._header(EXPERT_MAJOR_HEADER_BYTES, "experts")
        h = dict(zip(_HEADER_FIELDS, _HEADER.unpack_from(raw)))
        self._check_prelude(
            h, "experts", EXPERT_MAJOR_MAGIC, EXPERT_MAJOR_VERSION, EXPERT_MAJOR_HEADER_BYTES, "an ExpertMajor store"
        )
        zeroed = raw[: _HEADER.size - 32] + _ZERO32 + raw[_HEADER.size :]
        if hashlib.sha256(zeroed).digest() != h["header_sha256"]:
            raise DigestError("experts.header_sha256", "header digest mismatch")
        if raw[_HEADER.size :] != bytes(EXPERT_MAJOR_HEADER_BYTES - _HEADER.size):
            raise HeaderError("experts.reserved", "reserved header bytes are not zero")
        fam, cod = self._identity(h, "experts", family, codec_name)
        geom = Geometry(fam, cod.name)
        for name, want in geom.header_values().items():
            if h[name] != want:
                raise GeometryError(
                    f"experts.{name}", f"header says {h[name]}, family {fam.name}/{cod.name} needs {want}"
                )
        if size != geom.file_bytes:
            cls = TruncatedError if size < geom.file_bytes else HeaderError
            raise cls("experts.file_bytes", f"file is {size} bytes, layout needs {geom.file_bytes}")
        table = self._pread(geom.table_bytes, geom.table_offset, "experts.table")
        if hashlib.sha256(table).digest() != h["table_sha256"]:
            raise DigestError("experts.table_sha256", "record table digest mismatch")
        digests = []
        for i, e in enumerate(_ENTRY.iter_unpack(table)):
            layer, expert, offset, length = e[:4]
            want = (i // fam.num_experts, i % fam.num_experts, geom.record_offset(i), geom.record_bytes)
            if (layer, expert, offset, length) != want or list(e[4:22]) != geom.extents:
                raise GeometryError(f"experts.record[{i}]", f"entry {e[:4]} disagrees with layout {want}")
            digests.append(e[22])
        self.header, self.geometry, self.family, self.codec = h, geom, fam, cod
        self.digests = digests

    def read_record(self, layer, expert):
        """One pread of the record, digest checked, bytes returned."""
        g = self.geometry
        i = g.index(layer, expert)
        data = self._pread(g.record_bytes, g.record_offset(i), f"experts.record[{i}]")
        if self._fast is not None:
            if not self._fast(i, data):
                raise DigestError(f"experts.record[{i}]", f"XXH3-128 mismatch for (layer {layer}, expert {expert})")
        elif hashlib.sha256(data).digest() != self.digests[i]:
            raise DigestError(f"experts.record[{i}]", f"digest mismatch for (layer {layer}, expert {expert})")
        return data

    def read_record_into(self, layer, expert, out):
        """Copy a verified record into `out`; untouched on any failure."""
        data = self.read_record(layer, expert)
        memoryview(out).cast("B")[: len(data)] = data
        return len(data)

    def read_expert(self, layer, expert):
        """{component: {part: ndarray}} of one verified record."""
        data = self.read_record(layer, expert)
        out = {}
        for comp, part, dtype, shape, off, n in self.geometry.layout:
            out.setdefault(comp, {})[part] = np.frombuffer(
                data, dtype=dtype, count=n // DTYPE_BYTES[dtype], offset=off
            ).reshape(shape)
        return out

    def verify_all(self, progress=None, file_hash=None, fast=None):
        """Every record digest plus the whole-payload digest (separate checks). `fast(bytes)`,
        if given, is called with each record once its SHA-256 matched (the fast check's digests
        are taken from verified bytes)."""
        g = self.geometry

        def record(i):
            data = self._pread(g.record_stride, g.record_offset(i), f"experts.record[{i}]")
            if hashlib.sha256(data[: g.record_bytes]).digest() != self.digests[i]:
                raise DigestError(f"experts.record[{i}]", "record digest mismatch")
            if fast is not None:
                fast(data[: g.record_bytes])
            return data

        self._verify_payload(
            g.payload_offset, g.count, record, self.header["payload_sha256"], "experts", progress, file_hash
        )

    def extents(self):
        """Physical owners inside this file: (start, end, owner)."""
        g = self.geometry
        return [
            (0, EXPERT_MAJOR_HEADER_BYTES, "experts.header"),
            (g.table_offset, g.table_offset + g.table_bytes, "experts.table"),
            (g.payload_offset, g.payload_offset + g.payload_bytes, "experts.payload"),
        ]
