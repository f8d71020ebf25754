"""`hebrus-mlx simulate`: projected decode speed on a machine that is not this one.

    hebrus-mlx simulate --profile m5-pro-48gb                 # Qwen3.8-Flash-Next, shipped profile
    hebrus-mlx simulate --profile m5-pro-48gb --codec affine4-g64,affine2-g64 --check sha256
    hebrus-mlx simulate --profile my-mac.json --trace DIR     # a recorded route trace / export
    hebrus-mlx simulate --table docs/PROJECTION.md            # every shipped profile x width x check
    hebrus-mlx simulate --validate --model demo               # predicted vs measured, on this machine
    hebrus-mlx simulate --validate --stack decode             # ... on bench_stream's real-geometry stack
    hebrus-mlx simulate --profile machine --layer-ms 0.8      # this machine's SSD from `hebrus-mlx qualify`

A projection combines a route trace (replayed through the expert arena: hit rate, reads per
token), the model geometry (layers, experts, top-k, record bytes from the artifact format, per
--codec) and a machine (SSD GB/s by queue depth, compute per layer, the record checks' rates,
memory); see `hebrus_mlx.simulate.model` for the equations, `projection` for the profile's
predictors and the recommendation (runtime flags only), docs/SIMULATE.md for the profile fields.
`--validate` measures this machine (compute with every record cached, per predictor; reads
through the engine, `calibrate`), records the demo's routes for the bench's own prompt (and the
hinted sets of the engine's own Predictor), predicts the bench's runs at several cache sizes for
each predictor (--prefetch-modes), runs them (interleaved) and prints both sides of every engine
counter the model predicts. `--stack decode` does the same on the I/O-heavy real-geometry decode
stack (`hebrus_mlx.simulate.decode_stack`).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from .. import flags
from ..errors import UsageError
from ..traces import cachesim
from . import model as S
from . import report as R

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


def parse_list(s: str, conv, flag: str) -> list:
    try:
        v = [conv(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise UsageError(flag, f"bad list {s!r}: {e}") from None
    if not v:
        raise UsageError(flag, "is empty")
    return v


def expert_codecs(args) -> list[str]:
    """The expert widths to project: --expert-bits N[,N...] (affineN-g64) or --codec."""
    bits = getattr(args, "expert_bits", None)
    if bits is None:
        return [S.expert_codec(c, "--codec").name for c in parse_list(args.codec, str, "--codec")]
    if args.codec != "affine4-g64":
        raise UsageError("--expert-bits", "give --expert-bits or --codec, not both")
    out = []
    for b in parse_list(str(bits), int, "--expert-bits"):
        if b not in S.AFFINE_BITS:
            raise UsageError("--expert-bits", f"{b}: MLX's affine widths are {', '.join(map(str, S.AFFINE_BITS))}")
        out.append(f"affine{b}-g64")
    return out


def dense_codec(args) -> str:
    b = getattr(args, "dense_bits", None)
    if b is None:
        return S.ANCHOR_CODEC
    if b not in S.AFFINE_BITS:
        raise UsageError("--dense-bits", f"{b}: MLX's affine widths are {', '.join(map(str, S.AFFINE_BITS))}")
    return f"affine{b}-g64"


def qualify_machine(layer_ms: float | None) -> dict:
    """A machine description from the profile `hebrus-mlx qualify` wrote on this machine: its SSD
    probe by queue depth and SHA-256 speed, this machine's memory; compute per layer from
    --layer-ms (qualify does not measure the model); the shipped M5 Pro 48 GB profile's synthetic
    routes and memory reserve (said so in the assumptions)."""
    from ..bench.machine import memory_bytes
    from ..machine_profile import profile_path, read_profile

    prof = read_profile()
    pread = ((prof or {}).get("io") or {}).get("pread") if isinstance((prof or {}).get("io"), dict) else None
    if not isinstance(pread, dict) or pread.get("status") != "measured":
        raise UsageError(
            "--profile",
            f"machine: no measured SSD probe in the machine profile {profile_path()} (run hebrus-mlx qualify)",
        )
    if layer_ms is None or layer_ms < 0:
        raise UsageError(
            "--layer-ms",
            "--profile machine needs the decode compute per layer in ms "
            "(e.g. from hebrus-mlx bench: 1000 / resident tok/s / layers)",
        )
    ssd = {k[2:-5]: float(v) for k, v in pread.items() if k.startswith("qd") and k.endswith("_GBps")}
    base = load_profile("m5-pro-48gb")
    runtime = _runtime_here()
    when = prof.get("created_unix")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when)) if isinstance(when, (int, float)) else "unknown"
    return {
        "name": "this machine (qualify profile)",
        "memory_gb": memory_bytes() / 1e9,
        "ssd_gbps": ssd,
        "threads": 8,
        "layer_ms": layer_ms,
        "pre_router": 0.5,
        "verify_gbps": pread.get("sha256_GBps_one_thread"),
        **_qualify_fast_check(pread, base),
        "resident_gb": base["resident_gb"],
        "dense_gb": None if runtime else base.get("dense_gb"),
        "reserve_gb": base["reserve_gb"],
        "acceptance": base["acceptance"],
        "synthetic_routes": base["synthetic_routes"],
        "status": "projection from this machine's qualify probe and a given compute per layer",
        "sources": [
            f"SSD and SHA-256: machine profile {profile_path()} (hebrus-mlx qualify, written {stamp}; "
            f"{pread.get('record_bytes')} B O_DIRECT reads)",
            f"compute: --layer-ms {layer_ms}",
        ],
        "assumptions": [
            "ASSUMPTION: pre_router 0.5, 8 reader threads",
            f"fast check {_qualify_fast_check(pread, base)['fast_check_gbps']} GB/s per core: "
            + _qualify_fast_check(pread, base)["fast_check_source"],
            "ASSUMPTION: resident/reserve GB, acceptance and synthetic routes of the shipped m5-pro-48gb profile",
        ]
        + [a for a in base["assumptions"] if "synthetic" in a]
        + runtime.get("assumptions", []),
        **{k: v for k, v in runtime.items() if k != "assumptions"},
    }


def _runtime_here() -> dict:
    """How the runtime runs on this machine where that differs from the shipped (Mac GPU)
    profiles: on the CPU device its one-token steps run the wavefront (stream.experts: on by
    default there) and decode is compute-bound, so compute is not scaled by the bytes a width
    reads: --layer-ms must be measured at the widths projected. {} on a GPU device."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return {}
    return {
        "wavefront": True,
        "expert_ms": "measure",
        "assumptions": [
            "this machine decodes on the CPU device: the runtime's wavefront is on (each routed expert "
            "computes as its record lands, resident ones first); one routed expert's compute is measured "
            "at each width (simulate.calibrate.expert_ms)",
            "compute-bound CPU decode: compute is NOT scaled by the bytes a width reads; --layer-ms is "
            "taken at the expert and dense widths projected",
        ],
    }


