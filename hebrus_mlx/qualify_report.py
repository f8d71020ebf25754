"""`hebrus-mlx qualify --report FILE`: one self-contained file a user attaches to an issue.

FILE (JSON) and FILE with a .md suffix (a short summary) hold, for this machine and the artifact
given with --artifact (default: the demo):
- identity: OS release, architecture, chip, cores, memory, Python, MLX and its compute backend, the
  Metal device's name where there is one, what this build of the extension has (read backends,
  SHA-256 implementation, GPU-event path);
- kernels: each Metal kernel against its ops path, and streaming: GPU-event vs CPU-stream streaming
  (the profile's sections; "not qualified on this machine" without a Metal device, as qualify says);
- ssd: the artifact's own expert store read at its record size, queue depth 1/8/32, page cache
  bypassed (O_DIRECT; F_NOCACHE on macOS) - read only, the store is never written;
- hashes: SHA-256 (hashlib and the engine's) and the fast per-record check's rate, one thread;
- decode: a short resident decode of the artifact (prefill and decode tok/s, compute per layer)
  and streamed decodes at two expert-cache sizes (hit rate, exposed I/O wait, bytes per token), run
  interleaved with identical greedy tokens, plus the routes those runs took, so that
  `hebrus-mlx simulate --validate --report FILE` can replay them and compare its prediction with
  what was measured, and `simulate --profile FILE` can project from this machine.

No prompt, path, user or host name is written: the prompt is the bench's deterministic token IDs
(never their text), tokens are kept only as a digest, paths are left out, and every string is
scrubbed of the home directory, user, host name, working and temporary directories before writing.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

SCHEMA = "hebrus-mlx/qualify-report/1"
NOT_AVAILABLE = "not available in this build"
PROMPT_TOKENS = 32
CACHE_FRACTIONS = (0.1, 0.3)  # of the expert store: a small and a medium expert cache
REDACTED = "<redacted>"


def parse_caches(s: str) -> list[float]:
    from . import flags
    from .errors import UsageError

    v = flags.items(s, "--report-cache-gb", flags.gib())  # NaN, inf and 1e300 refused too
    if len(v) != 2 or min(v) <= 0 or v[0] == v[1]:
        raise UsageError("--report-cache-gb", f"expected two different positive sizes, got {s!r}")
    return sorted(v)


# ---- what must never be written -------------------------------------------------------------------


def secrets(extra: Iterable[str] = ()) -> list[str]:
    """Strings that identify the user or their files: home, user and host names, the working and
    temporary directories, and `extra` (the artifact's and probe's paths, the prompt's text)."""
    out = set()
    for s in (
        str(Path.home()),
        os.environ.get("USER"),
        os.environ.get("LOGNAME"),
        os.environ.get("USERNAME"),
        socket.gethostname(),
        platform.node(),
        os.getcwd(),
        tempfile.gettempdir(),
        *extra,
    ):
        if s and len(str(s).strip()) >= 2 and str(s) not in ("/", "."):
            out.add(str(s))
    try:
        import getpass

        out.add(getpass.getuser())
    except (KeyError, OSError):
        pass
    # Longest first, so a path is replaced whole before a name inside it.
    return sorted((s for s in out if len(s) >= 2), key=len, reverse=True)


def scrub(obj, words: list[str]):
    """`obj` with every occurrence of each word replaced (names as whole words only, so a user
    called "cpu" does not blank out "cpu_stream"); keys are scrubbed too."""
    pats = [
        re.compile(re.escape(w) if "/" in w or "\\" in w else rf"(?<![A-Za-z0-9_]){re.escape(w)}(?![A-Za-z0-9_])")
        for w in words
    ]

    def s(x: str) -> str:
        for p in pats:
            x = p.sub(REDACTED, x)
        return x

    if isinstance(obj, dict):
        return {s(str(k)): scrub(v, words) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, words) for v in obj]
    if isinstance(obj, str):
        return s(obj)
    return obj


def _pick(entry, keys) -> dict:
    return {k: entry[k] for k in keys if isinstance(entry, dict) and k in entry}


