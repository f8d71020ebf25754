"""Block-FP8 source checkpoints (transformers' FineGrainedFP8 layout).

The layout, as transformers 5.24.0 (`integrations/finegrained_fp8.py`) writes
and reads it and as mlx-vlm's qwen4_exp loader reads the official release:

  config.json  quantization_config = {quant_method: "fp8", fmt: "e4m3",
               weight_block_size: [br, bc], scale_fmt: "float", ...}
  X            float8_e4m3fn ([rows, cols], or [E, rows, cols] when fused)
  X_scale_inv  float per br x bc block: [..., ceil(rows/br), ceil(cols/bc)];
               edge blocks are partial and use their block's scale.
               (X is usually `...weight`, so the scale is `...weight_scale_inv`.)
  PLE table    `...ngram_embedding.shard_{s}.weight` float8_e4m3fn with ONE
               per-tensor `...ngram_embedding.weight_scale` ([1] or []) for all
               shards (transformers' FP8Embedding), or per-shard block scales.

Dequantization is exact float32 arithmetic: the e4m3 value (exact in f32)
times its block's float32 scale, one IEEE multiply, exactly what
`w.float() * scale` computes. Conversion then encodes that float32 tensor
like any float32 source. numpy has no float8 type, so the bytes are decoded
through a 256-entry table; torch is never imported here.
"""

import math

import numpy as np

from ..artifact.errors import ArtifactError

FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")
SCALE_INV_SUFFIX = "_scale_inv"
PLE_TENSOR_SCALE = ".ple.ple_embedding.ngram_embedding.weight_scale"


class Fp8Error(ArtifactError):
    """A block-FP8 source tensor, scale or quantization_config is malformed."""