FAST_CHECK_KEYS = (
    "xxh3_128_GBps_one_thread",
    "fast_check_GBps_one_thread",
    "xxh3_GBps_one_thread",
)  # what qualify may name its measurement


def _qualify_fast_check(pread: dict, base: dict) -> dict:
    """The fast read check's per-core rate: qualify's measurement when the profile has one, else
    the shipped profile's public figure (said so in the assumptions)."""
    got = next((pread[k] for k in FAST_CHECK_KEYS if isinstance(pread.get(k), (int, float)) and pread[k] > 0), None)
    if got is not None:
        return {"fast_check_gbps": float(got), "fast_check_source": "measured by hebrus-mlx qualify"}
    return {
        "fast_check_gbps": base.get("fast_check_gbps"),
        "fast_check_source": "ASSUMPTION: fast check rate of the shipped m5-pro-48gb profile (qualify measured none)",
    }


# Every number a profile may give, with the range a real machine can have: a hostile or mistyped
# value (NaN, a negative rate, acceptance 2.0 which doubles the projection, 1e9 synthetic tokens
# which fills memory) is refused naming its key before anything is projected.
# key: (int?, lo, hi, lo_open); None is allowed where the key is optional in Machine.
PROFILE_NUMBERS = {
    "memory_gb": (False, 0, 1e5, False),
    "threads": (True, 1, 1024, False),
    "layer_ms": (False, 0, 1e4, False),
    "other_ms": (False, 0, 1e5, False),
    "pre_router": (False, 0, 1, False),
    "verify_gbps": (False, 0, 1e4, True),
    "fast_check_gbps": (False, 0, 1e4, True),
    "verify_extra": (False, 0, 100, False),
    "resident_gb": (False, 0, 1e5, False),
    "dense_gb": (False, 0, 1e5, False),
    "reserve_gb": (False, 0, 1e5, False),
    "acceptance": (False, 0, 0.999, False),  # --acceptance takes [0, 1): 1 would be free tokens
    "read_cpu_us": (False, 0, 1e7, False),
}
MAX_SYNTHETIC_TOKENS = 1 << 16  # the [tokens, layers, top_k] routes stay a few hundred MB at most
SYNTHETIC_ROUTES = {
    "tokens": (True, 2, MAX_SYNTHETIC_TOKENS, False),
    "warm": (True, 0, MAX_SYNTHETIC_TOKENS, False),
    "reuse": (False, 0, 1, False),
    "skew": (False, 0, 100, False),
    "seed": (True, 0, 2**32 - 1, False),
}


def _check_number(v, spec, field: str) -> None:
    import math

    integer, lo, hi, lo_open = spec
    kind = "an integer" if integer else "a finite number"
    ok = (isinstance(v, int) if integer else isinstance(v, (int, float))) and not isinstance(v, bool)
    ok = ok and math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        raise UsageError("--profile", f"{field}: must be {kind} in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")


def check_profile(d: dict, where: str) -> dict:
    """Refuse a profile whose numbers no machine has (see PROFILE_NUMBERS); returns `d`."""
    for key, spec in PROFILE_NUMBERS.items():
        if d.get(key) is not None:
            _check_number(d[key], spec, f"{where}: {key}")
    ssd = d.get("ssd_gbps")
    if not isinstance(ssd, dict) or not ssd:
        raise UsageError("--profile", f"{where}: ssd_gbps: must be an object of queue depth -> GB/s, got {ssd!r}")
    for qd, v in ssd.items():
        if not (isinstance(qd, str) and qd.isdigit() and 1 <= int(qd) <= 4096):
            raise UsageError("--profile", f"{where}: ssd_gbps: queue depth {qd!r} is not an integer in [1, 4096]")
        _check_number(v, (False, 0, 1e4, True), f"{where}: ssd_gbps.{qd}")
    if "wavefront" in d and not isinstance(d["wavefront"], bool):
        raise UsageError("--profile", f"{where}: wavefront: must be true or false, got {d['wavefront']!r}")
    em = d.get("expert_ms")
    if em is not None and em != "measure":
        _check_number(em, (False, 0, 1e4, False), f"{where}: expert_ms")
    overhead = d.get("predictor_overhead") or {}
    if not isinstance(overhead, dict):
        raise UsageError("--profile", f"{where}: predictor_overhead: must be an object, got {overhead!r}")
    for name, v in overhead.items():
        _check_number(v, (False, 0, 0.99, False), f"{where}: predictor_overhead.{name}")
    sr = d.get("synthetic_routes")
    if sr is not None:
        if not isinstance(sr, dict):
            raise UsageError("--profile", f"{where}: synthetic_routes: must be an object, got {sr!r}")
        for key, spec in SYNTHETIC_ROUTES.items():
            if key in sr:
                _check_number(sr[key], spec, f"{where}: synthetic_routes.{key}")
        if isinstance(sr.get("tokens"), int) and sr.get("warm", 0) >= sr["tokens"]:
            raise UsageError("--profile", f"{where}: synthetic_routes.warm: must be < tokens ({sr['tokens']})")
    return d


