"""Build the MLX graph from an admitted artifact directory.

Order matters (AFN-004): `admission.admit` runs first and the graph is built
only once every boundary passed, so a rejected artifact allocates nothing.
What each tensor is (float or affine, which group and bits) is read from the
manifest's per-tensor codec and the store codecs, never inferred from key
names or shapes.

Routed experts are copied out of the ExpertMajor store into the resident
SwitchGLU (affine codecs become mlx_lm QuantizedSwitchLinear), and each PLE
table is read page by page into its embedding. Both stay resident for now;
the streaming engine replaces them for the full-size family.
"""

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import admission
from ..models.qwen4exp import Model, ModelArgs
from . import constants as C
from . import manifest as M
from .errors import AdmissionError, DigestError, GeometryError
from .expert_major import ExpertMajorReader
from .ple_pages import PleReader


def _quant_params(codec_name):
    c = C.codec(codec_name)
    return {"group_size": c.group_size, "bits": c.bits, "mode": "affine"}


def quantization_plan(m):
    """{module path: to_quantized kwargs} of every layer the manifest says is
    affine: dense tensors by their recorded codec, routed experts by the
    expert store's codec."""
    plan = {}
    for name, rec in m["tensors"].items():
        if C.codec(rec["codec"]).affine and name.endswith(".weight"):
            plan[name[: -len(".weight")]] = _quant_params(rec["codec"])
    expert_codec = m["codecs"]["experts"]
    if C.codec(expert_codec).affine:
        for layer in range(m["model_constants"]["num_hidden_layers"]):
            for comp in ("gate_proj", "up_proj", "down_proj"):
                plan[f"model.layers.{layer}.mlp.switch_mlp.{comp}"] = _quant_params(expert_codec)
    return plan


def _quantize(model, plan):
    done = set()

    def predicate(path, module):
        if path in plan:
            done.add(path)
            return plan[path]
        return False

    nn.quantize(model, class_predicate=predicate)
    missing = sorted(set(plan) - done)
    if missing:
        raise GeometryError(f"manifest.tensors.{missing[0]}.weight", "no quantizable layer at this path")


def _to_mx(a):
    """Store arrays -> MLX; uint16 parts are bf16 bit patterns."""
    if a.dtype == np.uint16:
        return mx.array(a).view(mx.bfloat16)
    return mx.array(a)


def _store(m, role):
    return [s for s in m["stores"] if s["role"] == role]


def _dense(artifact, m):
    s = _store(m, "dense")[0]
    path = os.path.join(artifact, s["path"])
    # Admission checked this file's metadata, not its bytes; it is read whole
    # anyway, so its digest is checked before use.
    if M.sha256_file(path) != s["sha256"]:
        raise DigestError(f"stores.{s['path']}.sha256", "dense store digest mismatch")
    weights = mx.load(path)
    if set(weights) != set(m["tensors"]):
        raise AdmissionError("tensors", "dense file changed after admission")
    return weights


def _experts(artifact, m, fam):
    """Runtime SwitchGLU tensors: [E, rows, cols] per component and part."""
    s = _store(m, "experts")[0]
    out = {}
    with ExpertMajorReader(os.path.join(artifact, s["path"]), fam, s["codec"]) as r:
        layout = r.geometry.layout
        for layer in range(fam.num_hidden_layers):
            stacks = {(comp, part): np.empty((fam.num_experts,) + shape, dtype)
                      for comp, part, dtype, shape, _, _ in layout}
            for e in range(fam.num_experts):
                for comp, parts in r.read_expert(layer, e).items():
                    for part, a in parts.items():
                        stacks[(comp, part)][e] = a
            for (comp, part), a in stacks.items():
                out[f"model.layers.{layer}.mlp.switch_mlp.{comp}_proj.{part}"] = _to_mx(a)
    return out


def _ple(artifact, m, fam):
    """Resident PLE tables: every page read through its digest check."""
    out = {}
    for s in _store(m, "ple"):
        with PleReader(os.path.join(artifact, s["path"]), fam, s["codec"]) as r:
            g = r.geometry
            raw = np.empty((g.total_rows, g.row_bytes), np.uint8)
            for page in range(g.num_pages):
                first = page * g.rows_per_page
                n = min(g.rows_per_page, g.total_rows - first)
                data = r.read_page(page)
                raw[first : first + n] = np.frombuffer(data, np.uint8, n * g.row_bytes, C.PLE_PAGE_HEADER_BYTES).reshape(n, -1)
            table = raw.view(np.uint16 if g.codec.name == "bf16" else np.float32)
        out[f"model.layers.{s['layer']}.ple.ple_embedding.ngram_embedding.weight"] = _to_mx(table)
    return out


def load_artifact_model(path, dtype=mx.float32) -> Model:
    """Admit `path`, then build and fill the graph.

    dtype: float tensors (dense floats, f32/bf16 experts, PLE rows) are cast
    to it; None keeps the stored dtype. Affine weights stay packed; their
    bf16 scales/biases are cast too: with bf16 scales MLX's CPU quantized
    matmul loses ~0.5% relative accuracy against the dequantized product,
    with fp32 scales it equals it exactly.
    """
    artifact = str(Path(path))
    admission.admit(artifact)  # raises before anything below allocates
    with open(os.path.join(artifact, C.MANIFEST_NAME), "rb") as f:
        m = json.loads(f.read())
    with open(os.path.join(artifact, "config.json"), "rb") as f:
        config = json.loads(f.read())
    fam = C.family(m["family"])
    plan = quantization_plan(m)

    model = Model(ModelArgs.from_dict(config))
    if plan:
        _quantize(model, plan)
    weights = _dense(artifact, m)
    weights.update(_experts(artifact, m, fam))
    weights.update(_ple(artifact, m, fam))
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model
