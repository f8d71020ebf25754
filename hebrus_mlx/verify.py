"""`hebrus-mlx verify DIR`: admit, then check every byte of every store against the manifest.

Admission (cheap, no payload) runs first. Then each store is read once, front to back in large
reads, and every byte is hashed once with SHA-256: the whole-file digest the manifest records,
which is what verify trusts (docs/INTEGRITY.md). The fast per-read check's XXH3-128 tables, where
the artifact has them, are compared with the same bytes in the same pass, so a verified artifact
streams without a false alarm. A reader thread keeps READ_AHEAD reads in flight and checks each
read's units against the XXH3-128 table while the caller's thread computes the SHA-256 of the
read before: both release the GIL, so on two cores the pass costs about one SHA-256 per byte in
wall time (READ_AHEAD = 0 reads and checks inline).

A store whose whole-file digest mismatches is read a second time, checking each record or page
against the store's own SHA-256 table (each dense tensor against its manifest digest), so the
error names the first bad one.

`deep=True` (`verify --deep`) also checks every ExpertMajor record digest, the stores'
whole-payload digests and every PLE page digest in the same pass (three SHA-256 streams): it
catches a store whose own digest tables disagree with its bytes although the manifest's
whole-file digest matches them. Progress bars (tqdm) show on a terminal only.
"""

import hashlib
import os
import queue
import threading

from tqdm import tqdm

from .admission import admit
from .artifact import fast_check
from .artifact.errors import DigestError, TruncatedError
from .artifact.expert_major import ExpertMajorReader
from .artifact.ple_pages import PleReader

_CHUNK = 8 << 20  # deep pass: whole-file stores' read size
READ_BYTES = 64 << 20  # default pass: bytes per read (whole units, at least this much); 16 MiB was slower
# Default pass: reads a thread keeps in flight ahead of the SHA-256 (0: read and check inline).
READ_AHEAD = 2


def _bar(label, total, stream):
    return tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=stream, disable=None)


class _FastTable:
    """Compares each unit's bytes with the store's XXH3-128 table (in unit order); `check()`
    reports the first disagreement once the SHA-256 checks of the same bytes passed."""

    def __init__(self, store, table, xxh3):
        self.store, self.table, self.xxh3, self.i, self.bad = store, table, xxh3, 0, None

    def __call__(self, data):
        if self.bad is None and self.xxh3(data) != self.table[self.i]:
            self.bad = self.i
        self.i += 1

    def check(self):
        if self.bad is not None:
            raise DigestError(
                f"stores.{self.store.path}.fast_check",
                f"unit {self.bad}: the XXH3-128 table disagrees with the SHA-256-verified bytes",
            )


def _units(m, s, full):
    """(offset, length) of each unit of `s` its fast table covers, in order ([] for the dense
    store): ExpertMajor records (without their padding), PLE pages, MTP chunks."""
    if s.role == "experts":
        with ExpertMajorReader(full, m.family, s.expert_codec) as r:
            g = r.geometry
            return [(g.record_offset(i), g.record_size(i)) for i in range(g.count)]
    if s.role == "ple":
        with PleReader(full, m.family, s.codec) as r:
            g = r.geometry
            return [(g.payload_offset + p * g.page_stride, g.page_stride) for p in range(g.num_pages)]
    if s.role == "mtp":
        n = fast_check.MTP_UNIT_BYTES
        return [(o, min(n, s.size - o)) for o in range(0, s.size, n)]
    return []


def _reads(size, units, chunk=READ_BYTES):
    """[(start, end, units)]: reads covering [0, size) in order, each ending on a unit's end
    (at least `chunk` bytes where the units allow), then the tail in `chunk` pieces."""
    out, pos, group = [], 0, []
    for off, n in units:
        group.append((off, n))
        if off + n - pos >= chunk:
            out.append((pos, off + n, group))
            pos, group = off + n, []
    if group:
        end = group[-1][0] + group[-1][1]
        out.append((pos, end, group))
        pos = end
    while pos < size:
        out.append((pos, min(size, pos + chunk), []))
        pos = out[-1][1]
    return out