def load_profile(name: str, layer_ms: float | None = None) -> dict:
    if name == "machine":
        return check_profile(qualify_machine(layer_ms), "machine")
    path = PROFILES_DIR / f"{name}.json"
    if not path.is_file():
        path = Path(name)
    if not path.is_file():
        known = ", ".join(sorted(x.stem for x in PROFILES_DIR.glob("*.json")))
        raise UsageError("--profile", f"no profile {name!r} (shipped: {known}; or a JSON file)")
    from ..artifact.untrusted import UntrustedFileError, read_json_path

    try:  # bounded and strict: a profile or report file may come from anyone (issue 22)
        d = read_json_path(path, "json", field=str(path))
    except UntrustedFileError as e:
        raise UsageError("--profile", f"{path}: {e.message}") from None
    except OSError as e:
        raise UsageError("--profile", f"{path}: unreadable: {e}") from None
    if not isinstance(d, dict):
        raise UsageError("--profile", f"{path}: not a JSON object")
    if R.is_report(d):
        return check_profile(R.machine_profile(d, str(path), layer_ms), str(path))
    return check_profile(d, str(path))


def load_trace(path: str, geom: S.ModelGeometry) -> np.ndarray:
    """[T, L, k] routes of every sequence of a trace directory or export (hebrus_mlx.traces)."""
    try:
        from ..traces.eval import load_source
    except ImportError:
        raise UsageError("--trace", "this build has no route-trace reader (hebrus_mlx.traces.eval)") from None
    identity, seqs, _, _ = load_source(path)
    ne = identity["num_experts"] if isinstance(identity, dict) else identity.num_experts
    if ne != geom.num_experts:
        raise UsageError("--trace", f"recorded with {ne} experts per layer, --family has {geom.num_experts}")
    topk = np.concatenate([t for _, t in seqs]) if seqs else np.zeros((0, geom.num_layers, geom.top_k))
    if topk.shape[1:] != (geom.num_layers, geom.top_k):
        raise UsageError("--trace", f"routes are {topk.shape[1:]}, the model has ({geom.num_layers}, {geom.top_k})")
    return topk.astype(np.int64)


def _trace_routes(args, fam):
    """[T, L, k] routes of --trace (None without one), checked against the family's geometry."""
    if not args.trace:
        return None
    return load_trace(args.trace, S.geometry_of_family(fam))


def _measured_shares(prof: dict, fam, codecs) -> dict:
    """The routed experts' share of a layer's compute per width from one expert's compute (given,
    or measured now: "measure") over --layer-ms; said in the profile's sources."""
    from .calibrate import expert_ms

    shares = {}
    for codec in codecs:
        given = prof["expert_ms"]
        ms = expert_ms(fam, codec) if given == "measure" else float(given)
        shares[codec] = min(1.0, ms * fam.num_experts_per_tok / prof["layer_ms"]) if prof["layer_ms"] else 0.0
        how = "measured now" if given == "measure" else "given"
        prof.setdefault("sources", []).append(
            f"experts' share of a layer at {codec}: {fam.num_experts_per_tok} x {ms:.2f} ms per routed expert "
            f"({how}) / {prof['layer_ms']:g} ms = {shares[codec]:.2f}"
        )
    return shares


def add_predictor_recall(prof: dict, given: str | None, predictors: str) -> dict:
    """--predictor-recall NAME=RECALL[/PRECISION],...: entries of the profile's predictor table
    (the one --predictors reads), e.g. a recall and precision the runtime's counters measured."""
    if not given:
        return prof
    from . import projection as P

    ahead = [p for p in P.RUNTIME_PREFETCH if S.prefetch_kind(p)[0] == "ahead"]
    field_name = "predictors" if predictors == "peer" else "synthetic_predictors"
    table = dict(prof.get(field_name) or {})
    for item in parse_list(given, str, "--predictor-recall"):
        name, eq, value = item.partition("=")
        recall, _, precision = value.partition("/")
        try:
            spec = {"recall": float(recall), "source": "--predictor-recall"}
            if precision:
                spec["precision"] = float(precision)
        except ValueError:
            raise UsageError("--predictor-recall", f"NAME=RECALL[/PRECISION], got {item!r}") from None
        if not eq or not name:
            raise UsageError("--predictor-recall", f"NAME=RECALL[/PRECISION], got {item!r}")
        if name not in ahead:
            raise UsageError("--predictor-recall", f"{name}: not one of {', '.join(ahead)}")
        if not 0.0 <= spec["recall"] <= 1.0 or not 0.0 < spec.get("precision", 1.0) <= 1.0:
            raise UsageError("--predictor-recall", f"{name}: recall in [0, 1], precision in (0, 1], got {value!r}")
        table[name] = spec
    return {**prof, field_name: table}


