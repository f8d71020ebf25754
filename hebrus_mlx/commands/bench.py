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

import sys
from pathlib import Path

from .. import flags
from ..bench import harness as H
from ..bench import report as R
from ..bench.run import pipeline_stage, run_bench
from ..errors import UsageError
from ..flags import positive_ints
from ..pipeline import launched as pipeline_launched
from .cli_args import ArgumentParser, add_overwrite_argument, add_pipeline_arguments, check_pipeline_timeout


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
    add_overwrite_argument(p, help="replace bench.json/.md/.png in --out even if hebrus-mlx did not write them")
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
    add_pipeline_arguments(p, state_defaults=False)
    return p


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
    check_pipeline_timeout(args)
    pipe = loaded = None
    if pipeline_launched():
        pipe, loaded = pipeline_stage(args.model, configs, args.pipeline_split, args.pipeline_timeout)
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
        from ..pipeline.ranks import finish

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
        from ..pipeline.ranks import release

        release(pipe.model)  # last: the launcher ends rank 0 once a peer exits
    return 0


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("bench", main))
