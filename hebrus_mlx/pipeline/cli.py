"""The CLI side of a pipeline launch: rank 0 loads its stage and the tokenizer and returns them to
the verb; every other rank serves until rank 0 stops it, then reports its counters."""

from __future__ import annotations

import sys

from . import gather_stats, load_pipeline
from .stage import PipelineError, collective


def load_or_serve(path, args):
    """(pipeline, model, tokenizer) on rank 0; (None, None, None) on a serving rank once done."""
    from ..cli_args import graph_options_from_args, prefetch_from_args, sweep_from_args
    from ..errors import UsageError

    if args.dtype != "auto":
        raise UsageError("--dtype", "pipeline stages run in the default dtype (float32 on CPU) for now")
    if getattr(args, "expert_mirror", None) is not None:
        raise UsageError("--expert-mirror", "pipeline stages do not read a mirror yet")
    pipe = load_pipeline(
        path,
        split=args.pipeline_split,
        timeout=args.pipeline_timeout,
        expert_cache_gb=args.expert_cache_gb,
        ple_cache_gb=args.ple_cache_gb,
        prefetch=prefetch_from_args(args),
        prefill_sweep=sweep_from_args(args),
        mtp=getattr(args, "draft_model", None) == "mtp",
        options=graph_options_from_args(args),
    )
    return serve_or_return(pipe, path)


def serve_or_return(pipe, path):
    """On a serving rank: serve until rank 0 stops, report the counters, return (None, None, None).
    On rank 0: (pipeline, model, tokenizer)."""
    from ..text.tokenizer import load_tokenizer

    if pipe.rank != 0:
        try:
            stats = pipe.serve()
        except PipelineError as e:
            print(f"hebrus-mlx: rank {pipe.rank}: error: {e}", file=sys.stderr)
            sys.exit(1)
        gather_stats(pipe.group, stats["forwards"], stats["comm_seconds"], stats["comm_bytes"])
        _barrier(pipe.group)  # rank 0 may still be writing its report: stay until it is done
        return None, None, None
    tokenizer = load_tokenizer(path, physical_vocab_size=pipe.model.args.vocab_size)
    pipe.model.tokenizer_vocab_size = tokenizer.effective_vocab_size  # generate_step's default, as load's
    return pipe, pipe.model, tokenizer


def _barrier(group):
    import mlx.core as mx

    collective(group, "the closing barrier", mx.distributed.all_sum(mx.array([1.0]), group=group))


def release(model):
    """Let the serving ranks exit (after `finish(..., release=False)` and rank 0's last output):
    `mlx.launch` ends rank 0 as soon as a peer exits."""
    _barrier(model.group)


def finish(model, verbose: bool = True, release_ranks: bool = True) -> list:
    """Stop the serving ranks and print one line per rank: layers, peak memory, wait on the link.
    Returns the rows (one dict per rank). With `release_ranks` false the other ranks stay until
    `release(model)`."""
    model.stop()
    rows = gather_stats(model.group, model.forwards, model.comm_seconds, model.comm_bytes)
    out = [
        {
            "rank": st.rank,
            "layers": [st.start, st.stop - 1],
            "peak_memory_gb": peak,
            "forwards": int(forwards),
            "comm_ms_per_forward": seconds / forwards * 1e3 if forwards else None,
            "bytes_per_forward": nbytes / forwards if forwards else None,
        }
        for st, (peak, seconds, nbytes, forwards) in zip(model.all_stages, rows)
    ]
    if release_ranks:
        release(model)
    if not verbose:
        return out
    for st, (peak, seconds, nbytes, forwards) in zip(model.all_stages, rows):
        per = seconds / forwards * 1e3 if forwards else 0.0
        # Rank 0's wait includes the other ranks' compute: it is the pipeline's critical path.
        print(
            f"Rank {st.rank}: layers {st.start}-{st.stop - 1}, peak memory {peak:.3f} GB, "
            f"waiting on the link {per:.2f} ms and {nbytes / max(forwards, 1) / 1024:.1f} KiB per forward"
        )
    return out
