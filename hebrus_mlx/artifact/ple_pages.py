"""PLE fixed-page store v1 (AFN-003).

One store holds one PLE n-gram table (the runtime table: all checkpoint
shards concatenated, rows in runtime order). Layout (little-endian):

    [0, 512)                   manifest header
    [512, 512 + 32*pages)      one SHA-256 per page
    pad to 4096
    payload                    pages of fixed stride (multiple of 4096); each
                               page = 64-byte header repeating its geometry,
                               rows_per_page encoded rows, zero fill

A bf16/f32 row is its width's values; an affine row (codecs ple-affine4/8) is self-contained:
width * bits / 8 bytes of values packed LSB first (as MLX packs uint32 words), then one bf16
scale per group, then one bf16 bias per group; value = q * scale + bias. The group is the
codec's (32) or the whole row when the row is narrower; the header's group_size records it.

Row r lives at page r // rows_per_page, slot r % rows_per_page; there is no
per-row index. A row read takes ONE page snapshot: pread the page, check its
header, check its digest, then copy out. The manifest digest (header + digest
table + padding), page digests and the whole-payload digest are three
independent checks.
"""

import hashlib
import struct

import numpy as np

from . import atomic, fast_check
from .constants import (
    ALIGNMENT,
    OFF_T_MAX,
    PLE_CODECS,
    PLE_DEFAULT_PAGE_BYTES,
    PLE_HEADER_BYTES,
    PLE_MAGIC,
    PLE_MAX_HEADS,
    PLE_MAX_PAGES,
    PLE_MAX_ROWS_PER_PAGE,
    PLE_PAGE_HEADER_BYTES,
    PLE_PAGE_MAGIC,
    PLE_VERSION,
    SHA256_BYTES,
    align_up,
    codec,
)
from .errors import CodecError, DigestError, GeometryError, HeaderError, TruncatedError
from .store_file import StoreFile, header_prelude, verify_closed

_HEADER = struct.Struct(f"<8s12I8Q{PLE_MAX_HEADS}I32s32s")
_PAGE = struct.Struct("<4sIQQ8I")
_ZERO32 = bytes(32)
assert _HEADER.size <= PLE_HEADER_BYTES and _PAGE.size <= PLE_PAGE_HEADER_BYTES

_FIELDS = (
    "magic",
    "version",
    "header_bytes",
    "family_id",
    "codec_id",
    "group_size",
    "width",
    "row_bytes",
    "rows_per_page",
    "page_header_bytes",
    "alignment",
    "table_index",
    "num_heads",
    "total_rows",
    "head_rows",
    "row_alignment",
    "num_pages",
    "page_stride",
    "digest_table_offset",
    "payload_offset",
    "payload_bytes",
)
_PAGE_FIELDS = (
    "magic",
    "family_id",
    "page_index",
    "first_row",
    "rows",
    "width",
    "row_bytes",
    "rows_per_page",
    "codec_id",
    "group_size",
    "table_index",
    "reserved",
)
_DIGEST_OFF = _HEADER.size - 64  # payload digest, then manifest digest


def storage_dtype(codec_name):
    """numpy dtype of a stored row's elements: bf16 bits, float32, or an affine row's bytes."""
    return {"bf16": np.uint16, "f32": np.float32}.get(codec_name, np.uint8)


def _bf16_bits(a, up):
    """float32 -> bf16 bits rounded toward +inf (up) or -inf (finite inputs)."""
    a = np.ascontiguousarray(a, np.float32)
    bits = (a.view(np.uint32) >> 16).astype(np.uint16)  # toward zero
    v = _bf16_values(bits)
    bits[(v < a) if up else (v > a)] += 1  # one step away from zero: the other direction
    return bits


def _bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def affine_layout(cod, width):
    """(group, row_bytes) of an affine PLE row of `width` values under codec `cod`."""
    group = min(cod.group_size, width)
    if width % group or width * cod.bits % 8:
        raise CodecError("ple.width", f"{cod.name}: rows of {width} values do not split into groups")
    return group, width * cod.bits // 8 + 4 * (width // group)


