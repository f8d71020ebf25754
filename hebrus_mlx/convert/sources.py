"""Checkpoint sources for `convert`: one tensor at a time out of an HF checkpoint's safetensors
shards (bf16/f32/f16, or block-FP8 dequantized exactly, `fp8`), and the encoders that
turn a float tensor into a store codec's parts. `mlx_source.MlxSource` extends `Source` for
MLX-quantized conversions."""

import os

import numpy as np

from .. import admission
from ..artifact import constants as C
from ..artifact import ple_pages, untrusted
from ..artifact.errors import ArtifactError, GeometryError
from ..format import checkpoint_keys as keys
from ..format.qwen4exp_config import ple_constants
from .fp8 import FP8_DTYPE, Fp8Scales, block_config, decode_e4m3

COMPONENT_HF_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


class Source:
    """Index of every tensor in a checkpoint's shards; reads one at a time."""

    def __init__(self, path, config=None):
        self.path = path
        self.index = {}
        for name in sorted(os.listdir(path)):
            if not name.endswith(".safetensors"):
                continue
            # Inside the checkpoint (a HF cache snapshot's links into its blobs/ included).
            full = untrusted.resolve(path, name, f"source.{name}", links=True)
            n, header, _ = admission.read_safetensors_header(full)
            for key, e in header.items():
                if key in self.index:
                    raise ArtifactError(f"source.{key}", f"in two shards ({self.index[key][0]} and {full})")
                self.index[key] = (full, 8 + n, e)
        # Block-FP8 sources: scale tensors leave the index (they are not
        # model tensors) and dequantize their tensor on read.
        self.fp8 = Fp8Scales(self.index, block_config(config or {}))

    def read(self, key, start=None, stop=None):
        """float32 (or int64 for buffers) ndarray of one source tensor, or of
        rows [start, stop) of its first axis: one pread of just those bytes,
        so a slice of a huge tensor never brings in the rest. A float8
        tensor comes back dequantized by its scales, dtype "F8_E4M3"."""
        raw, shape, dt = self._raw(key, self.index[key], start, stop)
        if dt == FP8_DTYPE:
            a = self.fp8.dequantize(key, decode_e4m3(raw), shape, start, self._scale)
            return a, dt
        return self._decode(key, raw, shape, dt), dt

    def _scale(self, key, start, stop):
        raw, shape, dt = self._raw(key, self.fp8.entries[key], start, stop)
        return self._decode(key, raw, shape, dt)

    def _raw(self, key, entry, start, stop):
        path, base, e = entry
        begin, end = e["data_offsets"]
        shape = list(e["shape"])
        if start is not None:
            if not shape or not 0 <= start <= stop <= shape[0]:
                raise ArtifactError(f"source.{key}", f"rows [{start}, {stop}) outside shape {shape}")
            row = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + start * row, begin + stop * row
            shape[0] = stop - start
        with open(path, "rb") as f:
            raw = os.pread(f.fileno(), end - begin, base + begin)
        if len(raw) != end - begin:
            raise ArtifactError(f"source.{key}", "short read")
        return raw, shape, e["dtype"]

    @staticmethod
    def _decode(key, raw, shape, dt):
        if dt == "BF16":
            a = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dt in ("F32", "F16", "I64"):
            a = np.frombuffer(raw, {"F32": np.float32, "F16": np.float16, "I64": np.int64}[dt])
            a = a.astype(np.float32) if dt == "F16" else a
        else:
            raise ArtifactError(f"source.{key}.dtype", f"unsupported source dtype {dt}")
        return a.reshape(shape)

    def shape(self, key):
        return tuple(self.index[key][2]["shape"])

    # The four things conversion asks of a source (MlxSource answers them too).
    def check(self, args):
        """Classify every key (named exclusions counted) and check the PLE
        constant buffers; returns the counts recorded in the manifest."""
        counts = keys.check_key_set(list(self.index), args)
        check_ple_constants(self, args)
        return counts

    def dense_parts(self, key, shape, codec_name):
        raw = self.key(key)
        if len(shape) == 2 and self.shape(raw) == tuple(shape) and shape[0] * shape[1] > DENSE_CHUNK_VALUES:
            # Row blocks: encoding is per row, so the parts are those of the whole tensor, while
            # memory holds one block's floats instead of the whole (the embedding is 2.5 GB).
            step = max(1, DENSE_CHUNK_VALUES // shape[1])
            pieces = [encode(*self.read(raw, s, min(shape[0], s + step)), codec_name) for s in range(0, shape[0], step)]
            return {part: np.concatenate([p[part] for p in pieces]) for part in pieces[0]}
        a, dt = self.read(raw)
        if key.endswith(keys.DEPTHWISE_CONV_SUFFIXES):
            a = a.transpose(0, 2, 1)  # HF [C, 1, K] -> MLX [C, K, 1]
        if tuple(a.shape) != tuple(shape):
            raise GeometryError(f"source.{key}.shape", f"{list(a.shape)} != expected {list(shape)}")
        return encode(a, dt, codec_name)

    def expert_parts(self, layer, e, fam, codec_name, layout):
        parts = {}
        for comp, (a, dt) in _expert_matrices(self, layout, layer, e, fam).items():
            if tuple(a.shape) != fam.component_shapes()[comp]:
                raise GeometryError(
                    f"source.layers.{layer}.experts.{e}.{COMPONENT_HF_NAMES[comp]}", f"shape {list(a.shape)}"
                )
            parts[comp] = encode(a, dt, codec_name)
        return parts

    def ple_chunks(self, args, layer, codec_name):
        for s in range(args.split_ngram_parts):
            key = self.key(f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{s}.weight")
            rows = self.shape(key)[0]
            for start in range(0, rows, PLE_CHUNK_ROWS):
                a, dt = self.read(key, start, min(rows, start + PLE_CHUNK_ROWS))
                yield encode(a, dt, codec_name)["weight"]

    def key(self, text_key):
        """Raw key for a text-model key, with or without the conditional prefix."""
        if text_key in self.index:
            return text_key
        alt = keys.CONDITIONAL_PREFIX + text_key[len("model.") :] if text_key.startswith("model.") else None
        if alt in self.index:
            return alt
        raise ArtifactError(f"source.{text_key}", "missing")


def to_bf16_bits(a, src_dtype):
    """Round-to-nearest-even float32 -> bf16 bits; exact when the source was bf16."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    if src_dtype == "BF16":
        return (bits >> 16).astype(np.uint16)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(a)
    out[nan] = 0x7FC0
    return out


def encode(a, src_dtype, codec_name):
    """{part: ndarray} of one [rows, cols] (or any-rank float) tensor."""
    c = C.codec(codec_name)
    if codec_name == "f32":
        return {"weight": np.ascontiguousarray(a, np.float32)}
    if codec_name == "bf16":
        return {"weight": to_bf16_bits(a, src_dtype)}
    if codec_name in C.PLE_AFFINE_CODECS:  # [n, width] PLE rows -> self-contained encoded rows
        return {"weight": ple_pages.encode_rows(a, codec_name)}
    import mlx.core as mx  # quantization is the one MLX step of conversion

    rows, cols = a.shape
    c.parts(rows, cols)  # rejects a group that does not cover the row
    w = mx.array(to_bf16_bits(a, src_dtype)).view(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=c.group_size, bits=c.bits)
    return {"weight": np.array(q), "scales": np.array(s.view(mx.uint16)), "biases": np.array(b.view(mx.uint16))}


# Values of a large 2-D dense tensor read and encoded per step (64 MiB of float32).
DENSE_CHUNK_VALUES = 1 << 24

# Rows of a PLE shard read per step: bounds conversion memory by a constant
# however large a shard is.
PLE_CHUNK_ROWS = 1 << 16


def check_ple_constants(src, args):
    for t, layer_id in enumerate(args.ple_layer_ids):
        for name, want in ple_constants(args, t).items():
            key = f"model.layers.{layer_id - 1}.ple.ple_embedding.{name}"
            a, _ = src.read(src.key(key))
            if a.tolist() != want:
                raise ArtifactError(f"source.{key}", f"{a.tolist()} != derived {want}")


def _expert_matrices(src, layout, layer, e, fam):
    """{component: (float32 [rows, in], source dtype)} of one routed expert.

    Fused checkpoints hold gate_up_proj [E, 2*m, h] (gate rows first, as
    upstream chunks the projection output) and down_proj [E, h, m]; only
    expert e's rows are read."""
    m, h = fam.moe_intermediate_size, fam.hidden_size
    prefix = f"model.layers.{layer}.mlp.experts."
    if layout == "unfused":
        return {comp: src.read(src.key(f"{prefix}{e}.{hf}.weight")) for comp, hf in COMPONENT_HF_NAMES.items()}
    gate_up, down = src.key(prefix + "gate_up_proj"), src.key(prefix + "down_proj")
    want = {gate_up: (fam.num_experts, 2 * m, h), down: (fam.num_experts, h, m)}
    for key, shape in want.items():
        if src.shape(key) != shape:
            raise GeometryError(f"source.{key}.shape", f"{list(src.shape(key))} != expected {list(shape)}")
    gu, dt = src.read(gate_up, e, e + 1)
    d, ddt = src.read(down, e, e + 1)
    return {"gate": (gu[0, :m], dt), "up": (gu[0, m:], dt), "down": (d[0], ddt)}
