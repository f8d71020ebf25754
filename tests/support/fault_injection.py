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

    def set_offset_delay_us(self, offset: int, us: int) -> None:
        """The read of the record at store ``offset`` stays in flight ``us`` microseconds longer
        (on top of ``set_read_delay_us``), so a test can order arrivals; 0 clears it."""
        _testing().set_offset_delay_us(self._e, offset, us)


def _testing():
    from hebrus_mlx import _testing as mod

    return mod


class Poison:
    """NaN after one graph stage of a Qwen4Exp model (AFN-010: failure injection after the graph
    stages, beside the engine's I/O faults above): `stage` "layer:I" multiplies decoder layer I's
    output streams by NaN, "logits" the vocabulary projection's output (of `model`'s class, and so
    of every model of that class). The first `after` calls of that stage stay clean; `armed =
    False` switches it off. Patched through `monkeypatch`, so it ends with the test."""

    def __init__(self, monkeypatch, model, stage: str, after: int = 0):
        from hebrus_mlx.models import qwen4exp as q

        self.after, self.calls, self.armed = after, 0, True
        if stage == "logits":
            cls = type(model)
            logits = cls.head_logits
            monkeypatch.setattr(cls, "head_logits", lambda m, h: self._apply(logits(m, h)))
            return
        kind, index = stage.split(":")
        assert kind == "layer", stage
        layer_call = q.DecoderLayer.__call__

        def call(layer, *args, **kwargs):
            out = layer_call(layer, *args, **kwargs)
            return self._apply(out) if layer.layer == int(index) else out

        monkeypatch.setattr(q.DecoderLayer, "__call__", call)

    def _apply(self, x):
        self.calls += 1
        return x * float("nan") if self.armed and self.calls > self.after else x
