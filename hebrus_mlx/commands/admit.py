"""`hebrus-mlx admit PATH`: CPU-only ordered admission of an artifact (hebrus_mlx/admission.py); no MLX
is imported (AFN-004)."""

import sys

from ..admission import admit
from .cli_args import ArgumentParser


def main(argv=None):
    p = ArgumentParser(prog="hebrus-mlx admit", description="CPU-only artifact admission")
    p.add_argument("path", help="artifact directory")
    args = p.parse_args(argv)
    print(admit(args.path).report.to_json())  # a rejection is one line on stderr (cli.run)
    return 0


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("admit", main))
