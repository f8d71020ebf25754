"""`hebrus-mlx simulate` from a qualify report (`hebrus-mlx qualify --report FILE`).

- `--profile FILE`: the machine of the report (its SSD by queue depth, its engine's SHA-256 rate,
  its memory, the compute per layer it measured on its artifact) as a simulator profile. The
  compute holds for the report's model family only: projecting another family needs --layer-ms.
- `--validate --report FILE`: replays the routes the report's streamed decodes took through the
  engine's arena at each run's arena rows (prefetch off, CLOCK, as they ran), predicts their tok/s,
  hit rate and exposed wait from the report's own machine and compute, and sets the prediction
  beside what the report measured. Nothing is measured on the machine simulate runs on.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import numpy as np

from ..errors import UsageError
from . import model as S

SCHEMA = "hebrus-mlx/qualify-report/1"  # hebrus_mlx.qualify_report.SCHEMA (that module is MLX-bound)
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


def is_report(d) -> bool:
    return isinstance(d, dict) and d.get("schema") == SCHEMA


def read_report(path: str, flag: str = "--report") -> dict:
    p = Path(path)
    if not p.is_file():
        raise UsageError(flag, f"{path!r} is not a file")
    from ..artifact.untrusted import UntrustedFileError, read_json_path

    try:  # a report is handed to us: bounded size and nesting, duplicate keys refused (issue 22)
        d = read_json_path(p, "json", field=str(path))
    except UntrustedFileError as e:
        raise UsageError(flag, f"{path}: {e.message}") from None
    except OSError as e:
        raise UsageError(flag, f"{path}: not JSON: {e}") from None
    if not is_report(d):
        raise UsageError(
            flag, f"{path}: not a qualify report (schema {SCHEMA!r}; write one with hebrus-mlx qualify --report FILE)"
        )
    return d


def _get(d: dict, dotted: str, flag: str):
    node = d
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            raise UsageError(flag, f"the report has no {dotted} (re-run hebrus-mlx qualify --report)")
        node = node[key]
    return node


def _ssd(d: dict, flag: str) -> dict:
    ssd = _get(d, "ssd", flag)
    if ssd.get("status") != "measured":
        raise UsageError(flag, f"the report's SSD probe was not measured: {ssd.get('reason')}")
    out = {int(k[2:-5]): float(v) for k, v in ssd.items() if k.startswith("qd") and k.endswith("_GBps")}
    if not out or min(out.values()) <= 0:
        raise UsageError(flag, "the report's SSD probe has no positive GB/s by queue depth")
    return out


def _verify_gbps(d: dict) -> float | None:
    """One reader thread's check rate for the check the report's artifact streams with."""
    h = d.get("hashes") or {}
    fast = h.get("fast_check") or {}
    if (d.get("artifact") or {}).get("read_check") == "xxh3-128" and fast.get("xxh3_128_GBps_one_thread"):
        return float(fast["xxh3_128_GBps_one_thread"])
    return h.get("sha256_engine_GBps_one_thread") or h.get("sha256_GBps_one_thread")


def _sha256_gbps(d: dict) -> float | None:
    h = d.get("hashes") or {}
    return h.get("sha256_engine_GBps_one_thread") or h.get("sha256_GBps_one_thread")


def _fast_gbps(d: dict) -> float | None:
    """The fast read check's rate (XXH3-128, one thread) where the report measured it."""
    v = ((d.get("hashes") or {}).get("fast_check") or {}).get("xxh3_128_GBps_one_thread")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def compute_layer_ms(d: dict, flag: str) -> tuple:
    """(ms per layer, where it comes from): the streamed path with every record cached where the
    report has it, else its resident decode, else the value derived from its largest cache."""
    dec = _get(d, "decode", flag)
    if "streamed" not in dec:
        raise UsageError(flag, f"the report has no decode runs: {dec.get('reason')}")
    if (dec.get("all_cached") or {}).get("layer_ms"):
        return float(dec["all_cached"]["layer_ms"]), "streamed decode with every record cached"
    res = dec.get("resident") or {}
    if res.get("layer_ms"):
        return float(res["layer_ms"]), res.get("layer_ms_how", "resident decode")
    raise UsageError(flag, "the report's decode has no compute per layer")


