"""What `simulate --validate` measures on this machine besides the runs it predicts, and how it
holds the prediction against the engine's own counters.

The read cost is measured through the engine itself (`engine_probe`): batches of q records
resolved into an arena of the run's layout (the same file descriptors, O_DIRECT or buffered as
the engine decides for that layout, the same reader threads and digest checks), timed from
the request to the last record pinned, minus the same batch resolved again as hits (the op's
own cost, which the compute runs already contain). An O_DIRECT probe of the store is not that
read: the demo's arena parts are not 512-byte multiples, so the engine reads it buffered.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np


def engine_probe(
    resolve: Callable[[int, np.ndarray], None],
    layers: int,
    experts: int,
    record_bytes: int,
    queue_depths: Sequence[int] = (1, 2, 4, 8),
    batches: int = 8,
    seed: int = 0,
    drop: Callable[[], None] | None = None,
) -> dict:
    """GB/s of record reads through the engine per queue depth: `resolve(layer, ids)` resolves
    (and releases) expert `ids` of `layer` in an arena of at least max(queue_depths) rows.
    Every batch reads records no earlier batch touched (so they miss), then resolves them
    again (hits); the read time is the median of (miss - hit) over `batches`. `drop()` is
    called first (e.g. to evict the page cache where the engine reads buffered)."""
    rng = np.random.default_rng(seed)
    queue_depths = [q for q in queue_depths if q <= experts] or [1]
    # As many batches as the store has untouched records for (a tiny test store: one, reused).
    batches = max(1, min(batches, (layers * experts - 1) // sum(queue_depths)))
    fresh = {l: list(rng.permutation(experts)) for l in range(layers)}  # untouched experts per layer
    out: dict[str, float] = {}
    ms: dict[str, float] = {}
    cpu = []
    if drop is not None:
        drop()
    first = int(fresh[0].pop())
    resolve(0, np.array([first]))  # threads and buffers started
    for q in queue_depths:
        dts = []
        for _ in range(batches):
            open_layers = [l for l in fresh if len(fresh[l]) >= q]
            if not open_layers:  # too small a store to read only untouched records
                fresh = {l: list(rng.permutation(experts)) for l in range(layers)}
                open_layers = list(fresh)
            layer = int(rng.choice(open_layers))
            ids = np.array([int(fresh[layer].pop()) for _ in range(q)])
            c0, t0 = time.process_time(), time.perf_counter()
            resolve(layer, ids)
            c1, t1 = time.process_time(), time.perf_counter()
            resolve(layer, ids)
            c2, t2 = time.process_time(), time.perf_counter()
            dts.append(((t1 - t0) - (t2 - t1), q))
            cpu.append(((c1 - c0) - (c2 - c1)) / q)
        per = statistics.median(max(dt, 1e-7) / n for dt, n in dts)  # seconds per record at this depth
        out[str(q)] = record_bytes / per / 1e9
        ms[str(q)] = per * q * 1e3
    return {
        "gbps_by_qd": out,
        "batch_ms_by_qd": ms,
        "record_bytes": record_bytes,
        "batches": batches,
        # CPU time of the process per read (reader thread: pread, copy/widen, digest; wake-ups):
        # on the CPU backend it is taken from the cores the compute uses.
        "cpu_us_per_record": max(statistics.median(cpu), 0.0) * 1e6,
        "source": "the engine's own reads of this store (resolve into the run's arena layout, minus the "
        "same batch as hits)",
    }


def hint_probe(
    hint: Callable[[int, np.ndarray], None],
    reads: Callable[[], np.ndarray],
    layers: int,
    experts: int,
    batch: int,
    batches: int = 12,
    seed: int = 0,
) -> dict:
    """How a hint batch lands, measured through the engine: `hint(layer, ids)` issues `ids` of
    `layer` as one prefetch op (P1, released at once, as the predictors issue them) and waits for
    the op; `reads()` returns the engine trace's `read` events since the last call (and clears
    them). Each batch hints `batch` records no earlier batch touched; of each read of a batch, the
    share that had landed (published) before the batch's next read was requested is
    `batch_landed`: a landed prediction is released and evictable, so the batch's later hints may
    displace it (model.replay_arena's `batch_landed`). A property of this machine's readers and
    request loop, measured apart from the runs it is used to predict."""
    rng = np.random.default_rng(seed + 1000)
    fresh = {l: list(rng.permutation(experts)) for l in range(layers)}
    landed, pairs = 0, 0
    reads()
    for _ in range(batches):
        open_layers = [l for l in fresh if len(fresh[l]) >= batch]
        if not open_layers:
            break
        layer = int(rng.choice(open_layers))
        ids = np.array([int(fresh[layer].pop()) for _ in range(batch)])
        hint(layer, ids)
        ev = np.zeros(0)
        for _ in range(2000):  # until every read of the batch has been published
            time.sleep(0.001)
            got = reads()
            ev = got if not len(ev) else np.concatenate([ev, got])
            if len(ev) >= batch:
                break
        ev = ev[(ev["kind"] == "read") & ~ev["exact"]] if len(ev) else ev
        ev = ev[np.argsort(ev["issue_ns"], kind="stable")] if len(ev) else ev
        for a, b in zip(ev[:-1], ev[1:]):
            pairs += 1
            landed += bool(a["end_ns"] <= b["issue_ns"])
    return {
        "batch_landed": landed / pairs if pairs else 0.0,
        "pairs": pairs,
        "source": "hint batches through the engine's prefetch op (trace: read published before the next request)",
    }


def artifact_resolver(path, rows: int, threads: int = 8):
    """(resolve, close) for `engine_probe` on an artifact's expert store, laid out as the loader
    lays it out (its arena parts, widening and digests)."""
    import mlx.core as mx

    from ..stream.experts import StreamedExperts

    ex = StreamedExperts.from_artifact(str(path), rows, threads=threads, prefetch_previous=False)

    def resolve(layer, ids):
        r, lease = ex.resolve(layer, mx.array(np.asarray(ids, np.uint32)))
        mx.eval(ex.engine.release_after(r, lease))

    return resolve, ex.engine.close


def artifact_hinter(path, rows: int, threads: int = 8):
    """(hint, reads, close) for `hint_probe` on an artifact's expert store, laid out as the loader
    lays it out, with the engine trace on."""
    import mlx.core as mx

    from ..stream.engine import P1
    from ..stream.experts import StreamedExperts

    ex = StreamedExperts.from_artifact(str(path), rows, threads=threads, prefetch_previous=False)
    ex.engine.enable_trace(1 << 14)

    def hint(layer, ids):
        mx.eval(ex.prefetch(layer, mx.array(np.asarray(ids, np.uint32)), P1))

    return hint, lambda: ex.engine.trace_events(clear=True)[0], ex.engine.close


def expert_ms(family, codec: str, repeats: int = 7, rows: int = 32, seed: int = 0) -> float:
    """Milliseconds of one routed expert's compute for one token on this machine's default device,
    at the family's widths and `codec`: the ops a one-token wavefront step runs per expert
    (stream.switch: gate, up and down through `gather_qmm` on an arena of `rows` records, SwiGLU
    between), top_k experts in turn as one graph; the median over `repeats` steps, per expert."""
    import mlx.core as mx

    from ..models.switch_layers import swiglu
    from . import model as S

    c = S.expert_codec(codec)
    if not c.affine:
        raise ValueError(f"expert_ms: {codec} is not an affine codec")
    d, f, k = family.hidden_size, family.moe_intermediate_size, family.num_experts_per_tok
    key = mx.random.key(seed)
    parts = {}
    for i, (name, shape) in enumerate((("gate", (rows, f, d)), ("up", (rows, f, d)), ("down", (rows, d, f)))):
        w = mx.random.normal(shape, key=mx.random.split(key, 3)[i]) * 0.02
        parts[name] = mx.quantize(w, group_size=c.group_size, bits=c.bits)
    mx.eval(parts)
    x = mx.random.normal((1, 1, 1, d), key=key).astype(mx.float32)

    def project(name, x, row):
        w, scales, biases = parts[name]
        return mx.gather_qmm(
            x, w, scales, biases, rhs_indices=row, transpose=True, group_size=c.group_size, bits=c.bits
        )

    def step(x, ids):
        ys = []
        for i in range(k):
            row = mx.array([[int(ids[i])]], dtype=mx.uint32)
            ys.append(project("down", swiglu(project("gate", x, row), project("up", x, row)), row))
        return mx.concatenate(ys, axis=-3)

    rng = np.random.default_rng(seed)
    mx.eval(step(x, rng.permutation(rows)[:k]))  # warm-up (first-call allocations)
    times = []
    for _ in range(repeats):
        ids = rng.permutation(rows)[:k]
        t = time.perf_counter()
        mx.eval(step(x, ids))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3 / k


def load_average() -> tuple | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def cpu_clock() -> tuple[float, float]:
    """(CPU seconds of this process's threads and its reaped children; monotonic seconds): two of
    them give its own load."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system, time.monotonic()


def own_load(start: tuple[float, float]) -> float:
    """Cores this process kept busy on average since `start` (a cpu_clock())."""
    cpu, wall = cpu_clock()
    return (cpu - start[0]) / max(wall - start[1], 1e-9)


def quiet_note(before: tuple | None, after: tuple | None, cores: int | None = None, own: float | None = None) -> str:
    """One line saying how loaded the machine was (the validation's numbers mean little on a busy one).
    The load at the end includes the validation's own runs (`own`: cores they kept busy, from CPU time);
    other processes are judged by the start and by the end less that."""
    cores = cores or os.cpu_count() or 1
    if before is None or after is None:
        return "load average: unknown"
    others = max(before[0], after[0] - (own or 0.0))
    verdict = "quiet" if others <= 0.5 * cores else "BUSY: other processes share the cores; rerun on a quiet machine"
    mine = "" if own is None else f" ({own:.2f} of it these runs' CPU)"
    return f"load average (1 min) {before[0]:.2f} at start, {after[0]:.2f} at end{mine} on {cores} cores: {verdict}"


def ratio_spread(ratios: Sequence[float]) -> tuple:
    """(min, max) of per-round predicted/measured ratios."""
    return (min(ratios), max(ratios)) if ratios else (float("nan"), float("nan"))


def min_median_max(ratios: Sequence[float]) -> str:
    """ "min/median/max" of predicted/measured ratios (the spread a validation prints)."""
    if not ratios:
        return "n/a"
    return f"{min(ratios):.2f}/{statistics.median(ratios):.2f}/{max(ratios):.2f}"


def validation_row(
    label, cap, preds_s, meas, ratios, rep, p, spread, cnt, prefetch, compute_s, hit_rate, mb_per_token, read_bytes=None
) -> dict:
    """One validated configuration: tok/s and every engine counter the model predicts, both sides.
    `read_bytes`: bytes the engine reads per record where that is not the stride the timing uses
    (the MB read per token then counts those, as the engine's counters do)."""
    need = cnt["predicted_hits"] + cnt["predicted_joins"] + cnt["exact_misses"]
    ahead = prefetch != "off"
    return {
        "config": label,
        "rows": cap,
        "predicted_tok_s": statistics.median(preds_s),
        "measured_tok_s": statistics.median(meas),
        "spread": spread,
        "ratio": statistics.median(ratios),
        "ratios_by_round": ratios,
        "predicted_tok_s_by_round": list(preds_s),
        "measured_tok_s_by_round": list(meas),
        "compute_ms_per_token": compute_s * 1e3,
        "predicted_exact_misses": float(rep.demand_misses.sum()),
        "measured_exact_misses": cnt["exact_misses"],
        "predicted_reads_ahead": float(rep.predicted_reads.sum()),
        "measured_reads_ahead": cnt["predicted_reads"],
        "predicted_timely_recall": p.timely_recall if ahead else None,
        "measured_timely_recall": cnt["predicted_hits"] / need if ahead and need else None,
        "predicted_late_recall": p.late_recall if ahead else None,
        "measured_late_recall": cnt["predicted_joins"] / need if ahead and need else None,
        "predicted_hit_rate": rep.engine_hit_rate,
        "exact_hit_rate": p.hit_rate,
        "measured_hit_rate": hit_rate,
        "predicted_precision": rep.precision,
        "predicted_mb_per_token": (rep.reads_per_token() * read_bytes if read_bytes else p.bytes_per_token) / 1e6,
        "measured_mb_per_token": mb_per_token,
        "predicted_exposed_ms": p.exposed_ms,
        "predicted_read_cpu_ms": p.read_cpu_ms,
        "measured_exposed_ms": cnt["exposed_wait_ns"] / 1e6,
    }


def command_line(args) -> str:
    """The command that reproduces this validation (for the printed header)."""
    parts = ["hebrus-mlx simulate --validate"]
    if args.stack:
        parts += ["--stack", args.stack, "--store", args.store, "--layers", str(args.layers)]
    else:
        parts += ["--model", str(args.model)]
    parts += [
        "--rows",
        str(args.rows),
        "--prefetch-modes",
        str(args.prefetch_modes),
        "--repeats",
        str(args.repeats),
        "--gen-tokens",
        str(args.gen_tokens),
        "--prompt-tokens",
        str(args.prompt_tokens),
    ]
    return " ".join(parts)
