"""Which runs count as "on a Metal device": MLX's Metal build alone does not (issue 25).

`mx.metal.is_available()` is True for every macOS build of MLX, on a VM without a GPU too, and
stays True after `mx.set_default_device(mx.cpu)` (how the hosted macOS CI job runs the suite on the
CPU backend). The Metal-only tests, the kernels and qualify's device sections must see no Metal
device there. The MLX calls are replaced by fakes: this machine has no Metal build to ask."""

import mlx.core as mx
import pytest

from hebrus_mlx import kernels
from hebrus_mlx import machine_profile as prof


@pytest.fixture
def metal_build(monkeypatch):
    """MLX as a macOS build reports itself: Metal compiled; the device and default device as set."""
    state = {"default": mx.gpu, "opens": True}

    real_info = mx.device_info

    def device_info(device=None):
        if device is not None and device != mx.gpu:
            return real_info(device)
        if not state["opens"]:
            raise RuntimeError("[metal::Device] Failed to load device")
        return {"device_name": "Apple M-test", "architecture": "applegpu_test"}

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", device_info)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(state["default"]))
    prof._metal_device_opens.cache_clear()
    yield state
    prof._metal_device_opens.cache_clear()


def test_a_metal_build_with_a_working_device_counts(metal_build):
    assert prof.metal_device() and kernels.metal_available() and prof.this_machine()["metal"]
    assert prof.compute_backend() == "metal"


def test_a_cpu_backend_run_of_a_metal_build_has_no_metal_device(metal_build):
    metal_build["default"] = mx.cpu
    assert not prof.metal_device() and not kernels.metal_available()
    assert prof.this_machine()["metal"] is False and prof.compute_backend() == "cpu"
    assert kernels.make_kernel("hc_mix", ["a"], ["b"], "") is None  # no kernel is built for the CPU


def test_a_metal_build_whose_device_does_not_open_has_no_metal_device(metal_build):
    metal_build["opens"] = False
    assert not prof.metal_device() and not kernels.metal_available()


def test_qualify_device_sections_say_not_qualified_on_a_cpu_backend_mac(metal_build):
    from hebrus_mlx import qualify as q

    metal_build["default"] = mx.cpu
    assert (
        q.gpu_event_section("demo", 1, 3, measure=lambda gpu: pytest.fail("must not measure"))["status"]
        == prof.NOT_QUALIFIED
    )
    entry = q.kernels_section(emulate=False)["hc_mix"]
    assert entry["status"] == prof.NOT_QUALIFIED and "max_abs_diff" not in entry


def test_generation_wires_the_model_through_mx_device_info(metal_build, monkeypatch):
    """generate's wired limit reads the working set from `mx.device_info()`, not the deprecated
    `mx.metal.device_info()` (which warns on every Mac run); faked here, never run on Metal."""
    import mlx.nn as nn

    from hebrus_mlx.generate import wired_limit

    real_info = mx.device_info
    monkeypatch.setattr(
        mx, "device_info", lambda device=None: {**real_info(device), "max_recommended_working_set_size": 64}
    )

    def deprecated():
        raise AssertionError("mx.metal.device_info() is deprecated")

    monkeypatch.setattr(mx.metal, "device_info", deprecated, raising=False)
    limits = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: limits.append(n) or 7)
    monkeypatch.setattr(mx, "synchronize", lambda *a: None)
    monkeypatch.setitem(wired_limit.__wrapped__.__globals__, "generation_stream", lambda: None)
    with wired_limit(nn.Linear(8, 8)):
        assert limits == [64]
    assert limits == [64, 7]
