"""`run_bench`: the bench's measurement over its configurations (the `hebrus-mlx bench` verb, its
flags and output are commands/bench.py; qualify --report and simulate --validate run it too)."""

from __future__ import annotations

import json
import sys

from ..errors import UsageError
from . import harness as H
from . import machine as M


def _load(name, load_kwargs):
    from ..loader import load
    from ..loading.hub import resolve_model

    return load(resolve_model(name), **load_kwargs)


def pipeline_stage(model: str, configs: list[dict], split, timeout):
    """Under mlx.launch: load this rank's stage of the one pipeline every configuration shares.
    Rank 0 gets (pipeline, (model, tokenizer)); a serving rank serves, then gets (None, None)."""
    from ..loading.hub import resolve_model
    from ..pipeline import load_pipeline
    from ..pipeline.ranks import serve_or_return

    loads, mtp = set(), False
    for c in configs:
        c = dict(c)
        name = c.pop("model", model)
        sp = H.split_config(c)
        loads.add((name, json.dumps(sp.load, sort_keys=True)))
        mtp = mtp or sp.generate.get("draft_model") == "mtp"
    if len(loads) > 1:
        raise UsageError(
            "--ab",
            "under mlx.launch every configuration shares one pipeline: compare options "
            "of generation (e.g. draft-model), not of loading or the model",
        )
    name, load = next(iter(loads))
    load = json.loads(load)
    for key in load:
        if key not in ("expert_cache_gb", "ple_cache_gb", "prefetch"):
            raise UsageError("--ab", f"{key.replace('_', '-')} is not supported under mlx.launch")
    path = resolve_model(name)
    pipe, mdl, tok = serve_or_return(load_pipeline(path, split=split, timeout=timeout, mtp=mtp, **load), path)
    return pipe, (None if pipe is None else (mdl, tok))


def run_bench(
    model: str,
    prompts: list[int],
    gens: list[int],
    configs: list[dict],
    repeats: int = 4,
    warmup: int = 1,
    seed: int = 0,
    probe: bool = True,
    progress: bool = False,
    timeline: bool = True,
    loaded_model=None,
    reuse_profile: bool = True,
) -> dict:
    """The whole bench as a dict (what bench.json holds). `loaded_model`: (model, tokenizer) every
    configuration runs (a pipeline's), instead of loading each configuration's."""
    from ..loader import resolve_model_path

    # Resolve every configuration before loading anything: a typo fails in a second.
    plans = []
    for c in configs:
        c = dict(c)
        name = c.pop("model", model)
        plans.append((name, H.split_config(c)))
    digests = {H.label(c): H.artifact_digest(resolve_model_path(name)) for c, (name, _) in zip(configs, plans)}
    H.check_artifacts(digests)

    loaded = {}
    for name, split in plans:
        key = (name, json.dumps(split.load, sort_keys=True))
        if key not in loaded:
            loaded[key] = loaded_model if loaded_model is not None else _load(name, split.load)
    cases = [(p, n) for p in prompts for n in gens]

    def go(i, case, trace=False):
        name, split = plans[i]
        mdl, tok = loaded[(name, json.dumps(split.load, sort_keys=True))]
        for k, v in split.adapt.items():
            H.ADAPTERS[k](mdl, v)
        p, n = case
        ids = H.prompt_ids(tok, p, seed)
        limit = getattr(mdl.args, "max_position_embeddings", None)
        if limit is not None and p + n > limit:
            raise UsageError("--prompt-tokens", f"{p} + {n} tokens exceed the model context {limit}")
        r = H.run_once(mdl, tok, ids, n, split.generate, trace=trace)
        r.update(config=H.label(configs[i]), requested=n)
        return r

    order = H.schedule(len(configs), repeats)
    total = len(configs) * warmup * len(cases[:1]) + len(order) * len(cases)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr)
    for i in range(len(configs)):
        for _ in range(warmup):
            go(i, cases[0])
            bar and bar.update()
    runs = []
    for case in cases:
        for i in order:
            if bar:
                bar.set_postfix_str(f"{H.label(configs[i])} p{case[0]} n{case[1]}")
            runs.append(go(i, case))
            bar and bar.update()
    bar and bar.close()
    H.check_tokens(runs)
    timelines = []
    if timeline:  # one more run per configuration with the engine trace on (untimed: tracing costs)
        traced = [go(i, cases[0], trace=True) for i in range(len(configs))]
        H.check_tokens(runs + traced)
        timelines = [
            {"config": r["config"], "prompt_tokens": cases[0][0], "rows": r.pop("timeline")}
            for r in traced
            if "timeline" in r
        ]
    summary = []
    for p, n in cases:
        for c in configs:
            sel = [r for r in runs if r["config"] == H.label(c) and r["prompt_tokens"] == p and r["requested"] == n]
            summary.append(
                {
                    "config": H.label(c),
                    "prompt_tokens": p,
                    "n": n,
                    "metrics": {k: H.summarize([r.get(k) for r in sel]) for k in H.METRICS},
                }
            )
    first_name = plans[0][0]
    return {
        "schema": H.BENCH_SCHEMA,
        "version": H.BENCH_VERSION,
        "model": model,
        "artifact_digest": next(iter(digests.values())),
        "machine": M.record(resolve_model_path(first_name), probe=probe, reuse_profile=reuse_profile),
        "configs": [H.label(c) for c in configs],
        "prompts": prompts,
        "gens": gens,
        "repeats": repeats,
        "warmup": warmup,
        "seed": seed,
        "order": [H.label(configs[i]) for i in order],
        "order_note": "A B B A" if len(configs) == 2 else "forward/reversed rounds",
        "tokens_identical": True,
        "runs": runs,
        "summary": summary,
        "timelines": timelines,
    }