def project_profile(args, memo=None, progress=True) -> dict:
    """One profile's projection at each --codec (expert width); see `projection`."""
    from ..artifact import constants as C
    from . import projection as P

    prof = load_profile(args.profile, args.layer_ms)
    prof = add_predictor_recall(prof, getattr(args, "predictor_recall", None), args.predictors)
    where = f"profile {args.profile}"
    check = "off" if args.no_verify else args.check
    fam = C.family(args.family, "--family")
    prof = R.check_family(prof, fam.name)
    codecs = expert_codecs(args)
    dense = dense_codec(args)
    memo = memo or P.Memo()
    dense_gb = P.dense_gb(prof, where)
    # The dense weights at --dense-bits take their share of the resident memory at that width.
    resident = float(prof.get("resident_gb", 0.0))
    if dense_gb is not None:
        resident += dense_gb * (S.bits_per_weight(dense) / S.bits_per_weight(S.ANCHOR_CODEC) - 1)
    # The experts' share of a layer per width (measured ones first: the machine lists the sources).
    if prof.get("expert_ms") is not None:
        shares = _measured_shares(prof, fam, codecs)
    else:
        shares = {codec: S.expert_share(fam, dense_gb, codec, dense) for codec in codecs}
    machine = P.machine_of(prof, where, check)
    budget = (machine.memory_gb or 0) - resident - float(prof.get("reserve_gb", 0))
    given = parse_list(args.cache_gb, flags.gib(), "--cache-gb") if args.cache_gb else None
    acceptance = args.acceptance if args.acceptance is not None else float(prof.get("acceptance", 0.0))
    policies = parse_list(args.policies, str, "--policies")
    for pol in policies:  # before any replay starts (and its progress bar)
        if pol not in cachesim.POLICIES:
            raise UsageError("policy", f"unknown {pol!r}; choose from {', '.join(cachesim.POLICIES)}")
    depths = parse_list(args.draft_depths, flags.integer(0, 64), "--draft-depths")
    if min(depths) < 0:
        raise UsageError("--draft-depths", f"must be >= 0, got {min(depths)}")
    trace = _trace_routes(args, fam)
    plans = []
    for codec in codecs:
        geom = S.geometry_of_family(fam, codec, resident)
        inp = P.inputs_of(prof, geom, args.predictors, memo, trace, args.trace or "")
        pfs = list(S.PREFETCH) + list(inp.predicted) + list(inp.gains)
        plans.append(
            (codec, geom, inp, P.cache_sizes(budget, given, geom), pfs, S.compute_scale(fam, dense_gb, codec, dense))
        )
    total = sum(S.replays_needed(c, policies, pfs, inp.gains, depths) for _, _, inp, c, pfs, _ in plans)
    bar = None
    if progress and not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"simulate {args.profile}", unit="replay", file=sys.stderr)
    out = []
    try:
        for codec, geom, inp, caches, pfs, scale in plans:

            def run(chk, geom=geom, codec=codec, inp=inp, caches=caches, pfs=pfs, scale=scale):
                return P.project_one(
                    prof,
                    where,
                    geom,
                    codec,
                    chk,
                    inp,
                    caches,
                    policies,
                    pfs,
                    depths,
                    acceptance,
                    memo,
                    bar.update if bar else None,
                    compute_scale=scale,
                    expert_share=shares[codec],
                )

            rows = run(check)
            # The same configurations unchecked: what the record check costs in each.
            unchecked = {
                (r.cache_gb, r.policy, r.prefetch, r.draft_depth): r for r in (rows if check == "off" else run("off"))
            }
            out.append(_codec_result(P, codec, geom, inp, rows, unchecked, budget))
            if out[-1]["default"] is not None and check != "off":
                out[-1]["batches"] = _batches(P, prof, where, check, scale, shares[codec], geom, inp, out[-1], memo)
            out[-1].update(P.width_note(prof, machine, fam, codec, dense, scale))
    finally:
        if bar:
            bar.update(max(bar.total - bar.n, 0))  # replays shared with an earlier projection were not rerun
            bar.close()
    first = out[0]
    return {
        "profile": prof,
        "machine": machine.to_dict(),
        "geometry": first["geometry"],
        "routes": plans[0][2].routes,
        "cache_budget_gb": budget,
        "dense_codec": dense,
        "resident_gb": resident,
        "check": check,
        "predictors": args.predictors,
        "rows": first["rows"],
        "best": first["best"],
        "by_codec": out,
        "status": "PROJECTION (not a measurement)",
    }


def _codec_result(P, codec, geom, inp, rows, unchecked, budget) -> dict:
    if not P.exposed_settings(rows):  # no recommendation without the loader's own policy
        best = S.best(rows)
        return {
            "codec": codec,
            "geometry": geom.__dict__,
            "rows": [r.to_dict() for r in rows],
            "best": best.to_dict(),
            "best_flags": None,
            "default": None,
            "notes": inp.notes,
        }
    best = P.recommend(rows)
    default = P.default_setting(rows, budget)
    off = (
        None
        if default is None
        else next(
            (
                r
                for r in rows
                if (r.cache_gb, r.policy, r.prefetch, r.draft_depth) == (default.cache_gb, default.policy, "off", 0)
            ),
            None,
        )
    )

    def check_ms(p):
        u = unchecked[(p.cache_gb, p.policy, p.prefetch, p.draft_depth)]
        return max(p.exposed_ms - u.exposed_ms, 0.0)

    return {
        "codec": codec,
        "geometry": geom.__dict__,
        "rows": [r.to_dict() for r in rows],
        "best": best.to_dict(),
        "best_flags": P.flags(best),
        "best_limit": P.limiting_term(best, check_ms(best)),
        "default": None if default is None else default.to_dict(),
        "default_flags": None if default is None else P.flags(default),
        "default_limit": None if default is None else P.limiting_term(default, check_ms(default)),
        "default_check_ms": None if default is None else check_ms(default),
        "default_gain": None if off is None else default.tok_s / off.tok_s,
        "notes": inp.notes,
    }


def _batches(P, prof, where, check, scale, share, geom, inp, result, memo) -> list[dict]:
    """The defaults' cache at 1, 2, 4, 8 concurrent requests (projection.batch_section)."""
    machine = P.runtime_machine(prof, where, check, scale, share)
    cache = result["default"]["cache_gb"]
    rows = S.project_batches(
        machine, geom, inp.topk, cache, P.BATCHES, inp.warm, P.RUNTIME_POLICY, result["codec"], memo.replays
    )
    plain = S.project_batches(
        dataclasses.replace(machine, check="off"),
        geom,
        inp.topk,
        cache,
        P.BATCHES,
        inp.warm,
        P.RUNTIME_POLICY,
        result["codec"],
        memo.replays,
    )
    out = []
    for b, p, u in zip(P.BATCHES, rows, plain):
        d = p.to_dict()
        d["union"] = S.batch_union(inp.topk, b)
        d["limit"] = P.limiting_term(p, max(p.exposed_ms - u.exposed_ms, 0.0))
        out.append(d)
    return out


