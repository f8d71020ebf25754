"""Typed errors of the streaming engine, shared by the C++ engine and the
pure-Python reference so tests can hold both to the same contract.

Engine calls made directly from Python raise these classes. A failure
inside MLX graph evaluation (a streamed layer's read) reaches Python as a
plain ``RuntimeError`` whose message ends in the engine's tag
``[stream:<name>]``; :func:`translate` turns it back into the typed error
(generate does this at its per-step rollback boundary).
"""

import re


class StreamError(RuntimeError):
    """Base class of every streaming-engine failure."""


class StreamIOError(StreamError):
    """The read failed (EIO or another OS error); nothing was published."""


class ShortReadError(StreamError):
    """The store returned fewer bytes than the record length."""


class DigestMismatchError(StreamError):
    """The bytes read do not match the record's SHA-256."""


class TicketCancelledError(StreamError):
    """The ticket was cancelled or already released."""


class StaleGenerationError(StreamError):
    """The ticket's owner generation was superseded before publication."""


class CacheFullError(StreamError):
    """Every byte of the slot cache is pinned or in flight."""


class StreamRequestError(StreamError, ValueError):
    """A request field is invalid (names the field)."""


class StreamClosedError(StreamError):
    """The engine was closed."""


class StreamTimeoutError(StreamError, TimeoutError):
    """A wait exceeded its timeout."""


# Engine error name -> class. The names (and their numeric codes) are the C++
# engine's (metal_ext/engine.h HEBRUS_ERROR_CODES, listed by
# hebrus_mlx._ext.error_codes()); the bindings raise BY_NAME[name] and the
# tests hold this table to that list.
BY_NAME = {
    "io": StreamIOError,
    "short_read": ShortReadError,
    "digest": DigestMismatchError,
    "cancelled": TicketCancelledError,
    "stale": StaleGenerationError,
    "cache_full": CacheFullError,
    "bad_request": StreamRequestError,
    "closed": StreamClosedError,
    "timeout": StreamTimeoutError,
}

_TAG = re.compile(r" \[stream:(\w+)\]$")


def translate(exc: BaseException) -> BaseException:
    """The typed StreamError for an engine failure that crossed MLX's eval
    boundary as a tagged ``RuntimeError`` (message kept, tag dropped);
    any other exception is returned unchanged."""
    if type(exc) is not RuntimeError:
        return exc
    m = _TAG.search(str(exc))
    cls = BY_NAME.get(m.group(1)) if m else None
    return exc if cls is None else cls(str(exc)[: m.start()])