def _read_all(fd, reads, depth, field, on_read=None):
    """Yield (start, view of the bytes) for each read in order, into reused buffers (no fresh
    allocation per read); a view is valid until the next one is asked for. `on_read(start, view,
    units)` sees each read first. With `depth` > 0 a thread keeps up to `depth` reads in flight
    ahead of the consumer and calls `on_read` itself."""

    def fill(buf, start, end, units):
        view = _fill(fd, buf, start, end, field)
        if on_read is not None:
            on_read(start, view, units)
        return view

    size = max((end - start for start, end, _ in reads), default=0)
    if depth <= 0:
        buf = bytearray(size)
        for start, end, units in reads:
            yield start, fill(buf, start, end, units)
        return
    free, full, stop = queue.Queue(), queue.Queue(), threading.Event()
    for _ in range(depth + 1):
        free.put(bytearray(size))

    def reader():
        try:
            for start, end, units in reads:
                buf = free.get()
                if stop.is_set():
                    return
                full.put((start, fill(buf, start, end, units), buf))
            full.put(None)
        except BaseException as e:  # handed to the consumer
            full.put(e)

    t = threading.Thread(target=reader, name="verify-read", daemon=True)
    t.start()
    try:
        while (item := full.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            start, view, buf = item
            yield start, view
            free.put(buf)
    finally:
        stop.set()
        free.put(bytearray(0))  # wakes a reader waiting for a buffer
        t.join()


def _fill(fd, buf, start, end, field):
    """`buf[:end - start]` filled from the file at `start` (a view), or TruncatedError."""
    view, done = memoryview(buf)[: end - start], 0
    while done < end - start:
        got = os.preadv(fd, [view[done:]], start + done)
        if got == 0:
            raise TruncatedError(field, f"read {done} of {end - start} bytes at offset {start}")
        done += got
    return view


def _scan(full, s, units, fast, progress):
    """One sequential pass: the whole-file SHA-256 (hex) of every byte, each unit fed to `fast`
    (on the reader's thread when there is one)."""

    def check_units(start, data, group):
        for off, n in group:
            fast(data[off - start : off - start + n])

    digest = hashlib.sha256()
    fd = os.open(full, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):  # not on macOS, whose read-ahead needs no hint
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        reads = _read_all(
            fd, _reads(s.size, units), READ_AHEAD, f"stores.{s.path}.size", None if fast is None else check_units
        )
        for _start, data in reads:
            digest.update(data)
            progress(len(data))
    finally:
        os.close(fd)
    return digest.hexdigest()


def _deep(m, s, full, fast, progress):
    """Today's full check: every record / page digest, the payload digest and the whole file."""
    digest = hashlib.sha256()
    if s.role == "experts":
        with ExpertMajorReader(full, m.family, s.expert_codec) as r:
            r.verify_all(progress, file_hash=digest, fast=fast)
    elif s.role == "ple":
        with PleReader(full, m.family, s.codec) as r:
            r.verify_all(progress, file_hash=digest, fast=fast)
    else:
        # Whole-file stores; the MTP head's fast check covers fixed-size chunks.
        size = fast_check.MTP_UNIT_BYTES if fast is not None else _CHUNK
        with open(full, "rb") as f:
            while b := f.read(size):
                digest.update(b)
                progress(len(b))
                if fast is not None:
                    fast(b)
    return digest.hexdigest()


def _diagnose(m, s, full, fast):
    """The whole-file digest of `s` mismatched: name the first bad record, page or dense tensor
    by the digests the store (or the manifest) holds for it, else the whole file."""
    where = f"stores.{s.path}: whole-file digest mismatch; "
    if s.role == "experts":
        with ExpertMajorReader(full, m.family, s.expert_codec) as r:
            try:
                r.verify_all()
            except DigestError as e:
                raise DigestError(e.field, where + e.message) from None
    elif s.role == "ple":
        with PleReader(full, m.family, s.codec) as r:
            try:
                r.verify_all()
            except DigestError as e:
                raise DigestError(e.field, where + f"{e.message} in {s.path}") from None
    elif s.role == "dense" and m.dense_digests:
        with open(full, "rb") as f:
            base = 8 + int.from_bytes(f.read(8), "little")
            for name, info in sorted(m.tensors.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                a, b = info["data_offsets"]
                f.seek(base + a)
                if name in m.dense_digests and hashlib.sha256(f.read(b - a)).hexdigest() != m.dense_digests[name]:
                    raise DigestError(f"tensors.{name}.sha256", where + "this tensor's digest mismatches")
    elif s.role == "mtp" and fast is not None and fast.bad is not None:
        raise DigestError(
            f"stores.{s.path}.sha256",
            where + f"first bad chunk {fast.bad} (bytes {fast.bad * fast_check.MTP_UNIT_BYTES}+, XXH3-128)",
        )
    raise DigestError(f"stores.{s.path}.sha256", "whole-file digest mismatch")


def verify(path, stream=None, deep=False):
    """(admission report, {what: count}) or the first typed error. `stream`: where progress goes
    (stderr by default; shown only when it is a terminal). `deep`: also every record, page and
    payload digest the stores hold (three SHA-256 passes over every byte instead of one)."""
    m = admit(path)
    checked = {}
    xxh3 = fast_check.xxh3_128()
    for s in m.stores:
        full = m.file(s)
        units = _units(m, s, full)
        table = m.fast_table(s)
        fast = None if table is None or xxh3 is None else _FastTable(s, table, xxh3)
        with _bar(s.path, s.size, stream) as bar:
            got = _deep(m, s, full, fast, bar.update) if deep else _scan(full, s, units, fast, bar.update)
        if got != s.sha256:
            if deep:
                raise DigestError(f"stores.{s.path}.sha256", "whole-file digest mismatch")
            _diagnose(m, s, full, fast)
        if fast is not None:
            fast.check()
            checked["fast_checks"] = checked.get("fast_checks", 0) + fast.i
        if s.role == "experts":
            checked["expert_records"] = len(units)
        elif s.role == "ple":
            checked["ple_pages"] = checked.get("ple_pages", 0) + len(units)
    checked["stores"] = len(m.stores)
    return m.report, checked