def _e4m3fn_table():
    """float32 value of every e4m3fn byte: 1 sign, 4 exponent (bias 7),
    3 mantissa bits; no infinities; S.1111.111 is NaN; exponent 0 is
    subnormal (m/8 * 2^-6)."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    sub = (man / 8.0) * 2.0**-6
    v = sign * np.where(exp == 0, sub, normal)
    v[(exp == 15) & (man == 7)] = np.nan
    return v.astype(np.float32)


E4M3FN = _e4m3fn_table()


def decode_e4m3(raw):
    """float32 ndarray (flat) of e4m3fn bytes."""
    return E4M3FN[np.frombuffer(raw, np.uint8)]


def block_config(config):
    """(rows, cols) of a block when config.json declares block-FP8; None when
    it declares no quantization. Anything else is refused naming the field."""
    q = config.get("quantization_config")
    if q is None and isinstance(config.get("text_config"), dict):
        q = config["text_config"].get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise Fp8Error("quantization_config", "must be an object")
    if q.get("quant_method") != "fp8":
        raise Fp8Error(
            "quantization_config.quant_method",
            f"{q.get('quant_method')!r} is not a supported source quantization (fp8 only)",
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise Fp8Error("quantization_config.fmt", f"{q.get('fmt')!r}; only e4m3 is supported")
    if q.get("scale_fmt", "float") != "float":
        raise Fp8Error("quantization_config.scale_fmt", f"{q.get('scale_fmt')!r}; only float scales are supported")
    if q.get("expert_dtype", "fp8") != "fp8":
        raise Fp8Error("quantization_config.expert_dtype", f"{q.get('expert_dtype')!r}; only fp8 is supported")
    block = q.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(type(v) is int and v > 0 for v in block):
        raise Fp8Error("quantization_config.weight_block_size", f"{block!r} is not two positive integers")
    return tuple(block)


class Fp8Scales:
    """Which scale dequantizes each FP8 tensor of a source index; validated
    against the headers before anything is written.

    `index` maps key -> (path, base, header entry) and has the scale tensors
    removed from it (they are not model tensors) by `attach`."""

    def __init__(self, index, block):
        self.block = block
        self.scale_of = {}  # fp8 key -> (scale key, "block" | "tensor")
        self.entries = {}  # scale key -> index entry
        fp8 = sorted(k for k, (_, _, e) in index.items() if e["dtype"] == FP8_DTYPE)
        scales = sorted(k for k in index if k.endswith(SCALE_INV_SUFFIX) or k.endswith(PLE_TENSOR_SCALE))
        if fp8 and block is None:
            raise Fp8Error(
                f"source.{fp8[0]}.dtype", "float8_e4m3fn tensor but config.json has no fp8 quantization_config"
            )
        if scales and block is None:
            raise Fp8Error(f"source.{scales[0]}", "scale tensor but config.json has no fp8 quantization_config")
        for s in scales:
            self.entries[s] = index.pop(s)
        for s in scales:
            if s.endswith(SCALE_INV_SUFFIX):
                owner = s[: -len(SCALE_INV_SUFFIX)]
                self._bind(index, owner, s, "block")
            else:  # one per-tensor scale for every shard of the table
                stem = s[: -len("weight_scale")]
                shards = sorted(k for k in index if k.startswith(stem + "shard_") and k.endswith(".weight"))
                if not shards:
                    raise Fp8Error(f"source.{s}", "per-tensor PLE scale without ngram_embedding shards")
                for k in shards:
                    self._bind(index, k, s, "tensor")
        for k in fp8:
            if k not in self.scale_of:
                raise Fp8Error(f"source.{k}{SCALE_INV_SUFFIX}", "missing: float8_e4m3fn tensor without its scale")

    def _bind(self, index, owner, scale, kind):
        if owner not in index:
            raise Fp8Error(f"source.{scale}", f"scale without its tensor {owner!r}")
        e = index[owner][2]
        if e["dtype"] != FP8_DTYPE:
            raise Fp8Error(f"source.{owner}.dtype", f"{e['dtype']} tensor has a scale ({scale}); expected {FP8_DTYPE}")
        if owner in self.scale_of:
            raise Fp8Error(f"source.{owner}", f"two scales ({self.scale_of[owner][0]} and {scale})")
        se = self.entries[scale][2]
        if se["dtype"] not in SCALE_DTYPES:
            raise Fp8Error(f"source.{scale}.dtype", f"{se['dtype']}; expected one of {SCALE_DTYPES}")
        shape = list(e["shape"])
        if kind == "block":
            if len(shape) < 2:
                raise Fp8Error(f"source.{owner}.shape", f"{shape}: block-FP8 needs a matrix")
            (br, bc), (rows, cols) = self.block, shape[-2:]
            want = shape[:-2] + [math.ceil(rows / br), math.ceil(cols / bc)]
        else:
            want = None
        if (want is not None and list(se["shape"]) != want) or (want is None and list(se["shape"]) not in ([], [1])):
            raise Fp8Error(
                f"source.{scale}.shape",
                f"{list(se['shape'])} != {want if want is not None else '[1] or []'} for {owner} {shape}",
            )
        self.scale_of[owner] = (scale, kind)

    def dequantize(self, key, values, shape, start, read_scale):
        """float32 [shape] of FP8 tensor `key` (rows [start, start+shape[0])
        of its first axis when start is not None); `values` are the decoded
        e4m3 values. read_scale(scale_key, start, stop) -> float32 ndarray."""
        scale_key, kind = self.scale_of[key]
        w = values.reshape(shape)
        if kind == "tensor":
            s = read_scale(scale_key, None, None).reshape(())
            self._finite(scale_key, s)
            return w * s
        br, bc = self.block
        first = 0 if start is None else start
        if len(shape) == 2:  # a row slice of a matrix: only its block rows
            lo = first // br
            s = read_scale(scale_key, lo, math.ceil((first + shape[0]) / br))
            ri = (first + np.arange(shape[0])) // br - lo
        else:  # a slice of the leading (expert) axis: the same scale slice
            s = read_scale(scale_key, start, None if start is None else start + shape[0])
            ri = np.arange(shape[-2]) // br
        self._finite(scale_key, s)
        # Scales expanded over rows only (small); columns broadcast through a
        # block view of the weight. Same single f32 multiply per element.
        srow = s[..., ri, :]
        cols = shape[-1]
        full, rem = divmod(cols, bc)
        out = np.empty(shape, np.float32)
        lead = tuple(shape[:-1])
        np.multiply(
            w[..., : full * bc].reshape(lead + (full, bc)),
            srow[..., :full, None],
            out=out[..., : full * bc].reshape(lead + (full, bc)),
        )
        if rem:
            np.multiply(w[..., full * bc :], srow[..., full : full + 1], out=out[..., full * bc :])
        return out

    @staticmethod
    def _finite(scale_key, s):
        bad = ~np.isfinite(s)
        if bad.any():
            where = [int(i) for i in np.argwhere(bad)[0]]
            raise Fp8Error(f"source.{scale_key}", f"non-finite scale {s[tuple(where)]} at block {where}")
