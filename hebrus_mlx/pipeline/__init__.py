"""Pipeline parallelism across processes or Macs with MLX's own distributed backend.

Launch any verb under `mlx.launch` (e.g. `mlx.launch --backend ring -n 2 "$(command -v hebrus-mlx)"
generate --model demo -p hi`): rank 0 tokenizes, samples and prints; every other rank serves its
layer range until rank 0 is done. See `split.py` for who owns what and `stage.py` for the wire.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .split import PipelineSplitError, Stage, layer_bytes, parse_split, plan_split, stages

__all__ = ["PipelineSplitError", "Stage", "launched", "load_pipeline", "local_hostfile", "Pipeline", "gather_stats"]


def local_hostfile(path, ranks: int) -> Path:
    """Write an `mlx.launch`-style ring hostfile for `ranks` processes on this machine (free
    loopback ports), for running a pipeline by hand: set MLX_HOSTFILE to it and MLX_RANK per
    process. Returns the path."""
    import json
    import socket

    socks = [socket.socket() for _ in range(ranks)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    path = Path(path)
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return path


def launched() -> bool:
    """True when started by `mlx.launch` (or by hand with its variables) with more than one rank."""
    return os.environ.get("MLX_RANK") is not None and (
        os.environ.get("MLX_HOSTFILE") is not None or os.environ.get("OMPI_COMM_WORLD_SIZE") is not None
    )


@dataclass
class Pipeline:
    rank: int
    size: int
    stage: Stage
    counts: list
    group: object
    model: object  # PipelineModel on rank 0, the pruned Model elsewhere
    timeout: float | None = None

    def serve(self) -> dict:
        from .stage import DEFAULT_TIMEOUT_S, serve

        return serve(self.model, self.stage, self.group, DEFAULT_TIMEOUT_S if self.timeout is None else self.timeout)


def load_pipeline(
    path,
    group=None,
    split: str | None = None,
    timeout: float | None = None,
    reserve_bytes: int | None = None,
    expert_cache_gb: float | None = None,
    ple_cache_gb: float | None = None,
    prefetch=None,
    mtp: bool = False,
    prefill_sweep=None,
    options=None,
    settings=None,
) -> Pipeline:
    """Admit the artifact on this rank, agree on the split with the other ranks (each rank's free
    memory, gathered over the group), load this rank's stage only — streaming its experts / PLE
    pages from its own SSD when its share does not fit or a cache size is given. `mtp`: rank 0
    also loads the final mixer, lm_head and MTP head (when the artifact has one) to draft with it.
    options: the GraphOptions the stage is built with, as `load`'s (the machine profile applied
    the same way: `loader.configure_runtime`)."""
    import mlx.core as mx

    from .. import admission
    from ..artifact import constants as C
    from ..loader import configure_runtime
    from ..loading.build_model import load_artifact_model
    from ..loading.plan import RESERVE_BYTES, available_memory
    from ..loading.settings import resolve
    from .stage import DEFAULT_TIMEOUT_S, PipelineModel, collective, set_nodelay, terminate_as_error

    # The streaming settings, checked once before any rank talks to another.
    settings = resolve(
        settings,
        expert_cache_gb=expert_cache_gb,
        ple_cache_gb=ple_cache_gb,
        prefetch=prefetch,
        prefill_sweep=prefill_sweep,
    )
    group = group or mx.distributed.init()
    set_nodelay()
    rank, size = group.rank(), group.size()
    path = Path(path)
    if not (path / C.MANIFEST_NAME).is_file():
        raise PipelineSplitError("model", f"pipeline runs need a converted artifact; {path} has no manifest")
    manifest = admission.admit(str(path))
    reserve = RESERVE_BYTES if reserve_bytes is None else reserve_bytes
    mine = max(available_memory() - reserve, 0) >> 20  # MiB: exact in float32 up to 16 TiB
    budgets = collective(group, "the split agreement", mx.distributed.all_gather(mx.array([float(mine)]), group=group))
    budgets = [int(b) << 20 for b in budgets.tolist()]
    per_layer, first, last, streamable = layer_bytes(manifest)
    n = manifest.family.num_hidden_layers
    heads = mtp and manifest.mtp is not None and size > 1
    if heads:  # rank 0 holds a copy of the last rank's heads and the MTP store
        first += last + manifest.mtp.size
    counts = plan_split(
        per_layer, first, last, budgets, parse_split(split, n, size) if split else None, streamable=streamable
    )
    stage = stages(counts, heads)[rank]
    configure_runtime(options)
    model = load_artifact_model(manifest, stage=stage, options=options, settings=settings)
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    if rank == 0:
        import threading

        if threading.current_thread() is threading.main_thread():  # the server loads on its worker thread
            terminate_as_error()
        model = PipelineModel(model, stage, group, timeout=timeout)
        model.all_stages = stages(counts, heads)
    return Pipeline(rank, size, stage, counts, group, model, timeout)


def gather_stats(group, forwards: int, comm_seconds: float, comm_bytes: int) -> list:
    """Every rank's (peak memory GB, communication seconds, bytes, forwards), gathered on all."""
    import mlx.core as mx

    from .stage import collective

    mine = mx.array([[mx.get_peak_memory() / 1e9, comm_seconds, float(comm_bytes), float(forwards)]])
    return collective(group, "the final counters", mx.distributed.all_gather(mine, group=group)).tolist()