def print_projection(res: dict) -> None:
    from . import projection as P

    m = res["machine"]
    rate = {"fast": m.get("fast_check_gbps"), "sha256": m.get("verify_gbps")}.get(res["check"])
    print(
        f"PROJECTION for {m['name']} (not a measurement); routes: {res['routes']}; record check: "
        f"{P.CHECK_NAMES[res['check']]}"
        + (f" at {rate:g} GB/s per reader core" if rate else "")
        + f"; predictors: {res['predictors']}; expert cache budget {res['cache_budget_gb']:.1f} GiB"
    )
    for c in res["by_codec"]:
        g = c["geometry"]
        rows = [S.Projection(**r) for r in c["rows"]]
        print(
            f"\n{g['name']} ({g['num_layers']} layers, {g['num_experts']} experts top-{g['top_k']}, "
            f"{g['record_bytes']:,} B records) with {c['codec']} experts; the fastest configuration at each "
            "cache size:"
        )
        per_cache = []
        for gb in sorted({r.cache_gb for r in rows}):  # the best configuration at each cache size, as recommended
            at = [r for r in rows if r.cache_gb == gb]
            per_cache.append(
                P.recommend(at)
                if P.exposed_settings(at)
                else max(
                    (r for r in at if r.policy != "belady"),
                    key=lambda r: r.tok_s,
                    default=max(at, key=lambda r: r.tok_s),
                )
            )
        print(P.table(per_cache))
        if c.get("compute_note"):
            print(c["compute_note"])
        bounds = [r for r in rows if r.policy != P.RUNTIME_POLICY]
        if bounds:
            b = max(bounds, key=lambda r: r.tok_s)
            print(f"comparison only (no flag selects policy {b.policy}): {b.tok_s:.2f} tok/s at {b.cache_gb:g} GiB")
        if c["default"]:
            d = S.Projection(**c["default"])
            gain = "" if c.get("default_gain") is None else f" (x{c['default_gain']:.2f} over --prefetch off)"
            print(
                f"runtime defaults ({c['default_flags']}, no draft model): {d.tok_s:.2f} tok/s{gain}; limited by "
                f"{c['default_limit']}"
            )
        b = S.Projection(**c["best"])
        if not c["best_flags"]:
            print(
                f"no recommendation: the loader's arena policy ({P.RUNTIME_POLICY}) was not swept (--policies); "
                f"fastest swept: {b.tok_s:.2f} tok/s at {b.cache_gb:g} GiB with {b.policy}"
            )
            continue
        print(
            f"recommended: {c['best_flags']} -> {b.tok_s:.2f} tok/s (hit rate {b.hit_rate:.1%}, "
            f"{b.bytes_per_token / 1e6:.0f} MB/token, exposed reads {b.exposed_ms:.1f} ms/token; {b.basis}); "
            f"limited by {c['best_limit']}"
        )
    for n in res["by_codec"][0]["notes"]:
        print(f"  - predictor {n}")
    for a in m["assumptions"]:
        print(f"  - {a}")


# The expert widths of the table: the default (4-bit) and the narrow widths recommended for 48-64 GB Macs
# (sized from MLX's affine layout where the format does not register them yet).
TABLE_CODECS = ("affine4-g64", "affine3-g64", "affine2-g64")
WHATIF_DENSE = "affine3-g64"  # the goal section's "what would move it": dense weights at 3 bits too
TABLE_CHECKS = ("fast", "sha256", "off")


def table_results(args, profiles=None, codecs=None) -> list[dict]:
    """Every (profile, check) projection of the table, all expert widths in each; replays shared."""
    from . import projection as P

    profiles = profiles or sorted(x.stem for x in PROFILES_DIR.glob("*.json"))
    codecs = codecs or list(TABLE_CODECS)
    memo = P.Memo()
    out = []
    for name in profiles:
        for check in TABLE_CHECKS:
            a = SimpleNamespace(
                **dict(vars(args), profile=name, codec=",".join(codecs), check=check, no_verify=False, trace=None)
            )
            if not args.quiet:
                print(f"{name}, check {check} ...", file=sys.stderr, flush=True)
            out.append({"profile_name": name, "check": check, "result": project_profile(a, memo)})
    return out


def whatif_results(args, profiles=None, codecs=None) -> list[dict]:
    """The goal profiles with their dense weights at 3 bits as well (fast check): what less
    compute per token would give (the table's own rows keep the dense weights at 4 bits)."""
    from . import projection as P

    out = []
    memo = P.Memo()
    for name in profiles or sorted(P.GOALS):
        a = SimpleNamespace(
            **dict(
                vars(args),
                profile=name,
                codec=",".join(codecs or TABLE_CODECS),
                check="fast",
                no_verify=False,
                trace=None,
                expert_bits=None,
                dense_bits=int(WHATIF_DENSE[6 : WHATIF_DENSE.index("-")]),
            )
        )
        if not args.quiet:
            print(f"{name}, dense {WHATIF_DENSE}, check fast ...", file=sys.stderr, flush=True)
        out.append({"profile_name": name, "check": "fast", "result": project_profile(a, memo)})
    return out


def write_table(args) -> dict:
    """`simulate --table FILE`: the markdown table of every shipped profile x width x check."""
    from ..output_files import write_text_atomic
    from . import projection as P

    if (
        args.trace
        or args.cache_gb
        or args.profile != "m5-pro-48gb"
        or args.no_verify
        or args.check != "fast"
        or args.expert_bits is not None
        or args.dense_bits is not None
        or args.codec != "affine4-g64"
    ):
        raise UsageError(
            "--table",
            "tabulates every shipped profile, width and check with their defaults: give no "
            "--profile/--trace/--cache-gb/--check/--codec/--expert-bits/--dense-bits",
        )
    results = table_results(args)
    whatif = whatif_results(args)
    text = P.render_doc(
        results, TABLE_COMMAND + ("" if args.predictors == "peer" else " --predictors synthetic"), whatif
    )
    write_text_atomic(args.table, text, field="--table", overwrite=args.overwrite)
    print(text, end="")
    return {"table": args.table, "results": results, "whatif": whatif}


TABLE_COMMAND = "hebrus-mlx simulate --table docs/PROJECTION.md"


