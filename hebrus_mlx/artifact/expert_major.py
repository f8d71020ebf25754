"""ExpertMajor v2 (v3: per-layer codecs, below): one store for every routed expert (AFN-002).

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

Per-layer codecs (version 3): the codec is a table of one [gate, up, down]
codec name per layer (mlx-lm's mixed recipes quantize e.g. `down_proj` wider
in some layers). Each layer's records then have that layer's layout and stride
(records stay layer-major and 4096-aligned, packed layer after layer); the
header's codec_id is EXPERT_MAJOR_PER_LAYER_ID, record_bytes / record_stride
are the largest layer's, and the first 32 reserved bytes are the SHA-256 of
the canonical table (`codec_table_digest`), so every field is implied by
(family, codec table) and the reader checks the file against it exactly as
for one codec. A table with one codec everywhere is refused: that store is
version 2.
"""

import hashlib
import json
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
    EXPERT_MAJOR_PER_LAYER_ID,
    EXPERT_MAJOR_PER_LAYER_VERSION,
    EXPERT_MAJOR_VERSION,
    U32_MAX,
    align_up,
    codec,
    family_by_id,
)
from .errors import DigestError, GeometryError, HeaderError, TruncatedError
from .store_file import StoreFile, header_prelude, verify_closed

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


def layer_codecs(family, spec, field_name="experts.layer_codecs"):
    """One (gate, up, down) tuple of codec names per layer: `spec` is one codec name (every
    record) or a sequence of one [gate, up, down] per layer; anything else is a typed error
    naming the entry."""
    n = family.num_hidden_layers
    if isinstance(spec, str):
        codec(spec, field_name)
        return ((spec,) * len(EXPERT_COMPONENTS),) * n
    if not isinstance(spec, (list, tuple)) or len(spec) != n:
        raise GeometryError(field_name, f"must list one [gate, up, down] per layer ({n} layers)")
    out = []
    for layer, row in enumerate(spec):
        if not isinstance(row, (list, tuple)) or len(row) != len(EXPERT_COMPONENTS):
            raise GeometryError(f"{field_name}[{layer}]", f"{row!r} is not [gate, up, down] codec names")
        for comp, name in zip(EXPERT_COMPONENTS, row):
            if type(name) is not str:
                raise GeometryError(f"{field_name}[{layer}].{comp}", f"{name!r} is not a codec name")
            codec(name, f"{field_name}[{layer}].{comp}")
        out.append(tuple(row))
    return tuple(out)


def codec_table_digest(table):
    """SHA-256 of a per-layer codec table in canonical JSON (what a version-3 header binds)."""
    return hashlib.sha256(json.dumps([list(r) for r in table], separators=(",", ":")).encode()).digest()


