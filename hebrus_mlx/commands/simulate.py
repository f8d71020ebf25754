"""`hebrus-mlx simulate`: projected decode speed on a machine that is not this one.

The verb's command line over hebrus_mlx/simulate/ (run.py: the projection, the table and the
validation on this machine; its docstring shows the invocations).
"""

from __future__ import annotations

import sys

from .. import flags
from ..errors import UsageError
from ..simulate import model as S
from ..simulate import report as R
from ..simulate.run import (
    PROFILES_DIR,
    parse_list,
    print_projection,
    print_validation,
    project_profile,
    validate,
    write_table,
)
from .cli_args import ArgumentParser, add_overwrite_argument


def build_parser():
    p = ArgumentParser(prog="hebrus-mlx simulate", description=__doc__.split("\n")[0])
    p.add_argument(
        "--profile",
        default="m5-pro-48gb",
        help=f"a shipped profile ({', '.join(sorted(x.stem for x in PROFILES_DIR.glob('*.json')))}), a JSON "
        "file, or 'machine': this machine's SSD from the `hebrus-mlx qualify` profile (with --layer-ms)",
    )
    p.add_argument(
        "--layer-ms",
        type=flags.number(0, 1e6),
        default=None,
        help="with --profile machine: decode compute per layer at 4-bit experts and dense weights (the anchor "
        "--expert-bits / --dense-bits scale from); on a CPU device at the widths projected (not scaled)",
    )
    p.add_argument(
        "--predictor-recall",
        default=None,
        help="NAME=RECALL[/PRECISION],...: a read-ahead predictor's recall (and precision) replayed through "
        "the arena, e.g. router-reuse:1=0.62/0.72 from a run's counters (adds to the profile's table)",
    )
    p.add_argument("--family", default="qwen3.8-flash-next", help="model geometry for a projection")
    p.add_argument(
        "--codec",
        default="affine4-g64",
        help="expert codec(s), comma-separated: one projection per width (record size), e.g. "
        "affine4-g64,affine3-g64,affine2-g64 (widths the format does not register yet are sized from "
        "MLX's affine layout)",
    )
    p.add_argument(
        "--expert-bits",
        default=None,
        metavar="N[,N...]",
        help="routed-expert width(s) in bits (2, 3, 4, 6, 8; affine, group 64): the same as "
        "--codec affineN-g64; record size, cache capacity and compute follow the width",
    )
    p.add_argument(
        "--dense-bits",
        type=flags.integer(2, 8),
        default=None,
        metavar="N",
        help="dense-weight width in bits (affine, group 64; default 4, the width the profile's compute "
        "was measured at): resident memory and compute follow it",
    )
    p.add_argument("--trace", default=None, help="a route trace directory or export (hebrus-mlx traces)")
    p.add_argument("--cache-gb", default=None, help="cache sizes to sweep (default: up to the memory budget)")
    p.add_argument(
        "--policies",
        default="clock",
        help="arena policies to sweep: clock (the loader's; the only one recommended), lru, and the "
        "simulator's lfu / belady (a bound) as comparisons",
    )
    p.add_argument("--draft-depths", default="0,1,2,3")
    p.add_argument(
        "--acceptance",
        type=flags.number(0, 1, hi_open=True),
        default=None,
        help="speculative acceptance per drafted token",
    )
    p.add_argument(
        "--check",
        default="fast",
        choices=["fast", "sha256", "off"],
        help="the check every streamed record pays: fast (XXH3-128, artifacts that carry it; the "
        "profile's fast_check_gbps), sha256 (older artifacts; verify_gbps), off",
    )
    p.add_argument("--no-verify", action="store_true", help="the same as --check off")
    p.add_argument(
        "--predictors",
        default="peer",
        choices=["peer", "synthetic"],
        help="what the ahead predictors are credited with: peer (the profile's `predictors`: gains and "
        "recalls public runtimes measured) or synthetic (`synthetic_predictors`: assumed recalls)",
    )
    p.add_argument(
        "--table",
        default=None,
        metavar="FILE",
        help="write the projection table of every shipped profile x expert width x check (markdown, "
        "e.g. docs/PROJECTION.md) and print it",
    )
    p.add_argument("--json", default=None, help="write the projection/validation as JSON")
    add_overwrite_argument(p, "--table/--json")
    p.add_argument("--validate", action="store_true", help="predicted vs measured on this machine")
    p.add_argument("--model", default="demo", help="with --validate: the model to run")
    p.add_argument(
        "--stack",
        default=None,
        choices=["decode"],
        help="with --validate: instead of --model, the real-geometry decode stack of "
        "benchmarks/bench_stream.py --decode (I/O-bound)",
    )
    p.add_argument("--layers", type=flags.integer(1, 1 << 12), default=4, help="with --stack decode: decoder layers")
    p.add_argument(
        "--store",
        default="/tmp/hebrus_bench_experts.bin",
        help="with --stack decode: store path stem (bench_stream's; built on first use)",
    )
    p.add_argument("--prompt-tokens", type=flags.integer(1, 1 << 24), default=32)
    p.add_argument(
        "--gen-tokens",
        type=flags.integer(1, 1 << 24),
        default=None,
        help="decode tokens per run (demo 144, decode stack 16)",
    )
    p.add_argument("--repeats", type=flags.integer(1, 1 << 20), default=3)
    p.add_argument(
        "--rows",
        default=None,
        help="with --validate: expert cache sizes in stored records (demo default 8,16,64,192; the "
        "in-memory arena may get more rows of the same GB, the table shows the rows it got; "
        "decode stack default 20,40,80,160 arena rows)",
    )
    p.add_argument(
        "--prefetch-modes",
        default=None,
        help="with --validate: the predictors to run at each cache size (demo default "
        "off,previous,router-reuse:1,hyper-reuse; decode stack off,previous,router-reuse:1)",
    )
    p.add_argument(
        "--report",
        default=None,
        help="with --validate: a qualify report (hebrus-mlx qualify --report FILE) whose streamed runs "
        "are predicted and compared (nothing is measured here)",
    )
    p.add_argument("--quiet", action="store_true")
    return p