# ---- sections ----------------------------------------------------------------------------------------


def _version(metadata):
    try:
        return metadata.version("hebrus-mlx")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        return None


def identity() -> dict:
    """The machine and this build, without the host or user name."""
    from importlib import metadata

    import mlx.core as mx

    from .bench.machine import chip, memory_bytes
    from .machine_profile import compute_backend, metal_device
    from .stream import engine

    ident = {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "macos": platform.mac_ver()[0] or None,
        "chip": chip(),
        "cpus": os.cpu_count(),
        "memory_gb": memory_bytes() / 2**30,
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "hebrus_mlx": _version(metadata),
        "backend": compute_backend(),
        "default_device": str(mx.default_device()),
        "metal_build": bool(hasattr(mx, "metal") and mx.metal.is_available()),
    }
    if metal_device():
        info = mx.device_info(mx.gpu)
        ident["metal_device"] = _pick(
            info, ("device_name", "architecture", "memory_size", "max_recommended_working_set_size")
        )
    build = {"extension": engine.available()}
    if engine.available():
        build.update(
            read_backends=list(engine.backends()),
            sha256_backend=engine.native().sha256_backend(),
            gpu_events_compiled=bool(engine.gpu_events_compiled()),
        )
    else:
        build["reason"] = engine.unavailable_reason()
    ident["build"] = build
    return ident


KERNEL_KEYS = ("status", "device", "reason", "max_abs_diff", "emulated_max_abs_diff", "emulated_ok")
AB_KEYS = (
    "status",
    "decision",
    "reason",
    "median_ratio",
    "min_gain",
    "identical",
    "order",
    "rounds",
    "tokens",
    "cpu_stream_tok_s",
    "gpu_event_tok_s",
    "pread_GBps",
    "mtlio_GBps",
)


def kernels_part(profile: dict) -> dict:
    """Each kernel's entry of the profile, with the shader-validation child's verdict (not its
    stderr, which may name files)."""
    out = {}
    for name, e in (profile.get("kernels") or {}).items():
        entry = _pick(e, KERNEL_KEYS)
        sv = e.get("shader_validation") if isinstance(e, dict) else None
        if isinstance(sv, dict):
            entry["shader_validation"] = _pick(sv, ("clean", "returncode", "max_abs_diff"))
        out[name] = entry
    return out


HANDOFF_KEYS = (
    "status",
    "device",
    "gpu_events",
    "reason",
    "event_round_trip_ms",
    "event_round_trip_loaded_ms",
    "resident_tok_s",
    "streamed_all_resident_tok_s",
    "identical",
    "layers",
    "handoff_ms",
)


def streaming_part(profile: dict) -> dict:
    io = profile.get("io") or {}
    return {
        "gpu_event": _pick((profile.get("streaming") or {}).get("gpu_event"), AB_KEYS),
        "handoff": _pick((profile.get("streaming") or {}).get("handoff"), HANDOFF_KEYS),
        "mtlio_vs_pread": _pick(io.get("mtlio_vs_pread"), AB_KEYS),
    }


def ssd_section(store: str, record_bytes: int, reads: int = 64) -> dict:
    """Record-sized random reads of the store (read only) at queue depth 1/8/32, page cache bypassed."""
    from .qualify import cold_read_probe
    from .stream import engine

    if not engine.available():
        return {"status": "not measured", "reason": engine.unavailable_reason()}
    probe = cold_read_probe(Path(store), record_bytes, reads=reads)
    out = _pick(probe, ("record_bytes", "file_bytes", "qd1_GBps", "qd8_GBps", "qd32_GBps", "direct", "page_cache"))
    out.update(status="measured", of="the artifact's expert store", reads_per_depth=max(reads, 32))
    return out


