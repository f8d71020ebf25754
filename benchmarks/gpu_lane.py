"""The GPU lane's driver: hebrus-mlx on MLX's CUDA backend (benchmarks/gpu_lane.sh installs and
builds, then runs this). The first non-CPU evidence for the graph; it is not Metal.

Sections, each recorded even when another fails (status "failed" with the error):
1. environment: MLX and its backend, the GPU, PyTorch, the extension;
2. parity: a transformers Qwen4Exp checkpoint (save_pretrained, seeded random weights at the
   lane's dims) against the reference on torch: hebrus in float32 vs transformers float32 (torch on
   the CPU) and hebrus in bfloat16 vs transformers bfloat16 (torch on CUDA where it has it); max
   |logit diff| over the prompt, top-1 agreement, and mlx-vlm 0.7.10's own float32 parity beside;
3. speed: resident bfloat16 decode and prefill tok/s, hebrus vs mlx-vlm 0.7.10 `qwen4_exp` holding
   the same weight arrays on the same device (decode paired token by token, prefill the best of
   interleaved repeats: benchmarks/bench_graph.py's measurement), and each one's peak memory;
4. streamed: the shipped demo artifact resident vs its routed experts streamed through a cache of 5%
   of the expert store (prefetch off and the default), greedy tokens identical, hit rate, exposed
   wait, peak memory - the streamed ops run on the engine's CPU stream and the GPU consumes their
   outputs (MLX's cross-device events);
and writes gpu_lane.json + gpu_lane.md to --out.

    python benchmarks/gpu_lane.py --device gpu --out DIR        # on the GPU machine (gpu_lane.sh)
    python benchmarks/gpu_lane.py --device cpu --quick --out DIR  # a dry run of the same code here
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The lane's dims, one row a field: (the full run on the GPU, the --quick dry run); hc_lowrank None is
# bench_graph's default (hidden / 8).
DIMS = dict(
    hidden=(768, 128),
    layers=(8, 4),
    heads=(8, 4),
    kv_heads=(2, 1),
    head_dim=(64, 32),
    experts=(64, 8),
    top_k=(8, 2),
    moe_inter=(384, 64),
    vocab=(16384, 512),
    hc_lowrank=(None, None),
    budget=(2048, 64),
    ratio=(4, 4),
    prompt=(256, 16),
    decode=(32, 4),
)
FULL, QUICK = ({field: values[i] for field, values in DIMS.items()} for i in range(2))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--device",
        choices=("gpu", "cpu"),
        default="gpu",
        help="gpu: MLX's GPU backend (CUDA; refused without one); cpu: the dry run",
    )
    p.add_argument("--out", required=True, help="directory for gpu_lane.json and gpu_lane.md")
    p.add_argument("--quick", action="store_true", help="tiny dims and few tokens (the CPU dry run)")
    p.add_argument("--skip-vlm", action="store_true", help="leave out the mlx-vlm peer")
    p.add_argument("--sections", default="parity,speed,streamed")
    return p.parse_args(argv)


def select_device(name: str) -> str:
    """Before anything of hebrus_mlx is imported: the graph reads the default device at import."""
    import mlx.core as mx

    if name == "gpu":
        cuda = getattr(mx, "cuda", None)
        if not ((cuda is not None and cuda.is_available()) or mx.metal.is_available()):
            print(
                "gpu_lane: error: --device: this MLX has no GPU backend (install mlx-cuda-13 / mlx[cuda])",
                file=sys.stderr,
            )
            sys.exit(2)
        mx.set_default_device(mx.gpu)
    else:
        mx.set_default_device(mx.cpu)
    return str(mx.default_device())


def _peak_reset():
    import mlx.core as mx

    mx.synchronize()
    mx.reset_peak_memory()


def _peak_gb():
    import mlx.core as mx

    mx.synchronize()
    return mx.get_peak_memory() / 1e9


# ---- 1. environment ------------------------------------------------------------------------------------


def environment() -> dict:
    import mlx.core as mx

    from hebrus_mlx.machine_profile import compute_backend
    from hebrus_mlx.stream import engine

    out = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "mlx": mx.__version__,
        "backend": compute_backend(),
        "default_device": str(mx.default_device()),
        "extension": engine.available(),
    }
    try:
        info = mx.device_info(mx.gpu)
        out["gpu"] = {k: v for k, v in info.items() if isinstance(v, (str, int, float))} or "none"
    except Exception as e:  # noqa: BLE001  (no GPU backend: the dry run)
        out["gpu"] = f"none ({type(e).__name__})"
    if engine.available():
        out["gpu_events_enabled"] = bool(engine._ext.gpu_events_enabled())
        out["streamed_ops_stream"] = "GPU (events)" if out["gpu_events_enabled"] else "the engine's CPU stream"
    else:
        out["extension_reason"] = engine.unavailable_reason()
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            out["torch_gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        out["torch"] = None
    return out


# ---- 2. parity -----------------------------------------------------------------------------------------


def dims_namespace(d: dict):
    return argparse.Namespace(**d)


def reference(checkpoint: Path, ids, dtype: str, device: str):
    import numpy as np
    import torch
    from transformers.models.qwen4_exp import Qwen4ExpForCausalLM

    td = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = Qwen4ExpForCausalLM.from_pretrained(checkpoint, dtype=td).eval().to(device)
    with torch.no_grad():
        logits = model(torch.from_numpy(ids.astype(np.int64)).to(device)).logits.float().cpu().numpy()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return logits


def _compare(ours, ref) -> dict:
    import numpy as np

    ours = np.asarray(ours, np.float32)
    return {
        "max_abs_logit_diff": float(np.abs(ours - ref).max()),
        "ref_logit_scale": float(np.abs(ref).max()),
        "top1_agreement": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
    }


def _low_dtype():
    """bfloat16 on a GPU backend; float32 on the CPU (MLX's CPU GatherMM has no bfloat16): the dry
    run exercises the same code, not the dtype."""
    import mlx.core as mx

    return mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32


def parity(dims: dict, workdir: Path, skip_vlm: bool) -> dict:
    import bench_graph as G
    import mlx.core as mx
    import numpy as np
    import torch

    from hebrus_mlx.loader import load_hf_model

    a = dims_namespace(dims)
    ckpt = workdir / "checkpoint"
    t0 = time.perf_counter()
    G.build_checkpoint(a, ckpt)
    hf_config = json.loads((ckpt / "config.json").read_text())
    ids = np.random.default_rng(1).integers(3, a.vocab, size=(1, a.prompt)).astype(np.int32)
    bf16_dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref32 = reference(ckpt, ids, "float32", "cpu")
    ref16 = reference(ckpt, ids, "bfloat16", bf16_dev)
    out = {
        "checkpoint": {k: v for k, v in dims.items() if k not in ("prompt", "decode")},
        "prompt_tokens": a.prompt,
        "reference": f"transformers {__import__('transformers').__version__} "
        f"Qwen4ExpForCausalLM on torch {torch.__version__} (float32 on the CPU, bfloat16 on {bf16_dev})",
        "build_s": time.perf_counter() - t0,
    }
    prompt = mx.array(ids)
    low = _low_dtype()
    out["low_precision_dtype"] = str(low).replace("mlx.core.", "")
    for name, dtype, ref in (("float32", mx.float32, ref32), ("bfloat16", low, ref16)):
        _peak_reset()
        ours = load_hf_model(ckpt, dtype=dtype)
        logits = ours(prompt, cache=ours.make_cache())
        mx.eval(logits)
        entry = _compare(np.array(logits.astype(mx.float32)), ref)
        entry["peak_memory_gb"] = _peak_gb()
        if name == "bfloat16":
            entry["vs_float32_reference"] = _compare(np.array(logits.astype(mx.float32)), ref32)
        out[f"hebrus_{name}"] = entry
        if name == "float32" and not skip_vlm:
            out["mlx_vlm_float32"] = _vlm_parity(ours, hf_config, prompt, ref32)
        del ours
    return out


def _vlm_parity(ours, hf_config, prompt, ref):
    import mlx.core as mx
    import numpy as np
    from peer_mlx_vlm import PeerUnavailable, from_hebrus

    try:
        peer = from_hebrus(ours, hf_config)
    except PeerUnavailable as e:
        return {"status": "skipped", "reason": str(e)}
    logits = peer(prompt, cache=peer.make_cache()).logits
    mx.eval(logits)
    return _compare(np.array(logits.astype(mx.float32)), ref)


# ---- 3. speed ------------------------------------------------------------------------------------------


def speed(dims: dict, workdir: Path, skip_vlm: bool) -> dict:
    import bench_graph as G
    import mlx.core as mx
    import numpy as np

    from hebrus_mlx.loader import load_hf_model

    a = dims_namespace(dims)
    ckpt = workdir / "checkpoint"
    if not (ckpt / "config.json").is_file():
        G.build_checkpoint(a, ckpt)
    hf_config = json.loads((ckpt / "config.json").read_text())
    low = _low_dtype()
    ours = load_hf_model(ckpt, dtype=low)
    models, names = [ours], ["hebrus"]
    if not skip_vlm:
        from peer_mlx_vlm import PeerUnavailable, from_hebrus

        try:
            models.append(from_hebrus(ours, hf_config))
            names.append("mlx_vlm")
        except PeerUnavailable as e:
            names.append(f"mlx_vlm skipped: {e}")
    prompt = mx.array(np.random.default_rng(2).integers(3, a.vocab, size=(1, a.prompt)).astype(np.int32))
    G.paired_decode(models, prompt[:, :8], 2)  # warm: compile, kernels, allocator
    decode, tokens = G.paired_decode(models, prompt, a.decode)
    prefill = G.paired_prefill(models, prompt, repeats=4)
    out = {
        "dtype": str(low).replace("mlx.core.", ""),
        "prompt_tokens": a.prompt,
        "decode_tokens": a.decode,
        "method": "decode paired token by token (A/B then B/A), median; prefill best of 4 interleaved",
    }
    for i, m in enumerate(models):
        _peak_reset()
        cache = m.make_cache()
        mx.eval(G._logits(m, prompt, cache))
        for _ in range(4):
            mx.eval(G._logits(m, prompt[:, -1:], cache))
        out[names[i]] = {"decode_tok_s": decode[i], "prefill_tok_s": prefill[i], "peak_memory_gb": _peak_gb()}
    if len(models) == 2:
        out["hebrus_vs_mlx_vlm"] = {"decode": decode[0] / decode[1], "prefill": prefill[0] / prefill[1]}
        out["greedy_tokens_identical"] = tokens[0] == tokens[1]
    elif len(names) == 2:
        out["mlx_vlm"] = {"status": "skipped", "reason": names[1]}
    return out


# ---- 4. streamed vs resident ------------------------------------------------------------------------------


def streamed(dims: dict, fraction: float = 0.05) -> dict:
    from hebrus_mlx.admission import admit
    from hebrus_mlx.bench import harness as H
    from hebrus_mlx.loader import DEMO_DIR, load

    m = admit(str(DEMO_DIR))
    store = m.experts.size
    cache_gb = fraction * store / 2**30
    n = dims["decode"] + 1
    runs = {}
    for name, kw in (
        ("resident", {}),
        ("streamed_5pct_prefetch_off", {"expert_cache_gb": cache_gb, "prefetch": "off"}),
        ("streamed_5pct_default_prefetch", {"expert_cache_gb": cache_gb}),
    ):
        model, tok = load("demo", **kw)
        prompt = H.prompt_ids(tok, 32, 0)
        H.run_once(model, tok, prompt, 2, {})  # warm
        r = H.run_once(model, tok, prompt, n, {})
        runs[name] = {
            "tokens": r["tokens"],
            "decode_tok_s": r["decode_tok_s_p50"],
            "peak_memory_gb": r["peak_memory_gb"],
            "hit_rate": r.get("hit_rate"),
            "exposed_wait_ms_per_token": r.get("exposed_wait_ms_per_token"),
            "arena_rows": r.get("arena_rows"),
            "streamed": model.streaming is not None,
        }
        del model
    base = runs["resident"]["tokens"]
    return {
        "artifact": "the shipped demo (trained weights, affine4 experts)",
        "expert_store_bytes": store,
        "cache_fraction": fraction,
        "cache_gb": cache_gb,
        "greedy_tokens": n,
        "identical": all(r["tokens"] == base for r in runs.values()),
        "runs": {k: {x: y for x, y in v.items() if x != "tokens"} for k, v in runs.items()},
    }


# ---- report ------------------------------------------------------------------------------------------------


def _f(x, f=".2f"):
    return "n/a" if x is None else format(x, f)


def _section(title: str, columns: tuple, *lead: str) -> list:
    """A report section's lines up to its table's rows: the heading, any lead paragraph, the table head."""
    return [
        "",
        f"## {title}",
        "",
        *(x for line in lead for x in (line, "")),
        "| " + " | ".join(columns) + " |",
        "|---" * len(columns) + "|",
    ]


def markdown(res: dict) -> str:
    env = res["sections"].get("environment", {})
    lines = [
        f"# hebrus-mlx GPU lane ({res['device']}{', quick dry run' if res['quick'] else ''})",
        "",
        f"- MLX {env.get('mlx')} ({env.get('backend')} backend), GPU: {env.get('gpu')}, torch {env.get('torch')}; "
        f"{res['wall_s']:.0f} s",
        "- MLX's CUDA backend, not Metal: this says nothing about Apple GPUs"
        if env.get("backend") == "cuda"
        else f"- {env.get('backend')} backend: a dry run of the lane's code, no GPU evidence",
        "",
    ]
    for name, s in res["sections"].items():
        if isinstance(s, dict) and s.get("status") == "failed":
            lines.append(f"- **{name}: failed** - {s['error']}")
    p = res["sections"].get("parity")
    if p and p.get("status") != "failed":
        lines += _section("Parity vs transformers", ("graph", "max abs logit diff", "top-1 agreement"))
        for k in ("hebrus_float32", "hebrus_bfloat16", "mlx_vlm_float32"):
            if k in p and "max_abs_logit_diff" in p[k]:
                label = k if k != "hebrus_bfloat16" else f"hebrus {p['low_precision_dtype']} vs reference bfloat16"
                lines.append(f"| {label} | {p[k]['max_abs_logit_diff']:.3g} | {p[k]['top1_agreement']:.1%} |")
    s = res["sections"].get("speed")
    if s and s.get("status") != "failed":
        lines += _section(
            f"Resident speed ({s['dtype']}, {s['prompt_tokens']}-token prompt)",
            ("graph", "decode tok/s", "prefill tok/s", "peak GB"),
        )
        for k in ("hebrus", "mlx_vlm"):
            if k in s and "decode_tok_s" in s[k]:
                lines.append(
                    f"| {k} | {s[k]['decode_tok_s']:.1f} | {s[k]['prefill_tok_s']:.1f} | {s[k]['peak_memory_gb']:.2f} |"
                )
        if s.get("mlx_vlm", {}).get("status") == "skipped":
            lines.append(f"\nmlx-vlm: skipped ({s['mlx_vlm']['reason']})")
        if "hebrus_vs_mlx_vlm" in s:
            r = s["hebrus_vs_mlx_vlm"]
            lines.append(
                f"\nhebrus / mlx-vlm: decode {r['decode']:.2f}x, prefill {r['prefill']:.2f}x; greedy tokens "
                f"{'identical' if s['greedy_tokens_identical'] else 'DIFFER'}"
            )
    st = res["sections"].get("streamed")
    if st and st.get("status") != "failed":
        lines += _section(
            f"Streamed vs resident (demo, {st['cache_fraction']:.0%} cache)",
            ("run", "decode tok/s", "hit rate", "exposed ms/token", "peak GB"),
            f"greedy tokens over {st['greedy_tokens']} steps: {'identical' if st['identical'] else 'DIFFER'}",
        )
        for k, r in st["runs"].items():
            lines.append(
                f"| {k} | {_f(r['decode_tok_s'], '.1f')} | {_f(r['hit_rate'], '.1%')} | "
                f"{_f(r['exposed_wait_ms_per_token'], '.3f')} | {_f(r['peak_memory_gb'])} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    device = select_device(a.device)
    sys.path.insert(0, str(HERE))
    dims = dict(QUICK if a.quick else FULL)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [s.strip() for s in a.sections.split(",") if s.strip()]
    unknown = set(wanted) - {"parity", "speed", "streamed"}
    if unknown:
        print(f"gpu_lane: error: --sections: unknown {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    res = {"schema": "hebrus-mlx/gpu-lane/1", "device": device, "quick": a.quick, "dims": dims, "sections": {}}

    def run(name, fn, *args):
        t = time.perf_counter()
        try:
            r = fn(*args)
            r["status"] = r.get("status", "ok")
        except Exception as e:  # noqa: BLE001  (one failing section must not lose the others)
            r = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        r["seconds"] = time.perf_counter() - t
        res["sections"][name] = r
        print(f"gpu_lane: {name}: {r['status']} ({r['seconds']:.1f} s)", file=sys.stderr, flush=True)

    run("environment", environment)
    with tempfile.TemporaryDirectory(prefix="gpu-lane-") as tmp:
        if "parity" in wanted:
            run("parity", parity, dims, Path(tmp), a.skip_vlm)
        if "speed" in wanted:
            run("speed", speed, dims, Path(tmp), a.skip_vlm)
    if "streamed" in wanted:
        run("streamed", streamed, dims)
    res["wall_s"] = time.perf_counter() - t0
    (out / "gpu_lane.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    (out / "gpu_lane.md").write_text(md)
    print(md)
    failed = [k for k, v in res["sections"].items() if v.get("status") == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
