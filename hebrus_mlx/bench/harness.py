"""The mechanics of `hebrus-mlx bench`: configurations, the interleaved A/B/B/A schedule, one timed
run, per-run metrics and the exactness check.

A configuration is a dict of ``key=value`` options (flag spelling, e.g. ``expert-cache-gb=0.002``).
Each key goes where the code accepts it: `load()`'s keyword arguments, then `stream_generate`/
`generate_step`'s, then the bench's own adapters for options that exist only on the loaded model
(``prefetch=off|previous`` until the loader takes it). So an option added to load() or generate
(``draft-model``, ``prefetch``) is benchmarkable as soon as it lands; an unknown key is a
UsageError naming it.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import HebrusError, UsageError

NONE_WORDS = ("none", "null", "default")


class NotComparableError(HebrusError):
    """Runs that cannot be compared honestly (different artifacts, or different greedy tokens
    from configurations that claim to be exact)."""

    default_field = "runs"


def parse_value(s: str):
    s = s.strip()
    if s.lower() in NONE_WORDS:
        return None
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return s


def parse_ab(specs: Sequence[str]) -> list[dict[str, object]]:
    """``["expert-cache-gb=8,16", "prefetch=off,previous"]`` -> the cross product of configurations
    (the first spec varies slowest). No spec: one configuration, the defaults."""
    axes = []
    seen = set()
    for spec in specs:
        key, eq, values = spec.partition("=")
        key = key.strip()
        if not eq or not key or not values.strip():
            raise UsageError("--ab", f"expected KEY=V1,V2,..., got {spec!r}")
        if key in seen:
            raise UsageError("--ab", f"{key} is given twice")
        seen.add(key)
        vals = [v for v in values.split(",")]
        if any(not v.strip() for v in vals):
            raise UsageError("--ab", f"{key}: empty value in {values!r}")
        axes.append([(key, v.strip()) for v in vals])
    return [dict(c) for c in itertools.product(*axes)] if axes else [{}]


def label(config: dict[str, object]) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items()) or "default"


# ---- where each key goes -------------------------------------------------------------------------


def _params(fn) -> set:
    return {
        p.name for p in inspect.signature(fn).parameters.values() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def _set_prefetch(model, value):
    """Bench adapter: the previous-token P1 hint of a streamed model (the loader has no flag yet)."""
    if value not in ("off", "previous"):
        raise UsageError("prefetch", f"expected off or previous, got {value!r}")
    streaming = model.streaming
    if streaming is None or streaming.experts is None:
        if value == "off":
            return
        raise UsageError("prefetch", "needs streamed experts (set expert-cache-gb)")
    streaming.experts.prefetch_previous = value == "previous"


ADAPTERS: dict[str, Callable] = {"prefetch": _set_prefetch}
GENERATE_RESERVED = {
    "max_tokens",
    "prompt_cache",
    "sampler",
    "logits_processors",
    "effective_vocab_size",
    "speculative_stats",
    "stats",
    "with_draft_flag",
}


@dataclass
class Split:
    load: dict = field(default_factory=dict)
    generate: dict = field(default_factory=dict)
    adapt: dict = field(default_factory=dict)


def split_config(config: dict[str, str], load_fn=None, generate_fns=None) -> Split:
    """Route each option to load / generate / an adapter by signature; refuse the rest."""
    if load_fn is None:
        from ..loader import load as load_fn
    if generate_fns is None:
        from ..generate import generate_step, stream_generate

        generate_fns = (stream_generate, generate_step)
    load_keys = _params(load_fn) - {"path_or_name", "dtype"}
    gen_keys = set().union(*(_params(f) for f in generate_fns)) - GENERATE_RESERVED - {"model", "tokenizer", "prompt"}
    out = Split()
    for key, raw in config.items():
        name = key.replace("-", "_")
        value = parse_value(raw) if isinstance(raw, str) else raw
        if name in load_keys:
            out.load[name] = value
        elif name in gen_keys:
            out.generate[name] = value
        elif key in ADAPTERS:
            out.adapt[key] = raw
        else:
            known = sorted(k.replace("_", "-") for k in load_keys | gen_keys) + sorted(ADAPTERS)
            raise UsageError("--ab", f"unknown option {key!r}; this build accepts {', '.join(known)}")
    return out


# ---- schedule ------------------------------------------------------------------------------------


def schedule(n_configs: int, repeats: int) -> list[int]:
    """Interleaved order: A B B A A B B A ... for two configurations (each pair of rounds mirrors
    the previous one, so a drift over time hits every configuration alike); for more, rounds
    alternate forward and reversed. Each configuration appears exactly `repeats` times."""
    if n_configs < 1 or repeats < 1:
        raise UsageError("--repeats", f"need >= 1 configuration and repeat, got {n_configs}, {repeats}")
    order = []
    for r in range(repeats):
        rnd = list(range(n_configs))
        order += rnd if r % 2 == 0 else rnd[::-1]
    return order


# ---- one run -------------------------------------------------------------------------------------


class _NoStop:
    """The tokenizer with an empty stop set: every run generates exactly n tokens."""

    def __init__(self, tok):
        self._tok = tok

    stop_token_ids = frozenset()

    def __getattr__(self, name):
        return getattr(self._tok, name)


def prompt_ids(tokenizer, n: int, seed: int = 0) -> list[int]:
    """n deterministic token IDs (like mlx_lm.benchmark's random prompt), drawn below the effective
    vocabulary and outside the stop set."""
    import numpy as np

    rng = np.random.default_rng(seed + n)
    stops = set(tokenizer.stop_token_ids)
    ids = []
    while len(ids) < n:
        for x in rng.integers(0, tokenizer.effective_vocab_size, n).tolist():
            if x not in stops and len(ids) < n:
                ids.append(int(x))
    return ids


def _engine(model):
    s = getattr(model, "streaming", None)
    return None if s is None else s.engine


def _delta(after: dict, before: dict, key: str) -> float:
    return float(after.get(key, 0) - before.get(key, 0))


def _split_delta(before: dict, after: dict, kinds: dict) -> dict:
    """Per store kind (experts, ple): reads, bytes and exposed wait over the decode phase."""
    from ..stream.engine import io_by_kind

    a, b = io_by_kind(after, kinds), io_by_kind(before, kinds)
    zero = {"reads": 0, "bytes": 0, "exposed_wait_ns": 0}
    return {k: {f: a[k][f] - b.get(k, zero)[f] for f in zero} for k in a}


def io_metrics(
    before: dict | None, after: dict | None, tokens: int, record_bytes: int | None, kinds: dict | None = None
) -> dict:
    """Engine counter deltas over the decode phase -> per-token I/O metrics (None when resident).
    ``engine_counters`` keeps every scalar counter's delta (simulate --validate compares its
    replay with them). With ``kinds`` (StreamEngine.store_kinds) expert records and PLE pages are
    reported apart; without it every byte read counts as expert bytes."""
    if before is None or after is None:
        return {
            "expert_bytes_per_token": 0.0 if before is None else None,
            "hit_rate": None,
            "exposed_wait_ms_per_token": 0.0,
            "hidden_fraction": None,
            "timely_recall": None,
            "late_recall": None,
            "precision": None,
            "ple_bytes_per_token": 0.0 if before is None else None,
            "ple_reads_per_token": 0.0 if before is None else None,
            "ple_exposed_wait_ms_per_token": 0.0,
        }
    keys = [
        k
        for k, v in after.items()
        if isinstance(v, (int, float)) and not k.startswith("latency_") and k != "hidden_fraction"
    ]
    d = {k: _delta(after, before, k) for k in keys}
    lookups = d["hits"] + d["joins"] + d["misses"]
    # The engine's own read-ahead measures (stream.engine.prediction_stats): exact lookups served by
    # a predicted read that had already landed (timely) or was still in flight (late), over the
    # exact lookups nothing exact had cached (those plus the exact misses).
    need = d.get("predicted_hits", 0) + d.get("predicted_joins", 0) + d.get("exact_misses", 0)
    reads = d.get("predicted_reads", 0)
    n = max(tokens, 1)
    split = _split_delta(before, after, kinds) if kinds else {}
    zero = {"reads": 0, "bytes": 0, "exposed_wait_ns": 0}
    ple = split.get("ple", zero)
    experts_bytes = split["experts"]["bytes"] if "experts" in split else d["exact_bytes"] + d["predicted_bytes"]
    return {
        "expert_bytes_per_token": experts_bytes / n,
        "ple_bytes_per_token": ple["bytes"] / n,
        "ple_reads_per_token": ple["reads"] / n,
        "ple_exposed_wait_ms_per_token": ple["exposed_wait_ns"] / 1e6 / n,
        "hit_rate": (d["hits"] + d["joins"]) / lookups if lookups else None,
        "exposed_wait_ms_per_token": d["exposed_wait_ns"] / 1e6 / max(tokens, 1),
        "hidden_fraction": 1.0 - d["exposed_wait_ns"] / d["exact_read_ns"] if d["exact_read_ns"] > 0 else None,
        "timely_recall": d["predicted_hits"] / need if need else None,
        "late_recall": d["predicted_joins"] / need if need else None,
        "precision": (d["predicted_hits"] + d["predicted_joins"]) / reads if reads else None,
        "engine_counters": d,
    }


def run_once(
    model, tokenizer, prompt: list[int], n: int, gen_kwargs: dict, record_bytes=None, trace: bool = False
) -> dict:
    """One timed greedy generation of exactly n tokens after a len(prompt)-token prefill."""
    import mlx.core as mx

    from ..generate import stream_generate

    eng = _engine(model)
    if eng is not None:
        eng.reset_counters()
        if trace:
            eng.enable_trace(1 << 20)
            eng.trace_events(clear=True)
    stats = None
    if gen_kwargs.get("draft_model") is not None:
        from ..speculative.protocol import SpeculativeStats

        stats = SpeculativeStats()
        gen_kwargs = dict(gen_kwargs, speculative_stats=stats)
    mx.reset_peak_memory()
    tokens, stamps = [], []
    before = None
    t0 = time.perf_counter()
    t_mono0 = time.monotonic_ns()
    for r in stream_generate(model, _NoStop(tokenizer), prompt, max_tokens=n, **gen_kwargs):
        now = time.perf_counter()
        if not tokens and eng is not None:
            before = eng.counters()
        tokens.append(int(r.token))
        stamps.append(now)
    after = eng.counters() if eng is not None else None
    ttft = stamps[0] - t0
    decode_s = stamps[-1] - stamps[0]
    out = {
        "tokens": tokens,
        "prompt_tokens": len(prompt),
        "generated": len(tokens),
        "ttft_s": ttft,
        "prefill_tok_s": len(prompt) / ttft if ttft > 0 else None,
        "decode_tok_s": (len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else None,
        # Per-token median: robust to another process taking the cores for a moment (shared machines).
        "decode_tok_s_p50": 1.0 / statistics.median([b - a for a, b in zip(stamps, stamps[1:])])
        if len(stamps) > 1 and stamps[-1] > stamps[0]
        else None,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        # Speculative decoding: accepted / drafted tokens, and tokens committed per verify step.
        "acceptance": stats.accepted / stats.drafted if stats is not None and stats.drafted else None,
        "tokens_per_step": stats.committed / stats.verify_steps if stats is not None and stats.verify_steps else None,
    }
    out.update(io_metrics(before, after, len(tokens) - 1, record_bytes, None if eng is None else eng.store_kinds))
    from ..models.optimize import implementations

    out["implementations"] = implementations(model)
    if eng is not None:
        out["cache_bytes"] = eng.memory()["capacity"]
        experts = model.streaming.experts
        out["arena_rows"] = None if experts is None else experts.rows
    if trace and eng is not None:
        events, _ = eng.trace_events(clear=True)
        eng.enable_trace(0)
        out["timeline"] = timeline(events, [int((s - t0) * 1e9) + t_mono0 for s in stamps], t_mono0)
    return out


def timeline(events, stamps_ns: list[int], t0_ns: int) -> list[dict]:
    """Per decode token (the first token's interval is the prefill, left out): wall time, exposed
    I/O wait and bytes read inside it (engine trace)."""
    rows = []
    prev = stamps_ns[0] if stamps_ns else t0_ns
    for i, end in enumerate(stamps_ns[1:], start=1):
        w = events[(events["kind"] == "wait") & (events["end_ns"] > prev) & (events["issue_ns"] < end)]
        wait = sum(min(e, end) - max(b, prev) for b, e in zip(w["issue_ns"].tolist(), w["end_ns"].tolist()))
        rd = events[(events["kind"] == "read") & (events["end_ns"] > prev) & (events["end_ns"] <= end)]
        rows.append(
            {
                "token": i,
                "wall_ms": (end - prev) / 1e6,
                "io_wait_ms": max(wait, 0) / 1e6,
                "read_bytes": int(rd["bytes"].sum()),
            }
        )
        prev = end
    return rows


# ---- statistics and honesty ----------------------------------------------------------------------

METRICS = (
    "decode_tok_s",
    "decode_tok_s_p50",
    "prefill_tok_s",
    "ttft_s",
    "peak_memory_gb",
    "expert_bytes_per_token",
    "hit_rate",
    "exposed_wait_ms_per_token",
    "hidden_fraction",
    "timely_recall",
    "late_recall",
    "precision",
    "acceptance",
    "tokens_per_step",
)


def summarize(values: Sequence[float | None]) -> dict | None:
    """Median and spread (min, max, and the half-range relative to the median)."""
    v = [x for x in values if x is not None]
    if not v:
        return None
    med = statistics.median(v)
    return {
        "median": med,
        "min": min(v),
        "max": max(v),
        "n": len(v),
        "spread": (max(v) - min(v)) / 2 / abs(med) if med else 0.0,
    }


def check_tokens(runs: Sequence[dict]) -> None:
    """Greedy outputs of one (prompt, n) must be identical across every configuration and repeat
    (every option the bench runs claims to be exact)."""
    by_case: dict[tuple[int, int], tuple[str, list[int]]] = {}
    for r in runs:
        key = (r["prompt_tokens"], r["requested"])
        first = by_case.setdefault(key, (r["config"], r["tokens"]))
        if r["tokens"] != first[1]:
            at = next(
                (i for i, (a, b) in enumerate(zip(first[1], r["tokens"])) if a != b),
                min(len(first[1]), len(r["tokens"])),
            )
            raise NotComparableError(
                "tokens",
                f"greedy output of [{r['config']}] differs from [{first[0]}] at token {at} "
                f"(prompt {key[0]}, n {key[1]}): a configuration that claims to be exact is not",
            )


def check_artifacts(digests: dict[str, str]) -> None:
    """Every configuration must run the same artifact."""
    if len(set(digests.values())) > 1:
        items = ", ".join(f"[{k}] {v[:24]}" for k, v in digests.items())
        raise NotComparableError("artifact", f"configurations run different artifacts: {items}")


def artifact_digest(path) -> str:
    """sha256 of the artifact's manifest.json (it pins every store's digest); an HF checkpoint dir:
    of config.json and its weight files."""
    from pathlib import Path

    path = Path(path)
    h = hashlib.sha256()
    if (path / "manifest.json").is_file():
        h.update((path / "manifest.json").read_bytes())
        return "manifest:" + h.hexdigest()
    for p in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return "hf:" + h.hexdigest()


BENCH_SCHEMA = "hebrus-mlx.bench"
BENCH_VERSION = 1


def check_bench_result(d, where: str) -> dict:
    """An earlier bench.json (`--against`) as `compare_results` reads it, checked before a run of
    minutes: another file's schema or version, or a malformed run, is one line naming the field."""

    def bad(field, msg):
        raise UsageError("--against", f"{where}: {field}: {msg}")

    if not isinstance(d, dict):
        bad("(top level)", "not a JSON object")
    if d.get("schema") != BENCH_SCHEMA:
        bad("schema", f"expected {BENCH_SCHEMA!r} (a hebrus-mlx bench.json), got {d.get('schema')!r}")
    if d.get("version") != BENCH_VERSION:
        bad("version", f"this build reads version {BENCH_VERSION}, got {d.get('version')!r}")
    if not isinstance(d.get("artifact_digest"), str):
        bad("artifact_digest", f"expected a string, got {d.get('artifact_digest')!r}")
    runs = d.get("runs")
    if not isinstance(runs, list):
        bad("runs", f"expected a list, got {type(runs).__name__}")
    for i, r in enumerate(runs):
        if not isinstance(r, dict):
            bad(f"runs[{i}]", "not an object")
        for key, want in (("config", str), ("prompt_tokens", int), ("requested", int), ("tokens", list)):
            if type(r.get(key)) is not want:
                bad(f"runs[{i}].{key}", f"expected {want.__name__}, got {r.get(key)!r}"[:200])
        if not all(type(t) is int for t in r["tokens"]):
            bad(f"runs[{i}].tokens", "expected a list of token IDs (integers)")
    return d


def compare_results(a: dict, b: dict) -> None:
    """Two bench JSON results are comparable only with the same artifact and identical tokens."""
    if a.get("artifact_digest") != b.get("artifact_digest"):
        raise NotComparableError("artifact", f"{a.get('artifact_digest')} != {b.get('artifact_digest')}")
    check_tokens(
        [dict(r, config=f"{tag}:{r['config']}") for tag, res in (("a", a), ("b", b)) for r in res.get("runs", [])]
    )
