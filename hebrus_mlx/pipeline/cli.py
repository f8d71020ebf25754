"""The CLI side of a pipeline launch: rank 0 loads its stage and the tokenizer and returns them to
the verb; every other rank serves until rank 0 stops it, then reports its counters."""

from __future__ import annotations

import sys

from . import gather_stats, load_pipeline
from .stage import PipelineError


def load_or_serve(path, args):
    """(pipeline, model, tokenizer) on rank 0; (None, None, None) on a serving rank once done."""
    from ..text.tokenizer import load_tokenizer

    from ..errors import UsageError
    from ..stream.predict import prefetch_from_args
    from ..stream.sweep import sweep_from_args

    if args.dtype != "auto":
        raise UsageError("--dtype", "pipeline stages run in the default dtype (float32 on CPU) for now")
    pipe = load_pipeline(path, split=args.pipeline_split, expert_cache_gb=args.expert_cache_gb,
                         ple_cache_gb=args.ple_cache_gb, prefetch=prefetch_from_args(args),
                         prefill_sweep=sweep_from_args(args))
    if pipe.rank != 0:
        try:
            stats = pipe.serve()
        except PipelineError as e:
            print(f"hebrus-mlx: rank {pipe.rank}: error: {e}", file=sys.stderr)
            sys.exit(1)
        gather_stats(pipe.group, stats["forwards"], stats["comm_seconds"], stats["comm_bytes"])
        return None, None, None
    tokenizer = load_tokenizer(path, physical_vocab_size=pipe.model.args.vocab_size)
    return pipe, pipe.model, tokenizer


def finish(model, verbose: bool = True):
    """Stop the serving ranks and print one line per rank: layers, peak memory, wait on the link."""
    model.stop()
    rows = gather_stats(model.group, model.forwards, model.comm_seconds, model.comm_bytes)
    if not verbose:
        return
    for st, (peak, seconds, nbytes, forwards) in zip(model.all_stages, rows):
        per = seconds / forwards * 1e3 if forwards else 0.0
        # Rank 0's wait includes the other ranks' compute: it is the pipeline's critical path.
        print(f"Rank {st.rank}: layers {st.start}-{st.stop - 1}, peak memory {peak:.3f} GB, "
              f"waiting on the link {per:.2f} ms and {nbytes / max(forwards, 1) / 1024:.1f} KiB per forward")