def fast_check_rates(record_bytes: int) -> dict:
    """The fast per-record check's one-thread rate (`bench.machine.fast_check_rate`, issue 23's
    XXH3-128) where this build has it, else said so."""
    from .bench import machine

    fn = getattr(machine, "fast_check_rate", None)
    if fn is None:
        return {"status": NOT_AVAILABLE}
    try:
        got = fn(record_bytes)
    except Exception as e:  # noqa: BLE001  (a build without the C++ side says so, the report goes on)
        return {"status": NOT_AVAILABLE, "reason": f"{type(e).__name__}: {e}"}
    if not isinstance(got, dict) or not got:
        return {"status": NOT_AVAILABLE}
    return dict(got, status="measured")


def hash_section(record_bytes: int, qd32_gbps: float | None) -> dict:
    from .qualify import sha256_cost

    out = sha256_cost(record_bytes)
    out["record_bytes"] = record_bytes
    out["fast_check"] = fast_check_rates(record_bytes)
    if qd32_gbps:
        for k in ("sha256_GBps_one_thread", "sha256_engine_GBps_one_thread"):
            if k in out:
                out[k.replace("GBps_one_thread", "vs_qd32")] = out[k] / qd32_gbps
    return out


# ---- decode: resident and streamed --------------------------------------------------------------------


def record_routes(model, prompt: list[int], n: int):
    """Greedy routes of `n` one-token decode forwards after the prompt's prefill, on any model
    (resident or streamed: the graph's Capture, the streaming left as it is): (prompt routes
    [P, L, k], decode routes [n, L, k], the n + 1 greedy tokens)."""
    import mlx.core as mx
    import numpy as np

    from .models.qwen4exp import Capture

    L = model.args.num_hidden_layers
    cache = model.make_cache()
    routes, tokens, ids = [], [], prompt
    for _ in range(n + 1):
        cap = Capture(hidden=False)
        logits = model(mx.array([ids]), cache, capture=cap)
        r = mx.stack([cap.routes[layer][0] for layer in range(L)], axis=1)
        tok = mx.argmax(logits[0, -1])
        mx.eval(r, tok)
        routes.append(np.array(r).astype(np.int64))
        tokens.append(int(tok.item()))
        ids = [tokens[-1]]
    return routes[0], np.concatenate(routes[1:]) if n else np.zeros((0, L, routes[0].shape[-1]), np.int64), tokens


def artifact_facts(artifact: str) -> dict:
    """The artifact's geometry (no path): family, codec, layers, experts, top-k, record stride and
    the bytes of its expert store and of everything else."""
    from .admission import admit
    from .artifact.expert_major import Geometry
    from .loader import resolve_model_path

    m = admit(str(resolve_model_path(artifact)))
    fam = m.family
    g = Geometry(fam, m.experts.expert_codec)  # per-layer: record_bytes/stride are the largest layer's
    experts = m.experts.size
    return {
        "family": fam.name,
        "profile": m.profile,
        "codec": m.experts.codec,
        "num_layers": fam.num_hidden_layers,
        "num_experts": fam.num_experts,
        "top_k": fam.num_experts_per_tok,
        "record_bytes": g.record_stride,
        "record_payload_bytes": g.record_bytes,
        "expert_store_bytes": experts,
        "other_bytes": sum(s.size for s in m.stores if s.role != "experts"),
        # What streaming checks each record read with: the fast check (XXH3-128) where the
        # artifact carries its table (issue 23), else SHA-256.
        "read_check": "xxh3-128" if getattr(m.experts, "fast_check", None) else "sha256",
        "_store": m.file(m.experts),
    }


def _by_round(runs, config):
    """A configuration's per-token-median tok/s in schedule order (one per round: every round runs
    every configuration once, so round i of two configurations ran side by side)."""
    return [r["decode_tok_s_p50"] for r in runs if r["config"] == config]


def _median(summary, config, key):
    for s in summary:
        if s["config"] == config:
            v = s["metrics"].get(key)
            return None if v is None else v["median"]
    return None


