"""`hebrus-mlx simulate --profile P`: the projection of one machine profile, per expert width.

A profile (profiles/*.json) gives the machine (SSD GB/s by queue depth, compute per layer, the
per-core rates of the two record checks, memory), the memory the expert cache may take, the
routes (a recorded trace, or synthetic routes tuned to a public hit-rate anchor) and what the
read-ahead predictors are credited with:

- ``predictors`` (the default, ``--predictors peer``): what public runtimes *measured* for the
  same kind of predictor: a decode ``gain`` over the same configuration without read-ahead
  (applied to the prefetch-off projection, capped at the exposed read time), or the ``recall``
  (share of misses the predictor brought in) replayed through the arena as predicted sets of
  that recall;
- ``synthetic_predictors`` (``--predictors synthetic``): predicted sets of an assumed per-expert
  recall (prediction accuracy figures, not end-to-end gains), replayed through the arena.

Every recommendation is a set of flags the runtime has: ``--expert-cache-gb``, ``--prefetch``,
``--draft-model mtp --num-draft-tokens D``; the arena's policy is the loader's (CLOCK), other
policies (``--policies lru,lfu,belady``) are printed as comparisons, never recommended.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import UsageError
from . import model as S

GRID_GB = (4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64, 80, 96)
RUNTIME_POLICY = "clock"  # the loader's arena policy (loading/build_model.py); no flag selects another
RUNTIME_PREFETCH = ("off", "previous", "router-reuse:1", "router-reuse:2", "hyper-reuse")  # --prefetch values
# Whether the runtime's streamed MoE step computes a layer's resident experts while its misses are
# read (stream.switch); the projection credits that overlap only when the runtime does it. It does
# by default on the CPU device only, not on the GPU the projected Macs decode on (a profile's own
# "wavefront" says otherwise: --profile machine on this CPU).
RUNTIME_WAVEFRONT = False
BATCHES = (1, 2, 4, 8)  # concurrent requests projected for agents (continuous batching)
DEFAULT_PREFETCH = "router-reuse:1"  # stream.predict.DEFAULT (not imported: that module needs MLX)
PREDICTOR_SOURCES = ("peer", "synthetic")
CHECK_NAMES = {"fast": "fast check (XXH3-128)", "sha256": "SHA-256", "off": "no check"}


@dataclass
class Inputs:
    """What one projection runs on, besides the machine: routes, predicted sets, peer gains."""

    warm: np.ndarray
    topk: np.ndarray
    routes: str
    predicted: dict[str, np.ndarray] = field(default_factory=dict)
    gains: dict[str, tuple] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Memo:
    """Routes, predicted sets and arena replays shared across profiles, widths and checks (the
    same synthetic routes at another record size only need the replays of new capacities)."""

    def __init__(self):
        self.routes: dict = {}
        self.predicted: dict = {}
        self.replays: dict = {}


def machine_of(prof: dict, where: str, check: str) -> S.Machine:
    m = S.Machine.from_dict(prof, where)
    if check not in S.CHECKS:
        raise UsageError("--check", f"must be one of {', '.join(S.CHECKS)}, got {check!r}")
    if check == "fast" and m.fast_check_gbps is None:
        raise UsageError(
            "--check",
            f"fast: {where} has no fast_check_gbps (the fast read check's GB/s per core); give --check sha256",
        )
    if check == "sha256" and m.verify_gbps is None:
        raise UsageError("--check", f"sha256: {where} has no verify_gbps (SHA-256 GB/s per core)")
    m.check = check
    return m


def inputs_of(
    prof: dict, geom: S.ModelGeometry, predictors: str, memo: Memo, trace_topk=None, trace_name: str = ""
) -> Inputs:
    """Routes (the trace, or the profile's synthetic routes) and the predictors' stand-ins."""
    if predictors not in PREDICTOR_SOURCES:
        raise UsageError("--predictors", f"must be one of {', '.join(PREDICTOR_SOURCES)}, got {predictors!r}")
    if trace_topk is not None:
        half = len(trace_topk) // 2
        allr, warm_n = trace_topk, half
        routes = f"trace {trace_name}"
        seed = 0
    else:
        sr = prof.get("synthetic_routes")
        if not sr:
            raise UsageError("--trace", "the profile has no synthetic_routes: give a route trace")
        try:
            key = (
                int(sr["tokens"]),
                geom.num_layers,
                geom.num_experts,
                geom.top_k,
                float(sr["reuse"]),
                float(sr["skew"]),
                int(sr.get("seed", 0)),
            )
            warm_n = int(sr.get("warm", 0))
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError("--profile", f"synthetic_routes: {e}") from None
        if key not in memo.routes:
            memo.routes[key] = S.synthetic_routes(*key)
        allr = memo.routes[key]
        seed = key[-1]
        routes = f"SYNTHETIC routes (reuse {sr['reuse']}, skew {sr['skew']}; see the profile's assumptions)"
    # The same view objects for the same routes: the replay memo is keyed by them.
    views = memo.routes.setdefault(("views", id(allr), warm_n), (allr[:warm_n], allr[warm_n:], allr))
    inp = Inputs(views[0], views[1], routes)
    table = prof.get("predictors" if predictors == "peer" else "synthetic_predictors") or {}
    field_name = "predictors" if predictors == "peer" else "synthetic_predictors"
    for name, spec in table.items():
        if name not in RUNTIME_PREFETCH or S.prefetch_kind(name)[0] != "ahead":
            raise UsageError("--profile", f"{field_name}.{name}: not an ahead predictor the runtime has")
        if not isinstance(spec, dict):
            spec = {"recall": spec}
        source = str(spec.get("source", ""))
        if "gain" in spec:
            gain = spec["gain"]
            if not isinstance(gain, (int, float)) or not 1.0 <= gain < 10:
                raise UsageError("--profile", f"{field_name}.{name}.gain: a decode speed-up >= 1, got {gain!r}")
            inp.gains[name] = (float(gain), source.split(":")[0] or "peer")
            inp.notes.append(f"{name}: x{gain:.2f} over prefetch off, measured by {source}")
        elif "recall" in spec:
            recall = spec["recall"]
            if not isinstance(recall, (int, float)) or not 0.0 <= recall <= 1.0:
                raise UsageError("--profile", f"{field_name}.{name}.recall: in [0, 1], got {recall!r}")
            precision = spec.get("precision", recall)
            if not isinstance(precision, (int, float)) or not 0.0 < precision <= 1.0:
                raise UsageError("--profile", f"{field_name}.{name}.precision: in (0, 1], got {precision!r}")
            # Candidates per layer: the budget at which `recall` of the routed experts is `precision`
            # of the predicted ones (wrong guesses fill the rest).
            budget = max(1, min(geom.num_experts, round(recall * geom.top_k / precision)))
            key = (id(allr), float(recall), budget, seed + 1)
            if key not in memo.predicted:
                memo.predicted[key] = (
                    S.synthetic_predictions(allr, geom.num_experts, float(recall), budget, seed + 1),
                    allr,
                )
            inp.predicted[name] = memo.predicted[key][0]
            inp.notes.append(
                f"{name}: predicted sets replayed, each routed expert predicted with probability "
                f"{recall:.2f}, {budget} candidates per layer (precision ~{recall * geom.top_k / budget:.2f})"
                + (f"; {source}" if source else "")
            )
        else:
            raise UsageError("--profile", f"{field_name}.{name}: needs a gain or a recall")
    return inp


def cache_sizes(budget: float, given: Sequence[float] | None, geom: S.ModelGeometry) -> list[float]:
    """The swept cache sizes: the grid up to the budget, and the budget itself (what the loader
    takes from free memory by default), never past the whole store."""
    if given:
        return list(given)
    store = geom.store_bytes / S.GIB
    top = min(budget, store)
    caches = [g for g in GRID_GB if g < top]
    caches.append(math.floor(top * 2) / 2)  # the default: the whole budget, to 0.5 GB
    if caches[-1] <= 0:
        raise UsageError("--profile", f"no expert cache fits: budget {budget:.1f} GiB")
    return sorted(set(caches))


def project_one(
    prof: dict,
    where: str,
    geom: S.ModelGeometry,
    codec: str,
    check: str,
    inp: Inputs,
    caches: Sequence[float],
    policies: Sequence[str],
    prefetches: Sequence[str],
    draft_depths: Sequence[int],
    acceptance: float,
    memo: Memo,
    progress=None,
    compute_scale: float | None = None,
    expert_share: float = 0.0,
) -> list[S.Projection]:
    machine = runtime_machine(prof, where, check, compute_scale, expert_share)
    pfs = [p for p in prefetches if p in S.PREFETCH or p in inp.predicted or p in inp.gains]
    return S.sweep(
        machine,
        geom,
        inp.topk,
        caches,
        policies,
        pfs,
        draft_depths,
        acceptance,
        inp.warm,
        inp.predicted,
        inp.gains,
        codec,
        memo.replays,
        progress,
    )


def runtime_machine(
    prof: dict, where: str, check: str, compute_scale: float | None = None, expert_share: float = 0.0
) -> S.Machine:
    """The profile's machine running this runtime at one width: compute follows the weight bytes a
    token reads (S.compute_scale), the experts' share of it is what a wavefront can overlap. A
    profile that says whether the runtime runs the wavefront there (``--profile machine`` on a
    CPU device does) keeps its setting; the shipped Mac profiles get the GPU's (off)."""
    machine = machine_of(prof, where, check)
    if compute_scale is not None:
        machine = dataclasses.replace(
            machine, layer_s=machine.layer_s * compute_scale, other_s=machine.other_s * compute_scale
        )
    wavefront = bool(prof["wavefront"]) if "wavefront" in prof else RUNTIME_WAVEFRONT
    return dataclasses.replace(machine, wavefront=wavefront, expert_share=expert_share)


def dense_gb(prof: dict, where: str) -> float | None:
    """The profile's dense weight bytes at the anchor width (GB), or None (compute then does not
    follow the widths)."""
    v = prof.get("dense_gb")
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
        raise UsageError(f"{where}.dense_gb", f"GB of dense weights >= 0, got {v!r}")
    return float(v)


def width_note(prof: dict, machine: S.Machine, family, codec: str, dense: str, scale: float | None) -> dict:
    """What the widths did to compute, in words (printed with each width's projection)."""
    base = (machine.layer_s * family.num_hidden_layers + machine.other_s) * 1e3
    rec, _ = S.expert_record_bytes(family, codec)
    if scale is None:
        return {
            "compute_scale": None,
            "compute_note": f"compute {base:.1f} ms/token resident, NOT scaled with the width "
            + (
                "(compute-bound CPU decode: --layer-ms is taken at the widths projected)"
                if prof.get("wavefront")
                else "(the profile gives no dense_gb)"
            ),
        }
    return {
        "compute_scale": scale,
        "compute_note": f"compute {base * scale:.1f} ms/token resident = {base:.1f} ms at {S.ANCHOR_CODEC} x "
        f"{scale:.3f}: dense {float(prof['dense_gb']) * S.bits_per_weight(dense) / S.bits_per_weight(S.ANCHOR_CODEC):.2f} GB "
        f"at {dense} + {family.num_hidden_layers} x {family.num_experts_per_tok} expert records "
        f"of {rec / 1e6:.2f} MB at {codec} per token (ASSUMPTION: memory-bandwidth-bound decode, "
        f"anchored at the 4-bit measurement)",
    }


def exposed_settings(rows: Sequence[S.Projection]) -> list[S.Projection]:
    """Configurations the runtime can be told to run (its policy, its --prefetch values)."""
    return [r for r in rows if r.policy == RUNTIME_POLICY and r.prefetch in RUNTIME_PREFETCH]


def recommend(rows: Sequence[S.Projection]) -> S.Projection:
    """The fastest exposed configuration; within 0.5% of it (a tie for a projection) the runtime's
    default predictor, then the smaller draft depth, then the smaller cache (fewer flags, less
    memory)."""
    cands = exposed_settings(rows)
    top = max(r.tok_s for r in cands)
    near = [r for r in cands if r.tok_s >= top * 0.995]
    return min(near, key=lambda r: (r.prefetch != DEFAULT_PREFETCH, r.draft_depth, r.cache_gb, -r.tok_s))


def default_setting(rows: Sequence[S.Projection], budget_gb: float) -> S.Projection | None:
    """The runtime's defaults: the cache it plans from free memory (the whole budget), its
    default predictor, no draft model."""
    cands = [r for r in exposed_settings(rows) if r.prefetch == DEFAULT_PREFETCH and r.draft_depth == 0]
    if not cands:
        return None
    top = max(r.cache_gb for r in cands)
    return next(r for r in cands if r.cache_gb == top)


def flags(p: S.Projection) -> str:
    """The runtime flags of one projected configuration."""
    f = f"--expert-cache-gb {p.cache_gb:g} --prefetch {p.prefetch}"
    if p.draft_depth:
        f += f" --draft-model mtp --num-draft-tokens {p.draft_depth}"
    return f


def limiting_term(p: S.Projection, check_ms: float) -> str:
    """What a token's time is mostly made of: compute, the SSD, the record check, the GPU waiting
    on the host per streamed layer, or PLE page reads."""
    disk = p.exposed_ms - check_ms
    # Per token: with a draft model a step's compute (and its verify cost) is shared by its tokens.
    compute = p.token_ms - p.exposed_ms - p.read_cpu_ms - p.handoff_ms - p.ple_ms if p.draft_depth else p.compute_ms
    terms = {
        "compute": compute,
        "SSD reads": disk,
        "record checks": check_ms,
        "host hand-off": p.handoff_ms,
        "PLE reads": p.ple_ms,
    }
    name = max(terms, key=terms.get)
    return (
        f"{name} ({terms[name]:.1f} of {p.token_ms:.1f} ms/token; compute {compute:.1f}, "
        f"exposed reads {disk:.1f}, checks {check_ms:.1f}, hand-off {p.handoff_ms:.1f}, PLE {p.ple_ms:.1f})"
    )


COLUMNS = (
    "| expert codec | cache (GiB) | policy | --prefetch | MTP draft depth | tok/s | ms/token | "
    "compute ms/token | exposed read ms/token | hit rate | expert MB read/token | "
    "timely / late recall | predictor basis |"
)


def table(rows: Sequence[S.Projection]) -> str:
    pct = lambda x: "n/a" if x is None else f"{x:.0%}"  # noqa: E731
    lines = [COLUMNS, "|" + "---|" * (COLUMNS.count("|") - 1)]
    for p in rows:
        lines.append(
            f"| {p.codec} | {p.cache_gb:g} | {p.policy} | {p.prefetch} | {p.draft_depth} | {p.tok_s:.2f} | "
            f"{p.token_ms:.1f} | {p.compute_ms:.1f} | {p.exposed_ms:.1f} | {p.hit_rate:.1%} | "
            f"{p.bytes_per_token / 1e6:.0f} | {pct(p.timely_recall)} / {pct(p.late_recall)} | {p.basis} |"
        )
    return "\n".join(lines)


DOC_COLUMNS = (
    "| profile | expert codec | record bytes | cache budget (GiB) | default settings, tok/s: fast check / "
    "SHA-256 / no check | default read-ahead vs --prefetch off (fast check) | best, tok/s: fast check / "
    "SHA-256 / no check | best flags (fast check) | what limits the default (fast check) |"
)


def doc_rows(results: Sequence[dict]) -> list[dict]:
    """One row per (profile, expert codec): tok/s of the defaults and of the best per check."""
    rows: dict[tuple, dict] = {}
    for item in results:
        res = item["result"]
        for c in res["by_codec"]:
            key = (res["machine"]["name"], c["codec"])
            row = rows.setdefault(
                key,
                {
                    "profile": res["machine"]["name"],
                    "profile_name": item["profile_name"],
                    "codec": c["codec"],
                    "record_bytes": c["geometry"]["record_bytes"],
                    "budget_gb": res["cache_budget_gb"],
                    "default": {},
                    "best": {},
                },
            )
            row["default"][item["check"]] = c["default"]["tok_s"] if c["default"] else None
            row["best"][item["check"]] = c["best"]["tok_s"]
            if item["check"] == "fast":
                row["best_flags"] = c["best_flags"]
                row["default_limit"] = c["default_limit"]
                row["default_gain"] = c.get("default_gain")
    return list(rows.values())


# Issue 23's goal: tok/s with default settings and the (fast) read check on.
GOALS = {"m5-pro-48gb": 25.0, "m5-pro-64gb": 30.0}

GOAL_COLUMNS = (
    "| profile | goal (tok/s) | expert width | default settings, tok/s (fast check) | ms/token: compute + "
    "exposed reads + checks + host hand-off + PLE reads | what limits it | compute the goal leaves (ms/token) | "
    "without the hand-off, tok/s | dense weights at 3 bits too, tok/s | best flags, tok/s |"
)


def _terms(c: dict) -> tuple:
    """(projection of the defaults, exposed expert reads, checks, hand-off, PLE) in ms/token."""
    d = c["default"]
    chk = c.get("default_check_ms") or 0.0
    return d, d["exposed_ms"] - chk, chk, d.get("handoff_ms", 0.0), d.get("ple_ms", 0.0)


def goal_section(results: Sequence[dict], whatif: Sequence[dict]) -> list[str]:
    """Where each goal profile stands at each expert width, which term limits it and what moves it."""
    fast = {item["profile_name"]: item["result"] for item in results if item["check"] == "fast"}
    alt = {item["profile_name"]: item["result"] for item in whatif or ()}
    lines = [
        "## The goal: M5 Pro 48 GB >= 25 tok/s, M5 Pro 64 GB >= 30 tok/s (default settings, fast check on)",
        "",
        GOAL_COLUMNS,
        "|" + "---|" * (GOAL_COLUMNS.count("|") - 1),
    ]
    verdicts = []
    for name, goal in sorted(GOALS.items()):
        res = fast.get(name)
        if res is None:
            continue
        budget = 1e3 / goal
        meets, rows = [], []
        for c in res["by_codec"]:
            if not c["default"]:
                continue
            d, reads, chk, hand, ple = _terms(c)
            w = next((x for x in (alt.get(name) or {}).get("by_codec", []) if x["codec"] == c["codec"]), None)
            wtok = (w or {}).get("default") or {}
            left = budget - reads - chk - hand - ple
            rows.append((c, d, reads, chk, hand, ple, left, wtok.get("tok_s")))
            limit = (c.get("default_limit") or "").split(" (")[0]
            lines.append(
                f"| {res['machine']['name']} | {goal:g} | {c['codec']} | {d['tok_s']:.1f} | "
                f"{d['token_ms']:.1f} = {d['compute_ms']:.1f} + {reads:.1f} + {chk:.1f} + {hand:.1f} + {ple:.1f} | "
                f"{limit} | {left:.1f} (assumed {d['compute_ms']:.1f}) | {1e3 / (d['token_ms'] - hand):.1f} | "
                + ("n/a" if wtok.get("tok_s") is None else f"{wtok['tok_s']:.1f}")
                + " | "
                f"{c['best']['tok_s']:.1f} (`{c.get('best_flags')}`) |"
            )
            if d["tok_s"] >= goal:
                meets.append((c["codec"], d["tok_s"]))
        if not rows:
            continue
        label = res["machine"]["name"]
        fc, fd, freads, fchk, fhand, fple = rows[0][:6]
        at_default = (
            f"at the default {fc['codec']} it projects {fd['tok_s']:.1f} tok/s, a token being "
            f"{fd['token_ms']:.1f} ms: compute {fd['compute_ms']:.1f}, exposed reads {freads:.1f}, checks "
            f"{fchk:.1f}, host hand-off {fhand:.1f}, PLE reads {fple:.1f} (compute alone allows "
            f"{1e3 / fd['compute_ms']:.1f} tok/s)"
        )
        if meets:
            widest = meets[0]  # the table lists the widest (least lossy) width first
            head = (
                f"**{label}: meets {goal:g} tok/s at {widest[0]} experts ({widest[1]:.1f} tok/s projected)**; "
                f"{at_default}."
            )
        else:
            best = max(rows, key=lambda r: r[1]["tok_s"])
            head = (
                f"**{label}: below {goal:g} tok/s at every width** (best default {best[1]['tok_s']:.1f} tok/s at "
                f"{best[0]['codec']}); {at_default}."
            )
        # Which term limits the fastest width, and what would move it.
        c, d, reads, chk, hand, ple, left, wt = max(rows, key=lambda r: r[1]["tok_s"])
        if d["tok_s"] >= goal:
            verdicts.append(
                head + f" At {c['codec']} a token is {d['token_ms']:.1f} ms: compute {d['compute_ms']:.1f}, "
                f"exposed reads {reads:.1f}, checks {chk:.1f}, hand-off {hand:.1f}, PLE {ple:.1f}; the margin is "
                f"{budget - d['token_ms']:.1f} ms."
            )
            continue
        if d["compute_ms"] >= budget:
            why = (
                f"Compute limits it: at {c['codec']} compute alone is {d['compute_ms']:.1f} ms/token against the "
                f"{budget:.1f} ms that {goal:g} tok/s allows, so no read-side change reaches it."
            )
        else:
            why = (
                f"Compute {d['compute_ms']:.1f} ms leaves {budget - d['compute_ms']:.1f} ms; the projection "
                f"spends {reads + chk:.1f} ms on exposed reads and checks, {hand:.1f} ms with the GPU waiting on "
                f"the host (48 streamed layers) and {ple:.1f} ms on PLE reads."
            )
        moves = [
            f"no GPU wait on the host for layers whose records are all resident (hits resolved from a "
            f"GPU-visible slot table): up to {1e3 / (d['token_ms'] - hand):.1f} tok/s with none at all",
            f"dense weights at 3 bits too ({'n/a' if wt is None else f'{wt:.1f}'} tok/s; quality not measured here)",
            f"a draft model (best {c['best']['tok_s']:.1f} tok/s with `{c.get('best_flags')}`, at the assumed "
            "MTP acceptance 0.5)",
            f"an M5 Pro that decodes faster than the assumed 0.6x an M4 Max: the goal needs compute <= "
            f"{left:.1f} ms/token at {c['codec']} with these reads and hand-offs",
        ]
        verdicts.append(head + " " + why + " What would move it: " + "; ".join(moves) + ".")
    lines += [""] + [f"- {v}" for v in verdicts]
    lines += [
        "",
        "What the goal rows rest on (each printed in full per profile below): compute = 0.6x an M4 Max's "
        "measured 21.2 ms/token (memory-bandwidth ratio, assumed), scaled with the weight bytes a token reads "
        "at each width (ASSUMPTION: memory-bandwidth-bound decode, anchored at the 4-bit measurement); SSD "
        "9.5 GB/s at QD1, 17.3 at QD8 (slotstream's M5 Pro); synthetic routes tuned to ~75% hits at 28 GiB; "
        "read-ahead credited with what public runtimes measured; the fast check at XXH3's public 36 GB/s "
        "per core; the GPU waiting on the host once per streamed layer (the profile's handoff_ms, an "
        "ASSUMPTION until `hebrus-mlx qualify` measures it on a Mac); PLE pages read from the SSD at each "
        "token's start (ple_hit 0: no PLE row cache credited); 8 GB kept for the OS and apps. The quality of "
        "2- and 3-bit experts is not part of a projection (`benchmarks/bench_widths.py` measures perplexity "
        "on the demo).",
        "",
    ]
    lines += batch_section(results)
    return lines


def batch_section(results: Sequence[dict]) -> list[str]:
    """Agents: aggregate and per-request tok/s of 1, 2, 4, 8 concurrent requests at the defaults."""
    lines = [
        "## Agents: concurrent requests (continuous batching, default cache, fast check)",
        "",
        "Each routed record is read once per step for all the requests that route to it; decode being "
        "memory-bound, a step reads the dense weights once and the distinct expert records of its rows. "
        "Batched steps are multi-row forwards, which predict nothing ahead (read-ahead off). This CPU's "
        "measured batching ratio (1.8x at 4, quiet) says little of a memory-bound GPU.",
        "",
        "| profile | expert width | requests | aggregate tok/s | per request tok/s | x one request | "
        "distinct records per step / (requests x top-k) | what limits it |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for item in results:
        if item["check"] != "fast" or item["profile_name"] not in GOALS:
            continue
        res = item["result"]
        for c in res["by_codec"]:
            batches = c.get("batches") or []
            if not batches:
                continue
            one = batches[0]["tok_s"]
            for b in batches:
                lines.append(
                    f"| {res['machine']['name']} | {c['codec']} | {b['batch']} | {b['tok_s']:.1f} | "
                    f"{b['tok_s'] / b['batch']:.1f} | x{b['tok_s'] / one:.2f} | {b.get('union', 1.0):.2f} | "
                    f"{b.get('limit', '')} |"
                )
    return lines + [""]


def render_doc(results: Sequence[dict], command: str, whatif: Sequence[dict] = ()) -> str:
    first = results[0]["result"]
    g = first["geometry"]
    num = lambda x: "n/a" if x is None else f"{x:.1f}"  # noqa: E731
    lines = [
        "# Projected decode speed on M5 Macs (a projection, not a measurement)",
        "",
        f"Generated by `{command}`; `tests/test_projection_doc.py` re-runs part of it and fails when this file",
        "is stale. Nothing here was measured on a Mac: every input is a public figure or an assumption listed",
        "below (`hebrus_mlx/simulate/profiles/*.json`).",
        "",
        f"Model: Qwen3.8-Flash-Next ({g['num_layers']} layers, {g['num_experts']} routed experts top-{g['top_k']}), "
        f"routes: {first['routes']}; predictors: {first['predictors']} "
        "(`--predictors synthetic` for the assumed-recall alternative).",
        "*Default settings*: what the runtime does with no flags: the expert cache planned from free memory (the",
        f"whole budget), `--prefetch {DEFAULT_PREFETCH}`, no draft model. *Best*: the fastest configuration of flags",
        "the runtime has (`--expert-cache-gb`, `--prefetch`, `--draft-model mtp --num-draft-tokens D`; the arena",
        "policy is the loader's CLOCK). tok/s with the check every streamed record pays: the fast check",
        "(XXH3-128, artifacts that carry it), SHA-256 (older artifacts), none. Read-ahead gains are modelled from",
        "what public runtimes measured (peers.md: x1.11 slotstream two layers ahead, +6% zerocool, ds4's early",
        "router prefetching 46% of misses for +34% on a 36 GB M4 Max). Near the whole store the 200 counted",
        "synthetic tokens still carry first-touch misses a long run would not have (pessimistic there).",
        "",
        DOC_COLUMNS,
        "|" + "---|" * (DOC_COLUMNS.count("|") - 1),
    ]
    for r in doc_rows(results):
        d, b = r["default"], r["best"]
        lines.append(
            f"| {r['profile']} | {r['codec']} | {r['record_bytes']:,} | {r['budget_gb']:.1f} | "
            f"{num(d.get('fast'))} / {num(d.get('sha256'))} / {num(d.get('off'))} | "
            + ("n/a" if r.get("default_gain") is None else f"x{r['default_gain']:.2f}")
            + " | "
            f"{num(b.get('fast'))} / {num(b.get('sha256'))} / {num(b.get('off'))} | "
            f"`{r.get('best_flags', '')}` | {r.get('default_limit', '')} |"
        )
    lines += [""] + goal_section(results, whatif)
    lines += ["## Assumptions and sources, per profile", ""]
    seen = set()
    for item in results:
        res = item["result"]
        name = res["machine"]["name"]
        if name in seen:
            continue
        seen.add(name)
        lines.append(f"### {name} (`--profile {item['profile_name']}`)")
        lines.append("")
        lines += [f"- predictor {n}" for n in res["by_codec"][0]["notes"]]
        lines += [f"- {a}" for a in res["machine"]["assumptions"]]
        lines += [f"- source: {x}" for x in res["machine"]["sources"]]
        lines.append("")
    return "\n".join(lines)
