"""Import an MLX-quantized conversion (the mlx-vlm / mlx-community layout).

The layout, as mlx-vlm 0.7.10 writes it for `qwen4_exp` (`convert` ->
`quantize_model` -> `save_weights` / `save_config`):

  config.json  the HF config plus `quantization: {group_size, bits, mode,
               <module path>: {group_size, bits, mode}, ...}` (per-module
               overrides: the router `mlp.gate` and `shared_expert_gate` at
               8 bits, the PLE shards at group 32 when 64 does not divide)
  language_model.model.layers.{i}.mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}
               routed experts stacked [E, rows, ...]: uint32 packed weights,
               bf16 scales and biases, exactly `mx.quantize` output
  language_model.model.*, language_model.lm_head.*   dense tensors; a
               quantized Linear/Embedding is `x.weight/x.scales/x.biases`
  ...ple.ple_embedding.ngram_embedding.shards.{s}.weight   PLE row shards
  vision_tower.*   excluded (text-only artifact)

What is copied, never re-quantized: every tensor quantized with its component's
codec (affine 2/3/4/6/8 bits at group 32/64/128, bf16 scales: the dense codec
from the global `quantization`, the expert codec from the routed-expert modules'
entries, which mlx-lm's mixed configs write per module) goes into the artifact
byte for byte (experts into the ExpertMajor records, dense tensors into the dense
file). Two kinds of tensor are decoded because the artifact has no codec for
them, both exactly: dense tensors the profile keeps float (routers,
hyper-connection mixers, decay inputs) are `mx.dequantize`d in float32, and
affine PLE rows are `mx.dequantize`d in their scales' dtype (bf16), which is
bit for bit the row mlx-vlm's QuantizedEmbedding returns. Anything else (a
group size or bit width the artifact has no codec for, another quantization
mode, fp16/fp32 scales, routed experts at different widths per layer) is
refused with a typed error naming the tensor or the `quantization` entry.
"""

import re

import numpy as np

from . import sources as _sources
from .artifact import constants as C
from .artifact import manifest as M
from .artifact.errors import ArtifactError, CodecError, GeometryError
from .format import checkpoint_keys as keys
from .format.qwen4exp_config import ple_constants

PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
EXCLUDED = (("vision", "vision_tower."), ("mtp", "mtp."))
PARTS = ("weight", "scales", "biases")


class MlxSourceError(ArtifactError):
    """An MLX-quantized source cannot be imported as is."""


def is_mlx_config(config):
    """mlx-lm / mlx-vlm write `quantization` into config.json."""
    return isinstance(config.get("quantization"), dict)


_EXPERT_MODULE = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.mlp\.switch_mlp\.(gate|up|down)_proj$")


def _affine_params(q, field):
    if type(q) is not dict:
        raise MlxSourceError(field, f"{q!r} is not a {{bits, group_size}} object")
    mode = q.get("mode", "affine")
    if mode != "affine":
        raise MlxSourceError(f"{field}.mode", f"{mode!r}; only affine MLX quantization imports as is")
    bits, group = q.get("bits"), q.get("group_size")
    name = C.affine_name(bits, group)
    if name not in C.CODECS:
        raise MlxSourceError(
            field,
            f"bits={bits} group_size={group} has no artifact codec (affine bits "
            f"{list(C.AFFINE_BITS)}, groups {list(C.AFFINE_GROUPS)}); refusing to requantize",
        )
    return bits, group, name


def source_profile(
    config, q_bits=None, q_group_size=None, dtype=None, expert_bits=None, expert_group_size=None, ple_dtype=None
):
    """Artifact profile of the source's quantization, or a typed refusal. The dense store takes
    the global width; the routed experts take the width their modules carry (a per-module
    override in the `quantization` block, mlx-lm's mixed configs, or the global one), which
    must be one width for every layer and projection: the ExpertMajor store holds one codec.
    Explicit width flags must agree; --dtype would mean dequantizing and is refused."""
    q = config["quantization"]
    bits, group, dense = _affine_params(q, "quantization")
    if dtype is not None:
        raise MlxSourceError(
            "dtype",
            f"the source is already quantized (bits={bits} group={group}); "
            f"it imports into its own affine profile, not {dtype}",
        )
    overrides = {k: v for k, v in q.items() if _EXPERT_MODULE.match(k)}
    first, experts = None, dense
    for path in sorted(overrides, key=lambda k: tuple(int(x) if x.isdigit() else x for x in re.split(r"(\d+)", k))):
        if overrides[path] is False:
            raise MlxSourceError(
                f"quantization.{path}",
                "routed experts left unquantized while the rest is quantized; the ExpertMajor store holds one codec",
            )
        name = _affine_params(overrides[path], f"quantization.{path}")[2]
        if first is None:
            first, experts = path, name
        elif name != experts:
            raise MlxSourceError(
                f"quantization.{path}",
                f"{name} but {first} is {experts}: the ExpertMajor store "
                "holds one width for every routed expert; refusing to requantize",
            )
    if overrides and len(overrides) != 3 * M.model_args(config).num_hidden_layers and experts != dense:
        # Some expert modules fall back to the global width, others override it.
        raise MlxSourceError(
            "quantization",
            f"routed experts mix {experts} ({first}) and the global {dense}: the "
            "ExpertMajor store holds one width for every routed expert; refusing to requantize",
        )
    e = C.codec(experts)
    for flag, want, got in (
        ("q_bits", bits, q_bits),
        ("q_group_size", group, q_group_size),
        ("expert_bits", e.bits, expert_bits),
        ("expert_group_size", e.group_size, expert_group_size),
    ):
        if got is not None and got != want:
            raise MlxSourceError(flag, f"{got} but the source is quantized with {want}; refusing to requantize")
    ple = {"float32": "f32", "bfloat16": "bf16", None: "bf16"}[ple_dtype]
    return C.profile_name({"dense": dense, "experts": experts, "ple": ple}, "quantization")


