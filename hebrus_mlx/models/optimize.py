"""The speed pass: `apply(model, options)` runs once after the weights are final and swaps in the
faster implementations `GraphOptions` asks for. The blocks in qwen4exp.py keep one implementation
each (the plain path); every alternative here computes the same outputs (bit for bit on this CPU,
tests/test_graph_fast_paths.py, test_cpu_streams.py, test_kernels.py) and is measured by a row of
benchmarks/bench_graph.py (docs/BENCHMARKS.md).

What is swapped, and where it applies:
- joined projections: each block's same-input Linears as one matmul for inputs up to
  `join_max_tokens` positions (a projector on the block, consulted by `qwen4exp._project`);
- `[in, out]` layout: resident float weights re-stored transposed (values and module code unchanged);
- one-graph blocks: the hyper-connection mix, the PLE mix and the MoE after its projections (decode
  sizes, one CPU stream) each as one compiled graph;
- second CPU stream: half the routed experts, the prefill projections and half the positions'
  logits on another CPU stream (models/cpu_streams.py), from the active options' `cpu_streams`;
- QSA: one rope table per call (`rope_tables`), the dense regime through fused SDPA (`dense_sdpa`);
- Metal kernels the machine profile qualified on this device (`metal_kernels`; never here).

Swaps change a module's class to a subclass (same parameters, keys and call signature) that
overrides only the methods `qwen4exp.SEAMS` lists for its block, or hang a plain attribute on it
(never a parameter), so checkpoints and callers see no change. The contract is checked here, once
per swap: a block lacking a listed method, or whose method takes other parameters, is refused with
`SeamError` naming it. What each swap needs (plain float Linears, plain norms, an in-memory n-gram
table, resident experts) is decided here too, and what a swapped method reads (joined and transposed
weights, folded norm scales, its compiled function) is worked out here, so it runs without checking
the module at call time. The pass runs once after the weights are final; a Model's `update` /
`update_modules` (`load_weights`, `nn.quantize`) run it again from the plain blocks. Whoever replaces
a child after the pass any other way puts the parent back first (`plain_block`) or runs it again.
"""

from __future__ import annotations

import inspect
from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import cpu_streams
from . import qwen4exp as q
from .activations import silu
from .options import GraphOptions
from .switch_layers import SORT_MIN_PAIRS, SwitchGLU, SwitchLinear

# Below this many multiply-adds a split site stays on one CPU stream: the cross-stream events cost
# about what half of it saves (docs/BENCHMARKS.md, "second CPU stream").
SIDE_MIN_MACS = 1 << 20


class SeamError(TypeError):
    """A block's class does not offer a method the load-time pass overrides (qwen4exp.SEAMS)."""


def apply(model: nn.Module, options: GraphOptions | None = None) -> GraphOptions:
    """Swap in what `options` (default: GraphOptions()) asks for on `model` (a Model, the MTP head
    or any block); returns the resolved options, also kept as `model.options` on a Model. Run again
    on the same model, it starts from the plain blocks (weights replaced since are joined anew)."""
    from .. import kernels

    options = (options or GraphOptions()).resolved()
    modules = [m for _, m in model.named_modules()]
    _restore(modules)
    checked: set = set()

    def swap(module, cls):
        if type(module) not in cls.__mro__[1:]:  # only the plain block, never a replaced module
            return
        if (type(module), cls) not in checked:
            check_seams(type(module), cls)
            checked.add((type(module), cls))
        module.__class__ = cls

    for m in modules:
        if hasattr(type(m), "projections") and (options.join_projections or options.cpu_streams == 2):
            group = (
                m.projections(inject="block_inject_weight" in m)
                if isinstance(m, q.HyperConnection)
                else m.projections()
            )
            joined = _Joined(group, options.in_major) if options.join_projections and _joinable(group) else None
            object.__setattr__(m, "_projector", Projector(joined, options.join_max_tokens))
        if isinstance(m, q.HyperConnection):
            if options.metal_kernels and kernels.enabled("hc_mix"):
                swap(m, MetalHyperConnection)
            elif options.join_projections:
                swap(m, OneGraphHyperConnection)
        elif isinstance(m, q.PLELayer) and options.join_projections and OneGraphPLELayer.applies(m):
            swap(m, OneGraphPLELayer)
        elif isinstance(m, q.NGramEmbedding) and options.metal_kernels and kernels.enabled("ple_gather"):
            if MetalNGramEmbedding.applies(m):
                swap(m, MetalNGramEmbedding)
        elif isinstance(m, q.QSAAttention):
            metal = options.metal_kernels and kernels.enabled("qsa_attention")
            if options.rope_tables or options.dense_sdpa or metal:
                swap(m, FastQSAAttention)
                object.__setattr__(m, "_metal", metal)
        elif isinstance(m, q.SparseMoE) and options.cpu_streams == 2:
            if SplitSparseMoE.applies(m):
                swap(m, SplitSparseMoE)
        elif isinstance(m, q.SparseMoE) and options.join_projections:
            swap(m, OneGraphSparseMoE)
        elif isinstance(m, q.Model) and options.cpu_streams == 2:
            swap(m, SplitLogitsModel)
    if options.in_major:
        _store_in_major(modules)
    # The one-graph arguments read the weights as stored (after the layout above); a block whose parts
    # do not fit (quantized, biased, streamed, a replaced norm) goes back to its plain class.
    for m in modules:
        if type(m) in (OneGraphHyperConnection, OneGraphSparseMoE) and not type(m).prepare(m):
            plain_block(m)
    if isinstance(model, q.Model):
        model.options = options
        model.after_update = apply  # a plain function: no reference cycle through the model
    return options