def handoff(d: dict) -> tuple[float, str]:
    """(ms the GPU waits on the host per streamed layer, where it comes from): the report's
    measurement on a Metal device with GPU events, else the shipped profile's assumption (a CPU
    backend's host task is part of its measured compute)."""
    h = (d.get("streaming") or {}).get("handoff") or {}
    v = h.get("handoff_ms")
    if h.get("device") == "metal" and isinstance(v, (int, float)) and 0 <= v < 1e3:
        return float(v), "measured by qualify on this Mac (streamed all-resident layer vs resident layer)"
    base = json.loads((PROFILES_DIR / "m5-pro-48gb.json").read_text())
    return float(base.get("handoff_ms", 0.0)), "ASSUMPTION: the shipped m5-pro-48gb profile's (no Metal measurement)"


def machine_profile(d: dict, where: str, layer_ms: float | None = None) -> dict:
    """A simulator profile (the shape of the shipped ones) for the report's machine. The routes,
    memory reserve, resident size and speculative acceptance are the shipped M5 Pro 48 GB
    profile's assumptions (said so); `--trace` replaces the routes."""
    flag = "--profile"
    ident = _get(d, "identity", flag)
    art = _get(d, "artifact", flag)
    measured, how = compute_layer_ms(d, flag)
    base = json.loads((PROFILES_DIR / "m5-pro-48gb.json").read_text())
    chip = ident.get("chip") or ident.get("machine")
    given = layer_ms is not None
    prof = {
        "name": f"{chip}, {ident.get('memory_gb', 0):.0f} GiB (qualify report)",
        "memory_gb": float(ident.get("memory_gb") or 0) * 2**30 / 1e9,
        "ssd_gbps": {str(k): v for k, v in sorted(_ssd(d, flag).items())},
        "threads": 8,
        "layer_ms": float(layer_ms) if given else measured,
        "pre_router": 0.5,
        # SHA-256 for artifacts without fast digests, the fast check for those with (simulate --check).
        "verify_gbps": _sha256_gbps(d),
        "fast_check_gbps": _fast_gbps(d) or base.get("fast_check_gbps"),
        # Dense weights, PLE and MTP of the report's artifact stay in memory beside the expert cache.
        "resident_gb": float(art.get("other_bytes") or 0) / 1e9 or base["resident_gb"],
        "reserve_gb": base["reserve_gb"],
        "acceptance": base["acceptance"],
        "synthetic_routes": base["synthetic_routes"],
        "synthetic_predictors": base.get("synthetic_predictors", {}),
        "predictors": base.get("predictors", {}),
        "predictor_overhead": base.get("predictor_overhead", {}),
        "report_family": art.get("family"),
        "chip": chip,
        "handoff_ms": handoff(d)[0],
        "layer_ms_given": given,
        "status": "projection from a qualify report's measurements and the stated assumptions",
        "sources": [
            f"SSD, SHA-256, memory: qualify report {where} ({ident.get('system')} {ident.get('macos') or ''} "
            f"{ident.get('machine')}, MLX {ident.get('mlx')} {ident.get('backend')} backend; "
            f"{d['ssd'].get('record_bytes')} B reads, page cache {d['ssd'].get('page_cache')})",
            f"compute: --layer-ms {layer_ms}"
            if given
            else f"compute: {measured:.4f} ms per layer on the report's {art.get('family')} ({how})",
        ],
        "assumptions": [
            "ASSUMPTION: pre_router 0.5, 8 reader threads (the loader's)",
            f"hand-off {handoff(d)[0]:.3f} ms per streamed layer: {handoff(d)[1]}",
        ]
        + (
            []
            if _fast_gbps(d)
            else ["ASSUMPTION: fast check rate of the shipped m5-pro-48gb profile (the report measured none)"]
        )
        + [
            "ASSUMPTION: resident_gb = the report's artifact less its expert store; reserve GB, "
            "acceptance, synthetic routes and predictor recalls of the shipped m5-pro-48gb profile"
        ]
        + [a for a in base["assumptions"] if "synthetic" in a],
    }
    return prof


