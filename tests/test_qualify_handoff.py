"""qualify's hand-off measurements (streaming.handoff): the empty event round trip, the same under
load, and a streamed all-resident layer against the resident one; the report carries them and
`simulate --profile REPORT` charges a Metal device's figure per streamed layer. The Metal case
runs with a fake device here (no Mac has run it)."""

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx import kernels
from hebrus_mlx import qualify as Q
from hebrus_mlx import qualify_report as QR
from hebrus_mlx.simulate import report as SR
from hebrus_mlx.stream import engine as se

pytestmark = pytest.mark.skipif(not se.available(), reason="the C++ extension is not built")


def test_host_roundtrip_is_the_identity_through_a_host_task():
    x = mx.array(np.arange(37, dtype=np.float32))
    y = x
    for _ in range(5):
        y = se._ext.host_roundtrip(y * 1)
    assert np.array_equal(np.array(y), np.arange(37, dtype=np.float32))
    strided = mx.array(np.arange(12, dtype=np.int32).reshape(3, 4)).T  # not row-contiguous
    assert np.array_equal(np.array(se._ext.host_roundtrip(strided)), np.arange(12).reshape(3, 4).T)


def test_event_round_trip_measures_a_per_op_cost():
    r = Q.event_round_trip(n=16, rounds=2)
    assert r["ops"] == 16 and r["per_op_ms"] >= 0 and r["host_ms"] > 0 and r["plain_ms"] > 0


def _fake(which):
    return {"resident": (100.0, [1, 2, 3]), "streamed": (80.0, [1, 2, 3])}[which]


def test_cpu_backend_handoff_is_measured_and_labelled_not_a_mac():
    trips = iter([{"per_op_ms": 0.01}, {"per_op_ms": 0.05}])
    h = Q.handoff_section("demo", rounds=1, tokens=3, measure=_fake, round_trip=lambda: next(trips))
    assert h["status"] == "measured" and h["device"] == "cpu" and not h["gpu_events"]
    assert h["event_round_trip_ms"] == 0.01 and h["event_round_trip_loaded_ms"] == 0.05
    assert h["handoff_ms"] == pytest.approx((1e3 / 80 - 1e3 / 100) / h["layers"])
    assert h["identical"] and "not a Mac" in h["reason"]
    # A CPU measurement does not stand for a Mac's hand-off: the report's profile keeps the assumption.
    ms, how = SR.handoff({"streaming": {"handoff": h}})
    assert how.startswith("ASSUMPTION") and ms == pytest.approx(0.25)


def test_metal_handoff_reaches_the_report_and_the_projection(monkeypatch):
    switched = []
    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    monkeypatch.setattr(se, "gpu_events_compiled", lambda: True)

    class Ext:
        host_roundtrip = staticmethod(se._ext.host_roundtrip)

        @staticmethod
        def set_gpu_events(on):
            switched.append(on)

    monkeypatch.setattr(se, "_ext", Ext)
    h = Q.handoff_section("demo", 1, 3, measure=_fake, round_trip=lambda: {"per_op_ms": 0.12})
    assert h["device"] == "metal" and h["gpu_events"] and switched == [True, False]
    part = QR.streaming_part({"streaming": {"handoff": h}})["handoff"]
    assert part["handoff_ms"] == pytest.approx(h["handoff_ms"]) and part["event_round_trip_ms"] == 0.12
    ms, how = SR.handoff({"streaming": {"handoff": part}})
    assert ms == pytest.approx(h["handoff_ms"]) and how.startswith("measured")


def test_a_slower_streamed_run_never_gives_a_negative_handoff():
    h = Q.handoff_section(
        "demo", 1, 3, measure=lambda w: (100.0 if w == "streamed" else 90.0, [1]), round_trip=lambda: {"per_op_ms": 0}
    )
    assert h["handoff_ms"] == 0.0
