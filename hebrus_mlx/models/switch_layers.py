"""Routed experts as stacked weights: `SwitchGLU(x, indices)` runs each token through its top-k
experts with gathered matmuls (mx.gather_mm / mx.gather_qmm).

Same parameter names and call shape as mlx-lm's switch layers (`gate_proj`, `up_proj`,
`down_proj`, each a weight [experts, out, in]; `(x, indices) -> [..., k, hidden]`), so checkpoints,
`nn.quantize` and the streamed `stream/switch.py` module are interchangeable with it. Written here
so the model path does not import mlx_lm, whose package init pulls transformers (seconds at start-up).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from . import options as graph_options
from .activations import silu

# Below this many (token, expert) pairs the gathers are left in token order; above it the rows are
# grouped by expert first so each expert's weight is read once per call (sorted_indices).
SORT_MIN_PAIRS = 64


def sort_by_expert(x, indices):
    """(rows of `x` [..., 1, 1, D] repeated per pair and ordered by expert, expert ids in that
    order, the permutation that restores pair order)."""
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    return x.flatten(0, -3)[order // k], flat[order], mx.argsort(order)


def unsort(y, restore, shape):
    """`y` in pair order again, with the pair axes `shape` restored in front."""
    return mx.unflatten(y[restore], 0, shape)


def _swiglu(gate, up):
    return silu(gate) * up


_swiglu_compiled = mx.compile(_swiglu)


def swiglu(gate, up):
    """silu(gate) * up, compiled while the active GraphOptions say so (models/options.py)."""
    return (_swiglu_compiled if graph_options.active().compile else _swiglu)(gate, up)


class SwitchLinear(nn.Module):
    """A bias-free Linear per expert: weight [experts, out, in]."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        bound = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-bound, bound, (num_experts, output_dims, input_dims))

    def rhs(self) -> mx.array:
        """The weight as [experts, in, out], a view kept with the weight (no swapaxes node per call);
        a replaced weight gets its own (lazy, so gradients still reach it)."""
        weight = dict.get(self, "weight")
        cached = self.__dict__.get("_rhs")
        if cached is None or cached[0] is not weight:
            cached = (weight, weight.swapaxes(-1, -2))
            object.__setattr__(self, "_rhs", cached)
        return cached[1]

    def __call__(self, x, indices, sorted_indices: bool = False):
        return mx.gather_mm(x, self.rhs(), rhs_indices=indices, sorted_indices=sorted_indices)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine"):
        """This layer's weights quantized (the hook `nn.quantize` calls)."""
        return QuantizedSwitchLinear.from_weight(self.weight, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with packed weights, scales and (affine) biases per expert."""

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        num_experts: int,
        group_size: int = 64,
        bits: int = 4,
        mode: str = "affine",
    ):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self._set(mx.zeros((num_experts, output_dims, input_dims)))
        self.freeze()

    @classmethod
    def from_weight(cls, weight, group_size: int, bits: int, mode: str = "affine"):
        experts, out, inp = weight.shape
        layer = cls(inp, out, experts, group_size, bits, mode)
        layer._set(weight)
        layer.freeze()
        return layer

    def _set(self, weight):
        self.weight, self.scales, *rest = mx.quantize(weight, self.group_size, self.bits, mode=self.mode)
        self.biases = rest[0] if rest else None

    def __call__(self, x, indices, sorted_indices: bool = False):
        return mx.gather_qmm(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )


class SwitchGLU(nn.Module):
    """SwiGLU experts: down(silu(gate(x)) * up(x)) through each token's chosen experts."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(input_dims, hidden_dims, num_experts)
        self.up_proj = SwitchLinear(input_dims, hidden_dims, num_experts)
        self.down_proj = SwitchLinear(hidden_dims, input_dims, num_experts)

    def __call__(self, x, indices):
        """x [..., D], indices [..., k] -> [..., k, D]."""
        indices = mx.stop_gradient(indices)
        x = mx.expand_dims(x, (-2, -3))
        grouped = indices.size >= SORT_MIN_PAIRS
        rows, restore = indices, None
        if grouped:
            x, rows, restore = sort_by_expert(x, indices)
        up = self.up_proj(x, rows, grouped)
        gate = self.gate_proj(x, rows, grouped)
        y = self.down_proj(swiglu(gate, up), rows, grouped)
        if grouped:
            y = unsort(y, restore, indices.shape)
        return y.squeeze(-2)