def check_seams(block: type, cls: type) -> None:
    """Raise SeamError unless `cls` (a swap for `block`'s plain class) overrides only the methods
    qwen4exp.SEAMS lists for it, and `block` offers each of them with the same parameters."""
    base = next((b for b in cls.__mro__[1:] if b in q.SEAMS), None)
    if base is None:
        raise SeamError(f"{cls.__name__}: replaces no block qwen4exp.SEAMS lists")
    seams = q.SEAMS[base]
    for name in seams:
        mine = getattr(block, name, None)
        if not callable(mine):
            raise SeamError(f"{base.__name__}.{name}: the block {block.__name__} has no such method (qwen4exp.SEAMS)")
        theirs = cls.__dict__.get(name)
        if theirs is not None and _params(mine) != _params(theirs):
            raise SeamError(
                f"{base.__name__}.{name}: {block.__name__} takes ({', '.join(_params(mine))}), "
                f"{cls.__name__} overrides it as ({', '.join(_params(theirs))})"
            )
    for name, value in cls.__dict__.items():
        if callable(value) and not name.startswith("__") and hasattr(base, name) and name not in seams:
            raise SeamError(f"{base.__name__}.{name}: not a seam (qwen4exp.SEAMS), {cls.__name__} overrides it")


def _params(fn) -> list[str]:
    return [
        f"{p.name}={p.default!r}" if p.default is not p.empty else p.name
        for p in inspect.signature(fn).parameters.values()
    ]


def plain_block(module: nn.Module) -> None:
    """`module` back to its plain block if the pass swapped it. Whoever replaces a child the pass
    decided from after it ran (streamed experts or PLE tables attached to a loaded model) calls this
    on the parent, or runs the pass again."""
    if type(module) in SWAPS:
        module.__class__ = next(b for b in type(module).__mro__[1:] if b in q.SEAMS)
    for key in ("_plans", "_plan"):
        module.__dict__.pop(key, None)


def _restore(modules):
    """Each swapped module back to its plain block, its projector and derived attributes dropped."""
    for m in modules:
        plain_block(m)
        m.__dict__.pop("_projector", None)
        m.__dict__.pop("_metal", None)


# The plain blocks of qwen4exp.py this pass may replace (qwen4exp.SEAMS: each by a subclass with the
# same parameters, keys and call signature that overrides only the methods listed there).
SWAPPABLE = tuple(q.SEAMS)