def encode_rows(values, codec_name):
    """[n, width] float rows -> [n, row_bytes] uint8 affine rows: per group the bias is the min
    rounded down to bf16 and the scale the step rounded up, so every value lies within the
    2**bits levels and is off by at most half a step (bf16 scales and biases cost no clip)."""
    values = np.ascontiguousarray(values, np.float32)
    if values.ndim != 2:
        raise GeometryError("ple.rows", f"rows must be [n, width], got {values.shape}")
    if not np.isfinite(values).all():
        raise CodecError("ple.rows", f"{codec_name}: non-finite PLE values cannot be quantized")
    cod = codec(codec_name, "ple.codec")
    n, width, bits = *values.shape, cod.bits
    group, _ = affine_layout(cod, width)
    x = values.reshape(n, -1, group)
    lo, hi = x.min(axis=2), x.max(axis=2)
    levels = (1 << bits) - 1
    bias = _bf16_bits(lo, up=False)
    b = _bf16_values(bias)
    scale = _bf16_bits((hi - b) / levels, up=True)
    s, b = _bf16_values(scale)[..., None], b[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s > 0, np.rint((x - b) / s), 0)
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(n, width)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return np.concatenate([q, scale.view(np.uint8).reshape(n, -1), bias.view(np.uint8).reshape(n, -1)], axis=1)


def decode_rows(rows, codec_name, width):
    """[n, row_bytes] uint8 affine rows -> [n, width] float32 (the reference decode)."""
    rows = np.ascontiguousarray(rows, np.uint8)
    cod = codec(codec_name, "ple.codec")
    n, bits = len(rows), cod.bits
    group, _ = affine_layout(cod, width)
    packed, groups = width * bits // 8, width // group
    q = rows[:, :packed]
    if bits == 4:
        q = np.stack([q & 0xF, q >> 4], axis=2).reshape(n, width)
    scale = _bf16_values(np.ascontiguousarray(rows[:, packed : packed + 2 * groups]).view(np.uint16))
    bias = _bf16_values(np.ascontiguousarray(rows[:, packed + 2 * groups :]).view(np.uint16))
    x = q.astype(np.float32).reshape(n, groups, group) * scale[..., None] + bias[..., None]
    return x.reshape(n, width)


