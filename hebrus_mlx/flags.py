"""Typed numeric command-line values (issue 22 §4): every numeric flag of every verb is parsed by
one of these, so NaN, infinities, negatives and huge values end as one line naming the flag
(``hebrus-mlx VERB: error: --flag: must be ...``, exit 2) before any work starts, never as a
traceback deep in MLX or an empty result.

The types are argparse types (a bad value raises `BadValue`, an ArgumentTypeError, whose message
argparse shows as it is); library code parses comma-separated lists with them (`items`). The parser
whose errors name the flag is commands/cli_args.py's `ArgumentParser`. No MLX.
"""

import argparse
import math

from .errors import UsageError

INT32_MAX = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1
SEED_MAX = (1 << 64) - 1  # mx.random.seed takes a uint64
MAX_CACHE_GB = float(1 << 20)  # 1 PiB: any --*-cache-gb beyond is a typo (and overflows byte counts)
MAX_SECONDS = 1e6  # ~11.6 days; time.sleep / thread timeouts overflow near 1e300


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A flag value out of its type's range: argparse shows the message as it is, and a library
    that parses a list of such values catches it as a ValueError."""


def _range_text(lo, hi, lo_open=False, hi_open=False):
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    return f"{'<' if hi_open else '<='} {hi:g}"


def integer(lo=None, hi=INT32_MAX):
    """argparse type: an integer in [lo, hi]."""

    def parse(s):
        try:
            v = int(s, 10)
        except ValueError:
            raise BadValue(f"expected an integer, got {s!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise BadValue(f"must be an integer {_range_text(lo, hi)}, got {s}")
        return v

    parse.__name__ = "integer"
    parse.bounds = (lo, hi)
    return parse


def number(lo=None, hi=None, lo_open=False, hi_open=False):
    """argparse type: a finite float in the given range (NaN and infinities refused)."""

    def parse(s):
        try:
            v = float(s)
        except ValueError:
            raise BadValue(f"expected a number, got {s!r}") from None
        ok = math.isfinite(v)
        ok = ok and (lo is None or (v > lo if lo_open else v >= lo))
        ok = ok and (hi is None or (v < hi if hi_open else v <= hi))
        if not ok:
            raise BadValue(f"must be a finite number {_range_text(lo, hi, lo_open, hi_open)}, got {s}")
        return v

    parse.__name__ = "number"
    parse.bounds = (lo, hi)
    return parse


def seed():
    return integer(0, SEED_MAX)


def gib():
    """A positive cache size in GiB (``--expert-cache-gb``, ``--ple-cache-gb``)."""
    return number(0, MAX_CACHE_GB, lo_open=True)


def seconds():
    return number(0, MAX_SECONDS, lo_open=True)


def items(s, flag, conv):
    """``--flag 4,8,16`` with each item parsed by an argparse type `conv`; UsageError naming the flag."""
    parts = [x.strip() for x in str(s).split(",") if x.strip()]
    if not parts:
        raise UsageError(flag, f"expected a comma-separated list, got {s!r}")
    try:
        return [conv(x) for x in parts]
    except argparse.ArgumentTypeError as e:
        raise UsageError(flag, f"{e} (in {s!r})") from None


def positive_ints(s, flag):
    """`--flag 4,8,16` -> [4, 8, 16]; a typed error naming the flag otherwise."""
    out = items(s, flag, integer(1))
    if not out or min(out) < 1:
        raise UsageError(flag, f"expected integers >= 1, got {s!r}")
    return out
