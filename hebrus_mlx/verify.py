"""`hebrus-mlx verify DIR`: admit, then check every digest the artifact holds.

Admission (cheap, no payload) runs first; then every ExpertMajor record and
its whole-payload digest, every PLE page and its payload digest, and the
whole-file SHA-256 of every store recorded in the manifest. Each store is read
once: the record and page checks feed the whole-file digest as they go.
Progress bars (tqdm) show on a terminal only.
"""

import hashlib
import json
import sys

from tqdm import tqdm

from . import flags
from .admission import admit
from .artifact.errors import DigestError
from .artifact.expert_major import ExpertMajorReader
from .artifact.ple_pages import PleReader

_CHUNK = 8 << 20


def _bar(label, total, stream):
    return tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=stream, disable=None)


def verify(path, stream=None):
    """(admission report, {what: count}) or the first typed error. `stream`: where progress goes
    (stderr by default; shown only when it is a terminal)."""
    m = admit(path)
    checked = {}
    for s in m.stores:
        full = m.file(s)
        digest = hashlib.sha256()
        with _bar(s.path, s.size, stream) as bar:
            if s.role == "experts":
                with ExpertMajorReader(full, m.family, s.codec) as r:
                    r.verify_all(bar.update, file_hash=digest)
                    checked["expert_records"] = r.geometry.count
            elif s.role == "ple":
                with PleReader(full, m.family, s.codec) as r:
                    r.verify_all(bar.update, file_hash=digest)
                    checked["ple_pages"] = checked.get("ple_pages", 0) + r.geometry.num_pages
            else:
                with open(full, "rb") as f:
                    while b := f.read(_CHUNK):
                        digest.update(b)
                        bar.update(len(b))
        if digest.hexdigest() != s.sha256:
            raise DigestError(f"stores.{s.path}.sha256", "whole-file digest mismatch")
    checked["stores"] = len(m.stores)
    return m.report, checked


def main(argv=None):
    p = flags.Parser(prog="hebrus-mlx verify", description="verify every artifact digest")
    p.add_argument("path")
    a = p.parse_args(argv)
    _, checked = verify(a.path)  # a failure is one line on stderr (cli.run)
    print(json.dumps({"verified": True, **checked}, indent=1))
    return 0


if __name__ == "__main__":
    from .cli import run

    sys.exit(run("verify", main))