def decode_section(
    artifact: str,
    gen_tokens: int,
    repeats: int,
    cache_gb: list[float] | None = None,
    prompt_tokens: int = PROMPT_TOKENS,
    facts: dict | None = None,
) -> dict:
    """Resident and streamed greedy decodes of the artifact, interleaved (`hebrus-mlx bench`'s
    schedule, identical tokens required), and the routes they took."""
    import numpy as np

    from .bench import harness as H
    from .bench import run as B
    from .bench.machine import memory_bytes
    from .loader import load
    from .stream import engine

    f = facts or artifact_facts(artifact)
    if not engine.available():
        return {"status": "not measured", "reason": engine.unavailable_reason()}
    L, E, k, R = f["num_layers"], f["num_experts"], f["top_k"], f["record_bytes"]
    total_rows = L * E
    if cache_gb is None:
        rows = [max(int(x * total_rows), 2 * k) for x in CACHE_FRACTIONS]
        cache_gb = [r * R / 2**30 for r in rows]
    mem = memory_bytes()
    # Resident only where the whole artifact takes at most half the memory (the loader would
    # stream otherwise, and the machine must stay usable).
    resident = f["expert_store_bytes"] + f["other_bytes"] <= mem / 2
    # Beside the resident run, the streamed path with every record cached: the streamed runs' own
    # compute (what `simulate --validate --report` predicts them from).
    all_gb = total_rows * R / 2**30
    # Prefetch off: demand paging, which the simulator's arena replays record for record (a
    # predictor's hinted sets are not recorded here).
    configs = ([{}, {"expert-cache-gb": f"{all_gb:.9f}", "prefetch": "off"}] if resident else []) + [
        {"expert-cache-gb": f"{g:.9f}", "prefetch": "off"} for g in cache_gb
    ]
    # The routes of the runs' greedy tokens, recorded on the smallest cache (routes do not depend
    # on the cache: streaming is exact).
    model, tok = load(artifact, expert_cache_gb=cache_gb[0], prefetch="off")
    prompt = H.prompt_ids(tok, prompt_tokens, 0)
    warm, routes, tokens = record_routes(model, prompt, gen_tokens - 1)
    del model
    bench = B.run_bench(
        artifact,
        [prompt_tokens],
        [gen_tokens],
        configs,
        repeats=repeats,
        warmup=1,
        probe=False,
        progress=False,
        timeline=False,
    )
    runs, summary = bench["runs"], bench["summary"]
    if runs[0]["tokens"] != tokens[:gen_tokens]:
        raise H.NotComparableError("tokens", "the recorded routes' greedy tokens differ from the timed runs'")
    out = {
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "repeats": repeats,
        "order": bench["order_note"],
        "tokens_identical": True,
        "tokens_sha256": hashlib.sha256(json.dumps(tokens[:gen_tokens]).encode()).hexdigest(),
        "prompt": "the bench's deterministic token IDs (seed 0); not stored",
    }
    keys = (
        "decode_tok_s",
        "decode_tok_s_p50",
        "prefill_tok_s",
        "peak_memory_gb",
        "hit_rate",
        "exposed_wait_ms_per_token",
        "expert_bytes_per_token",
        "hidden_fraction",
    )
    if resident:
        label = H.label(configs[0])
        streamed_anyway = next(r for r in runs if r["config"] == label).get("arena_rows") is not None
        if streamed_anyway:
            out["resident"] = {"status": "skipped", "reason": "the loader streamed the experts (not enough memory)"}
        else:
            res = {key: _median(summary, label, key) for key in keys[:4]}
            ms = 1e3 / res["decode_tok_s_p50"]
            res.update(
                status="measured",
                ms_per_token=ms,
                layer_ms=ms / L,
                layer_ms_how="resident decode ms/token (median inter-token time) / layers; embedding, "
                "head and sampling included",
            )
            out["resident"] = res
            label = H.label(configs[1])
            tps = _median(summary, label, "decode_tok_s_p50")
            out["all_cached"] = {
                "cache_gb": all_gb,
                "decode_tok_s_p50": tps,
                "layer_ms": 1e3 / tps / L,
                "decode_tok_s_p50_by_round": _by_round(runs, label),
                "exposed_wait_ms_per_token": _median(summary, label, "exposed_wait_ms_per_token"),
                "hit_rate": _median(summary, label, "hit_rate"),
                "what": "streamed with every record cached: the streamed path's compute",
            }
    else:
        out["resident"] = {
            "status": "skipped",
            "reason": f"the artifact ({(f['expert_store_bytes'] + f['other_bytes']) / 2**30:.1f} GiB) "
            f"takes more than half of this machine's {mem / 2**30:.0f} GiB",
        }
    streamed = []
    for c, g in zip(configs[len(configs) - len(cache_gb) :], cache_gb):
        label = H.label(c)
        run = next(r for r in runs if r["config"] == label)
        entry = {key: _median(summary, label, key) for key in keys}
        entry.update(
            cache_gb=g,
            cache_fraction=g * 2**30 / (total_rows * R),
            arena_rows=run.get("arena_rows"),
            decode_tok_s_p50_by_round=_by_round(runs, label),
            prefetch="off",
            policy="clock",
        )
        streamed.append(entry)
    out["streamed"] = streamed
    if out["resident"].get("status") != "measured":
        # Compute per layer from the largest cache's run: its token time less its exposed wait.
        big = streamed[-1]
        ms = 1e3 / big["decode_tok_s_p50"] - (big["exposed_wait_ms_per_token"] or 0.0)
        out["resident"].update(
            layer_ms=ms / L,
            layer_ms_how="derived: the largest cache's streamed ms/token less its exposed I/O wait, / layers",
        )
    out["routes"] = {
        "prompt": warm.tolist(),
        "decode": np.asarray(routes).tolist(),
        "note": "expert IDs [token][layer][k] of the prompt's prefill and of each decode forward",
    }
    return out


