"""What each rank does once its stage is loaded under `mlx.launch`: rank 0 gets its stage and the
tokenizer back to generate with; every other rank serves until rank 0 stops it, then reports its
counters (`finish` prints one line per rank). The verbs' flags reach `load_pipeline` through
commands/verb_flags.py's `load_or_serve`."""

from __future__ import annotations

import sys

from . import gather_stats
from .stage import PipelineError, collective


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
