"""`hebrus-mlx upgrade DIR`: the verb's command line over hebrus_mlx/upgrade.py (the fast per-read
check's XXH3-128 tables for an older artifact, swapped in atomically)."""

import json
import sys

from ..upgrade import upgrade
from .cli_args import ArgumentParser


def main(argv=None):
    p = ArgumentParser(
        prog="hebrus-mlx upgrade", description="add the fast per-read check (XXH3-128 tables) to an older artifact"
    )
    p.add_argument("path", help="artifact directory (replaced atomically)")
    p.add_argument(
        "--refresh",
        action="store_true",
        help="recompute the tables of an artifact that has them (from SHA-256-verified bytes)",
    )
    a = p.parse_args(argv)
    _, summary = upgrade(a.path, refresh=a.refresh)  # a failure is one line on stderr (cli.run)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("upgrade", main))
