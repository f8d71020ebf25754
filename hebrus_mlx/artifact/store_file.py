"""Read-only handle on one untrusted store file: validated on open, exact-length preads."""

import hashlib
import os

from .constants import codec_by_id, family_by_id
from .errors import DigestError, GeometryError, HeaderError, TruncatedError


def header_prelude(magic, version, header_bytes, family, codec_id):
    """The fields every store header opens with, as a writer fills them: magic, format version and
    header size (read back by `StoreFile._check_prelude`), then the family and codec ids (`_identity`)."""
    return {
        "magic": magic,
        "version": version,
        "header_bytes": header_bytes,
        "family_id": family.family_id,
        "codec_id": codec_id,
    }


def verify_closed(reader, fast=None):
    """`reader.verify_all(fast=fast)`, then the reader's descriptor closed: a publication's check
    must not keep the published file open (a deleted artifact's bytes stay on disk while any
    descriptor on them lives)."""
    with reader:
        return reader.verify_all(fast=fast)


class StoreFile:
    """Subclasses implement `_open(*args)` to validate the file's header; a failed validation
    closes the descriptor before the error leaves the constructor."""

    def __init__(self, path, *open_args):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self._open(*open_args)
        except BaseException:
            os.close(self.fd)
            raise

    def _open(self, *open_args):
        raise NotImplementedError

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _header(self, nbytes, prefix):
        """(file size, the fixed-size header); TruncatedError when the file is shorter."""
        size = os.fstat(self.fd).st_size
        if size < nbytes:
            raise TruncatedError(f"{prefix}.header", f"file is {size} bytes, header needs {nbytes}")
        return size, self._pread(nbytes, 0, f"{prefix}.header")

    @staticmethod
    def _check_prelude(h, prefix, magic, version, header_bytes, what):
        """The fields every store header opens with: its magic, format version and header size."""
        if h["magic"] != magic:
            raise HeaderError(f"{prefix}.magic", f"{h['magic']!r} is not {what}")
        if h["version"] != version:
            raise HeaderError(f"{prefix}.version", f"version {h['version']}, reader speaks {version}")
        if h["header_bytes"] != header_bytes:
            raise HeaderError(f"{prefix}.header_bytes", f"{h['header_bytes']} != {header_bytes}")

    @staticmethod
    def _identity(h, prefix, family, codec_name):
        """(family, codec) the header names by id; they must be `family` / `codec_name` when given."""
        fam = family_by_id(h["family_id"], f"{prefix}.family_id")
        if family is not None and fam != family:
            raise GeometryError(f"{prefix}.family_id", f"store family {fam.name!r} != expected {family.name!r}")
        cod = codec_by_id(h["codec_id"], f"{prefix}.codec_id")
        if codec_name is not None and cod.name != codec_name:
            raise GeometryError(f"{prefix}.codec_id", f"store codec {cod.name!r} != expected {codec_name!r}")
        return fam, cod

    def _verify_payload(self, payload_offset, units, read_unit, payload_sha, prefix, progress, file_hash):
        """Read every unit (record, page) through `read_unit(i)` (which checks its digest), then
        the whole-payload digest. `file_hash` (a hashlib object) is fed every byte of the file in
        order, so the same pass yields the whole-file digest."""
        if file_hash is not None:
            file_hash.update(self._pread(payload_offset, 0, f"{prefix}.header"))
        payload = hashlib.sha256()
        for i in range(units):
            data = read_unit(i)
            payload.update(data)
            if file_hash is not None:
                file_hash.update(data)
            if progress is not None:
                progress(len(data))
        if payload.digest() != payload_sha:
            raise DigestError(f"{prefix}.payload_sha256", "whole-payload digest mismatch")

    def _pread(self, n, offset, field):
        """Exactly n bytes at offset, or TruncatedError naming the field."""
        data = os.pread(self.fd, n, offset)
        if len(data) != n:
            raise TruncatedError(field, f"read {len(data)} of {n} bytes at offset {offset}")
        return data