def project_widths(
    profile: str = "m5-pro-48gb",
    expert_bits=(4,),
    dense_bits: int | None = None,
    check: str = "fast",
    predictors: str = "peer",
    cache_gb: str | None = None,
    draft_depths: str = "0,1,2,3",
    memo=None,
    progress: bool = False,
) -> list[dict]:
    """The projection of `simulate --profile P --expert-bits N[,N...]` as one flat dict per width
    (for scripts such as benchmarks/bench_widths.py): the defaults' and the recommended
    configuration's tok/s, flags and limiting term, and what the width did to the record size,
    the cache budget and compute. A PROJECTION, not a measurement."""
    argv = [
        "--profile",
        profile,
        "--expert-bits",
        ",".join(str(int(b)) for b in expert_bits),
        "--check",
        check,
        "--predictors",
        predictors,
        "--draft-depths",
        draft_depths,
    ] + ([] if progress else ["--quiet"])
    if dense_bits is not None:
        argv += ["--dense-bits", str(int(dense_bits))]
    if cache_gb is not None:
        argv += ["--cache-gb", str(cache_gb)]
    res = project_profile(build_parser().parse_args(argv), memo=memo, progress=progress)
    out = []
    for b, c in zip(expert_bits, res["by_codec"]):
        d, best = c.get("default") or {}, c["best"]
        out.append(
            {
                "expert_bits": int(b),
                "codec": c["codec"],
                "dense_codec": res["dense_codec"],
                "profile": res["machine"]["name"],
                "check": check,
                "predictors": predictors,
                "record_bytes": c["geometry"]["record_bytes"],
                "cache_budget_gb": res["cache_budget_gb"],
                "default_tok_s": d.get("tok_s"),
                "default_flags": c.get("default_flags"),
                "default_limit": c.get("default_limit"),
                "default_hit_rate": d.get("hit_rate"),
                "default_mb_per_token": None if not d else d["bytes_per_token"] / 1e6,
                "best_tok_s": best["tok_s"],
                "best_flags": c.get("best_flags"),
                "best_limit": c.get("best_limit"),
                "compute_ms_per_token": None if not d else d["compute_ms"],
                "compute_scale": c.get("compute_scale"),
                "compute_note": c.get("compute_note"),
                "status": res["status"],
            }
        )
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ..artifact.atomic import check_output_file

    for flag, out in (("--table", args.table), ("--json", args.json)):  # before minutes of simulation
        if out is not None:
            check_output_file(out, overwrite=args.overwrite, field=flag)
    if args.report is not None and not args.validate:
        raise UsageError("--report", "goes with --validate (to project from a report: --profile FILE)")
    if args.validate and args.report is not None:
        res = R.validate_report(args)
        R.print_validation(res)
    elif args.validate:
        if args.trace:
            raise UsageError("--trace", "--validate records its own routes")
        if args.gen_tokens is None:
            # Demo: 144 tokens make a run ~2 s (48 made it ~1 s, shorter than the load swings of a
            # shared 2-core machine, and the worst case followed the noise; docs/SIMULATE.md).
            args.gen_tokens = 16 if args.stack == "decode" else 144
        for flag, v in (
            ("--prompt-tokens", args.prompt_tokens),
            ("--gen-tokens", args.gen_tokens),
            ("--repeats", args.repeats),
            ("--layers", args.layers),
        ):
            if v < 1:
                raise UsageError(flag, f"must be >= 1, got {v}")
        if args.prefetch_modes is None:
            args.prefetch_modes = "off,previous,router-reuse:1" + ("" if args.stack == "decode" else ",hyper-reuse")
        for m in parse_list(args.prefetch_modes, str, "--prefetch-modes"):
            try:
                S.prefetch_kind(m)
            except UsageError as e:
                raise UsageError("--prefetch-modes", e.message) from None
            if m == "hyper-reuse" and args.stack == "decode":
                raise UsageError(
                    "--prefetch-modes", "the decode stack has no hyper-connections (hyper-reuse: use --model)"
                )
        if args.stack == "decode":
            from ..simulate.decode_stack import validate_decode

            if args.gen_tokens < 2:
                raise UsageError("--gen-tokens", "the decode stack times tokens 1.. of a cold run: give >= 2")
            args.rows = ",".join(str(x) for x in parse_list(args.rows or "20,40,80,160", flags.integer(1), "--rows"))
            res = validate_decode(args)
        else:
            res = validate(args)
        print_validation(res)
    else:
        if args.acceptance is not None and not 0 <= args.acceptance < 1:
            raise UsageError("--acceptance", f"must be in [0, 1), got {args.acceptance}")
        if args.table:
            res = write_table(args)
        else:
            res = project_profile(args)
            print_projection(res)
    if args.json:
        from ..bench.report import write_json

        write_json(args.json, res, field="--json", overwrite=args.overwrite, schema="hebrus-mlx.simulate")
    return 0


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("simulate", main))
