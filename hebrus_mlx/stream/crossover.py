"""The prefill sweep's crossover on this machine (issue 13): measured by `hebrus-mlx qualify` (and
`benchmarks/bench_prefill.py --crossover`), read back by the loader for ``--prefill-sweep auto``.

Measurement (I/O only, cold): for a few unique-expert fractions f of one layer, the slot path
resolves f*E distinct random records of the layer into a fresh arena (the engine's per-record reads,
SHA-256 verified), and the sweep reads the layer's whole extent into a fresh ring (verified). The
page cache is emptied before every run (``evict``); the runs go forward then backward through the
fractions (A/B/B/A) and rotate over the layers; medians. The crossover is the fraction from which on
the slot path's median time is never below the sweep's, interpolated between the neighbouring
fractions; when the sweep does not win at the largest it is 1.0 (auto then sweeps only chunks the
arena cannot take).

Which measurement the loader honours (``from_profile``): the machine profile's
``io.sweep_crossover`` entry, status ``measured``, written on this machine (``profile.IDENTITY``:
OS, release, architecture, MLX — the same rule as the profile's other I/O facts, bench's SSD record;
unlike the Metal claims it needs no GPU, so it holds on Linux too), on the file system the loaded
expert store lives on (the measured store's ``st_dev``), for records of this size (within 10%) and
this many experts per layer (the per-record cost and the extent's length are what the crossover
trades). Anything else keeps the built-in :data:`stream.sweep.CROSSOVER` and says why; a value that
is not a fraction in [0, 1] is refused (ProfileError naming the field).
"""

from __future__ import annotations

import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from ..machine_profile import IDENTITY, ProfileError, profile_path, read_profile, this_machine
from .sweep import CROSSOVER

SECTION, NAME = "io", "sweep_crossover"
FIELD = f"{SECTION}.{NAME}"
MEASURED = "measured"
FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0)
RECORD_TOLERANCE = 0.1


def crossover_from(fractions: Sequence[float], slot_s: Sequence[float], sweep_s: float) -> tuple:
    """(crossover, sweep_won): the fraction from which on the slot path is never faster than the
    sweep — linear between the last fraction where it still is and the next one (so one noisy slow
    run at a small fraction does not decide), the smallest fraction if the sweep wins at every one;
    1.0 and False when the slot path is faster at the largest."""
    faster = [i for i, t in enumerate(slot_s) if t < sweep_s]
    if not faster:
        return float(fractions[0]), True
    i = faster[-1]
    if i == len(fractions) - 1:
        return 1.0, False
    (f0, t0), (f1, t1) = (fractions[i], slot_s[i]), (fractions[i + 1], slot_s[i + 1])
    return float(f0 + (f1 - f0) * (sweep_s - t0) / (t1 - t0)), True


def measure(
    make_experts: Callable,
    evict: Callable,
    num_layers: int,
    fractions: Sequence[float] = FRACTIONS,
    passes: int = 4,
    sweep_threads: int = 4,
    seed: int = 0,
) -> dict:
    """Time the slot path at each fraction and the whole-extent sweep, cold, ``passes`` passes
    (even passes forward, odd ones backward; pass p reads layer p % num_layers).

    ``make_experts(rows) -> (engine, experts)``: a fresh engine and StreamedExperts-like object with
    a ``rows``-row arena (closed after each run); ``evict()`` empties the page cache of the store.
    Returns the profile entry's numbers (times in ms)."""
    import mlx.core as mx

    from .sweep import PrefillSweep

    fractions = sorted(float(f) for f in fractions)
    if not fractions or fractions[0] <= 0 or fractions[-1] > 1:
        raise ValueError(f"fractions must be in (0, 1], got {fractions}")
    rng = np.random.default_rng(seed)
    probe_eng, probe = make_experts(1)
    E, top_k = probe.num_experts, probe.top_k
    record = sum(probe.part_bytes)
    probe_eng.close()

    def slot(f, layer):
        eng, ex = make_experts(E)
        try:
            ids = rng.choice(E, max(1, round(f * E)), replace=False).astype(np.uint32)
            evict()
            t0 = time.perf_counter()
            rows, lease = ex.resolve(layer, mx.array(ids))
            mx.eval(eng.release_after(rows, lease))
            return time.perf_counter() - t0
        finally:
            eng.close()

    def sweep(layer):
        eng, ex = make_experts(top_k)
        sw = PrefillSweep(ex, "on", threads=sweep_threads, layers=range(num_layers))
        try:
            evict()
            t0 = time.perf_counter()
            mx.eval(sw.wait(layer, mx.array(0)))
            return time.perf_counter() - t0
        finally:
            sw.close()
            eng.close()

    slot_runs = {f: [] for f in fractions}
    sweep_runs = []
    for p in range(passes):
        layer = p % num_layers
        order = list(fractions) + [None]
        for f in order if p % 2 == 0 else order[::-1]:
            if f is None:
                sweep_runs.append(sweep(layer))
            else:
                slot_runs[f].append(slot(f, layer))
    slot_med = [statistics.median(slot_runs[f]) for f in fractions]
    sweep_med = statistics.median(sweep_runs)
    cross, won = crossover_from(fractions, slot_med, sweep_med)
    return {
        "crossover": cross,
        "sweep_won": won,
        "fractions": fractions,
        "record_bytes": record,
        "num_experts": E,
        "passes": passes,
        "order": "forward/backward (ABBA), layer p % L",
        "slot_ms_median": [1e3 * t for t in slot_med],
        "sweep_ms_median": 1e3 * sweep_med,
        "slot_ms": [[1e3 * t for t in slot_runs[f]] for f in fractions],
        "sweep_ms": [1e3 * t for t in sweep_runs],
        "sweep_GBps": E * record / sweep_med / 1e9,
        "slot_GBps_at_1": (E * record / slot_med[-1] / 1e9) if fractions[-1] == 1.0 else None,
    }