def implementations(model: nn.Module) -> dict:
    """What a loaded model runs: for each swappable block, {implementation class: count} (the plain
    block's own name where nothing was swapped); the joined projection groups; the weight layout.
    generate --verbose prints it (implementations_line) and bench records it."""
    blocks: dict = {}
    joined = 0
    # A pipeline stage's model wraps its Model (`.model`); a stand-in without modules runs no block here.
    modules = model if hasattr(model, "named_modules") else getattr(model, "model", None)
    for _, m in modules.named_modules() if hasattr(modules, "named_modules") else ():
        base = next((b for b in SWAPPABLE if isinstance(m, b)), None)
        if base is not None:
            counts = blocks.setdefault(base.__name__, {})
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
        projector = m.__dict__.get("_projector")
        if projector is not None and projector.joined is not None:
            joined += 1
    options = getattr(modules, "options", None)
    return {
        "blocks": blocks,
        "joined_projection_groups": joined,
        "in_major": None if options is None else options.in_major,
        "cpu_streams": None if options is None else options.cpu_streams,
    }


def implementations_line(model: nn.Module) -> str:
    """``Graph: HyperConnection -> OneGraphHyperConnection x17, ...; 34 joined projection groups``."""
    impl = implementations(model)
    parts = [
        f"{base} -> " + ", ".join(f"{cls} x{n}" for cls, n in sorted(counts.items()))
        for base, counts in sorted(impl["blocks"].items())
    ]
    tail = f"{impl['joined_projection_groups']} joined projection groups"
    if impl["in_major"] is not None:
        tail += f", in_major {'on' if impl['in_major'] else 'off'}, {impl['cpu_streams']} CPU stream(s)"
    return "Graph: " + "; ".join(parts + [tail])


# ---- joined projections ------------------------------------------------------------------------


class _Joined:
    """One weight for several bias-free float Linears that read the same input. Each Linear's weight
    is re-pointed at its rows of the joint array (a view, no second copy); a load or update that
    replaces one runs the pass again (Model.update), which joins the new arrays."""

    def __init__(self, linears, in_major: bool):
        joint = mx.concatenate([m.weight for m in linears], axis=0)
        if in_major:
            joint = _in_major(joint)
        mx.eval(joint)
        ends = np.cumsum([m.weight.shape[0] for m in linears]).tolist()
        for m, start, end in zip(linears, [0, *ends[:-1]], ends):
            m.weight = joint[start:end]
        self.rhs = joint.T  # evaluated once: no transpose node per call
        mx.eval([m.weight for m in linears], self.rhs)
        self.parts = tuple(m.weight for m in linears)
        self.splits = ends[:-1]


def _joinable(linears) -> bool:
    return (
        len(linears) > 1
        and all(type(m) is nn.Linear and "bias" not in m for m in linears)
        and len({m.weight.dtype for m in linears}) == 1
    )


class Projector:
    """[m(x) for m in linears] as one joint matmul (short inputs) or split across the two CPU
    streams (long inputs, enough work), else per Linear. `linears` are the group it was built for
    (the block's `projections()`; the pass runs again when a Model's weights are replaced)."""

    def __init__(self, joined: _Joined | None, max_tokens: int = 0):
        self.joined, self.max_tokens = joined, max_tokens

    def __call__(self, linears, x):
        j = self.joined
        if j is not None and x.shape[-2] <= self.max_tokens:
            return mx.split(x @ j.rhs, j.splits, axis=-1)
        side = cpu_streams.side_stream()
        if (
            side is None
            or len(linears) < 2
            or x.size // x.shape[-1] * sum(m.weight.size for m in linears) < SIDE_MIN_MACS
        ):
            return [m(x) for m in linears]
        # The Linears split between the two CPU streams, the larger ones first to whichever has fewer rows.
        load, on_side = [0, 0], set()
        for i in sorted(range(len(linears)), key=lambda i: -linears[i].weight.shape[0]):
            k = int(load[1] < load[0])
            load[k] += linears[i].weight.shape[0]
            if k:
                on_side.add(i)
        with mx.stream(side):
            late = {i: linears[i](x) for i in on_side}
        return [late[i] if i in on_side else m(x) for i, m in enumerate(linears)]


# ---- [in, out] layout --------------------------------------------------------------------------
# The CPU backend's BLAS (reference gemm) runs x @ W^T several tens of percent faster when W is
# stored [in, out] instead of the checkpoint's [out, in] (an axpy inner loop it vectorises instead of
# a dot-product reduction it cannot); both sum over `in` in the same order, so every output is
# bit-identical. Each weight stays an [out, in] array (a transposed view): module code is unchanged.


