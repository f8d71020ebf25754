"""The pinned reference model carrying exactly the weights the shipped demo artifact computes with.

The artifact stores affine4/affine8-quantized tensors; the reference gets their dequantized values
(mx.dequantize of the loaded layers), mapped back to the upstream module names. The comparison
therefore checks the graph on trained weights; the artifact reader is covered by its own round-trip
tests (f32 artifacts load bitwise identical to the HF directory)."""

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import capture_reference  # noqa: E402

# A held-out-style Python snippet written for this test (contract control), long enough that the
# demo's QSA (budget 64, ratio 8) selects sparsely.
PROMPT_TEXT = '''import os


class Registry:
    """Keep named handlers and dispatch events to them in order."""

    def __init__(self, name, strict=False):
        self.name = name
        self.strict = strict
        self._handlers = {}

    def register(self, key, handler):
        if key in self._handlers and self.strict:
            raise KeyError(f"duplicate handler {key!r}")
        self._handlers.setdefault(key, []).append(handler)
        return handler

    def dispatch(self, key, *args, **kwargs):
        results = []
        for handler in self._handlers.get(key, ()):
            results.append(handler(*args, **kwargs))
        return results


def load_paths(root):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for filename in sorted(filenames):
            if filename.endswith(".py"):
                yield os.path.join(dirpath, filename)
'''


def _dequantized(module):
    if hasattr(module, "scales"):
        return mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
    return module.weight


def reference_state(model) -> dict:
    """torch state_dict entries (numpy) for every parameter of the MLX model."""
    state = {}
    for name, module in model.named_modules():
        if not hasattr(module, "weight") or isinstance(module, nn.Module) and name.endswith("switch_mlp"):
            continue
        if ".switch_mlp." in name:
            continue
        state[name + ".weight"] = np.array(_dequantized(module).astype(mx.float32))
    for name, value in nn.utils.tree_flatten(model.parameters()):
        if name.endswith(("A_log", "dt_bias")):
            state[name] = np.array(value.astype(mx.float32))
    for i, layer in enumerate(model.layers):
        sw = layer.mlp.switch_mlp
        gate, up, down = (
            np.array(_dequantized(getattr(sw, p)).astype(mx.float32)) for p in ("gate_proj", "up_proj", "down_proj")
        )
        prefix = f"model.layers.{i}.mlp.experts."
        state[prefix + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
        state[prefix + "down_proj"] = down
    for key in list(state):
        if key.endswith("conv1d.weight"):
            state[key] = np.ascontiguousarray(state[key].transpose(0, 2, 1))
    return state


def reference_model(model, config: dict):
    import torch
    from transformers.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    capture_reference.check_pins()
    cfg = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "dtype", "model_type")}
    ref = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**cfg)).eval()
    state = {k: torch.from_numpy(v) for k, v in reference_state(model).items()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    missing = [
        k for k in missing if not k.endswith(("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"))
    ]
    if missing or unexpected:
        raise AssertionError(f"state mapping incomplete: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return ref
