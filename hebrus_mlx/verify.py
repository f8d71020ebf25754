"""`hebrus-mlx verify DIR`: admit, then check every digest the artifact holds.

Admission (cheap, no payload) runs first; then every ExpertMajor record and
its whole-payload digest, every PLE page and its payload digest, and the
whole-file SHA-256 of every store recorded in the manifest. Each store is read
once: the record and page checks feed the whole-file digest as they go.
SHA-256 is what verify trusts (docs/INTEGRITY.md); the fast per-read check's
XXH3-128 tables, where the artifact has them, are also compared with the
verified bytes in the same pass, so a verified artifact streams without a
false alarm. Progress bars (tqdm) show on a terminal only.
"""

import hashlib

from tqdm import tqdm

from .admission import admit
from .artifact import fast_check
from .artifact.errors import DigestError
from .artifact.expert_major import ExpertMajorReader
from .artifact.ple_pages import PleReader

_CHUNK = 8 << 20


def _bar(label, total, stream):
    return tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=stream, disable=None)


class _FastTable:
    """Compares each unit's bytes with the store's XXH3-128 table (in unit order); `check()`
    reports the first disagreement once the SHA-256 checks of the same bytes passed."""

    def __init__(self, store, table, xxh3):
        self.store, self.table, self.xxh3, self.i, self.bad = store, table, xxh3, 0, None

    def __call__(self, data):
        if self.bad is None and self.xxh3(bytes(data)) != self.table[self.i]:
            self.bad = self.i
        self.i += 1

    def check(self):
        if self.bad is not None:
            raise DigestError(
                f"stores.{self.store.path}.fast_check",
                f"unit {self.bad}: the XXH3-128 table disagrees with the SHA-256-verified bytes",
            )


def verify(path, stream=None):
    """(admission report, {what: count}) or the first typed error. `stream`: where progress goes
    (stderr by default; shown only when it is a terminal)."""
    m = admit(path)
    checked = {}
    xxh3 = fast_check.xxh3_128()
    for s in m.stores:
        full = m.file(s)
        digest = hashlib.sha256()
        table = m.fast_table(s)
        fast = None if table is None or xxh3 is None else _FastTable(s, table, xxh3)
        with _bar(s.path, s.size, stream) as bar:
            if s.role == "experts":
                with ExpertMajorReader(full, m.family, s.expert_codec) as r:
                    r.verify_all(bar.update, file_hash=digest, fast=fast)
                    checked["expert_records"] = r.geometry.count
            elif s.role == "ple":
                with PleReader(full, m.family, s.codec) as r:
                    r.verify_all(bar.update, file_hash=digest, fast=fast)
                    checked["ple_pages"] = checked.get("ple_pages", 0) + r.geometry.num_pages
            else:
                # Whole-file stores; the MTP head's fast check covers fixed-size chunks.
                size = fast_check.MTP_UNIT_BYTES if fast is not None else _CHUNK
                with open(full, "rb") as f:
                    while b := f.read(size):
                        digest.update(b)
                        bar.update(len(b))
                        if fast is not None:
                            fast(b)
        if digest.hexdigest() != s.sha256:
            raise DigestError(f"stores.{s.path}.sha256", "whole-file digest mismatch")
        if fast is not None:
            fast.check()
            checked["fast_checks"] = checked.get("fast_checks", 0) + fast.i
    checked["stores"] = len(m.stores)
    return m.report, checked