def _in_major(w: mx.array) -> mx.array:
    """`w` [..., out, in] as an equal view whose storage is [..., in, out]."""
    return mx.contiguous(w.swapaxes(-1, -2)).swapaxes(-1, -2)


def _store_in_major(modules):
    joined = {
        id(w)
        for m in modules
        for j in [getattr(m.__dict__.get("_projector"), "joined", None)]
        if j is not None
        for w in j.parts
    }
    for m in modules:
        if (
            type(m) in (nn.Linear, SwitchLinear)
            and id(m.weight) not in joined
            and mx.issubdtype(m.weight.dtype, mx.floating)
        ):
            m.weight = _in_major(m.weight)
            mx.eval(m.weight)


# ---- one-graph blocks --------------------------------------------------------------------------


def _rhs(linear: nn.Module) -> mx.array | None:
    """A bias-free float Linear's weight.T, evaluated once per weight array (a view: no transpose node
    per call); None for anything else (quantized, biased)."""
    if type(linear) is not nn.Linear or "bias" in linear:
        return None
    return q.derived(linear, "_rhs", dict.get(linear, "weight"), lambda w: w.T)


@cache
def _hc_mix_fn(hc_count: int, hidden: int, eps: float, lowrank: int, inject: bool):
    """HyperConnection.mix as one compiled graph on [rows, width] (no batch axes around the matmuls,
    one fused sigmoid-product): the same ops in the same order as the per-part path."""
    return q.compiled_region(_hc_mix(hc_count, hidden, eps, lowrank, inject))


@cache
def _hc_inject_mix_fn(hc_count: int, hidden: int, eps: float, lowrank: int):
    """HyperConnection.inject_then_mix as one compiled graph: the previous inject, then the mix."""
    mix = _hc_mix(hc_count, hidden, eps, lowrank, True)

    @q.compiled_region
    def inject_then_mix(streams, out, logits, scale, down_rhs, up_rhs):
        streams = q.hc_inject(streams, out, logits, hc_count, hidden)
        return (streams, *mix(streams, scale, down_rhs, up_rhs))

    return inject_then_mix


def _hc_mix(hc_count: int, hidden: int, eps: float, lowrank: int, inject: bool):
    fns = q.hc_fns(hc_count, hidden)

    def mix(streams, scale, down_rhs, up_rhs):
        lead = streams.shape[:-1]
        grouped = streams.reshape(-1, hc_count, hidden)
        normed = (mx.fast.rms_norm(grouped, None, eps) * scale).reshape(grouped.shape[0], -1)
        down = normed @ down_rhs
        if inject:
            down, logits = mx.split(down, [lowrank], axis=-1)
        up = fns.activate(down) @ up_rhs
        mixed = (mx.sigmoid(up) * normed).reshape(grouped.shape).mean(axis=-2).reshape(*lead, hidden)
        if inject:
            return mixed, normed.reshape(streams.shape), logits.reshape(*lead, hc_count)
        return mixed, normed.reshape(streams.shape)

    return mix


class OneGraphHyperConnection(q.HyperConnection):
    """Decode steps and short blocks: the whole mix as one compiled graph over 2-D rows.

    What the graph reads (the compiled function, the folded norm scale, the two right-hand sides) is
    worked out by the pass (`prepare`), per `inject`, and read from a plain attribute per call; the
    pass runs again when a Model's weights are replaced."""

    @staticmethod
    def prepare(block) -> bool:
        """Keep on `block` the one-graph arguments for the mix with and without inject (None where
        its parts are quantized, biased or replaced); False where neither applies."""
        projector = block.__dict__.get("_projector")
        if projector is None or type(block.hc_norm) is not q.ZeroCenteredRMSNorm:
            return False
        up = _rhs(block.input_mix_weight_up)
        lowrank = block.input_mix_weight_up.weight.shape[-1]
        dims = (block.hc_count, block.hidden_size, block.hc_norm.eps, lowrank)
        plans = {}
        for inject in (False, True):
            if inject:
                j = projector.joined if "block_inject_weight" in block else None
                down = None if j is None else j.rhs
            else:
                down = _rhs(block.input_mix_weight_down)
            plans[inject] = (
                None
                if down is None or up is None
                else (
                    _hc_mix_fn(*dims, inject),
                    _hc_inject_mix_fn(*dims) if inject else None,
                    block.hc_norm.grouped_scale,
                    down,
                    up,
                )
            )
        object.__setattr__(block, "_plans", (projector.max_tokens, plans))
        return any(p is not None for p in plans.values())

    def mix(self, streams, inject: bool = False):
        max_tokens, plans = self.__dict__["_plans"]
        plan = plans[inject] if streams.shape[-2] <= max_tokens else None
        if plan is None:
            return super().mix(streams, inject)
        return plan[0](streams, *plan[2:])

    def inject_then_mix(self, streams, out, logits):
        max_tokens, plans = self.__dict__["_plans"]
        plan = plans[True] if streams.shape[-2] <= max_tokens else None
        if plan is None:
            return super().inject_then_mix(streams, out, logits)
        return plan[1](streams, out, logits, *plan[2:])


