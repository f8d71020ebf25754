"""`hebrus-mlx verify DIR`: the verb's command line over hebrus_mlx/verify.py (admit, then check every
store against the manifest's whole-file SHA-256; --deep: every record, page and payload digest too)."""

import json
import sys

from ..verify import verify
from .cli_args import ArgumentParser


def main(argv=None):
    p = ArgumentParser(prog="hebrus-mlx verify", description="verify every artifact digest")
    p.add_argument("path")
    p.add_argument(
        "--deep",
        action="store_true",
        help="also check every expert record, PLE page and store payload digest (three SHA-256 passes, not one)",
    )
    a = p.parse_args(argv)
    _, checked = verify(a.path, deep=a.deep)  # a failure is one line on stderr (cli.run)
    print(json.dumps({"verified": True, "deep": a.deep, **checked}, indent=1))
    return 0


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("verify", main))