# ---- validation on this machine ------------------------------------------------------------------


class _PredictionRecorder:
    """Stands in for the model's Streaming while routes are recorded on the resident model: at
    each layer's router it runs the engine's own Predictor for every --prefetch kind asked for
    and keeps the candidates it would have hinted (one-token forwards only, as the engine)."""

    experts = None
    engine = None
    max_chunk_tokens = None

    def __init__(self, layers, top_k: int, kinds):
        from ..stream.predict import Predictor, parse_prefetch

        self.predictors = {k: Predictor(parse_prefetch(k), layers, top_k) for k in kinds}
        self.rows: dict = {}

    def layer_start(self, layer, x):
        return x

    def before_router(self, layer, streams, x):
        for k, p in self.predictors.items():
            r = p.predict(layer, streams, x)
            if r is not None:
                self.rows.setdefault(k, {})[r[0]] = r[1]
        return x


def record_routes(model, prompt: list[int], n: int, kinds=()):
    """Greedy routes of the bench's own run, recorded on the resident model: (prompt routes
    [P-1, L, k] as the warm prefix, decode routes [n, L, k], tokens, {kind: predicted sets
    [n, L, B] (-1: none)} for the ahead predictors in `kinds`)."""
    import mlx.core as mx

    from ..models.qwen4exp import Capture

    L = model.args.num_hidden_layers
    k = model.args.num_experts_per_tok
    cache = model.make_cache()
    kinds = [x for x in kinds if S.prefetch_kind(x)[0] == "ahead"]
    rec = _PredictionRecorder(model.model.layers, k, kinds) if kinds else None

    def fwd(ids):
        cap = Capture()
        if rec is not None:
            rec.rows = {}
        logits = model(mx.array([ids]), cache, capture=cap)
        routes = mx.stack([cap.routes[l][0] for l in range(L)], axis=1)  # [len, L, k]
        mx.eval(logits, routes, *[a for r in (rec.rows.values() if rec else ()) for a in r.values()])
        return logits, np.array(routes)

    warm = np.zeros((0, L, k), np.int64)
    if len(prompt) > 1:
        _, warm = fwd(prompt[:-1])
    tok, out, toks = prompt[-1], [], []
    preds = {x: [] for x in kinds}
    saved = model.streaming
    model.streaming = rec
    try:
        for _ in range(n):
            logits, r = fwd([tok])
            out.append(r[0])
            for x in kinds:
                row = np.full((L, k), -1, np.int64)
                for l, c in rec.rows.get(x, {}).items():
                    row[l, : c.size] = np.array(c).astype(np.int64)[:k]
                row[row >= model.args.num_experts] = -1  # below the threshold: skipped
                preds[x].append(row)
            tok = int(mx.argmax(logits[0, -1]).item())
            toks.append(tok)
    finally:
        model.streaming = saved
    return warm.astype(np.int64), np.stack(out).astype(np.int64), toks, {x: np.stack(v) for x, v in preds.items()}