@cache
def _ple_mix_fn(hc_count: int, hidden: int, eps: float, dilation: int):
    """PLELayer.mix (norms, gate, dilated conv) as one compiled graph."""
    norm = q.group_norm_fn(hidden, eps)

    @q.compiled_region
    def mix(key, value, streams, state, conv_w, key_scale, query_scale, conv_scale):
        split = (*streams.shape[:-1], hc_count, hidden)
        gated = q.ple_gate(norm(key, key_scale).reshape(split), norm(streams, query_scale).reshape(split), value)
        conv, state = q.causal_depthwise_conv(norm(gated, conv_scale), state, conv_w, dilation=dilation)
        return gated + silu(conv), state

    return mix


class OneGraphPLELayer(q.PLELayer):
    @staticmethod
    def applies(block) -> bool:
        return all(type(n) is q.ZeroCenteredRMSNorm for n in (block.norm_key, block.norm_query, block.norm_conv))

    def mix(self, key, value, streams, state):
        norms = (self.norm_key, self.norm_query, self.norm_conv)
        return _ple_mix_fn(self.hc_count, self.hidden_size, self.norm_key.eps, self.dilation)(
            key, value, streams, state, self.conv1d.weight, *(n.grouped_scale for n in norms)
        )


# ---- QSA attention -----------------------------------------------------------------------------


class FastQSAAttention(q.QSAAttention):
    def rotations(self, offset: int, L: int):
        if not q.graph_options.active().rope_tables:
            return super().rotations(offset, L)
        # One cos/sin table for the three rotations (bit-identical to mx.fast.rope, whose CPU path
        # rebuilds it per call).
        cos, sin = self.rotary.tables(offset + mx.arange(L))
        return (lambda t: self.rotary.apply(t, cos, sin)), {"cos": cos, "sin": sin}

    def attend(self, queries, keys, values, idx, ok, n_tokens: int):
        if n_tokens <= self.indexer.budget + self.indexer.ratio - 1 and q.graph_options.active().dense_sdpa:
            # Every visible key is selected (the selection is the whole causal prefix), so this is the
            # same attention through the fused kernel instead of a gather of all keys.
            B, _, L, _ = queries.shape
            out = mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=self.scale, mask="causal" if L > 1 else None
            )
            return out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        if self.__dict__.get("_metal"):  # qualified on this Metal device only (AFN-013)
            from ..kernels import qsa_attention

            return qsa_attention.metal(queries, keys, values, idx, ok, self.scale)
        return super().attend(queries, keys, values, idx, ok, n_tokens)


# ---- one-graph MoE -----------------------------------------------------------------------------


@cache
def _moe_fn(k: int, norm_topk_prob: bool):
    """SparseMoE.experts for resident float experts at decode sizes (rows left in token order) as one
    compiled graph: the same ops in the same order as the plain path's route, SwitchGLU, shared
    expert and combine."""

    @q.compiled_region
    def experts(x, logits, shared_logit, shared_gate, shared_up, gate_rhs, up_rhs, down_rhs, shared_down_rhs):
        inds, scores = q.route_logits(logits, k, norm_topk_prob)
        scores = scores.astype(x.dtype)
        rows = mx.expand_dims(x, (-2, -3))
        up = mx.gather_mm(rows, up_rhs, rhs_indices=inds)
        gate = mx.gather_mm(rows, gate_rhs, rhs_indices=inds)
        routed = mx.gather_mm(silu(gate) * up, down_rhs, rhs_indices=inds).squeeze(-2)
        shared = (silu(shared_gate) * shared_up) @ shared_down_rhs
        out = (routed * scores[..., None]).sum(axis=-2) + mx.sigmoid(shared_logit) * shared
        return out, inds, scores

    return experts