# ---- assembly ------------------------------------------------------------------------------------------


def build_report(
    profile: dict,
    artifact: str = "demo",
    gen_tokens: int = 32,
    repeats: int = 2,
    cache_gb: list[float] | None = None,
    extra_secrets: Iterable[str] = (),
) -> dict:
    f = artifact_facts(artifact)
    store = f.pop("_store")
    ssd = ssd_section(store, f["record_bytes"])
    report = {
        "schema": SCHEMA,
        "created_unix": int(time.time()),
        "identity": identity(),
        "artifact": dict(f, name="demo" if artifact == "demo" else "user artifact"),
        "kernels": kernels_part(profile),
        "streaming": streaming_part(profile),
        "ssd": ssd,
        "hashes": hash_section(f["record_bytes"], ssd.get("qd32_GBps")),
        "decode": decode_section(artifact, gen_tokens, repeats, cache_gb, facts=dict(f, _store=store)),
        "notes": [
            "Device sections read 'not qualified on this machine' without a Metal device: nothing there "
            "was verified on one.",
            "Rates are one run on this machine at the time it was written (other load moves them).",
        ],
    }
    words = secrets(
        [
            str(Path(artifact).resolve()) if artifact != "demo" else "",
            str(Path(store).resolve()),
            str(Path(store).parent),
            *extra_secrets,
        ]
    )
    return scrub(report, words)


def _fmt(x, f=".2f", none="n/a"):
    return none if x is None else format(x, f)


