"""Command-line pieces every verb shares: a parser whose errors are typed (one line, exit 2 at
`cli.run`) and the boolean flag type. generate's model, cache and sampling flags, their checks and
the loader they feed are `generate.build_parser`, `generate.check_args` and `generate.load_from_args`
(chat and server reuse them)."""

import argparse

from .flags import Parser

__all__ = ["ArgumentParser", "str2bool"]


class ArgumentParser(Parser):
    """argparse whose usage errors raise a UsageError naming the flag (flags.Parser) instead of
    exiting; numeric flags take their types from `hebrus_mlx.flags`."""


def str2bool(s: str) -> bool:
    """``--verbose true|false`` (also t/f, 1/0, yes/no)."""
    if s.lower() in ("true", "t", "1", "yes"):
        return True
    if s.lower() in ("false", "f", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")
