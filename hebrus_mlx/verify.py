"""`hebrus-mlx verify DIR`: admit, then check every digest the artifact holds.

Admission (cheap, no payload) runs first; then every ExpertMajor record and
its whole-payload digest, every PLE page and its payload digest, and the
whole-file SHA-256 of every store recorded in the manifest. Reports progress.
"""

import argparse
import json
import os
import sys

from .admission import admit
from .artifact.errors import ArtifactError, DigestError
from .artifact.expert_major import ExpertMajorReader
from .artifact.manifest import sha256_file
from .artifact.ple_pages import PleReader
from .artifact.progress import Progress


def verify(path, stream=None):
    report = admit(path)
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        stores = json.loads(f.read())["stores"]
    checked = {}
    for s in stores:
        full = os.path.join(path, s["path"])
        if s["role"] == "experts":
            with ExpertMajorReader(full) as r:
                p = Progress(f"records {s['path']}", r.geometry.payload_bytes, stream)
                r.verify_all(p)
                p.close()
                checked["expert_records"] = r.geometry.count
        elif s["role"] == "ple":
            with PleReader(full) as r:
                p = Progress(f"pages {s['path']}", r.geometry.payload_bytes, stream)
                r.verify_all(p)
                p.close()
                checked["ple_pages"] = checked.get("ple_pages", 0) + r.geometry.num_pages
        p = Progress(f"sha256 {s['path']}", s["size"], stream)
        digest = sha256_file(full, progress=p)
        p.close()
        if digest != s["sha256"]:
            raise DigestError(f"stores.{s['path']}.sha256", "whole-file digest mismatch")
    checked["stores"] = len(stores)
    return report, checked


def main(argv=None):
    p = argparse.ArgumentParser(prog="hebrus-mlx verify", description="verify every artifact digest")
    p.add_argument("path")
    a = p.parse_args(argv)
    try:
        _, checked = verify(a.path)
    except ArtifactError as e:
        print(json.dumps({"verified": False, "field": e.field, "error": str(e), "type": type(e).__name__}, indent=1))
        return 2
    print(json.dumps({"verified": True, **checked}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
