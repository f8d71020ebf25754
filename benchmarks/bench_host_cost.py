"""Host cost of one decode step: hebrus-mlx vs mlx-vlm 0.7.10 `qwen4_exp` vs mlx-lm `qwen3_next`.

On a GPU the host's time to build and dispatch a decode step is what the GPU waits on. Per model,
at the same dims (benchmarks/bench_graph.py's, the default small ones where per-step cost
dominates): the host ms to build one decode step's graph (the model call and the argmax, lazy:
nothing evaluated; hebrus-mlx's per-layer async_eval is held back while building, see _NoAsyncEval),
as the building thread's CPU time (the build runs on that one thread; on this shared machine its wall
time also counts the other jobs' turns on the cores),
the graph's node count (MLX's own DOT export of that graph), and the whole step (build + evaluate on
the CPU backend). Steps alternate between models (A/B/B/A...) so load hits all alike; medians over
the steps. Prints ratios hebrus / peer (below 1.0: cheaper than the peer).

hebrus-mlx runs twice: with the options its loader resolves on this CPU backend (no compiled
regions, two CPU streams) and with the ones it resolves on a GPU (compiled regions, one stream, no
[in, out] weights or rope tables): the GPU's host cost is what the question is about, and the peers
compile their regions on every backend. The fast ops (rms_norm, rope, SDPA) are one node each on a
GPU and their ops fallback here, for all models alike.

Run: python benchmarks/bench_host_cost.py [--steps 32] [--skip-vlm] [bench_graph dims, e.g. --hidden 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_graph as G  # noqa: E402

from hebrus_mlx.models import optimize  # noqa: E402
from hebrus_mlx.models.options import GraphOptions  # noqa: E402

# What GraphOptions().resolved() gives on a GPU (models/options.py).
GPU_OPTIONS = GraphOptions(compile=True, in_major=False, rope_tables=False, cpu_streams=1)
GPU_ROW = "hebrus-mlx, GPU options"


def graph_nodes(out: mx.array) -> int:
    """Nodes of the unevaluated graph behind `out` (MLX's DOT export: one line per node)."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        return sum(1 for line in Path(f.name).read_text().splitlines() if "[" in line and "->" not in line)


class _NoAsyncEval:
    """While building a step's graph, `mx.async_eval` does nothing: hebrus-mlx starts each resident
    layer's evaluation while it builds the next (on a CPU that computes during the build, so the
    build would time compute too); every model's whole graph is then built, counted and evaluated
    at once."""

    def __enter__(self):
        self.real = mx.async_eval
        mx.async_eval = lambda *a, **k: None

    def __exit__(self, *exc):
        mx.async_eval = self.real


def host_costs(models: dict, prompt: mx.array, steps: int) -> dict:
    """{name: {"host_ms", "step_ms", "nodes"}} medians over `steps` alternating decode steps."""
    states = {}
    for name, m in models.items():
        cache = m.make_cache()
        mx.eval(G._logits(m, prompt, cache))
        states[name] = [cache, prompt[:, -1:]]
    host = {n: [] for n in models}
    step = {n: [] for n in models}
    nodes = {}
    names = list(models)
    for s in range(steps):
        for name in names if s % 2 == 0 else reversed(names):
            m = models[name]
            cache, token = states[name]
            with _NoAsyncEval():
                c0, t0 = time.thread_time(), time.perf_counter()
                nxt = mx.argmax(G._logits(m, token, cache)[:, -1:], axis=-1).astype(mx.int32)
                c1, t1 = time.thread_time(), time.perf_counter()
            if name not in nodes:
                nodes[name] = graph_nodes(nxt)
            t2 = time.perf_counter()
            mx.eval(nxt)
            t3 = time.perf_counter()
            host[name].append((c1 - c0) * 1e3)
            step[name].append((t1 - t0 + t3 - t2) * 1e3)
            states[name][1] = nxt
    return {
        n: {"host_ms": statistics.median(host[n]), "step_ms": statistics.median(step[n]), "nodes": nodes[n]}
        for n in models
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, (default, text) in G.DIMS.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=text)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--skip-vlm", action="store_true")
    a = p.parse_args(argv)
    a.checkpoint = None
    a.decode = a.steps
    ids = np.random.default_rng(1).integers(3, a.vocab, size=(1, a.prompt)).astype(np.int32)
    models = {}
    with tempfile.TemporaryDirectory(prefix="bench-host-") as tmp:
        if not a.skip_vlm:
            from peer_mlx_vlm import PeerUnavailable, from_hebrus

            from hebrus_mlx.loader import load_hf_model

            G.build_checkpoint(a, Path(tmp))
            ours = load_hf_model(tmp)
            try:
                models["mlx-vlm qwen4_exp"] = from_hebrus(ours, json.loads((Path(tmp) / "config.json").read_text()))
            except PeerUnavailable as e:
                print(f"mlx-vlm: skipped ({e})")
            models["hebrus-mlx"] = ours
            models[GPU_ROW] = load_hf_model(tmp, options=GPU_OPTIONS)
        else:
            models["hebrus-mlx"] = G.built(a)
            models[GPU_ROW] = G.hebrus_model(a)
            G.init_weights(models[GPU_ROW])
            optimize.apply(models[GPU_ROW], GPU_OPTIONS)
    lm = G.mlx_lm_model(a)
    G.init_weights(lm)
    models["mlx-lm qwen3_next"] = lm
    got = host_costs(models, mx.array(ids), a.steps)
    print(
        f"dims: hidden={a.hidden} layers={a.layers} heads={a.heads}/{a.kv_heads} experts={a.experts} "
        f"top-k={a.top_k}; {a.steps} decode steps, medians; CPU backend"
    )
    print("| model | host ms to build a step (thread CPU) | graph nodes | step ms (build + eval, wall) |")
    print("|---|---|---|---|")
    for name, r in got.items():
        print(f"| {name} | {r['host_ms']:.2f} | {r['nodes']} | {r['step_ms']:.2f} |")
    for own in ("hebrus-mlx", GPU_ROW):
        ours = got[own]
        for name, r in got.items():
            if not name.startswith("hebrus-mlx"):
                print(
                    f"{own} / {name}: host {ours['host_ms'] / r['host_ms']:.2f}x, "
                    f"nodes {ours['nodes'] / r['nodes']:.2f}x, step {ours['step_ms'] / r['step_ms']:.2f}x"
                )


if __name__ == "__main__":
    main()