def chip_profile(prof: dict) -> tuple[str, dict]:
    """The shipped profile whose chip names the report's machine (M5 Pro, M5 Max; the closest
    memory size), else the M5 Pro 48 GB one: (its file stem, its contents)."""
    chip = str(prof.get("chip") or "").lower()
    best = None
    for path in sorted(PROFILES_DIR.glob("*.json")):
        p = json.loads(path.read_text())
        label = " ".join(p["name"].split()[:2]).lower()  # "m5 pro"
        if label and label in chip:
            gap = abs(float(p.get("memory_gb") or 0) - float(prof.get("memory_gb") or 0))
            if best is None or gap < best[0]:
                best = (gap, path.stem, p)
    if best is None:
        return "m5-pro-48gb", json.loads((PROFILES_DIR / "m5-pro-48gb.json").read_text())
    return best[1], best[2]


def check_family(prof: dict, family_name: str) -> dict:
    """The report's compute per layer was measured on its own family. For another family (a Mac
    user's report of the demo, projecting the real model) without --layer-ms, compute comes from
    the shipped chip profile (labelled an assumption); SSD, checks and hand-off stay measured."""
    fam = prof.get("report_family")
    if fam is None or prof.get("layer_ms_given") or fam == family_name:
        return prof
    stem, chip = chip_profile(prof)
    out = dict(prof)
    out["layer_ms"] = float(chip["layer_ms"])
    for key in ("dense_gb", "other_ms"):
        if key in chip:
            out[key] = chip[key]
    out["sources"] = [s for s in prof["sources"] if not s.startswith("compute:")] + [
        f"compute: the shipped {stem} profile's {chip['layer_ms']:.4f} ms per layer (the report measured "
        f"compute on {fam}, not {family_name}; give --layer-ms to replace it)"
    ]
    out["assumptions"] = list(prof["assumptions"]) + [
        a for a in chip["assumptions"] if "decodes" in a and "ASSUMPTION" in a
    ]
    out["compute_from"] = stem
    return out


# ---- validation ----------------------------------------------------------------------------------


def validate_report(args) -> dict:
    """Predicted vs measured for every streamed run of the report."""
    flag = "--report"
    d = read_report(args.report)
    art = _get(d, "artifact", flag)
    dec = _get(d, "decode", flag)
    runs = dec.get("streamed")
    if not runs:
        raise UsageError(flag, f"the report has no streamed decode runs: {dec.get('reason')}")
    L, E, k, R = (int(art[x]) for x in ("num_layers", "num_experts", "top_k", "record_bytes"))
    routes = _get(d, "decode.routes", flag)
    try:
        warm = np.asarray(routes["prompt"], np.int64).reshape(-1, L, k)
        decode = np.asarray(routes["decode"], np.int64).reshape(-1, L, k)
    except (KeyError, ValueError) as e:
        raise UsageError(flag, f"decode.routes: not [tokens][{L}][{k}] expert IDs ({e})") from None
    if len(decode) == 0 or decode.min() < 0 or decode.max() >= E or (len(warm) and warm.max() >= E):
        raise UsageError(flag, f"decode.routes: expert IDs must be in [0, {E})")
    layer_ms, how = compute_layer_ms(d, flag)
    machine = S.Machine(
        name=f"{d['identity'].get('chip')} (qualify report)",
        ssd_gbps=_ssd(d, flag),
        layer_s=layer_ms / 1e3,
        threads=8,
        verify_gbps=_verify_gbps(d),
        assumptions=[f"compute: {layer_ms:.4f} ms per layer ({how})", "pre_router 0.5 (assumption)"],
    )
    geom = S.ModelGeometry(str(art.get("family")), L, E, k, R)
    # The timed run's arena has seen the warm-up run and one earlier run of the same tokens: the
    # prompt, a decode, then this run's prompt (as `simulate --validate` replays bench runs).
    before = np.concatenate([warm, decode, warm])
    out = []
    for r in runs:
        cap = r.get("arena_rows")
        if not isinstance(cap, int) or cap < k:
            raise UsageError(flag, f"a streamed run has no arena rows >= top_k ({cap!r})")
        policy, prefetch = r.get("policy", "clock"), r.get("prefetch", "off")
        rep = S.replay(decode, E, cap, policy, prefetch, before)
        setup = dict(cache_gb=float(r["cache_gb"]), capacity=cap, policy=policy, prefetch=prefetch)
        p = S.project(machine, geom, rep, **setup)
        meas = r.get("decode_tok_s_p50")
        ratio = p.tok_s / meas if meas else None
        # Paired by round where the report has the rounds: each run predicted from the compute of
        # the all-cached run of its own round, so a slow patch of the machine moves both alike.
        comp, mine = (dec.get("all_cached") or {}).get("decode_tok_s_p50_by_round"), r.get("decode_tok_s_p50_by_round")
        by_round = None
        if comp and mine and len(comp) == len(mine) and all(comp) and all(mine):
            by_round = []
            for c, m_ in zip(comp, mine):
                mach = dataclasses.replace(machine, layer_s=1.0 / c / L)
                by_round.append(S.project(mach, geom, rep, **setup).tok_s / m_)
            ratio = statistics.median(by_round)
        out.append(
            {
                "cache_gb": r["cache_gb"],
                "rows": cap,
                "predicted_tok_s": p.tok_s,
                "measured_tok_s": meas,
                "ratio": ratio,
                "ratios_by_round": by_round,
                "predicted_hit_rate": rep.engine_hit_rate,
                "measured_hit_rate": r.get("hit_rate"),
                "predicted_exposed_ms": p.exposed_ms,
                "measured_exposed_ms": r.get("exposed_wait_ms_per_token"),
                "predicted_mb_per_token": p.bytes_per_token / 1e6,
                "measured_mb_per_token": None
                if r.get("expert_bytes_per_token") is None
                else r["expert_bytes_per_token"] / 1e6,
            }
        )
    ratios = [abs(x["ratio"] - 1) for x in out if x["ratio"] is not None]
    hits = [abs(x["predicted_hit_rate"] - x["measured_hit_rate"]) for x in out if x["measured_hit_rate"] is not None]
    return {
        "report": {
            "machine": d["identity"].get("chip"),
            "family": art.get("family"),
            "created_unix": d.get("created_unix"),
        },
        "machine": machine.to_dict(),
        "compute_ms_per_token": layer_ms * L,
        "runs": out,
        "worst": max(ratios) if ratios else None,
        "worst_hit_rate_gap": max(hits) if hits else None,
        "stack": "qualify report",
    }


