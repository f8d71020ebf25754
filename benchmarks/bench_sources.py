"""Source-format read cost, side by side (interleaved A/B/B/A rounds, medians):

  * block-FP8 expert matrices (real size: gate/up [640, 2560], down [2560, 640],
    float8_e4m3fn + float32 scale per 128x128 block) read and dequantized
    to float32 by `sources.Source.read`, vs the same matrices stored bf16;
  * an MLX affine4-g64 stacked switch_mlp (mlx-vlm layout) copied per expert
    by `mlx_source.MlxSource.expert_parts`, vs quantizing the bf16 expert
    with `sources.encode` (what a float source costs).

Reported per expert (3 matrices) and as ratios. Files live in a temp dir and
are read warm (page cache), so this is the CPU cost of the formats.

    python benchmarks/bench_sources.py [--experts 16] [--rounds 5]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from hebrus_mlx.convert import sources as CV
from hebrus_mlx.convert.fp8 import E4M3FN

H, M = 2560, 640
SHAPES = {"gate_proj": (M, H), "up_proj": (M, H), "down_proj": (H, M)}


def _write(path, tensors):
    """Minimal safetensors writer: {name: (dtype, shape, bytes)}."""
    header, off, blobs = {}, 0, []
    for name in sorted(tensors):
        dt, shape, raw = tensors[name]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for b in blobs:
            f.write(b)


def _fp8_bytes(rng, shape):
    # codes of finite e4m3 values only (NaN bytes excluded)
    finite = np.flatnonzero(np.isfinite(E4M3FN)).astype(np.uint8)
    return rng.choice(finite, size=shape).tobytes()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="bench-sources-") as d:
        fp8, bf16 = os.path.join(d, "fp8"), os.path.join(d, "bf16")
        os.makedirs(fp8)
        os.makedirs(bf16)
        tf, tb = {}, {}
        for e in range(a.experts):
            for comp, (r, c) in SHAPES.items():
                k = f"model.layers.0.mlp.experts.{e}.{comp}.weight"
                tf[k] = ("F8_E4M3", (r, c), _fp8_bytes(rng, (r, c)))
                tf[k + "_scale_inv"] = (
                    "F32",
                    (r // 128, c // 128),
                    rng.uniform(1e-4, 1e-3, (r // 128, c // 128)).astype(np.float32).tobytes(),
                )
                w = rng.standard_normal((r, c), dtype=np.float32) * 0.02
                tb[k] = ("BF16", (r, c), (w.view(np.uint32) >> 16).astype(np.uint16).tobytes())
        _write(os.path.join(fp8, "model.safetensors"), tf)
        _write(os.path.join(bf16, "model.safetensors"), tb)
        qcfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
        src_f, src_b = CV.Source(fp8, qcfg), CV.Source(bf16, {})
        keys = sorted(k for k in tb)

        def read_all(src):
            for k in keys:
                src.read(k)

        # the MLX import vs quantizing: one stacked switch_mlp per component
        import mlx.core as mx

        stacked = {}
        for comp, (r, c) in SHAPES.items():
            w = mx.array(
                np.stack(
                    [
                        np.frombuffer(tb[f"model.layers.0.mlp.experts.{e}.{comp}.weight"][2], np.uint16).reshape(r, c)
                        for e in range(a.experts)
                    ]
                )
            ).view(mx.bfloat16)
            q, s, b = mx.quantize(w, group_size=64, bits=4)
            stem = f"language_model.model.layers.0.mlp.switch_mlp.{comp}"
            stacked[stem + ".weight"] = q
            stacked[stem + ".scales"] = s
            stacked[stem + ".biases"] = b
        mlx_dir = os.path.join(d, "mlx")
        os.makedirs(mlx_dir)
        mx.save_safetensors(os.path.join(mlx_dir, "model.safetensors"), stacked)
        from hebrus_mlx.convert.mlx_source import MlxSource

        src_m = MlxSource(mlx_dir, {"quantization": {"group_size": 64, "bits": 4}})

        class Fam:  # the expert geometry expert_parts needs
            @staticmethod
            def component_shapes():
                return {"gate": (M, H), "up": (M, H), "down": (H, M)}

        def copy_all():
            for e in range(a.experts):
                src_m.expert_parts(0, e, Fam, "affine4-g64", "mlx")

        def quantize_all():
            for k in keys:
                x, dt = src_b.read(k)
                CV.encode(x, dt, "affine4-g64")

        pairs = {
            "fp8 read+dequant / bf16 read": (lambda: read_all(src_f), lambda: read_all(src_b)),
            "mlx affine4 copy / bf16 read+quantize": (copy_all, quantize_all),
        }
        for name, (fa, fb) in pairs.items():
            fa(), fb()  # warm
            ta, tb_ = [], []
            for i in range(a.rounds):
                order = (fa, fb) if i % 2 == 0 else (fb, fa)
                for f in order:
                    t = time.perf_counter()
                    f()
                    (ta if f is fa else tb_).append(time.perf_counter() - t)
            ma, mb = statistics.median(ta), statistics.median(tb_)
            print(
                f"{name}: {1e3 * ma / a.experts:.2f} ms vs {1e3 * mb / a.experts:.2f} ms per expert "
                f"(3 matrices) = {ma / mb:.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