def _fraction(entry: dict, key: str) -> float:
    value = entry.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0.0 <= value <= 1.0
    ):
        raise ProfileError(f"{FIELD}.{key}", f"must be a fraction in [0, 1], got {value!r}")
    return float(value)


def _positive_int(entry: dict, key: str) -> int:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProfileError(f"{FIELD}.{key}", f"must be a positive integer, got {value!r}")
    return value


def from_profile(profile: dict | None, store_path: str, record_bytes: int, num_experts: int) -> tuple:
    """(crossover, source) for ``--prefill-sweep auto`` over the expert store at ``store_path``:
    the profile's measured value when it stands for this machine, file system and store geometry
    (module doc), else (CROSSOVER, "built-in ... (why)"). A malformed entry raises ProfileError
    naming the field."""
    builtin = f"built-in {CROSSOVER:.2f}"
    section = profile.get(SECTION) if isinstance(profile, dict) else None
    entry = section.get(NAME) if isinstance(section, dict) else None
    if entry is None:
        return CROSSOVER, f"{builtin} (no measured crossover in the machine profile: `hebrus-mlx qualify`)"
    if not isinstance(entry, dict):
        raise ProfileError(FIELD, f"must be an object, got {type(entry).__name__}")
    if entry.get("status") != MEASURED:
        return CROSSOVER, f"{builtin} (machine profile: {FIELD} {entry.get('status')!r})"
    value = _fraction(entry, "crossover")
    measured_record = _positive_int(entry, "record_bytes")
    measured_experts = _positive_int(entry, "num_experts")
    store = entry.get("store")
    if not isinstance(store, str) or not store:
        raise ProfileError(f"{FIELD}.store", f"must name the measured store file, got {store!r}")
    wrote = profile.get("machine") if isinstance(profile.get("machine"), dict) else {}
    here = this_machine()
    other = [k for k in IDENTITY if wrote.get(k) != here[k]]
    if other:
        return CROSSOVER, f"{builtin} (machine profile written with another {'/'.join(other)})"
    if abs(measured_record / record_bytes - 1) > RECORD_TOLERANCE or measured_experts != num_experts:
        return CROSSOVER, (
            f"{builtin} (machine profile measured {measured_experts} x {measured_record} B records, "
            f"this store has {num_experts} x {record_bytes} B: `hebrus-mlx qualify --artifact DIR`)"
        )
    try:
        same_disk = os.stat(store).st_dev == os.stat(store_path).st_dev
    except OSError:
        return CROSSOVER, f"{builtin} (the store the machine profile measured, {store}, is gone)"
    if not same_disk:
        return CROSSOVER, f"{builtin} (machine profile measured another file system: {store})"
    return value, f"machine profile {value:.2f}"


def for_store(store_path: str, record_bytes: int, num_experts: int, path=None) -> tuple:
    """``from_profile`` over the machine profile on disk; a profile that cannot be read or whose
    entry is malformed keeps the built-in value, with the error in the source (load never fails
    on it, as for the profile's other sections)."""
    try:
        return from_profile(read_profile(path), store_path, record_bytes, num_experts)
    except ProfileError as e:
        warnings.warn(
            f"{e}; the prefill sweep keeps its built-in crossover (re-run `hebrus-mlx qualify`)", stacklevel=2
        )
        return CROSSOVER, f"built-in {CROSSOVER:.2f} (machine profile {path or profile_path()} refused: {e})"