def ssd_rates(ssd_gbps: dict, fmt: str) -> str:
    """A machine's SSD read rates, one per queue depth: "QD1 x, QD32 y GB/s"."""
    return ", ".join(f"QD{q} {g:{fmt}}" for q, g in ssd_gbps.items()) + " GB/s"


def print_validation(v: dict) -> None:
    m = v["machine"]
    num = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
    print(
        f"validation against a qualify report ({v['report']['machine']}, {v['report']['family']}): compute "
        f"{v['compute_ms_per_token']:.2f} ms/token, SSD "
        + ssd_rates(m["ssd_gbps"], ".2f")
        + (f", SHA-256 {m['verify_gbps']:.2f} GB/s" if m.get("verify_gbps") else "")
        + "; the report's routes replayed at each run's arena rows (prefetch off, CLOCK); pred/meas = the "
        "median over rounds of each run predicted from its own round's all-cached compute, where recorded"
    )
    print(
        "| expert cache GiB | rows | predicted tok/s | measured tok/s | pred/meas | hit rate pred/meas | "
        "exposed ms pred/meas | MB/token pred/meas |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in v["runs"]:
        print(
            f"| {r['cache_gb']:.3g} | {r['rows']} | {r['predicted_tok_s']:.2f} | {num(r['measured_tok_s'], '.2f')} | "
            f"{num(r['ratio'], '.2f')} | {r['predicted_hit_rate']:.1%} / {num(r['measured_hit_rate'], '.1%')} | "
            f"{r['predicted_exposed_ms']:.3f} / {num(r['measured_exposed_ms'], '.3f')} | "
            f"{r['predicted_mb_per_token']:.2f} / {num(r['measured_mb_per_token'], '.2f')} |"
        )
    if v["worst"] is not None:
        print(
            f"validation: worst |predicted/measured - 1| = {100 * v['worst']:.1f}% over {len(v['runs'])} runs; "
            f"worst hit-rate gap {100 * (v['worst_hit_rate_gap'] or 0):.1f} points"
        )
