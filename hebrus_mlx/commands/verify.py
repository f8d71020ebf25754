"""`hebrus-mlx verify DIR`: the verb's command line over hebrus_mlx/verify.py (admit, then check every
digest the artifact holds)."""

import json
import sys

from ..verify import verify
from .cli_args import ArgumentParser


def main(argv=None):
    p = ArgumentParser(prog="hebrus-mlx verify", description="verify every artifact digest")
    p.add_argument("path")
    a = p.parse_args(argv)
    _, checked = verify(a.path)  # a failure is one line on stderr (cli.run)
    print(json.dumps({"verified": True, **checked}, indent=1))
    return 0


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("verify", main))