def record_layout(family, codec_name):
    """[(component, part, dtype, shape, offset, nbytes)] of one record: one codec name for every
    projection, or a (gate, up, down) tuple of names (a layer of a per-layer store)."""
    names = (codec_name,) * len(EXPERT_COMPONENTS) if isinstance(codec_name, str) else tuple(codec_name)
    layout, off = [], 0
    for (comp, (rows, cols)), name in zip(family.component_shapes().items(), names, strict=True):
        c = codec(name, f"experts.{comp}.codec")
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
    """The complete expected layout for (family, codec): `codec_name` is one codec name (a
    version-2 store) or a per-layer table of (gate, up, down) names (version 3, `per_layer`).
    `layout`, `extents` and `codec` describe every record of a uniform store (None for a
    per-layer one: use `layer_layout(layer)`, `record_size(i)`, `record_offset(i)`)."""

    def __init__(self, family, codec_name):
        self.family = family
        if family.num_hidden_layers > EXPERT_MAJOR_MAX_LAYERS or family.num_experts > EXPERT_MAJOR_MAX_EXPERTS:
            raise GeometryError("experts.geometry", "family exceeds ExpertMajor v2 structural maximum")
        self.per_layer = not isinstance(codec_name, str)
        self.layer_codecs = layer_codecs(family, codec_name)
        if self.per_layer and len({n for row in self.layer_codecs for n in row}) == 1:
            raise GeometryError(
                "experts.layer_codecs", f"one codec {self.layer_codecs[0][0]!r} for every record: a uniform store"
            )
        self.codec = None if self.per_layer else codec(codec_name)
        layouts = {row: record_layout(family, row) for row in set(self.layer_codecs)}
        self.layer_layouts = [layouts[row] for row in self.layer_codecs]
        self.layer_record_bytes = [sum(n for *_, n in lay) for lay in self.layer_layouts]
        if max(self.layer_record_bytes) > U32_MAX:
            raise GeometryError("experts.record_bytes", "record exceeds 4 GiB")
        self.layer_strides = [align_up(b) for b in self.layer_record_bytes]
        self.layer_extents = [_extents(lay) for lay in self.layer_layouts]
        self.layout = None if self.per_layer else self.layer_layouts[0]
        self.extents = None if self.per_layer else self.layer_extents[0]
        self.record_bytes = max(self.layer_record_bytes)
        self.record_stride = max(self.layer_strides)
        E = family.num_experts
        self.count = family.num_hidden_layers * E
        self.table_offset = EXPERT_MAJOR_HEADER_BYTES
        self.table_bytes = self.count * EXPERT_MAJOR_ENTRY_BYTES
        self.payload_offset = align_up(self.table_offset + self.table_bytes)
        self.layer_base, off = [], self.payload_offset
        for stride in self.layer_strides:
            self.layer_base.append(off)
            off += E * stride
        self.payload_bytes = off - self.payload_offset
        self.file_bytes = self.payload_offset + self.payload_bytes

    def layer_layout(self, layer):
        return self.layer_layouts[layer]

    def record_size(self, i):
        """Bytes of record i (its layer's record)."""
        return self.layer_record_bytes[i // self.family.num_experts]

    def record_stride_of(self, i):
        return self.layer_strides[i // self.family.num_experts]

    def index(self, layer, expert):
        f = self.family
        if not (0 <= layer < f.num_hidden_layers and 0 <= expert < f.num_experts):
            raise GeometryError("experts.index", f"(layer {layer}, expert {expert}) out of range")
        return layer * f.num_experts + expert

    def record_offset(self, i):
        layer, e = divmod(i, self.family.num_experts)
        return self.layer_base[layer] + e * self.layer_strides[layer]

    def reserved(self):
        """The header's bytes after the fixed fields: zero, or the per-layer table's digest."""
        digest = codec_table_digest(self.layer_codecs) if self.per_layer else b""
        return digest.ljust(EXPERT_MAJOR_HEADER_BYTES - _HEADER.size, b"\0")

    def header_values(self):
        f = self.family
        return {
            **header_prelude(
                EXPERT_MAJOR_MAGIC,
                EXPERT_MAJOR_PER_LAYER_VERSION if self.per_layer else EXPERT_MAJOR_VERSION,
                EXPERT_MAJOR_HEADER_BYTES,
                f,
                EXPERT_MAJOR_PER_LAYER_ID if self.per_layer else self.codec.codec_id,
            ),
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


def _pack_header(values, table_sha, payload_sha, reserved=bytes(EXPERT_MAJOR_HEADER_BYTES - _HEADER.size)):
    raw = _HEADER.pack(*[values[k] for k in _HEADER_FIELDS[:17]], table_sha, payload_sha, _ZERO32) + reserved
    digest = hashlib.sha256(raw).digest()
    return raw[: _HEADER.size - 32] + digest + raw[_HEADER.size :]


def encode_record(geom, parts, layer=0):
    """Concatenate one expert's arrays in layout order (its layer's), checking each exactly."""
    layout = geom.layer_layout(layer)
    out = bytearray(geom.layer_record_bytes[layer])
    for comp, part, dtype, shape, off, n in layout:
        try:
            a = parts[comp][part]
        except (KeyError, TypeError):
            raise GeometryError(f"experts.{comp}.{part}", "missing array") from None
        if not isinstance(a, np.ndarray) or a.dtype != np.dtype(dtype) or a.shape != shape:
            got = (getattr(a, "dtype", type(a).__name__), getattr(a, "shape", None))
            raise GeometryError(f"experts.{comp}.{part}", f"expected {dtype}{list(shape)}, got {got}")
        out[off : off + n] = np.ascontiguousarray(a).view(np.uint8).reshape(-1).tobytes()
    extra = {(c, p) for c in parts for p in parts[c]} - {(c, p) for c, p, *_ in layout}
    if extra:
        raise GeometryError("experts.parts", f"unexpected arrays {sorted(extra)}")
    return bytes(out)


def write(w, family, codec_name, records, progress=None):
    """Stream records through AtomicWriter `w`.

    records: iterable of (layer, expert, {component: {part: ndarray}}) in
    layer-major order; memory stays at one record plus the table. `codec_name`: one codec name or
    a per-layer table (see Geometry).
    """
    geom = Geometry(family, codec_name)
    w.write(bytes(geom.payload_offset))
    table = bytearray(geom.table_bytes)
    payload = hashlib.sha256()
    i = -1
    for i, (layer, expert, parts) in enumerate(records):
        if i >= geom.count or geom.index(layer, expert) != i:
            raise GeometryError(
                "experts.order", f"record {i} is (layer {layer}, expert {expert}); expected layer-major order"
            )
        rec = encode_record(geom, parts, layer)
        digest = hashlib.sha256(rec).digest()
        _ENTRY.pack_into(
            table,
            i * EXPERT_MAJOR_ENTRY_BYTES,
            layer,
            expert,
            geom.record_offset(i),
            len(rec),
            *geom.layer_extents[layer],
            digest,
        )
        pad = bytes(geom.layer_strides[layer] - len(rec))
        w.write(rec)
        w.write(pad)
        payload.update(rec)
        payload.update(pad)
        if progress is not None:
            progress(geom.layer_strides[layer])
    if i + 1 != geom.count:
        raise GeometryError("experts.count", f"{i + 1} records written, family needs {geom.count}")
    table_sha = hashlib.sha256(table).digest()
    w.pwrite(table, geom.table_offset)
    w.pwrite(_pack_header(geom.header_values(), table_sha, payload.digest(), geom.reserved()), 0)
    return geom


def publish(path, family, codec_name, records, faults=None, progress=None, fast=None):
    """Atomically publish a store, verifying every record before rename. `fast`
    (fast_check.Collector) gets each record's bytes from that verify pass."""
    return atomic.publish_file(
        path,
        lambda w: write(w, family, codec_name, records, progress),
        verify=lambda tmp: verify_closed(ExpertMajorReader(tmp, family, codec_name), fast),
        faults=faults,
    )


class ExpertMajorReader(StoreFile):
    """Validate an untrusted store on open (header + table, no payload read).

    family / codec_name: if given, the header must name exactly these. codec_name may be a
    per-layer table (Geometry); a per-layer store cannot be opened without its table.
    fast: the admitted per-record XXH3-128 digests (Manifest.fast_table): record reads are then
    checked by the fast check instead of SHA-256 (verify_all always checks SHA-256).
    """

    def __init__(self, path, family=None, codec_name=None, fast=None):
        self._fast = fast_check.checker(fast)
        super().__init__(path, family, codec_name)

    def _open(self, family, codec_name):
        size, raw = self._header(EXPERT_MAJOR_HEADER_BYTES, "experts")
        h = dict(zip(_HEADER_FIELDS, _HEADER.unpack_from(raw)))
        per_layer = codec_name is not None and not isinstance(codec_name, str)
        if codec_name is None and h["version"] == EXPERT_MAJOR_PER_LAYER_VERSION:
            raise GeometryError("experts.layer_codecs", "a per-layer store is read with its manifest's layer_codecs")
        version = EXPERT_MAJOR_PER_LAYER_VERSION if per_layer else EXPERT_MAJOR_VERSION
        self._check_prelude(
            h, "experts", EXPERT_MAJOR_MAGIC, version, EXPERT_MAJOR_HEADER_BYTES, "an ExpertMajor store"
        )
        zeroed = raw[: _HEADER.size - 32] + _ZERO32 + raw[_HEADER.size :]
        if hashlib.sha256(zeroed).digest() != h["header_sha256"]:
            raise DigestError("experts.header_sha256", "header digest mismatch")
        if per_layer:
            fam, cod = family_by_id(h["family_id"], "experts.family_id"), None
            if family is not None and fam != family:
                raise GeometryError("experts.family_id", f"store family {fam.name!r} != expected {family.name!r}")
            if h["codec_id"] != EXPERT_MAJOR_PER_LAYER_ID:
                raise GeometryError("experts.codec_id", f"store codec id {h['codec_id']} is not a per-layer table")
            geom = Geometry(fam, codec_name)
            if raw[_HEADER.size :] != geom.reserved():
                raise HeaderError("experts.layer_codecs", "header's codec table digest differs from layer_codecs")
            what = f"{fam.name}/per-layer"
        else:
            if raw[_HEADER.size :] != bytes(EXPERT_MAJOR_HEADER_BYTES - _HEADER.size):
                raise HeaderError("experts.reserved", "reserved header bytes are not zero")
            fam, cod = self._identity(h, "experts", family, codec_name)
            geom = Geometry(fam, cod.name)
            what = f"{fam.name}/{cod.name}"
        for name, want in geom.header_values().items():
            if h[name] != want:
                raise GeometryError(f"experts.{name}", f"header says {h[name]}, {what} needs {want}")
        if size != geom.file_bytes:
            cls = TruncatedError if size < geom.file_bytes else HeaderError
            raise cls("experts.file_bytes", f"file is {size} bytes, layout needs {geom.file_bytes}")
        table = self._pread(geom.table_bytes, geom.table_offset, "experts.table")
        if hashlib.sha256(table).digest() != h["table_sha256"]:
            raise DigestError("experts.table_sha256", "record table digest mismatch")
        digests = []
        for i, e in enumerate(_ENTRY.iter_unpack(table)):
            layer, expert, offset, length = e[:4]
            want = (i // fam.num_experts, i % fam.num_experts, geom.record_offset(i), geom.record_size(i))
            if (layer, expert, offset, length) != want or list(e[4:22]) != geom.layer_extents[want[0]]:
                raise GeometryError(f"experts.record[{i}]", f"entry {e[:4]} disagrees with layout {want}")
            digests.append(e[22])
        self.header, self.geometry, self.family, self.codec = h, geom, fam, cod
        self.digests = digests

    def read_record(self, layer, expert):
        """One pread of the record, digest checked, bytes returned."""
        g = self.geometry
        i = g.index(layer, expert)
        data = self._pread(g.record_size(i), g.record_offset(i), f"experts.record[{i}]")
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
        for comp, part, dtype, shape, off, n in self.geometry.layer_layout(layer):
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
            data = self._pread(g.record_stride_of(i), g.record_offset(i), f"experts.record[{i}]")
            n = g.record_size(i)
            if hashlib.sha256(data[:n]).digest() != self.digests[i]:
                raise DigestError(f"experts.record[{i}]", "record digest mismatch")
            if fast is not None:
                fast(data[:n])
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