def _text_key(raw):
    for src, dst in PREFIXES:
        if raw.startswith(src):
            return dst + raw[len(src) :]
    return raw


class MlxSource(_sources.Source):
    """A Source whose reads and checks follow the MLX layout (see module doc)."""

    def __init__(self, path, config):
        super().__init__(path, None)  # no FP8 in this layout
        self.quant = config["quantization"]
        self.text = {}  # text key -> raw key
        self.excluded = {}
        for raw in sorted(self.index):
            rule = next((name for name, p in EXCLUDED if raw.startswith(p)), None)
            if rule is not None:
                self.excluded[rule] = self.excluded.get(rule, 0) + 1
                continue
            self.text[_text_key(raw)] = raw

    # -- helpers ---------------------------------------------------------
    def _array(self, text_key, start=None, stop=None):
        """(ndarray in storage dtype, safetensors dtype) of one tensor."""
        raw_key = self.text[text_key]
        raw, shape, dt = self._raw(raw_key, self.index[raw_key], start, stop)
        if dt == "U32":
            return np.frombuffer(raw, np.uint32).reshape(shape), dt
        if dt == "BF16":
            return np.frombuffer(raw, np.uint16).reshape(shape), dt
        return self._decode(raw_key, raw, shape, dt), dt

    def _params(self, stem):
        """(bits, group_size) of quantized module `stem` (text key
        without the trailing dot), from its per-module override or the
        global quantization."""
        raw_stem = self.text[stem + ".weight"][: -len(".weight")]
        q = self.quant.get(raw_stem)
        q = q if isinstance(q, dict) else self.quant
        if q.get("mode", "affine") != "affine":
            raise MlxSourceError(f"source.{raw_stem}", f"mode {q.get('mode')!r} is not affine")
        return q["bits"], q["group_size"]

    def _quantized(self, stem, start=None, stop=None):
        """{part: ndarray} (uint32 weight, uint16 bf16 scales/biases) and (bits, group)."""
        out = {}
        for part in PARTS:
            a, dt = self._array(f"{stem}.{part}", start, stop)
            if part != "weight" and dt != "BF16":
                raise MlxSourceError(
                    f"source.{self.text[stem + '.' + part]}.dtype",
                    f"{dt}; the artifact's affine codecs store bf16 scales and biases",
                )
            if part == "weight" and dt != "U32":
                raise MlxSourceError(f"source.{self.text[stem + '.weight']}.dtype", f"{dt}; packed weights are U32")
            out[part] = a
        return out, self._params(stem)

    def _is_quantized(self, stem):
        return stem + ".scales" in self.text

    @staticmethod
    def _check_packed(stem, parts, bits, group, rows, cols):
        want = {"weight": (rows, cols * bits // 32), "scales": (rows, cols // group), "biases": (rows, cols // group)}
        for part, shape in want.items():
            if tuple(parts[part].shape[-2:]) != shape or cols % group:
                raise GeometryError(
                    f"source.{stem}.{part}.shape",
                    f"{list(parts[part].shape)} != {list(shape)} for [{rows}, {cols}] at bits={bits} group={group}",
                )

    @staticmethod
    def _dequantize(parts, bits, group, dtype):
        import mlx.core as mx

        s = mx.array(parts["scales"]).view(mx.bfloat16).astype(dtype)
        b = mx.array(parts["biases"]).view(mx.bfloat16).astype(dtype)
        w = mx.dequantize(mx.array(parts["weight"]), s, b, group_size=group, bits=bits)
        return np.array(w.astype(mx.float32)) if dtype == mx.float32 else np.array(w.view(mx.uint16))

    def _copy_or_refuse(self, stem, parts, bits, group, codec_name):
        c = C.codec(codec_name)
        if (bits, group) != (c.bits, c.group_size):
            raise CodecError(
                f"source.{self.text[stem + '.weight']}",
                f"quantized with bits={bits} group={group}; the profile stores {codec_name}: refusing to requantize",
            )
        return {part: np.ascontiguousarray(parts[part]) for part in PARTS}

    # -- the four things conversion asks of a source ----------------------
    def check(self, args):
        """Every raw key is one part of a module the key tables name
        (layout "mlx") or excluded by a named rule; PLE constant buffers
        equal their derivation."""
        expected = set()
        logical = keys.expected_hf_keys(args, "mlx")
        for key in logical:
            stem = key[: -len(".weight")] if key.endswith(".weight") else None
            if stem is not None and self._is_quantized(stem):
                expected.update(f"{stem}.{p}" for p in PARTS)
            else:
                expected.add(key)
        missing = sorted(expected - set(self.text))
        if missing:
            raise keys.CheckpointKeyError(f"missing tensor {missing[0]!r} ({len(missing)} missing in total)")
        extra = sorted(set(self.text) - expected)
        if extra:
            raise keys.CheckpointKeyError(
                f"unexpected tensor {self.text[extra[0]]!r} ({len(extra)} unexpected in total)"
            )
        for t, layer_id in enumerate(args.ple_layer_ids):
            for name, want in ple_constants(args, t).items():
                key = f"model.layers.{layer_id - 1}.ple.ple_embedding.{name}"
                if key in self.text:
                    a, _ = self._array(key)
                    if a.tolist() != want:
                        raise ArtifactError(f"source.{self.text[key]}", f"{a.tolist()} != derived {want}")
        return {"expert_layout": "mlx", "consumed": len(logical), "excluded": dict(self.excluded)}

    def dense_parts(self, key, shape, codec_name):
        c = C.codec(codec_name)
        stem = key[: -len(".weight")] if key.endswith(".weight") else None
        if stem is not None and self._is_quantized(stem):
            parts, (bits, group) = self._quantized(stem)
            rows, cols = shape
            self._check_packed(self.text[key][: -len(".weight")], parts, bits, group, rows, cols)
            if c.affine:
                return self._copy_or_refuse(stem, parts, bits, group, codec_name)
            import mlx.core as mx

            return _sources.encode(self._dequantize(parts, bits, group, mx.float32), "F32", codec_name)
        a, dt = self._array(key)
        if dt == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        if tuple(a.shape) != tuple(shape):  # depthwise convs are already MLX [C, K, 1]
            raise GeometryError(f"source.{self.text[key]}.shape", f"{list(a.shape)} != expected {list(shape)}")
        return _sources.encode(a, dt, codec_name)

    def expert_parts(self, layer, e, fam, codec_name, layout):
        out = {}
        for comp, (rows, cols) in fam.component_shapes().items():
            stem = f"model.layers.{layer}.mlp.switch_mlp.{comp}_proj"
            if not self._is_quantized(stem):
                a, dt = self._array(stem + ".weight", e, e + 1)
                a = (a.astype(np.uint32) << 16).view(np.float32) if dt == "BF16" else a
                out[comp] = _sources.encode(a[0], dt, codec_name)
                continue
            parts, (bits, group) = self._quantized(stem, e, e + 1)
            parts = {p: a[0] for p, a in parts.items()}
            self._check_packed(self.text[stem + ".weight"][: -len(".weight")], parts, bits, group, rows, cols)
            out[comp] = self._copy_or_refuse(stem, parts, bits, group, codec_name)
        return out

    def ple_chunks(self, args, layer, codec_name):
        import mlx.core as mx

        for s in range(args.split_ngram_parts):
            stem = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.shards.{s}"
            rows = self.shape(self.text[stem + ".weight"])[0]
            for start in range(0, rows, _sources.PLE_CHUNK_ROWS):
                stop = min(rows, start + _sources.PLE_CHUNK_ROWS)
                if self._is_quantized(stem):
                    parts, (bits, group) = self._quantized(stem, start, stop)
                    # bf16, as mlx-vlm's QuantizedEmbedding returns it
                    bits16 = self._dequantize(parts, bits, group, mx.bfloat16)
                    a, dt = (bits16.astype(np.uint32) << 16).view(np.float32), "BF16"
                else:
                    a, dt = self._array(stem + ".weight", start, stop)
                    a = (a.astype(np.uint32) << 16).view(np.float32) if dt == "BF16" else a
                yield _sources.encode(a, dt, codec_name)["weight"]