def validate(args) -> dict:
    from ..bench import harness as H
    from ..bench import run as B
    from ..loader import load, resolve_model_path
    from . import calibrate as K

    load0, clock0 = K.load_average(), K.cpu_clock()
    path = resolve_model_path(args.model)
    rows = parse_list(args.rows or "8,16,64,192", flags.integer(1), "--rows")
    model, tok = load(str(path))
    if model.streaming is not None:
        raise UsageError("--model", "validation records routes on the resident model; this one streams")
    modes = parse_list(args.prefetch_modes, str, "--prefetch-modes")
    for m in modes:
        S.prefetch_kind(m)
    prompt = H.prompt_ids(tok, args.prompt_tokens, 0)
    warm1, decode, toks, preds = record_routes(model, prompt, args.gen_tokens, modes)
    L, E, k = model.args.num_hidden_layers, model.args.num_experts, model.args.num_experts_per_tok
    from ..bench.machine import expert_store

    st = expert_store(path)
    if st is None:
        raise UsageError("--model", "validation needs an artifact with an expert store")
    total = L * E
    if min(rows) < k or max(rows) > total:
        raise UsageError("--rows", f"arena rows must be in [{k}, {total}]")
    gb = lambda r: r * st["record_bytes"] / S.GIB  # noqa: E731
    # Compute: every record cached, once per predictor (an ahead predictor's extra router / mix
    # per layer is compute the streamed run pays too).
    # Run order: per predictor its all-cached run, its streamed runs, and a second all-cached run
    # (a label of its own: 1e-9 GB more, the same rows), so each streamed run's compute is the
    # two all-cached runs that bracket it in time, interpolated to its place (the bench reverses
    # every other round, the places stay symmetric). The load of a shared machine moves in
    # seconds: a compute run 20 runs away measures another machine.
    predictors = ["off"] + [m for m in modes if m != "off"]
    hot = {pf: {"expert-cache-gb": f"{gb(total):.9f}", "prefetch": pf} for pf in predictors}
    hot2 = {pf: {"expert-cache-gb": f"{gb(total) + 1e-9:.9f}", "prefetch": pf} for pf in predictors}
    streamed = [{"expert-cache-gb": f"{gb(r):.9f}", "prefetch": pf} for r in rows for pf in modes]
    configs = []
    for pf in predictors:
        configs += [hot[pf], *[c for c in streamed if c["prefetch"] == pf], hot2[pf]]
    bench = B.run_bench(
        args.model,
        [args.prompt_tokens],
        [args.gen_tokens],
        configs,
        repeats=args.repeats,
        warmup=1,
        progress=not args.quiet,
        timeline=False,
    )
    bench_tokens = bench["runs"][0]["tokens"]
    if bench_tokens != toks:
        raise H.NotComparableError("tokens", "the recorded routes' greedy tokens differ from the bench's")
    # The disk as the engine reads this store (its arena layout decides O_DIRECT or buffered, its
    # readers check every record), probed next to the runs, once before and once after them.
    probes = [bench_probe(path, st, L, E, seed) for seed in (0, 1)]
    probe = _median_probe(probes)
    med = {s["config"]: s["metrics"] for s in bench["summary"]}
    # Per-token medians on both sides (robust to other processes on a shared machine).
    compute_s = statistics.median(
        1.0 / r["decode_tok_s_p50"] for r in bench["runs"] if r["config"] in (H.label(hot["off"]), H.label(hot2["off"]))
    )
    machine = S.Machine(
        name="this machine (measured)",
        ssd_gbps={int(q): v for q, v in probe["gbps_by_qd"].items()},
        layer_s=compute_s / L,
        threads=8,
        verify_gbps=None,
        read_cpu_us=probe["cpu_us_per_record"],
        check="off",
        assumptions=[
            "compute: the same model with every record cached, per predictor, measured in the same interleaved rounds",
            "pre_router 0.5 (assumption)",
            f"reads: {probe['source']} (its record checks included)",
            "reader CPU time taken from compute (the CPU backend computes on every core)",
            f"a hint batch's reads landed before its next hint: {probe.get('batch_landed', 0.0):.0%} (probed)",
        ],
    )
    geom = S.ModelGeometry(str(args.model), L, E, k, st["record_bytes"])
    batch_landed = probe.get("batch_landed", 0.0)
    # The arena persists across the bench's runs: before a timed run come the warm-up and earlier
    # runs of the same tokens; the replay sees the prompt and one earlier run of this config.
    prompt_and_prev = np.concatenate([warm1, decode, warm1])
    none = np.full((len(warm1), L, k), -1, np.int64)
    # Paired by round (the schedule runs every configuration once per round): each run is predicted
    # from the compute measured in its own round, so a slow patch of the shared machine moves the
    # prediction and the measurement together; the per-configuration ratio is the median over rounds.
    n = len(configs)
    rounds = [bench["runs"][i : i + n] for i in range(0, len(bench["runs"]), n)]
    out = []
    for c in streamed:
        label = H.label(c)
        base, base2 = H.label(hot[c["prefetch"]]), H.label(hot2[c["prefetch"]])
        group = [H.label(x) for x in configs if x["prefetch"] == c["prefetch"]]
        at = group.index(label) / (len(group) - 1)  # its place between the two all-cached runs
        cap = _arena_rows(bench, label)
        pred = preds.get(c["prefetch"])
        if pred is not None:  # the prompt's forward predicts nothing (one-token forwards only)
            pred = np.concatenate([none, pred, none, pred])
        # Hints of one batch that land before its next hint is requested are evictable by it
        # (probed through the engine, not taken from these runs).
        rep = S.replay(
            decode, E, cap, "clock", c["prefetch"], prompt_and_prev, predicted=pred, batch_landed=batch_landed
        )
        preds_s, meas, ratios = [], [], []
        for rnd in rounds:
            a, b = (1.0 / next(r for r in rnd if r["config"] == x)["decode_tok_s_p50"] for x in (base, base2))
            run = next(r for r in rnd if r["config"] == label)["decode_tok_s_p50"]
            mach = dataclasses.replace(machine, layer_s=(a + (b - a) * at) / L)
            p = S.project(
                mach,
                geom,
                rep,
                cache_gb=float(c["expert-cache-gb"]),
                capacity=cap,
                policy="clock",
                prefetch="off" if c["prefetch"] == "off" else c["prefetch"],
            )
            preds_s.append(p.tok_s)
            meas.append(run)
            ratios.append(p.tok_s / run)
        comp = statistics.median(1.0 / r["decode_tok_s_p50"] for r in bench["runs"] if r["config"] in (base, base2))
        p = S.project(
            dataclasses.replace(machine, layer_s=comp / L),
            geom,
            rep,
            cache_gb=float(c["expert-cache-gb"]),
            capacity=cap,
            policy="clock",
            prefetch=c["prefetch"],
        )
        m = med[label]
        cnt = _median_counters([r for r in bench["runs"] if r["config"] == label], len(decode) - 1)
        out.append(
            K.validation_row(
                label,
                cap,
                preds_s,
                meas,
                ratios,
                rep,
                p,
                m["decode_tok_s_p50"]["spread"],
                cnt,
                c["prefetch"],
                comp,
                (m["hit_rate"] or {}).get("median"),
                ((m.get("expert_bytes_per_token") or {}).get("median") or 0) / 1e6,
                st.get("record_payload_bytes"),
            )
        )
    load1 = K.load_average()
    return {
        "machine": machine.to_dict(),
        "bench_machine": bench["machine"],
        "own_load": K.own_load(clock0),
        "compute_ms_per_token": compute_s * 1e3,
        "probe": probe,
        "probe_source": probe["source"],
        "runs": out,
        "worst": max(abs(r["ratio"] - 1) for r in out),
        "token_records": L * k,
        "repeats": args.repeats,
        "stack": f"model {args.model}",
        "pairing": "the two all-cached runs of its predictor that bracket it in its round (interpolated to its place)",
        "load_average": [load0, load1],
        "command": K.command_line(args),
    }


def bench_probe(path, st, L, E, seed) -> dict:
    """engine_probe on the artifact's store through a loader-laid-out arena of 16 rows."""
    from . import calibrate as K

    resolve, close = K.artifact_resolver(path, 16)
    try:
        out = K.engine_probe(resolve, L, E, st["record_bytes"], batches=6, seed=seed)
    finally:
        close()
    hint, reads, close = K.artifact_hinter(path, 16)
    try:
        out["hints"] = K.hint_probe(hint, reads, L, E, min(4, E), seed=seed)
    finally:
        close()
    return out


def _median_probe(probes: list[dict]) -> dict:
    out = dict(probes[0])
    out["gbps_by_qd"] = {q: statistics.median(p["gbps_by_qd"][q] for p in probes) for q in probes[0]["gbps_by_qd"]}
    out["cpu_us_per_record"] = statistics.median(p["cpu_us_per_record"] for p in probes)
    if all("hints" in p for p in probes):
        out["batch_landed"] = statistics.median(p["hints"]["batch_landed"] for p in probes)
    out["source"] = probes[0]["source"] + f" (median of {len(probes)} probes, before and after the runs)"
    return out


