"""The fast per-read check of streamed units: XXH3-128 of every expert record, PLE page and MTP
chunk (docs/INTEGRITY.md).

SHA-256 stays the publication digest (the stores' record/page tables, the manifest's whole-file
digests) and what `hebrus-mlx verify` checks. The fast check is a second digest domain the
engine checks every read against at memory speed. A store entry of the manifest carries it as

    "fast_check": {"algorithm": "xxh3-128", "path": "<store path>.xxh3",
                   "size": 16 * units, "sha256": "<SHA-256 of that file>"}

and the file holds one canonical 16-byte XXH3-128 digest per unit, in unit order, nothing else:
the manifest binds it by SHA-256 like every other file, and it scales with the store (a PLE
table of a real checkpoint has ~10^5-10^6 pages, too many for manifest JSON). Units: the records
of the ExpertMajor store, the pages of a PLE store, and fixed MTP_UNIT_BYTES chunks of the MTP
store (the loader checks each chunk as it reads it).

The digests are computed by hebrus_mlx._hash (metal_ext/xxh3.cpp), which needs no MLX; admission
only checks the table file's shape and SHA-256 (numpy/hashlib), never hashes a payload.
"""

import hashlib
import os

from .errors import AdmissionError, ArtifactError

ALGORITHM = "xxh3-128"
DIGEST_BYTES = 16
SUFFIX = ".xxh3"
FIELDS = ("algorithm", "path", "size", "sha256")
ROLES = ("experts", "ple", "mtp")  # the stores whose units are checked per read
MTP_UNIT_BYTES = 8 << 20


def table_path(store_path):
    """The digest table file of a store (a plain name next to it)."""
    return store_path + SUFFIX


def mtp_units(size):
    return max(1, -(-size // MTP_UNIT_BYTES))


def xxh3_128():
    """The XXH3-128 function (any contiguous buffer -> 16 canonical bytes; slices of a read
    buffer are hashed in place, the GIL released), or None where the extension is not
    built (then converted artifacts carry SHA-256 only, like artifacts from before the check)."""
    try:
        from .. import _hash
    except ImportError:
        return None
    return _hash.xxh3_128


class Collector:
    """Feeds on each unit's bytes in unit order (a reader's verify pass calls it after the
    unit's SHA-256 matched); `table()` is the digest table file's content."""

    def __init__(self, units, field, hasher=None):
        self.units, self.field = units, field
        self._hash = hasher or xxh3_128()
        if self._hash is None:
            raise ArtifactError(field, "the XXH3-128 check needs the compiled extension (hebrus_mlx._hash)")
        self._buf = bytearray()

    def __call__(self, data):
        self._buf += self._hash(data)

    def table(self):
        if len(self._buf) != DIGEST_BYTES * self.units:
            raise ArtifactError(self.field, f"{len(self._buf) // DIGEST_BYTES} units hashed, store has {self.units}")
        return bytes(self._buf)


def scan_file(path, field):
    """One pass over a whole-file store (the MTP head): (its SHA-256 hex, a Collector holding
    the XXH3-128 of each MTP_UNIT_BYTES chunk of the same bytes)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        fast = Collector(mtp_units(size), field)
        for _ in range(mtp_units(size)):
            chunk = f.read(MTP_UNIT_BYTES)
            sha.update(chunk)
            fast(chunk)
    return sha.hexdigest(), fast


def checker(table):
    """`check(i, data) -> bool` against unit i of a digest list (Manifest.fast_table), or None
    when there is none or the extension is not built (then callers check SHA-256)."""
    xxh3 = xxh3_128() if table is not None else None
    if xxh3 is None:
        return None
    return lambda i, data: xxh3(data) == table[i]


def entry(store_path, table):
    """The manifest's `fast_check` object for a store whose digest table is `table`."""
    return {
        "algorithm": ALGORITHM,
        "path": table_path(store_path),
        "size": len(table),
        "sha256": hashlib.sha256(table).hexdigest(),
    }


def claim(field, store, owned):
    """Admission's bounds stage: the digest table file a store entry names, as a plain file name
    owned once. None when the entry has no `fast_check` (an artifact from before the check)."""
    fc = store.get("fast_check")
    if fc is None:
        return None
    if type(fc) is not dict:
        raise AdmissionError(f"{field}.fast_check", "must be an object")
    for k in sorted(fc):
        if k not in FIELDS:
            raise AdmissionError(f"{field}.fast_check.{k}", "unknown field")
    for k in FIELDS:
        if k not in fc:
            raise AdmissionError(f"{field}.fast_check.{k}", "missing")
    if fc["algorithm"] != ALGORITHM:
        raise AdmissionError(f"{field}.fast_check.algorithm", f"{fc['algorithm']!r} != {ALGORITHM!r}")
    want = table_path(store["path"])
    if fc["path"] != want:
        raise AdmissionError(f"{field}.fast_check.path", f"{fc['path']!r} != {want!r}")
    if want in owned:
        raise AdmissionError(f"{field}.fast_check.path", f"{want!r} is owned twice")
    if type(fc["size"]) is not int:
        raise AdmissionError(f"{field}.fast_check.size", "must be an integer")
    digest = fc["sha256"]
    if type(digest) is not str or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise AdmissionError(f"{field}.fast_check.sha256", "must be a lowercase hex SHA-256")
    return want


def admit_table(directory, field, store, units):
    """The digest table of `store` (a manifest store entry with `fast_check`), read once and
    checked: exactly `units` digests, the file the manifest's SHA-256 names. Returns its bytes."""
    fc = store["fast_check"]
    if store.get("role") not in ROLES:
        raise AdmissionError(f"{field}.fast_check", f"a {store.get('role')!r} store is not read per unit")
    if fc["size"] != DIGEST_BYTES * units:
        raise AdmissionError(
            f"{field}.fast_check.size", f"{fc['size']} bytes, the store's {units} units need {DIGEST_BYTES * units}"
        )
    path = os.path.join(directory, fc["path"])
    if not os.path.isfile(path) or os.path.islink(path):
        raise AdmissionError(f"{field}.fast_check.path", f"{fc['path']!r} missing or not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # never through a link
    except OSError as e:
        raise AdmissionError(f"{field}.fast_check.path", f"{fc['path']!r}: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size != fc["size"]:
            raise AdmissionError(f"{field}.fast_check.size", f"file is {size} bytes, manifest says {fc['size']}")
        data = os.pread(fd, size, 0) if size else b""
    finally:
        os.close(fd)
    if len(data) != size or hashlib.sha256(data).hexdigest() != fc["sha256"]:
        raise AdmissionError(f"{field}.fast_check.sha256", f"{fc['path']} digest mismatch")
    return data


def digests(table):
    """The per-unit digests of a table file's bytes."""
    return [table[i : i + DIGEST_BYTES] for i in range(0, len(table), DIGEST_BYTES)]
