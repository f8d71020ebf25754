"""The engine's fault injection for tests: a StreamEngine whose reads the test-only extension
module hebrus_mlx._testing can fail, shorten, corrupt, hold back or delay (metal_ext/testing/).

The runtime module hebrus_mlx._ext has none of these hooks (tests/test_ext_build.py checks it);
only this helper imports hebrus_mlx._testing.
"""

from hebrus_mlx.stream import engine as se


class FaultyEngine(se.StreamEngine):
    """StreamEngine plus the test hooks. Same arguments as StreamEngine."""

    def inject_fault(self, kind: str, count: int = 1) -> None:
        """The next ``count`` reads fail: "eio" (I/O error), "short_read" (half the bytes), or
        "digest" (the record's first byte flipped before its check; reads without a digest are
        skipped). 0 clears."""
        _testing().inject_fault(self._e, kind, count)

    def hold(self, on: bool) -> None:
        """While on, no queued read starts (requests queue up behind it)."""
        _testing().hold(self._e, on)

    def set_read_delay_us(self, us: int) -> None:
        """Every read stays in flight ``us`` microseconds longer."""
        _testing().set_read_delay_us(self._e, us)


def _testing():
    from hebrus_mlx import _testing as mod

    return mod
