"""Typed errors of the streaming engine, shared by the C++ engine and the
pure-Python reference so tests can hold both to the same contract."""


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


# Codes used by metal_ext/engine.h (ErrorCode).
BY_CODE = {
    1: StreamIOError,
    2: ShortReadError,
    3: DigestMismatchError,
    4: TicketCancelledError,
    5: StaleGenerationError,
    6: CacheFullError,
    7: StreamRequestError,
    8: StreamClosedError,
    9: StreamTimeoutError,
}