def _median_counters(runs: list[dict], tokens: int) -> dict:
    """Per-token medians over a configuration's runs of the engine counters the replay predicts."""
    keys = ("exact_misses", "predicted_reads", "predicted_hits", "predicted_joins", "exposed_wait_ns")
    got = [r.get("engine_counters") or {} for r in runs]
    return {k: statistics.median(g.get(k, 0) for g in got) / max(tokens, 1) for k in keys}


def _arena_rows(bench, label):
    """Arena rows the loader gave this configuration (recorded by each run)."""
    return next(r["arena_rows"] for r in bench["runs"] if r["config"] == label)


def print_validation(v: dict) -> None:
    from . import calibrate as K

    m = v["machine"]
    pct = lambda x: "n/a" if x is None else f"{x:.0%}"  # noqa: E731
    num = lambda x, f=".2f": "n/a" if x is None else format(x, f)  # noqa: E731
    print(
        f"simulate --validate: the model's prediction of runs on THIS machine next to their measurement "
        f"({v.get('stack', '')})"
    )
    if v.get("command"):
        print(f"command: {v['command']}")
    if v.get("load_average"):
        print(K.quiet_note(*v["load_average"], own=v.get("own_load")))
    print(
        f"inputs measured here: compute {v['compute_ms_per_token']:.2f} ms/token with every record cached "
        f"(per predictor, in the same rounds); {m['pre_router']:.0%} of a layer before its router; reads "
        + R.ssd_rates(m["ssd_gbps"], ".3f")
        + (f", reader CPU {m['read_cpu_us']:.0f} us per record taken from compute" if m.get("read_cpu_us") else "")
        + (f" [{v['probe_source']}]" if v.get("probe_source") else "")
        + (
            f"; of a hint batch's reads {v['probe']['batch_landed']:.0%} landed before its next hint was requested "
            "(probed; the replay lets later hints of the batch displace those)"
            if (v.get("probe") or {}).get("batch_landed") is not None
            else ""
        )
    )
    timing = v.get("timing", "tok/s = 1 / the median inter-token time")
    pairing = v.get("pairing", "its own round's compute run")
    print(
        f"method: {v['repeats']} interleaved rounds; {timing}; each run predicted "
        f"from {pairing}; pred/meas = the median over rounds (their range in brackets); counters "
        "per decode token from the engine (stream.engine.counters), medians over the rounds"
    )
    cols = [
        "configuration",
        "arena rows",
        "tok/s pred",
        "tok/s meas (spread)",
        "pred/meas [rounds]",
        "exact misses/token pred / meas",
        "reads ahead/token pred / meas",
        "timely recall pred / meas",
        "late recall pred / meas",
        "hit rate pred / meas",
        "MB read/token pred / meas",
        "exposed wait ms/token pred / meas",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in v["runs"]:
        lo, hi = K.ratio_spread(r.get("ratios_by_round") or [r["ratio"]])
        print(
            f"| {r['config']} | {r['rows']} | {r['predicted_tok_s']:.2f} | {r['measured_tok_s']:.2f} "
            f"(±{r['spread']:.0%}) | {r['ratio']:.2f} [{lo:.2f}-{hi:.2f}] | "
            f"{num(r.get('predicted_exact_misses'), '.1f')} / {num(r.get('measured_exact_misses'), '.1f')} | "
            f"{num(r.get('predicted_reads_ahead'), '.1f')} / {num(r.get('measured_reads_ahead'), '.1f')} | "
            f"{pct(r.get('predicted_timely_recall'))} / {pct(r.get('measured_timely_recall'))} | "
            f"{pct(r.get('predicted_late_recall'))} / {pct(r.get('measured_late_recall'))} | "
            f"{pct(r['predicted_hit_rate'])} / {pct(r['measured_hit_rate'])} | "
            f"{num(r.get('predicted_mb_per_token'), '.1f')} / {num(r.get('measured_mb_per_token'), '.1f')} | "
            f"{r['predicted_exposed_ms']:.2f} / {num(r['measured_exposed_ms'])} |"
        )
    ratios = [x for r in v["runs"] for x in (r.get("ratios_by_round") or [r["ratio"]])]
    spread = statistics.median(r["spread"] for r in v["runs"])
    load = v.get("load_average") or [None, None]
    loads = "unknown" if None in load else f"{load[0][0]:.1f} -> {load[1][0]:.1f}"
    per = K.min_median_max([r["ratio"] for r in v["runs"]])
    rnd = K.min_median_max(ratios)
    tr = v.get("token_records")
    big = [r for r in v["runs"] if tr and r["rows"] >= tr]
    # Below one token's routed records every layer evicts what the next token needs and predictions
    # in flight hold rows: the replay (no time) is least exact there, so those runs are also left out.
    part = (
        f"; arenas of at least one token's {tr} records: worst {100 * max(abs(r['ratio'] - 1) for r in big):.1f}% "
        f"over {len(big)} runs"
        if tr and 0 < len(big) < len(v["runs"])
        else ""
    )
    gaps = []
    for key, name in (("exact_misses", "exact misses"), ("reads_ahead", "reads ahead")):
        d = [
            (abs(r[f"predicted_{key}"] - r[f"measured_{key}"]), r["config"])
            for r in v["runs"]
            if r.get(f"predicted_{key}") is not None and r.get(f"measured_{key}") is not None
        ]
        if d:
            gap, at = max(d)
            gaps.append(f"{name} worst |pred - meas| {gap:.1f}/token ({at})")
    if gaps:
        print("engine counters: " + "; ".join(gaps))
    print(
        f"validation: worst |predicted/measured - 1| = {100 * v['worst']:.1f}% over {len(v['runs'])} runs "
        f"(pred/meas min/median/max: per run {per}, per round {rnd}; median measured spread ±{spread:.0%}, "
        f"load average {loads}){part}"
    )
