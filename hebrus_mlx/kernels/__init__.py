"""Metal kernels (one per module) with their MLX-ops fallbacks.

Each kernel module has: SOURCE (the body passed to `mx.fast.metal_kernel`), `launch(...)` (grid,
threadgroup, template for a call), `ops(...)` (the fallback, which is the graph's own path), `metal(...)`
(the kernel on a Metal device). The same sources run through the MSL emulator on numpy in
`hebrus_mlx.testing.kernel_emulation` (a test oracle; no kernel module imports it).

A kernel runs in the graph only when all hold (AFN-013: code is not a feature until qualified):
- MLX has a Metal device (`kernel_object()` is None otherwise — this machine: always None);
- `GraphOptions.metal_kernels` is not False (models/optimize.apply swaps them in at load);
- the machine profile written by `hebrus-mlx qualify` on this device marks it passed
  (`configure(profile)`, called by `load()`).
"""

from __future__ import annotations

import mlx.core as mx

KERNELS = ("qsa_attention", "ple_gather", "hc_mix")

_qualified: set[str] = set()


def metal_available() -> bool:
    """A Metal device computes here (`profile.metal_device`: not merely MLX's Metal build)."""
    from ..machine_profile import metal_device

    return metal_device()


def configure(profile: dict | None) -> set[str]:
    """Switch on the kernels the machine profile says passed on this device (`profile.passed`:
    written on this machine, Metal present); returns them."""
    from ..machine_profile import passed

    _qualified.clear()
    for name in KERNELS:
        if passed(profile, "kernels", name):
            _qualified.add(name)
    return set(_qualified)


def enabled(name: str) -> bool:
    return name in _qualified and metal_available()


def make_kernel(name: str, input_names, output_names, source: str, header: str = "", ensure_row_contiguous=True):
    """`mx.fast.metal_kernel` for a kernel module, or None where Metal is absent. A kernel that
    reads its inputs through `<name>_strides` passes ensure_row_contiguous=False (no copies)."""
    if not metal_available():
        return None
    return mx.fast.metal_kernel(
        name=f"hebrus_{name}",
        input_names=list(input_names),
        output_names=list(output_names),
        source=source,
        header=header,
        ensure_row_contiguous=ensure_row_contiguous,
    )
