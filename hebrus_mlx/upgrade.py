"""`hebrus-mlx upgrade DIR`: give an artifact from before the fast per-read check its XXH3-128
digest tables (docs/INTEGRITY.md, artifact/fast_check.py).

DIR is admitted first. Then every expert record, PLE page and MTP chunk is read once and checked
against its SHA-256 (the stores' record/page tables and whole-file digests, as `verify` checks
them) before it is hashed with XXH3-128: the fast digests describe verified bytes only. The new
directory - the same store files (hard links, no copy; copies where the file system has none),
one `.xxh3` table per streamed store and the new manifest - is admitted, then swapped in for DIR
atomically (temp + fsync + exchange, artifact/atomic.py). Any failure before that leaves DIR as
it was; upgrade replaces nothing it did not write (DIR changing meanwhile aborts it). An artifact
that already has fast checks is left alone, unless `--refresh` asks for its tables to be taken
again from the SHA-256-verified bytes (e.g. after its stores were rebuilt).
"""

import errno
import hashlib
import os

from tqdm import tqdm

from .admission import admit
from .artifact import atomic, untrusted
from .artifact import constants as C
from .artifact import fast_check as FC
from .artifact import manifest as M
from .artifact.errors import ArtifactError, DigestError
from .artifact.expert_major import ExpertMajorReader
from .artifact.ple_pages import PleReader


def _table(m, s, i, stream):
    """The XXH3-128 table of store entry `s` (stores[i]), from bytes whose SHA-256 matched."""
    field = f"stores[{i}].fast_check"
    full = os.path.join(m.directory, s["path"])
    with tqdm(
        total=s["size"], desc=s["path"], unit="B", unit_scale=True, unit_divisor=1024, file=stream, disable=None
    ) as bar:
        if s["role"] == "mtp":
            sha, fast = FC.scan_file(full, field)
            bar.update(s["size"])
        else:
            reader = ExpertMajorReader if s["role"] == "experts" else PleReader
            with reader(full, m.family, s["codec"]) as r:
                g = r.geometry
                fast = FC.Collector(g.count if s["role"] == "experts" else g.num_pages, field)
                digest = hashlib.sha256()
                r.verify_all(bar.update, file_hash=digest, fast=fast)
                sha = digest.hexdigest()
    if sha != s["sha256"]:
        raise DigestError(f"stores.{s['path']}.sha256", "whole-file digest mismatch")
    return fast.table()


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise

        def copy(w):
            with open(src, "rb") as f:
                while b := f.read(8 << 20):
                    w.write(b)

        atomic.publish_file(dst, copy)


def upgrade(path, stream=None, refresh=False):
    """(the admitted upgraded manifest, summary) or the first typed error; DIR is unchanged on
    any error. `stream`: where progress goes (a terminal only). refresh: recompute the tables of
    an artifact that has them."""
    if os.path.islink(os.path.abspath(path)):
        raise ArtifactError("path", f"{path} is a symbolic link: upgrade the directory it names")
    m = admit(path)
    if m.fast_digests and not refresh:
        return m, {"upgraded": False, "reason": "the artifact already has fast checks"}
    if FC.xxh3_128() is None:
        raise ArtifactError("upgrade", "the XXH3-128 check needs the compiled extension (hebrus_mlx._hash)")
    d = m.directory
    files = sorted(os.listdir(d))  # exactly the files admission found owned
    old_tables = {s.fast_check["path"] for s in m.stores if s.fast_check}
    man = untrusted.read_json(d, C.MANIFEST_NAME)  # the same bounded, strict reader admission used
    if [(s["path"], s["size"], s["sha256"]) for s in man["stores"]] != [(s.path, s.size, s.sha256) for s in m.stores]:
        raise ArtifactError("manifest", "changed since admission; nothing replaced")
    tables = {s["path"]: _table(m, s, i, stream) for i, s in enumerate(man["stores"]) if s["role"] in FC.ROLES}
    new = dict(
        man,
        stores=[
            dict(s, fast_check=FC.entry(s["path"], tables[s["path"]])) if s["path"] in tables else s
            for s in man["stores"]
        ],
    )
    data = M.dumps(new)

    def build(tmp):
        for name in files:
            if name != C.MANIFEST_NAME and name not in old_tables:
                _link_or_copy(os.path.join(d, name), os.path.join(tmp, name))
        for store, table in tables.items():
            atomic.publish_file(os.path.join(tmp, FC.table_path(store)), lambda w, t=table: w.write(t))
        atomic.publish_file(os.path.join(tmp, C.MANIFEST_NAME), lambda w: w.write(data))
        # The exchange below replaces DIR as a whole: only if it still holds what was read.
        if sorted(os.listdir(d)) != files:
            raise ArtifactError("upgrade", f"{d} changed while upgrading; nothing replaced")

    atomic.publish_dir(d, build, verify=admit)
    return admit(d), {"upgraded": True, "fast_checks": {p: len(t) // FC.DIGEST_BYTES for p, t in tables.items()}}
