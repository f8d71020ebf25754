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
mode, fp16/fp32 scales, routed experts left unquantized) is refused with a
typed error naming the tensor or the `quantization` entry.

Routed experts whose width differs per layer or per projection (mlx-lm's
mixed_2_6 / 3_4 / 3_6 / 4_6 recipes put `down_proj` at the high width in the
first and last eighth of the layers and every third layer between) import as
they are too: the profile's expert codec is `per-layer` and the expert store
holds each layer's records in that layer's (gate, up, down) codecs, the table
recorded in the manifest (`stores[].layer_codecs`, see expert_codecs).
"""

import re

import numpy as np

from ..artifact import constants as C
from ..artifact import manifest as M
from ..artifact.errors import ArtifactError, CodecError, GeometryError
from ..format import checkpoint_keys as keys
from ..format.qwen4exp_config import ple_constants
from . import sources as _sources

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


def expert_codecs(config):
    """One (gate, up, down) codec name per layer of the routed experts: each module's per-module
    entry in the `quantization` block (mlx-lm's mixed recipes, e.g. `down_proj` at 6 bits in the
    first, last and every third layer) or the global codec. Refused with a typed error naming the
    entry: a module left unquantized (False) while the rest is quantized, a non-affine mode, a
    width with no artifact codec, a layer the model does not have, two entries for one module."""
    q = config["quantization"]
    dense = _affine_params(q, "quantization")[2]
    n = M.model_args(config).num_hidden_layers
    table = [[dense] * len(C.EXPERT_COMPONENTS) for _ in range(n)]
    seen = {}
    for path in sorted(q):
        found = _EXPERT_MODULE.match(path)
        if not found:
            continue
        layer, comp = int(found.group(1)), found.group(2)
        field = f"quantization.{path}"
        if layer >= n:
            raise MlxSourceError(field, f"layer {layer}, but the model has {n} layers")
        if (layer, comp) in seen:
            raise MlxSourceError(field, f"a second entry for the module of {seen[layer, comp]}")
        seen[layer, comp] = field
        if q[path] is False:
            raise MlxSourceError(
                field, "routed experts left unquantized while the rest is quantized: no artifact codec holds both"
            )
        table[layer][C.EXPERT_COMPONENTS.index(comp)] = _affine_params(q[path], field)[2]
    return tuple(tuple(row) for row in table)


def source_profile(
    config, q_bits=None, q_group_size=None, dtype=None, expert_bits=None, expert_group_size=None, ple_dtype=None
):
    """Artifact profile of the source's quantization, or a typed refusal. The dense store takes
    the global width; the routed experts take the width their modules carry (`expert_codecs`):
    one codec for every layer and projection gives that codec, widths that differ per layer or
    projection give the per-layer expert store (constants.PER_LAYER; the table is
    `expert_codecs(config)`). Explicit width flags must agree (an expert width flag cannot agree
    with per-layer widths); --dtype would mean dequantizing and is refused."""
    q = config["quantization"]
    bits, group, dense = _affine_params(q, "quantization")
    if dtype is not None:
        raise MlxSourceError(
            "dtype",
            f"the source is already quantized (bits={bits} group={group}); "
            f"it imports into its own affine profile, not {dtype}",
        )
    names = {name for row in expert_codecs(config) for name in row}
    experts = names.pop() if len(names) == 1 else C.PER_LAYER
    for flag, want, got in (("q_bits", bits, q_bits), ("q_group_size", group, q_group_size)):
        if got is not None and got != want:
            raise MlxSourceError(flag, f"{got} but the source is quantized with {want}; refusing to requantize")
    for flag, got in (("expert_bits", expert_bits), ("expert_group_size", expert_group_size)):
        if got is None:
            continue
        if experts == C.PER_LAYER:
            raise MlxSourceError(
                flag, f"{got} but the source's routed experts have per-layer widths; refusing to requantize"
            )
        e = C.codec(experts)
        want = e.bits if flag == "expert_bits" else e.group_size
        if got != want:
            raise MlxSourceError(flag, f"{got} but the source is quantized with {want}; refusing to requantize")
    ple = C.PLE_DTYPES[ple_dtype or "bfloat16"]
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
        """`codec_name`: one codec for the record, or the layer's (gate, up, down) names."""
        names = dict(zip(C.EXPERT_COMPONENTS, (codec_name,) * 3 if isinstance(codec_name, str) else codec_name))
        out = {}
        for comp, (rows, cols) in fam.component_shapes().items():
            codec_name = names[comp]
            stem = f"model.layers.{layer}.mlp.switch_mlp.{comp}_proj"
            if not self._is_quantized(stem):
                if C.codec(codec_name).affine:  # quantizing them here would be requantizing
                    raise MlxSourceError(
                        f"source.{self.text[stem + '.weight']}",
                        f"routed experts stored unquantized but the profile stores them {codec_name}; "
                        "refusing to quantize",
                    )
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