class Geometry:
    """Expected layout of PLE table `table` of `family` under `codec_name`."""

    def __init__(self, family, table, codec_name, rows_per_page=None):
        if codec_name not in PLE_CODECS:
            raise CodecError("ple.codec", f"{codec_name!r} is not a PLE row codec {PLE_CODECS}")
        if not 0 <= table < family.ple_tables:
            raise GeometryError("ple.table_index", f"family {family.name} has {family.ple_tables} PLE tables")
        self.family, self.table = family, table
        self.codec = codec(codec_name)
        self.width = family.ple_width
        if self.codec.affine:
            self.group_size, self.row_bytes = affine_layout(self.codec, self.width)
            self.row_values = self.row_bytes  # a stored row is its bytes
        else:
            self.group_size = 0
            self.row_bytes = self.codec.nbytes(1, self.width, "ple.width")
            self.row_values = self.width
        self.heads = family.ple_head_sizes(table)
        self.total_rows = family.ple_rows[table]
        self.head_rows = family.ple_head_rows[table]
        if rows_per_page is None:
            rows_per_page = max(1, (PLE_DEFAULT_PAGE_BYTES - PLE_PAGE_HEADER_BYTES) // self.row_bytes)
        if not 1 <= rows_per_page <= PLE_MAX_ROWS_PER_PAGE:
            raise GeometryError("ple.rows_per_page", f"{rows_per_page} outside [1, {PLE_MAX_ROWS_PER_PAGE}]")
        self.rows_per_page = rows_per_page
        self.page_stride = align_up(PLE_PAGE_HEADER_BYTES + rows_per_page * self.row_bytes)
        self.num_pages = -(-self.total_rows // rows_per_page)
        if self.num_pages > PLE_MAX_PAGES:
            raise GeometryError("ple.num_pages", f"{self.num_pages} pages exceed {PLE_MAX_PAGES}")
        self.digest_table_offset = PLE_HEADER_BYTES
        self.payload_offset = align_up(PLE_HEADER_BYTES + SHA256_BYTES * self.num_pages)
        self.payload_bytes = self.num_pages * self.page_stride
        self.file_bytes = self.payload_offset + self.payload_bytes
        if self.file_bytes > OFF_T_MAX:
            raise GeometryError("ple.payload_bytes", "store exceeds off_t")

    def header_values(self):
        f = self.family
        return {
            **header_prelude(PLE_MAGIC, PLE_VERSION, PLE_HEADER_BYTES, f, self.codec.codec_id),
            "group_size": self.group_size,
            "width": self.width,
            "row_bytes": self.row_bytes,
            "rows_per_page": self.rows_per_page,
            "page_header_bytes": PLE_PAGE_HEADER_BYTES,
            "alignment": ALIGNMENT,
            "table_index": self.table,
            "num_heads": len(self.heads),
            "total_rows": self.total_rows,
            "head_rows": self.head_rows,
            "row_alignment": f.ngram_row_alignment,
            "num_pages": self.num_pages,
            "page_stride": self.page_stride,
            "digest_table_offset": self.digest_table_offset,
            "payload_offset": self.payload_offset,
            "payload_bytes": self.payload_bytes,
        }

    def page_values(self, page):
        first = page * self.rows_per_page
        return {
            "magic": PLE_PAGE_MAGIC,
            "family_id": self.family.family_id,
            "page_index": page,
            "first_row": first,
            "rows": min(self.rows_per_page, self.total_rows - first),
            "width": self.width,
            "row_bytes": self.row_bytes,
            "rows_per_page": self.rows_per_page,
            "codec_id": self.codec.codec_id,
            "group_size": self.group_size,
            "table_index": self.table,
            "reserved": 0,
        }

    def locate(self, row):
        """(page, page_offset, row_offset_in_page), every step range-checked."""
        if not isinstance(row, (int, np.integer)) or not 0 <= row < self.total_rows:
            raise GeometryError("ple.row", f"row {row} outside [0, {self.total_rows})")
        row = int(row)
        page, slot = divmod(row, self.rows_per_page)
        page_offset = self.payload_offset + page * self.page_stride
        if page >= self.num_pages or page_offset + self.page_stride > self.file_bytes:
            raise GeometryError("ple.row", f"row {row} maps past the payload")
        return page, page_offset, PLE_PAGE_HEADER_BYTES + slot * self.row_bytes


def _pack_header(values, payload_sha, heads):
    sizes = list(heads) + [0] * (PLE_MAX_HEADS - len(heads))
    raw = _HEADER.pack(*[values[k] for k in _FIELDS], *sizes, payload_sha, _ZERO32)
    return raw.ljust(PLE_HEADER_BYTES, b"\0")


def _pack_page_header(values):
    return _PAGE.pack(*[values[k] for k in _PAGE_FIELDS]).ljust(PLE_PAGE_HEADER_BYTES, b"\0")


def write(w, family, table, codec_name, chunks, rows_per_page=None, progress=None):
    """Stream rows into pages; memory is one page plus the digest table.

    chunks: iterable of [n, row_values] arrays in storage dtype (uint16 bf16 bits,
    float32, or encode_rows' uint8 affine rows), in runtime row order, totalling the
    family's padded rows.
    """
    g = Geometry(family, table, codec_name, rows_per_page)
    dtype = storage_dtype(codec_name)
    w.write(bytes(g.payload_offset))
    digests = bytearray(SHA256_BYTES * g.num_pages)
    payload = hashlib.sha256()
    page = bytearray(g.page_stride)
    fill, page_index, row = 0, 0, 0

    def flush():
        nonlocal fill, page_index
        page[:PLE_PAGE_HEADER_BYTES] = _pack_page_header(g.page_values(page_index))
        page[PLE_PAGE_HEADER_BYTES + fill * g.row_bytes :] = bytes(
            g.page_stride - PLE_PAGE_HEADER_BYTES - fill * g.row_bytes
        )
        digests[page_index * 32 : page_index * 32 + 32] = hashlib.sha256(page).digest()
        payload.update(page)
        w.write(page)
        if progress is not None:
            progress(g.page_stride)
        fill, page_index = 0, page_index + 1

    for chunk in chunks:
        if (
            not isinstance(chunk, np.ndarray)
            or chunk.dtype != dtype
            or chunk.ndim != 2
            or chunk.shape[1] != g.row_values
        ):
            got = (getattr(chunk, "dtype", type(chunk).__name__), getattr(chunk, "shape", None))
            raise GeometryError("ple.rows", f"chunk must be {np.dtype(dtype)}[n, {g.row_values}], got {got}")
        if row + chunk.shape[0] > g.total_rows:
            raise GeometryError("ple.total_rows", f"more than {g.total_rows} rows supplied")
        data = np.ascontiguousarray(chunk).view(np.uint8).reshape(chunk.shape[0], g.row_bytes)
        i = 0
        while i < len(data):
            take = min(g.rows_per_page - fill, len(data) - i)
            start = PLE_PAGE_HEADER_BYTES + fill * g.row_bytes
            page[start : start + take * g.row_bytes] = data[i : i + take].tobytes()
            fill, i, row = fill + take, i + take, row + take
            if fill == g.rows_per_page:
                flush()
    if row != g.total_rows:
        raise GeometryError("ple.total_rows", f"{row} rows supplied, table has {g.total_rows}")
    if fill:
        flush()
    header = bytearray(_pack_header(g.header_values(), payload.digest(), g.heads))
    pad = bytes(g.payload_offset - PLE_HEADER_BYTES - len(digests))
    header[_DIGEST_OFF + 32 : _DIGEST_OFF + 64] = hashlib.sha256(bytes(header) + digests + pad).digest()
    w.pwrite(digests, g.digest_table_offset)
    w.pwrite(header, 0)
    return g


def publish(path, family, table, codec_name, chunks, rows_per_page=None, faults=None, progress=None, fast=None):
    """Atomically publish a PLE store; every page and the payload are
    verified through the reader before the rename. `fast` (fast_check.Collector)
    gets each page's bytes from that verify pass."""
    return atomic.publish_file(
        path,
        lambda w: write(w, family, table, codec_name, chunks, rows_per_page, progress),
        verify=lambda tmp: verify_closed(PleReader(tmp, family, codec_name), fast),
        faults=faults,
    )


class PleReader(StoreFile):
    """Open validates the manifest (no row payload is read). fast: the admitted per-page XXH3-128
    digests (Manifest.fast_table): page reads are then checked by the fast check instead of
    SHA-256 (verify_all always checks SHA-256)."""

    def __init__(self, path, family=None, codec_name=None, fast=None):
        self._fast = fast_check.checker(fast)
        super().__init__(path, family, codec_name)

    def _open(self, family, codec_name):
        size, raw = self._header(PLE_HEADER_BYTES, "ple")
        vals = _HEADER.unpack_from(raw)
        h = dict(zip(_FIELDS, vals))
        heads = vals[len(_FIELDS) : len(_FIELDS) + PLE_MAX_HEADS]
        payload_sha, manifest_sha = vals[-2], vals[-1]
        self._check_prelude(h, "ple", PLE_MAGIC, PLE_VERSION, PLE_HEADER_BYTES, "a PLE page store")
        if raw[_HEADER.size :] != bytes(PLE_HEADER_BYTES - _HEADER.size):
            raise HeaderError("ple.reserved", "reserved header bytes are not zero")
        fam, cod = self._identity(h, "ple", family, codec_name)
        if not 0 <= h["table_index"] < fam.ple_tables:
            raise GeometryError("ple.table_index", f"{h['table_index']} outside family's {fam.ple_tables} tables")
        if not 1 <= h["rows_per_page"] <= PLE_MAX_ROWS_PER_PAGE:
            raise GeometryError("ple.rows_per_page", f"{h['rows_per_page']} outside [1, {PLE_MAX_ROWS_PER_PAGE}]")
        g = Geometry(fam, h["table_index"], cod.name, h["rows_per_page"])
        for name, want in g.header_values().items():
            if h[name] != want:
                raise GeometryError(f"ple.{name}", f"header says {h[name]}, geometry needs {want}")
        want_heads = tuple(g.heads) + (0,) * (PLE_MAX_HEADS - len(g.heads))
        for i, (got, want) in enumerate(zip(heads, want_heads)):
            if got != want:
                raise GeometryError(f"ple.head_sizes[{i}]", f"prime {got} != {want}")
        if size != g.file_bytes:
            cls = TruncatedError if size < g.file_bytes else HeaderError
            raise cls("ple.file_bytes", f"file is {size} bytes, layout needs {g.file_bytes}")
        # Bounded by the file size checked above.
        rest = self._pread(g.payload_offset - PLE_HEADER_BYTES, PLE_HEADER_BYTES, "ple.digest_table")
        zeroed = raw[: _DIGEST_OFF + 32] + _ZERO32 + raw[_DIGEST_OFF + 64 :]
        if hashlib.sha256(zeroed + rest).digest() != manifest_sha:
            raise DigestError("ple.manifest_sha256", "manifest digest mismatch")
        self.header, self.geometry, self.family, self.codec = h, g, fam, cod
        self.payload_sha = payload_sha
        self.digests = rest[: SHA256_BYTES * g.num_pages]

    def _check_page(self, page, data, sha=False):
        g = self.geometry
        vals = dict(zip(_PAGE_FIELDS, _PAGE.unpack_from(data)))
        for name, want in g.page_values(page).items():
            if vals[name] != want:
                raise GeometryError(f"ple.page[{page}].{name}", f"page header says {vals[name]}, expected {want}")
        if data[_PAGE.size : PLE_PAGE_HEADER_BYTES] != bytes(PLE_PAGE_HEADER_BYTES - _PAGE.size):
            raise HeaderError(f"ple.page[{page}].reserved", "reserved page header bytes are not zero")
        if self._fast is not None and not sha:
            if not self._fast(page, data):
                raise DigestError(f"ple.page[{page}]", "page XXH3-128 mismatch")
        elif hashlib.sha256(data).digest() != self.digests[page * 32 : page * 32 + 32]:
            raise DigestError(f"ple.page[{page}]", "page digest mismatch")

    def read_page(self, page, sha=False):
        """One verified page snapshot (sha: by its SHA-256 even where a fast table was given)."""
        g = self.geometry
        if not 0 <= page < g.num_pages:
            raise GeometryError("ple.page", f"page {page} outside [0, {g.num_pages})")
        data = self._pread(g.page_stride, g.payload_offset + page * g.page_stride, f"ple.page[{page}]")
        self._check_page(page, data, sha)
        return data

    def verify_page(self, page):
        self.read_page(page)

    def read_row_into(self, row, out):
        """Copy the encoded row into `out` (row_bytes); `out` is untouched
        unless the page snapshot it comes from verified."""
        g = self.geometry
        page, _, off = g.locate(row)
        data = self.read_page(page)
        dst = memoryview(out).cast("B")
        if dst.nbytes != g.row_bytes:
            raise GeometryError("ple.out", f"buffer is {dst.nbytes} bytes, row is {g.row_bytes}")
        dst[:] = data[off : off + g.row_bytes]
        return out

    def read_rows(self, rows):
        """[len(rows), row_values] array in storage dtype; each page read once."""
        g = self.geometry
        rows = [int(r) for r in rows]
        out = np.empty((len(rows), g.row_values), dtype=storage_dtype(self.codec.name))
        raw = out.view(np.uint8).reshape(len(rows), g.row_bytes)
        by_page = {}
        for i, r in enumerate(rows):
            page, _, off = g.locate(r)
            by_page.setdefault(page, []).append((i, off))
        for page, items in by_page.items():
            data = self.read_page(page)
            for i, off in items:
                raw[i] = np.frombuffer(data, np.uint8, g.row_bytes, off)
        return out

    def verify_all(self, progress=None, file_hash=None, fast=None):
        """Every page (header + digest), then the whole-payload digest. `fast(bytes)`, if given,
        is called with each page once it verified."""
        g = self.geometry

        def page(i):
            data = self.read_page(i, sha=True)
            if fast is not None:
                fast(data)
            return data

        self._verify_payload(g.payload_offset, g.num_pages, page, self.payload_sha, "ple", progress, file_hash)

    def extents(self):
        g = self.geometry
        return [
            (0, PLE_HEADER_BYTES, "ple.header"),
            (PLE_HEADER_BYTES, g.payload_offset, "ple.digest_table"),
            (g.payload_offset, g.payload_offset + g.payload_bytes, "ple.payload"),
        ]
