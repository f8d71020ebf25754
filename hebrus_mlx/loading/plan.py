"""Resident or streamed: the one memory planner for routed experts and PLE pages.

No MLX: it works from byte counts (file metadata) and the memory the OS reports.
"""

from __future__ import annotations

import os

from ..errors import UsageError

GIB = 1 << 30

# Kept free for activations, KV/recurrent state and the OS, besides the resident dense and PLE
# bytes: 2 GiB is a few prefill chunks of the full family's activations plus headroom.
RESERVE_BYTES = 2 << 30


def available_memory() -> int:
    """Bytes the OS reports as available (Linux MemAvailable; elsewhere the
    physical size, which the reserve has to cover)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_stream(
    resident_bytes: int,
    unit_bytes: int,
    units: int,
    available: int,
    reserve: int,
    cache_gb: float | None,
    cache_field: str,
    what: str,
    min_units: int = 1,
) -> int | None:
    """None keeps the data resident (its in-memory ``resident_bytes`` fit in ``available - reserve``
    and no cache size was forced); otherwise how many ``unit_bytes`` units (records, pages) to
    stream through, at most ``units``. ``cache_gb`` (a ``--*-cache-gb`` flag, named by
    ``cache_field``) forces streaming with that budget. A budget below ``min_units`` units is a
    UsageError naming the field."""
    if cache_gb is None:
        budget = available - reserve
        if resident_bytes <= budget:
            return None
        field = "available memory"
    else:  # a StreamSettings value: in (0, MAX_CACHE_GB], checked when the settings were made
        budget = int(cache_gb * GIB)
        field = cache_field
    n = min(budget // unit_bytes, units)
    if n < min_units:
        raise UsageError(
            field, f"{budget / GIB:.4f} GiB holds {max(n, 0)} {what} of {unit_bytes} bytes, need at least {min_units}"
        )
    return int(n)


# The stream engine's bound on one arena part (metal_ext/ops.cpp create_arena): rows * part bytes
# (fp32-widened where expanded) at most INT32_MAX - 4096.
ARENA_PART_BYTES_MAX = (1 << 31) - 1 - 4096


def plan_experts(
    store_bytes: int,
    record_bytes: int,
    available: int,
    reserve: int,
    expert_cache_gb: float | None = None,
    min_rows: int = 1,
    part_bytes: int | None = None,
) -> int | None:
    """None (resident) or the arena rows to stream routed experts through; at least ``min_rows``
    (one layer's top-k for the largest token chunk). ``part_bytes``: the arena's largest part per
    row (in memory); the rows stay within the engine's ARENA_PART_BYTES_MAX for it, whatever the
    budget (the real family's 2-bit gate part caps an arena at 5,242 rows, ~8 GiB)."""
    units = store_bytes // record_bytes
    if part_bytes:
        units = min(units, ARENA_PART_BYTES_MAX // part_bytes)
    return plan_stream(
        store_bytes,
        record_bytes,
        units,
        available,
        reserve,
        expert_cache_gb,
        "expert_cache_gb",
        "expert records",
        min_rows,
    )


def plan_ple(
    table_bytes: int, page_bytes: int, num_pages: int, available: int, reserve: int, ple_cache_gb: float | None = None
) -> int | None:
    """None (resident) or the slab-cache bytes (whole pages) to stream PLE pages through;
    gather_rows works in waves, so one page is enough for correctness."""
    pages = plan_stream(
        table_bytes, page_bytes, num_pages, available, reserve, ple_cache_gb, "ple_cache_gb", "PLE pages"
    )
    return None if pages is None else pages * page_bytes