def markdown(r: dict) -> str:
    i, a, d = r["identity"], r["artifact"], r["decode"]
    lines = [
        f"# hebrus-mlx qualify report ({r['schema']})",
        "",
        f"- machine: {i['chip']}, {i['cpus']} cores, {i['memory_gb']:.0f} GiB, {i['system']} {i['macos'] or i['release']} "
        f"{i['machine']}; Python {i['python']}, MLX {i['mlx']} ({i['backend']} backend), hebrus-mlx {i['hebrus_mlx']}",
        f"- build: {json.dumps(i['build'])}",
        f"- artifact: {a['family']} ({a['codec']}, {a['num_layers']} layers, {a['num_experts']} experts top-{a['top_k']}, "
        f"{a['record_bytes']:,} B records)",
        "",
        "## Kernels and streaming",
        "",
        "| section | status | detail |",
        "|---|---|---|",
    ]
    for name, e in r["kernels"].items():
        lines.append(
            f"| kernels.{name} | {e.get('status')} | {e.get('reason') or _fmt(e.get('max_abs_diff'), '.1e')} |"
        )
    for name, e in r["streaming"].items():
        lines.append(f"| {name} | {e.get('status')} | {e.get('reason', '')} |")
    s, h = r["ssd"], r["hashes"]
    lines += ["", "## SSD and hashes", ""]
    if s.get("status") == "measured":
        lines.append(
            f"- SSD, {s['record_bytes']:,} B reads, page cache {s['page_cache']}: QD1 {s['qd1_GBps']:.2f}, "
            f"QD8 {s['qd8_GBps']:.2f}, QD32 {s['qd32_GBps']:.2f} GB/s"
        )
    else:
        lines.append(f"- SSD: {s.get('status')} ({s.get('reason')})")
    fc = h["fast_check"]
    fast = (
        (", ".join(f"{k} {v:.2f}" for k, v in fc.items() if isinstance(v, float)) or fc["status"])
        if fc.get("status") == "measured"
        else fc["status"]
    )
    lines.append(
        f"- SHA-256 one thread: hashlib {h['sha256_GBps_one_thread']:.2f} GB/s"
        + (
            f", engine ({h.get('sha256_engine_backend')}) {h['sha256_engine_GBps_one_thread']:.2f} GB/s"
            if "sha256_engine_GBps_one_thread" in h
            else ""
        )
        + f"; fast check: {fast}"
    )
    lines += ["", "## Decode", ""]
    if "streamed" not in d:
        lines.append(f"- {d.get('status')}: {d.get('reason')}")
    else:
        res = d["resident"]
        lines.append(
            f"- {d['prompt_tokens']}-token prompt, {d['gen_tokens']} greedy tokens, {d['repeats']} interleaved "
            f"rounds, tokens identical in every run"
        )
        if res.get("status") == "measured":
            lines.append(
                f"- resident: decode {res['decode_tok_s_p50']:.2f} tok/s, prefill {_fmt(res['prefill_tok_s'])} "
                f"tok/s, {res['layer_ms']:.3f} ms per layer, peak {res['peak_memory_gb']:.2f} GB"
            )
            if "all_cached" in d:
                lines.append(
                    f"- streamed with every record cached: decode {d['all_cached']['decode_tok_s_p50']:.2f} "
                    f"tok/s, {d['all_cached']['layer_ms']:.3f} ms per layer"
                )
        else:
            lines.append(
                f"- resident: {res['status']} ({res['reason']}); {res['layer_ms']:.3f} ms per layer "
                f"({res['layer_ms_how']})"
            )
        lines += [
            "",
            "| expert cache GiB | share of store | arena rows | decode tok/s | hit rate | exposed wait ms/token | "
            "MB/token |",
            "|---|---|---|---|---|---|---|",
        ]
        for e in d["streamed"]:
            lines.append(
                f"| {e['cache_gb']:.3g} | {e['cache_fraction']:.0%} | {e['arena_rows']} | "
                f"{_fmt(e['decode_tok_s_p50'])} | {_fmt(e['hit_rate'], '.1%')} | "
                f"{_fmt(e['exposed_wait_ms_per_token'], '.3f')} | "
                f"{_fmt((e['expert_bytes_per_token'] or 0) / 1e6, '.2f')} |"
            )
    lines += [
        "",
        "Replay it: `hebrus-mlx simulate --validate --report FILE`; project from it: "
        "`hebrus-mlx simulate --profile FILE`.",
        "",
    ]
    return "\n".join(lines)


def summary_path(path) -> Path:
    p = Path(path)
    return p.with_suffix(".md") if p.suffix != ".md" else p.with_name(p.name + ".summary.md")


def write_report(report: dict, path, overwrite: bool = False) -> tuple:
    from .output_files import write_text_atomic

    p = Path(path).expanduser()
    write_text_atomic(p, json.dumps(report, indent=1) + "\n", field="--report", overwrite=overwrite)
    md = summary_path(p)
    write_text_atomic(md, markdown(report), field="--report", overwrite=overwrite)
    return p, md