class OneGraphSparseMoE(q.SparseMoE):
    """Decode steps: everything after the projections as one compiled graph, where the routed
    experts are the resident float SwitchGLU (not streamed, not quantized) and the shared expert's
    down projection a bias-free float Linear (decided by the pass); longer inputs take the plain parts."""

    @staticmethod
    def prepare(block) -> bool:
        """Keep on `block` the (gate, up, down, shared down) right-hand sides; False where a part is
        streamed, quantized or replaced."""
        switch = block.switch_mlp
        if type(switch) is not SwitchGLU:
            return False
        parts = (switch.gate_proj, switch.up_proj, switch.down_proj)
        shared_down = _rhs(block.shared_expert.down_proj)
        if shared_down is None or not all(type(p) is SwitchLinear for p in parts):
            return False
        object.__setattr__(block, "_plan", (*(p.rhs() for p in parts), shared_down))
        return True

    def experts(self, x, logits, shared_logit, shared_gate, shared_up):
        if x.size // x.shape[-1] * self.top_k >= SORT_MIN_PAIRS:
            return super().experts(x, logits, shared_logit, shared_gate, shared_up)
        return _moe_fn(self.top_k, self.norm_topk_prob)(
            x, logits, shared_logit, shared_gate, shared_up, *self.__dict__["_plan"]
        )


# ---- second CPU stream -------------------------------------------------------------------------


class SplitSparseMoE(q.SparseMoE):
    @staticmethod
    def applies(block) -> bool:
        return type(block.switch_mlp) is SwitchGLU  # resident experts (not streamed)

    def routed_experts(self, x, inds):
        side = cpu_streams.side_stream()
        w = self.switch_mlp.gate_proj.weight
        if (
            side is None
            or self.top_k < 2
            or x.size // x.shape[-1] * self.top_k * 3 * (w.size // w.shape[0]) < SIDE_MIN_MACS
        ):
            return super().routed_experts(x, inds)
        # Half of the routed experts on the second CPU stream, concurrently with the other half and
        # the shared expert; each expert's output is the same matmul, combined as before.
        half = self.top_k // 2
        with mx.stream(side):
            late = self.switch_mlp(x, inds[..., half:])
        return mx.concatenate([self.switch_mlp(x, inds[..., :half]), late], axis=-2)


class SplitLogitsModel(q.Model):
    def head_logits(self, h):
        big = h.shape[-2] > 1 and h.size * self.lm_head.weight.shape[0] >= SIDE_MIN_MACS
        side = cpu_streams.side_stream() if big else None
        if side is None:
            return super().head_logits(h)
        # Prefill and verify blocks: the positions in two halves, one per CPU stream (a column half
        # of the weight would be a strided view, copied per call; row halves of `h` are contiguous).
        half = h.shape[-2] // 2
        with mx.stream(side):
            late = q.linear(self.lm_head, h[..., half:, :])
        return self.mask_unassigned(mx.concatenate([q.linear(self.lm_head, h[..., :half, :]), late], axis=-2))


# ---- qualified Metal kernels -------------------------------------------------------------------


class MetalHyperConnection(q.HyperConnection):
    def combine(self, weights, normed):
        from ..kernels import hc_mix

        return hc_mix.metal(weights, normed, self.hc_count, self.hidden_size)


class MetalNGramEmbedding(q.NGramEmbedding):
    @staticmethod
    def applies(block) -> bool:
        return type(block.ngram_embedding) is nn.Embedding  # not a streamed or quantized table

    def lookup(self, history, n_new: int):
        from ..kernels import ple_gather

        return ple_gather.metal(self, history, n_new)


# Every class apply may swap in (implementations() and a second apply know them by this).
SWAPS = (
    OneGraphHyperConnection,
    MetalHyperConnection,
    OneGraphPLELayer,
    MetalNGramEmbedding,
    FastQSAAttention,
    OneGraphSparseMoE,
    SplitSparseMoE,
    SplitLogitsModel,
)
