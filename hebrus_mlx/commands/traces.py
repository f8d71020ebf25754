"""`hebrus-mlx traces {replay,export,eval}`: route-trace tools (issue 11, AFN-021).

    hebrus-mlx traces replay DIR [--model M] [--prefill-step-size N] [--json F]
    hebrus-mlx traces export DIR --out OUT [--split-by sequence|owner] [--fractions 0.8,0.1,0.1]
    hebrus-mlx traces eval DIR|OUT [--model M] [--budgets 4,8,16] [--json F] [--plot F.png]
                                   [--cache-sim] [--cache-sizes 5,10,20,30,50]

Exit status: 0 ok; 1 replay parity failed; 2 bad input (one line on stderr, nothing published).
"""

from __future__ import annotations

import argparse
import sys

from .. import flags
from ..errors import UsageError
from ..flags import positive_ints
from .cli_args import ArgumentParser, add_overwrite_argument


def build_parser():
    p = ArgumentParser(prog="hebrus-mlx traces", description="Route traces: replay, export, eval.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=ArgumentParser)
    r = sub.add_parser("replay", help="recompute routes by causal prefill and check exact parity")
    r.add_argument("trace_dir")
    r.add_argument("--model", default="demo")
    r.add_argument("--prefill-step-size", type=flags.integer(1), default=2048)
    r.add_argument("--json", default=None, help="write the per-sequence parity report here")
    add_overwrite_argument(r, "--json")
    e = sub.add_parser("export", help="write a safetensors dataset + manifest.json for external trainers")
    e.add_argument("trace_dir")
    e.add_argument("--out", required=True)
    e.add_argument("--split-by", choices=("sequence", "owner"), default="sequence")
    e.add_argument("--fractions", default="0.8,0.1,0.1", help="train,validation,test")
    e.add_argument("--shard-tokens", type=flags.integer(1), default=65536)
    e.add_argument("--id-dtype", choices=("int16", "int32"), default="int16")
    e.add_argument("--weight-dtype", choices=("float16", "float32"), default="float32")
    v = sub.add_parser("eval", help="history/router-reuse controls and the expert-cache simulator")
    v.add_argument("source", help="a trace DIR or an export OUT")
    v.add_argument("--model", default=None, help="recompute router inputs by replay for the router-reuse controls")
    v.add_argument("--budgets", default=None, help="candidates per layer, e.g. 4,8,16 (default k,2k,4k)")
    v.add_argument("--split", default="test", help="evaluate on this split (exports; frequency is fit on train)")
    v.add_argument("--prefill-step-size", type=flags.integer(1), default=512)
    v.add_argument("--json", default=None)
    v.add_argument("--plot", default=None)
    add_overwrite_argument(v, "--json/--plot")
    v.add_argument("--cache-sim", action="store_true")
    v.add_argument("--cache-sizes", default="5,10,20,30,50", help="percent of the expert store")
    v.add_argument("--seed", type=flags.seed(), default=0)
    return p


def _replay(args) -> int:
    from ..loader import load
    from ..traces.replay import replay
    from ..traces.shards import read_trace

    if args.prefill_step_size < 1:
        raise UsageError("--prefill-step-size", f"must be >= 1, got {args.prefill_step_size}")
    _check_outputs(args, ("--json",))
    traces = read_trace(args.trace_dir)
    model, tokenizer = load(args.model)
    results = replay(model, tokenizer, traces, chunk=args.prefill_step_size)
    L = traces.identity.num_layers
    total = sum(r.tokens for r in results)
    dec = sum(r.decode_tokens for r in results)
    per_layer = [sum(r.mismatches_per_layer[i] for r in results) for i in range(L)]
    tied = [sum(r.tied_per_layer[i] for r in results) for i in range(L)]
    bad = [r for r in results if not r.ok]
    print(
        f"replay: {len(results)} sequences, {total} tokens ({dec} decode-fed), {L} layers, "
        f"chunk {args.prefill_step_size}"
    )
    print("mismatched rows per layer: " + " ".join(str(x) for x in per_layer))
    print("exact-tie rows per layer (ranked by expert id, checked exactly): " + " ".join(str(x) for x in tied))
    print(f"max |weight diff| on matching rows: {max((r.max_weight_diff for r in results), default=0):.2e}")
    for r in bad:
        print(f"sequence {r.sequence_id} (owner {r.owner}): {r.diagnosis}")
        for ex in r.examples:
            print(
                f"  position {ex['position']} layer {ex['layer']}: recorded {ex['recorded']} replayed {ex['replayed']}"
            )
    print("parity: " + ("exact" if not bad else f"FAILED in {len(bad)} of {len(results)} sequences"))
    if args.json:
        from ..traces.export import write_report_json

        write_report_json(
            args.json,
            {
                "identity": traces.identity.to_dict(),
                "chunk": args.prefill_step_size,
                "sequences": [r.__dict__ for r in results],
            },
            field="--json",
            overwrite=args.overwrite,
            schema="hebrus-mlx.traces-replay",
        )
    return 0 if not bad else 1


def _flags_as_named(args, *names) -> dict:
    """The flags a verb passes on as they are, to a keyword of the same name."""
    return {name: getattr(args, name) for name in names}


def _export(args) -> int:
    from ..traces.export import export

    fr = args.fractions.split(",")
    try:
        fractions = [flags.number(0, 1)(x) for x in fr]
    except argparse.ArgumentTypeError:
        raise UsageError("--fractions", f"expected three numbers, got {args.fractions!r}") from None
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6:
        raise UsageError("--fractions", f"expected three non-negative numbers summing to 1, got {args.fractions!r}")
    if args.shard_tokens < 1:
        raise UsageError("--shard-tokens", f"must be >= 1, got {args.shard_tokens}")
    m = export(
        args.trace_dir,
        args.out,
        fractions=fractions,
        **_flags_as_named(args, "split_by", "shard_tokens", "id_dtype", "weight_dtype"),
    )
    print(
        f"exported {m['counts']['tokens']} tokens, {m['counts']['sequences']} sequences to {args.out}: "
        + ", ".join(f"{k} {v['tokens']} tokens" for k, v in m["splits"].items())
    )
    return 0


def _check_outputs(args, names) -> None:
    """User-named outputs are checked before the work (and again when published)."""
    from ..artifact.atomic import check_output_file

    for flag in names:
        path = getattr(args, flag[2:])
        if path is not None:
            check_output_file(path, overwrite=args.overwrite, field=flag)


def _eval(args) -> int:
    from ..traces.eval import run_eval

    _check_outputs(args, ("--json", "--plot"))
    budgets = positive_ints(args.budgets, "--budgets") if args.budgets else None
    sizes = positive_ints(args.cache_sizes, "--cache-sizes")
    if max(sizes) > 100:
        raise UsageError("--cache-sizes", f"percentages must be <= 100, got {args.cache_sizes!r}")
    report = run_eval(
        args.source,
        budgets=budgets,
        cache_sizes=sizes,
        chunk=args.prefill_step_size,
        json_path=args.json,
        plot_path=args.plot,
        **_flags_as_named(args, "model", "split", "cache_sim", "seed", "overwrite"),
    )
    print(report["text"])
    return 0


def main(argv=None) -> int:
    """`hebrus-mlx traces`; typed errors (TraceError, UsageError) propagate to `cli.run`."""
    args = build_parser().parse_args(argv)
    return {"replay": _replay, "export": _export, "eval": _eval}[args.cmd](args)


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("traces", main))
