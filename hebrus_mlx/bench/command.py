"""`hebrus-mlx bench`: what this model does on this Mac, and which setting to choose.

    hebrus-mlx bench --model demo -p 128,512 -n 64 --repeats 4 \\
        --ab "expert-cache-gb=0.002,0.004" --ab "prefetch=off,previous" --out bench-out

Every configuration is loaded once, warmed up, then the runs interleave A B B A ... so the
machine's drift hits all configurations alike; the table shows medians and the half-range spread.
Greedy tokens must be identical across configurations (every option claims exactness) and every
configuration must run the same artifact, else the bench refuses to compare (exit 2).
Writes OUT/bench.json, OUT/bench.md and OUT/bench.png (when matplotlib is installed).

Under `mlx.launch` the configurations share one pipeline (rank 0 runs the harness, the other ranks
their layers): they may differ in generation options (e.g. draft-model) but not in how the model
loads; bench.json gains one row per rank (peak memory, link wait and bytes per forward).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .. import flags
from ..cli_args import ArgumentParser
from ..errors import UsageError
from ..pipeline import launched as pipeline_launched
from ..traces.command import positive_ints
from . import harness as H
from . import machine as M
from . import report as R


def build_parser():
    p = ArgumentParser(prog="hebrus-mlx bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", "-m", default="demo", help="'demo', an artifact or an HF checkpoint directory")
    p.add_argument("--prompt-tokens", "-p", default="128", help="prompt sizes, e.g. 512,2048")
    # -n and -g mean what they mean to mlx_lm.benchmark: trials and generated tokens.
    p.add_argument(
        "--gen-tokens", "--generation-tokens", "-g", default="64", help="generation lengths, e.g. 128 (default 64)"
    )
    p.add_argument(
        "--repeats",
        "--num-trials",
        "-n",
        "-r",
        type=flags.integer(1, 1 << 20),
        default=4,
        help="timed runs per configuration and size (default 4)",
    )
    p.add_argument("--warmup", type=flags.integer(0, 1 << 20), default=1, help="untimed runs per configuration first")
    p.add_argument(
        "--ab",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="configurations to compare (repeatable: the cross product), e.g. expert-cache-gb=8,16, "
        "draft-model=none,mtp, prefetch=off,previous",
    )
    p.add_argument("--out", default="bench-out", help="directory for bench.json, bench.md, bench.png")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace bench.json/.md/.png in --out even if hebrus-mlx did not write them",
    )
    p.add_argument("--seed", type=flags.seed(), default=0, help="prompt token seed")
    p.add_argument("--no-probe", action="store_true", help="skip the SSD read probe")
    p.add_argument(
        "--fresh-probe",
        action="store_true",
        help="probe the SSD now even when the machine profile (hebrus-mlx qualify) has a matching probe",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--against", default=None, help="an earlier bench.json: refuse unless comparable")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--pipeline-split", default=None, help="under mlx.launch: layers per rank, e.g. 5,3")
    p.add_argument(
        "--pipeline-timeout",
        type=flags.seconds(),
        default=None,
        help="under mlx.launch: seconds a rank waits on another before the run ends with an error",
    )
    return p


def _load(name, load_kwargs):
    from ..hub import resolve_model
    from ..loader import load

    return load(resolve_model(name), **load_kwargs)


def _pipeline(model: str, configs: list[dict], split, timeout):
    """Under mlx.launch: load this rank's stage of the one pipeline every configuration shares.
    Rank 0 gets (pipeline, (model, tokenizer)); a serving rank serves, then gets (None, None)."""
    from ..hub import resolve_model
    from ..pipeline import load_pipeline
    from ..pipeline.cli import serve_or_return

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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    prompts = positive_ints(args.prompt_tokens, "--prompt-tokens")
    gens = positive_ints(args.gen_tokens, "--gen-tokens")
    if args.repeats < 1:
        raise UsageError("--repeats", f"must be >= 1, got {args.repeats}")
    if args.warmup < 0:
        raise UsageError("--warmup", f"must be >= 0, got {args.warmup}")
    configs = H.parse_ab(args.ab)
    from ..artifact.atomic import check_output_file

    for name in ("bench.json", "bench.md", "bench.png"):  # before a run of minutes, and again at publish
        check_output_file(Path(args.out) / name, overwrite=args.overwrite, field="--out")
    against = None
    if args.against is not None:
        from ..artifact.untrusted import UntrustedFileError, read_json_path

        try:  # bounded, strict: a bench.json may come from another machine (issue 22)
            against = read_json_path(args.against, "json", field=str(args.against))
        except UntrustedFileError as e:
            raise UsageError("--against", f"cannot read {args.against}: {e.message}") from None
        except (OSError, ValueError) as e:
            raise UsageError("--against", f"cannot read {args.against}: {e}") from None
        H.check_bench_result(against, str(args.against))
    if args.pipeline_timeout is not None and not (0 < args.pipeline_timeout < float("inf")):
        raise UsageError("--pipeline-timeout", f"must be a positive number of seconds, got {args.pipeline_timeout}")
    pipe = loaded = None
    if pipeline_launched():
        pipe, loaded = _pipeline(args.model, configs, args.pipeline_split, args.pipeline_timeout)
        if pipe is None:
            return 0  # a serving rank: rank 0 reports
    elif args.pipeline_split is not None:
        raise UsageError("--pipeline-split", "needs a distributed launch (mlx.launch)")
    result = run_bench(
        args.model,
        prompts,
        gens,
        configs,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        probe=not args.no_probe,
        progress=not args.quiet,
        loaded_model=loaded,
        reuse_profile=not args.fresh_probe,
    )
    if pipe is not None:
        from ..pipeline.cli import finish

        result["pipeline"] = finish(pipe.model, release_ranks=False)  # one line per rank
    if against is not None:
        H.compare_results(against, result)
    out = Path(args.out)
    R.write_json(out / "bench.json", result, overwrite=args.overwrite)
    md = R.markdown(result)
    R.write_text_atomic(out / "bench.md", md, overwrite=args.overwrite)
    print(md, end="")
    if not args.no_plot:
        if R.have_matplotlib():
            R.plot(result, out / "bench.png", overwrite=args.overwrite)
            print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}")
        else:
            print(
                f"wrote {out / 'bench.json'}, {out / 'bench.md'}; no PNG: matplotlib is not installed "
                f"(pip install matplotlib, or the 'test' extra)"
            )
    else:
        print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}")
    if pipe is not None:
        from ..pipeline.cli import release

        release(pipe.model)  # last: the launcher ends rank 0 once a peer exits
    return 0


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("bench", main))
