"""Qwen4Exp (Qwen3.8-Flash-Next) text model in MLX.

Layer stack: hc_count residual streams; each layer optionally adds PLE (hashed n-gram features),
then a gated-residual hyper-connection around either Gated DeltaNet or QSA indexed attention, then
another around the sparse MoE. A final hyper-connection mixer collapses the streams for lm_head.
The pinned reference is transformers 5.24.0 `models/qwen4_exp`; tests compare against it.

Each block keeps one implementation (the plain path). `models/optimize.apply` may replace a block's
class by a subclass that overrides only the methods `SEAMS` (end of this file) lists, with the same
parameters, keys, call signature and results; the pass checks that contract once, when it swaps,
and refuses a block that lacks a listed method or whose method takes other parameters
(`optimize.SeamError`). `optimize.implementations(model)` says what a loaded model runs:

- `HyperConnection.mix`, `HyperConnection.inject_then_mix` (one compiled graph each),
  `HyperConnection.combine` (Metal kernel);
- `PLELayer.mix` (one compiled graph); `NGramEmbedding.lookup` (Metal kernel);
- `QSAAttention.rotations`, `QSAAttention.attend` (rope tables, fused dense SDPA, Metal kernel);
- `SparseMoE.routed_experts` (half the experts on a second CPU stream), `SparseMoE.experts` (one
  compiled graph after the projections);
- `Model.head_logits` (half the positions' logits on a second CPU stream).

What a swapped method reads (joined and transposed weights, folded norm scales) is worked out by the
pass, which runs once after the weights are final; `Model.update` and `Model.update_modules` (so
`load_weights` and `nn.quantize` on the model) run it again from the plain blocks. Anything else in
this file is not a seam: change it here, and every implementation follows.
"""

from __future__ import annotations

import math
import operator
from functools import cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..format.checkpoint_keys import CheckpointKeyError, check_key_set, classify, strip_prefix
from ..format.qwen4exp_config import (
    ConfigError,
    ModelArgs,
    ple_constants,
    ple_head_offsets,
    ple_head_vocab_sizes,
    ple_layer_multipliers,
    ple_table_rows,
)
from . import gated_delta
from . import options as graph_options
from .activations import silu, softplus
from .cache import AttentionCache, CacheHoleError, ContextLengthError, LinearCache, SequenceCache
from .streaming_protocol import Streaming
from .switch_layers import SwitchGLU

__all__ = ["ModelArgs", "Model", "ConfigError", "ContextLengthError", "CacheHoleError"]


class Capture:
    """Opt-in per-call record of hidden states, routes and QSA selections (tests, traces).

    Everything stays lazy on the device; the caller decides when to read it back. Route traces
    pass hidden=False (holding every layer's streams of a prefill chunk is too much memory) and
    router_inputs=True only when they record the router's input feature.
    """

    def __init__(self, hidden: bool = True, router_inputs: bool = False):
        self.hidden: list[mx.array] | None = [] if hidden else None
        self.routes: dict[int, mx.array] = {}
        self.route_weights: dict[int, mx.array] = {}
        self.router_inputs: dict[int, mx.array] | None = {} if router_inputs else None
        self.qsa_selected: dict[int, tuple[mx.array, mx.array]] = {}


# ---- norms -------------------------------------------------------------------------------------


def compiled_region(fn):
    """`fn`, run mx.compile'd while the active GraphOptions say so (models/options.py)."""
    compiled = mx.compile(fn)

    def call(*args):
        return compiled(*args) if graph_options.active().compile else fn(*args)

    return call


def derived(owner: nn.Module, key: str, source: mx.array, make, evaluate: bool = True) -> mx.array:
    """`make(source)`, kept on `owner` as a plain attribute (never a parameter) and made again only
    when `source` is another array (a load, update or quantization replaced it)."""
    cached = owner.__dict__.get(key)
    if cached is None or cached[0] is not source:
        cached = (source, make(source))
        if evaluate:  # once here, not per call
            mx.eval(cached[1])
        object.__setattr__(owner, key, cached)
    return cached[1]


def linear(m: nn.Module, x: mx.array) -> mx.array:
    """m(x). A bias-free nn.Linear multiplies by its weight's transposed view, kept with the weight
    (`derived`, lazy: gradients still reach a replaced weight) instead of a transpose node per call."""
    if type(m) is nn.Linear and "bias" not in m:
        return x @ derived(m, "_rhs", dict.get(m, "weight"), _transposed, evaluate=False)
    return m(x)


def _transposed(w: mx.array) -> mx.array:
    return w.T


def children(module: nn.Module, *names: str) -> list:
    """[module.name for name in names] read as the dict items a Module keeps its children in (an
    attribute read reaches them only after a failed lookup: slower, on paths run per token)."""
    return [dict.get(module, name) for name in names]


def _project(owner: nn.Module, linears, x):
    """[m(x) for m in linears]: the same-input projections of a block. `models/optimize.apply` may
    give `owner` a projector that computes the same outputs as one matmul or across two CPU streams."""
    projector = owner.__dict__.get("_projector")
    if projector is not None:
        return projector(linears, x)
    return [m(x) for m in linears]


@cache
def _norm_fn(eps: float):
    # Compiled: the CPU fallback of mx.fast.rms_norm is ~11 ops, 3 nodes once fused.
    @compiled_region
    def norm(x, scale):
        return mx.fast.rms_norm(x, scale, eps)

    return norm


@cache
def group_norm_fn(group_size: int, eps: float):
    @compiled_region
    def norm(x, scale):
        grouped = x.reshape(*x.shape[:-1], -1, group_size)
        out = mx.fast.rms_norm(grouped, None, eps) * scale  # scale: [groups, group_size]
        return out.reshape(x.shape)

    return norm


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight); with group_size it normalises each group separately.

    `weight` holds what the weights came as: zero-centred (the checkpoint's convention; the scale
    1 + weight is folded once per weight array, in memory, re-derived whenever `weight` is replaced
    by a load) or, when `stored_folded` is set, already the scale. Only a loader that read the
    convention from the artifact's metadata sets it (`set_norm_weights`); nothing guesses it.
    """

    stored_folded = False  # plain attribute, never a parameter

    def __init__(self, dims: int, eps: float, group_size: int | None = None):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps
        self.group_size = group_size

    @property
    def scale(self):
        if self.stored_folded:
            return self.weight
        return derived(self, "_folded", self.weight, lambda w: 1.0 + w, evaluate=False)

    @property
    def grouped_scale(self):
        """`scale` as [groups, group_size], evaluated once per scale array (a view: no reshape node
        per call)."""
        return derived(self, "_grouped", self.scale, lambda s: s.reshape(-1, self.group_size))

    def __call__(self, x):
        if self.group_size is None:
            return _norm_fn(self.eps)(x, self.scale)
        return group_norm_fn(self.group_size, self.eps)(x, self.grouped_scale)


def set_norm_weights(module: nn.Module, folded: bool) -> None:
    """Declare how every ZeroCenteredRMSNorm under `module` holds its loaded weights (folded: the
    scale itself; else zero-centred) and fold the zero-centred ones now, once, at load."""
    norms = [m for _, m in module.named_modules() if isinstance(m, ZeroCenteredRMSNorm)]
    for m in norms:
        m.stored_folded = folded
    mx.eval([m.scale for m in norms])


class GatedRMSNorm(nn.Module):
    """Plain-weight RMSNorm followed by an activation gate (DeltaNet output norm)."""

    def __init__(self, dims: int, eps: float, activation: str):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps
        self.activation = silu if activation == "silu" else mx.sigmoid

    def __call__(self, x, gate):
        return _gated_norm_fn(self.activation, self.eps)(x, self.weight, gate)


@cache
def _gated_norm_fn(activation, eps: float):
    @compiled_region
    def norm(x, weight, gate):
        return mx.fast.rms_norm(x, weight, eps) * activation(gate)

    return norm


# ---- rotary --------------------------------------------------------------------------------------


class Rotary:
    """Rotate-half RoPE on the leading `dims` channels at explicit integer positions.

    Positions are explicit (not an offset) because QSA block keys sit at every compress_ratio-th
    position; cos/sin follow the reference arithmetic (float32 position * inv_freq).
    """

    def __init__(self, dims: int, base: float):
        self.dims = dims
        exponents = np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims)
        inv_freq = (1.0 / (np.float32(base) ** exponents)).astype(np.float32)
        self.inv_freq = mx.array(inv_freq)
        # mx.fast.rope divides positions by these periods; given the same float32 inv_freq it
        # reproduces `apply(tables(...))` bit for bit at consecutive positions.
        self.periods = mx.array((1.0 / inv_freq).astype(np.float32))

    def at_offset(self, x: mx.array, offset: int) -> mx.array:
        """x: [..., L, D] at consecutive positions offset..offset+L-1."""
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self.periods)

    def tables(self, positions: mx.array):
        return _rope_tables(positions, self.inv_freq)

    def apply(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """x: [..., L, D] with cos/sin [L, dims] broadcast over leading axes."""
        return _rope_apply_fn(self.dims)(x, cos, sin)


@compiled_region
def _rope_tables(positions, inv_freq):
    freqs = positions.astype(mx.float32)[:, None] * inv_freq[None, :]
    freqs = mx.concatenate([freqs, freqs], axis=-1)
    return mx.cos(freqs), mx.sin(freqs)


@cache
def _rope_apply_fn(d: int):
    @compiled_region
    def apply(x, cos, sin):
        rot, rest = x[..., :d], x[..., d:]
        half = d // 2
        rotated = mx.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
        out = rot * cos + rotated * sin
        return mx.concatenate([out, rest], axis=-1) if rest.shape[-1] else out

    return apply


# ---- hyper-connections ---------------------------------------------------------------------------


class HyperConnection(nn.Module):
    """Gated residual over hc_count streams: mix streams into one block input, inject the output back."""

    def __init__(self, args: ModelArgs, inject: bool = True):
        super().__init__()
        self.hc_count = args.hc_count
        self.hidden_size = args.hidden_size
        width = args.hc_count * args.hidden_size
        self.hc_norm = ZeroCenteredRMSNorm(width, args.rms_norm_eps, group_size=args.hidden_size)
        self.input_mix_weight_down = nn.Linear(width, args.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(args.hc_lowrank, width, bias=False)
        if inject:
            self.block_inject_weight = nn.Linear(width, args.hc_count, bias=False)

    def projections(self, inject: bool):
        """The Linears that read the normed streams (joined into one matmul by models/optimize)."""
        return [self.input_mix_weight_down, self.block_inject_weight] if inject else [self.input_mix_weight_down]

    def mix(self, streams, inject: bool = False):
        """(mixed block input, normed streams[, inject logits when `inject`])."""
        fns = hc_fns(self.hc_count, self.hidden_size)
        normed = self.hc_norm(streams)
        down, *logits = _project(self, self.projections(inject), normed)
        weights = self.input_mix_weight_up(fns.activate(down))
        mixed = self.combine(weights, normed)
        return (mixed, normed, logits[0]) if inject else (mixed, normed)

    def combine(self, weights, normed):
        """The streams weighted by sigmoid(weights), averaged: [..., hc * hidden] -> [..., hidden]."""
        return hc_fns(self.hc_count, self.hidden_size).mix(weights, normed)

    def __call__(self, streams, block):
        """Run `block` on the mixed input and add its output back into every stream."""
        fns = hc_fns(self.hc_count, self.hidden_size)
        mixed, _, inject = self.mix(streams, inject=True)
        out = block(mixed)
        return fns.inject(streams, out, inject)

    def inject_then_mix(self, streams, out, logits):
        """The previous hyper-connection's block output `out` added into `streams` (with its inject
        logits), then this one's mix: (streams, mixed block input, normed streams, inject logits)."""
        streams = hc_fns(self.hc_count, self.hidden_size).inject(streams, out, logits)
        return (streams, *self.mix(streams, inject=True))


def hc_inject(streams, out, logits, hc_count: int, hidden: int):
    """`out` added into every stream, gated by 2 * sigmoid(logits / hc_count)."""
    # Added on the [..., hc, hidden] view so the product and the sum fuse into one kernel.
    gate = 2.0 * mx.sigmoid(logits / hc_count)
    grouped = streams.reshape(*streams.shape[:-1], hc_count, hidden)
    return (grouped + out[..., None, :] * gate[..., :, None]).reshape(streams.shape)


class _HCFns:
    """The hyper-connection's elementwise parts, compiled once per (hc_count, hidden)."""

    def __init__(self, hc_count: int, hidden: int):
        @compiled_region
        def activate(down):
            return silu(down / hc_count)

        @compiled_region
        def mix(up, normed):
            shape = (*normed.shape[:-1], hc_count, hidden)
            return (mx.sigmoid(up).reshape(shape) * normed.reshape(shape)).mean(axis=-2)

        @compiled_region
        def inject(streams, out, logits):
            return hc_inject(streams, out, logits, hc_count, hidden)

        self.activate, self.mix, self.inject = activate, mix, inject


@cache
def hc_fns(hc_count: int, hidden: int) -> _HCFns:
    return _HCFns(hc_count, hidden)


# ---- Gated DeltaNet ------------------------------------------------------------------------------


def causal_depthwise_conv(x, state, weight, dilation=1):
    """Depthwise causal conv over [state; x]; returns (output of len(x), new state)."""
    full = mx.concatenate([state, x], axis=1)
    out = mx.conv1d(full, weight, dilation=dilation, groups=x.shape[-1])
    return out, full[:, -state.shape[1] :]


@cache
def _gdn_gates_fn(q_scale: float):
    """Normalised q/k, beta and the log decay g, as one compiled elementwise graph."""

    @compiled_region
    def gates(q, k, b, a, A_log, dt_bias):
        q = gated_delta.l2_normalize(q) * q_scale
        k = gated_delta.l2_normalize(k)
        beta = mx.sigmoid(b)
        g = -mx.exp(A_log.astype(mx.float32)) * softplus(a + dt_bias)
        return q, k, beta, g

    return gates


@cache
def _gdn_recurrent_fn(dims):
    """The per-token GatedDeltaNet path after the projections (conv, gates, recurrence, gated norm),
    as one compiled graph: the same ops as the chunked path's pieces, in the same order."""
    n_k, d_k, n_v, d_v, eps, activation = dims
    gates = _gdn_gates_fn(d_k**-0.5)
    norm = _gated_norm_fn(activation, eps)

    @compiled_region
    def step(qkv, z, b, a, conv_state, conv_w, A_log, dt_bias, state, norm_w):
        B, L, _ = qkv.shape
        qkv, conv_state = causal_depthwise_conv(qkv, conv_state, conv_w)
        q, k, v = mx.split(silu(qkv), [n_k * d_k, 2 * n_k * d_k], axis=-1)
        q, k, beta, g = gates(q.reshape(B, L, n_k, d_k), k.reshape(B, L, n_k, d_k), b, a, A_log, dt_bias)
        out, state = gated_delta.recurrent_step(q, k, v.reshape(B, L, n_v, d_v), g, beta, state)
        out = norm(out.astype(qkv.dtype), norm_w, z.reshape(B, L, n_v, d_v))
        return out.reshape(B, L, -1), conv_state, state

    return step


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = args.linear_conv_kernel_dim
        h = args.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim, bias=False)
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.A_log = mx.zeros((self.num_v_heads,))
        self.norm = GatedRMSNorm(self.head_v_dim, args.rms_norm_eps, args.output_gate_type or args.hidden_act)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def projections(self):
        """The Linears that read the layer input (joined into one matmul by models/optimize)."""
        return children(self, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def _dims(self):
        return (
            self.num_k_heads,
            self.head_k_dim,
            self.num_v_heads,
            self.head_v_dim,
            self.norm.eps,
            self.norm.activation,
        )

    def _recurrent_step(self):
        """(the one-graph step, conv weight, A_log, dt_bias, norm weight), or None where the norm is
        replaced. Kept with the modules and arrays it came from, checked by identity each call (a
        Module's arrays are dict items, slower to reach as attributes; this runs per layer per token)."""
        get = dict.get
        conv, norm = get(self, "conv1d"), get(self, "norm")
        sources = (conv, norm, get(conv, "weight"), get(self, "A_log"), get(self, "dt_bias"), get(norm, "weight"))
        cached = self.__dict__.get("_step")
        if cached is not None and all(map(operator.is_, cached[0], sources)):
            return cached[1]
        step = (_gdn_recurrent_fn(self._dims()), *sources[2:]) if type(norm) is GatedRMSNorm else None
        object.__setattr__(self, "_step", (sources, step))
        return step

    def __call__(self, x, cache: LinearCache):
        B, L, _ = x.shape
        conv_state = cache.conv_state
        if conv_state is None:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=x.dtype)
        qkv, z, b, a = _project(self, self.projections(), x)
        state = cache.recurrent_state
        if state is None:
            state = mx.zeros((B, self.num_v_heads, self.head_v_dim, self.head_k_dim), dtype=mx.float32)
        step = self._recurrent_step() if L <= gated_delta.RECURRENT_MAX_TOKENS else None
        if step is not None:
            # decode and speculative verify blocks: everything after the projections is one compiled graph
            fn, conv_w, A_log, dt_bias, norm_w = step
            out, cache.conv_state, cache.recurrent_state = fn(
                qkv, z, b, a, conv_state, conv_w, A_log, dt_bias, state, norm_w
            )
            return linear(self.out_proj, out)
        qkv, cache.conv_state = causal_depthwise_conv(qkv, conv_state, self.conv1d.weight)
        qkv = silu(qkv)
        q, k, v = mx.split(qkv, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(B, L, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, L, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, L, self.num_v_heads, self.head_v_dim)
        q, k, beta, g = _gdn_gates_fn(self.head_k_dim**-0.5)(q, k, b, a, self.A_log, self.dt_bias)
        out, state = gated_delta.chunked(q, k, v, g, beta, state)
        cache.recurrent_state = state
        z = z.reshape(B, L, self.num_v_heads, self.head_v_dim)
        out = self.norm(out.astype(x.dtype), z)
        return linear(self.out_proj, out.reshape(B, L, -1))


# ---- QSA indexed attention -------------------------------------------------------------------------


def _select_groups(scores, valid, keep):
    """Per query, the `keep` best groups by (score desc, position asc), emitted in position order.

    scores/valid: [Q, G]. Returns (group ids [Q, keep], ok [Q, keep]); AFN-017. O(G) per query
    apart from one partition: membership by threshold + positional tie rank, order by scatter.
    """
    Q, G = scores.shape
    neg_inf = mx.array(-np.inf, dtype=scores.dtype)
    masked = mx.where(valid, scores, neg_inf)
    if G > keep:
        kth = -mx.partition(-masked, keep - 1, axis=-1)[:, keep - 1 : keep]
        above = valid & (masked > kth)
        tied = valid & (masked == kth)
        room = keep - above.astype(mx.int32).sum(axis=-1, keepdims=True)
        chosen = above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= room))
    else:
        chosen = valid
    # Chosen groups land in slots by their running count, i.e. chronologically; the rest go to a
    # scratch column that is dropped.
    slot = mx.where(chosen, mx.cumsum(chosen.astype(mx.int32), axis=-1) - 1, keep)
    positions = mx.broadcast_to(mx.arange(G, dtype=mx.int32), (Q, G))
    groups = mx.put_along_axis(mx.zeros((Q, keep + 1), dtype=mx.int32), slot, positions, axis=-1)[:, :keep]
    count = chosen.astype(mx.int32).sum(axis=-1, keepdims=True)
    ok = mx.arange(keep)[None, :] < count
    return groups, ok


def _online_softmax_attention(q, k, v, ok, scale, tile: int = 512):
    """Attention over compact gathered keys with a running max/sum.

    q: [B, Hkv, Q, R, D]; k, v: [B, Hkv, Q, W, D]; ok: [Q, W]. Visits W keys per query only.
    """
    W = k.shape[3]
    m = l = acc = None
    for start in range(0, W, tile):
        kt = k[:, :, :, start : start + tile]
        vt = v[:, :, :, start : start + tile]
        s = (q @ kt.swapaxes(-1, -2)) * scale  # [B,Hkv,Q,R,t]
        s = mx.where(ok[None, None, :, None, start : start + tile], s, -np.inf)
        tile_max = s.max(axis=-1, keepdims=True)
        new_m = tile_max if m is None else mx.maximum(m, tile_max)
        safe_m = mx.where(mx.isinf(new_m), 0.0, new_m)
        p = mx.exp(s - safe_m)
        if m is None:
            l, acc = p.sum(axis=-1, keepdims=True), p @ vt
        else:
            correction = mx.exp(mx.where(mx.isinf(m), -np.inf, m - safe_m))
            l = l * correction + p.sum(axis=-1, keepdims=True)
            acc = acc * correction + p @ vt
        m = new_m
    return acc / l


class QSAIndexer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.indexer_n_heads
        self.head_dim = args.indexer_head_dim
        self.ratio = args.indexer_compress_ratio
        self.budget = args.indexer_budget
        self.block_topk = args.indexer_budget // args.indexer_compress_ratio
        self.index_qk_proj = nn.Linear(args.hidden_size, (self.n_heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = ZeroCenteredRMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_layernorm = ZeroCenteredRMSNorm(self.head_dim, args.rms_norm_eps)

    def dense(self, n_tokens: int) -> bool:
        """Every visible key of a run of `n_tokens` fits the window: the selection is the whole
        causal prefix, no scoring (and no index queries) needed."""
        return n_tokens <= self.budget + self.ratio - 1

    def project(
        self, x, rotary: Rotary, cos=None, sin=None, *, offset: int | None = None, qk=None, queries: bool = True
    ):
        """Index queries (rotated by the cos/sin tables, or at consecutive positions from `offset`;
        None unless `queries`) and the raw keys. `qk`: index_qk_proj(x) when the caller already has
        it (fused projection)."""
        B, L, _ = x.shape
        if qk is None:
            qk = self.index_qk_proj(x)
        raw_keys = qk[..., self.n_heads * self.head_dim :]
        if not queries:
            return None, raw_keys
        q = qk[..., : self.n_heads * self.head_dim].reshape(B, L, self.n_heads, self.head_dim)
        q = self.q_layernorm(q).transpose(0, 2, 1, 3)  # [B, nh, L, Di]
        if offset is not None:
            return rotary.at_offset(q, offset), raw_keys
        return rotary.apply(q, cos, sin), raw_keys

    def block_keys(self, raw_keys, first_group, rotary: Rotary, start_position: int):
        """Pooled, normalised, rotated keys for complete groups given their raw keys [B, n*ratio, Di]."""
        B, n_tok, D = raw_keys.shape
        pooled = raw_keys.astype(mx.float32).reshape(B, n_tok // self.ratio, self.ratio, D).mean(axis=2)
        pooled = self.k_layernorm(pooled.astype(raw_keys.dtype))
        starts = start_position + (first_group + mx.arange(n_tok // self.ratio)) * self.ratio
        cos, sin = rotary.tables(starts)
        return rotary.apply(pooled, cos, sin)

    def select(self, q, block_keys, first_query, n_tokens, tile_budget: int = 1 << 22, *, rows=None):
        """Token ids each query may attend (compact, chronological) and their validity.

        q: [B, nh, L, Di] for cache indices first_query..first_query+L-1 (None where `dense`, with
        `rows` = (B, L)); block_keys: [B, G, Di].
        Returns (idx [B, L, W], ok [B, L, W]) with W = min(budget + ratio - 1, n_tokens).
        """
        B, nh, L, Di = (rows[0], None, rows[1], None) if q is None else q.shape
        G = block_keys.shape[1]
        r = self.ratio
        query_idx = first_query + mx.arange(L, dtype=mx.int32)
        if self.dense(n_tokens):
            # Every visible key fits the window, so the selection is the whole causal prefix,
            # already chronological (AFN-017 dense parity); no scoring needed.
            idx = mx.broadcast_to(mx.arange(n_tokens, dtype=mx.int32), (B, L, n_tokens))
            return idx, idx <= query_idx[None, :, None]
        complete = (query_idx + 1) // r  # groups fully visible to each query
        tail = complete[:, None] * r + mx.arange(r - 1, dtype=mx.int32)[None, :]
        tail_ok = tail <= query_idx[:, None]
        # Score candidate groups in query tiles so the score buffer stays bounded.
        tile = max(1, min(L, tile_budget // max(1, nh * G)))
        all_idx, all_ok = [], []
        for b in range(B):
            # Kept 3-D: MLX copies the whole [G, Di] operand of a matmul taken as block_keys[b].
            keys_t = block_keys[b : b + 1].astype(mx.float32).swapaxes(-1, -2)  # [1, Di, G]
            rows_idx, rows_ok = [], []
            for s in range(0, L, tile):
                qs = q[b, :, s : s + tile].astype(mx.float32)  # [nh, t, Di]
                t = qs.shape[1]
                scores = (qs.reshape(1, nh * t, Di) @ keys_t).reshape(nh, t, G)
                scores = mx.maximum(scores, 0.0).sum(axis=0)
                scores = scores / math.sqrt(Di)
                valid = mx.arange(G)[None, :] < complete[s : s + tile, None]
                groups, ok = _select_groups(scores, valid, self.block_topk)
                tokens = (groups[:, :, None] * r + mx.arange(r, dtype=mx.int32)).reshape(groups.shape[0], -1)
                tok_ok = mx.repeat(ok, r, axis=-1)
                rows_idx.append(mx.concatenate([tokens, tail[s : s + tile]], axis=-1))
                rows_ok.append(mx.concatenate([tok_ok, tail_ok[s : s + tile]], axis=-1))
            all_idx.append(mx.concatenate(rows_idx, axis=0))
            all_ok.append(mx.concatenate(rows_ok, axis=0))
        return mx.stack(all_idx), mx.stack(all_ok)


class QSAAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        h = args.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, args.rms_norm_eps)
        self.indexer = QSAIndexer(args)
        self.rotary = Rotary(args.rotary_dim, args.rope_theta)

    def projections(self):
        """The Linears that read the layer input (joined into one matmul by models/optimize)."""
        return [*children(self, "q_proj", "k_proj", "v_proj"), dict.get(dict.get(self, "indexer"), "index_qk_proj")]

    def __call__(self, x, cache: AttentionCache, capture: Capture | None = None, layer: int = -1):
        B, L, _ = x.shape
        first = cache.length  # cache index of the first new token
        offset = cache.start_position + first

        q_all, k, v, index_qk = _project(self, self.projections(), x)
        q_all = q_all.reshape(B, L, self.n_heads, 2 * self.head_dim)
        queries, gate = q_all[..., : self.head_dim], q_all[..., self.head_dim :]
        rotate, index_rope = self.rotations(offset, L)
        queries = rotate(self.q_norm(queries).transpose(0, 2, 1, 3))
        keys = rotate(self.k_norm(k.reshape(B, L, self.n_kv_heads, self.head_dim)).transpose(0, 2, 1, 3))
        values = v.reshape(B, L, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)

        # The index queries are read only past the dense regime (cache.length after the append).
        dense = self.indexer.dense(first + L)
        index_q, raw_keys = self.indexer.project(x, self.rotary, qk=index_qk, queries=not dense, **index_rope)
        keys, values = cache.append(keys, values, raw_keys)
        new_groups = cache.pending_groups(self.indexer.ratio)
        if new_groups is not None:
            first_group, raw = new_groups
            cache.add_block_keys(self.indexer.block_keys(raw, first_group, self.rotary, cache.start_position))
        idx, ok = self.indexer.select(index_q, cache.block_keys_view(), first, cache.length, rows=(B, L))
        # A hard selection has no gradient; stopping it lets the graph train (MTP head trainer).
        idx, ok = mx.stop_gradient(idx), mx.stop_gradient(ok)
        if capture is not None:
            capture.qsa_selected[layer] = (idx, ok)

        out = self.attend(queries, keys, values, idx, ok, cache.length)
        out = out * mx.sigmoid(gate.reshape(B, L, -1))
        return linear(self.o_proj, out)

    def rotations(self, offset: int, L: int):
        """(rotate(t) for the L positions from `offset`, the indexer's rope keywords)."""
        return (lambda t: self.rotary.at_offset(t, offset)), {"offset": offset}

    def attend(self, queries, keys, values, idx, ok, n_tokens: int):
        """Attention of each query over its selected keys (idx, ok) among the `n_tokens` cached."""
        return self.sparse_attention(queries, keys, values, idx, ok)

    def sparse_attention(self, queries, keys, values, idx, ok, gather_budget: int = 1 << 18):
        """Gather only the selected K/V rows, then online softmax over them (AFN-016).

        Queries go in tiles so the gathered rows (tile x W per KV head) stay bounded in prefill.
        """
        B, H, L, D = queries.shape
        W = idx.shape[-1]
        rep = H // self.n_kv_heads
        tile = max(1, min(L, gather_budget // max(W, 1)))
        outs = []
        for b in range(B):
            rows = []
            for s in range(0, L, tile):
                t_ok = ok[b, s : s + tile]
                t = t_ok.shape[0]
                flat = mx.where(t_ok, idx[b, s : s + tile], 0).reshape(-1)
                k_sel = mx.take(keys[b : b + 1], flat, axis=2).reshape(1, self.n_kv_heads, t, W, D)
                v_sel = mx.take(values[b : b + 1], flat, axis=2).reshape(1, self.n_kv_heads, t, W, D)
                q = queries[b : b + 1, :, s : s + tile].reshape(1, self.n_kv_heads, rep, t, D).transpose(0, 1, 3, 2, 4)
                o = _online_softmax_attention(q, k_sel, v_sel, t_ok, self.scale)  # [1,Hkv,t,rep,D]
                rows.append(o.transpose(0, 2, 1, 3, 4).reshape(1, t, H * D))
            outs.append(mx.concatenate(rows, axis=1))
        return mx.concatenate(outs, axis=0)


# ---- PLE -------------------------------------------------------------------------------------------


@cache
def _row_ids_fn(ngram_size: int, heads_per_ngram: int, eos: int, n_new: int):
    """NGramEmbedding.row_ids as one compiled integer graph (the hash is exact integer arithmetic)."""

    @compiled_region
    def row_ids(history, multipliers, head_sizes, head_offsets):
        B, T = history.shape
        pos = mx.arange(T)
        eos_pos = mx.where(history == eos, pos, -1)
        prev_inclusive = mx.cummax(eos_pos, axis=1)
        prev = mx.concatenate([mx.full((B, 1), -1, dtype=prev_inclusive.dtype), prev_inclusive[:, :-1]], axis=1)
        in_segment = pos[None, :] - (prev + 1)
        shifted = [history]
        for shift in range(1, ngram_size):
            src = mx.maximum(pos - shift, 0)
            moved = history[:, src]
            keep = (in_segment >= shift) & ((pos - shift) >= 0)[None, :]
            shifted.append(mx.where(keep, moved, eos))
        blocks = []
        for n in range(2, ngram_size + 1):
            mixed = shifted[0] * multipliers[0]
            for p in range(1, n):
                mixed = mx.bitwise_xor(mixed, shifted[p] * multipliers[p])
            lo = (n - 2) * heads_per_ngram
            sizes = head_sizes[lo : lo + heads_per_ngram]
            offsets = head_offsets[lo : lo + heads_per_ngram]
            blocks.append(mx.remainder(mixed[..., None], sizes) + offsets)
        return mx.concatenate(blocks, axis=-1)[:, T - n_new :]

    return row_ids


def dequantize_ple_rows(raw: mx.array, bits: int, group_size: int, width: int) -> mx.array:
    """[..., row_bytes] uint8 affine PLE rows (artifact.ple_pages: values packed LSB first, then
    bf16 scales, then bf16 biases per group) -> [..., width] float32. The resident table and the
    streamed pages decode through this one function, so both give the same bits."""
    lead = raw.shape[:-1]
    packed, groups = width * bits // 8, width // group_size
    q = raw[..., :packed]
    if bits == 4:
        q = mx.stack([q & 0xF, q >> 4], axis=-1)
    q = q.reshape(*lead, groups, group_size).astype(mx.float32)
    scales = raw[..., packed : packed + 2 * groups].view(mx.bfloat16).astype(mx.float32)
    biases = raw[..., packed + 2 * groups :].view(mx.bfloat16).astype(mx.float32)
    return (q * scales[..., None] + biases[..., None]).reshape(*lead, width)


class QuantizedNGramTable(nn.Module):
    """A resident PLE table of affine rows (`weight`: [rows, row_bytes] uint8, the page store's
    rows as stored), decoded after the gather: the table stays at its stored size in memory."""

    def __init__(self, rows: int, width: int, bits: int, group_size: int, row_bytes: int, dtype=mx.float32):
        super().__init__()
        self.weight = mx.zeros((rows, row_bytes), dtype=mx.uint8)
        self.width, self.bits, self.group_size, self.dtype = width, bits, group_size, dtype
        self.freeze()

    def __call__(self, rows: mx.array) -> mx.array:
        out = dequantize_ple_rows(self.weight[rows], self.bits, self.group_size, self.width)
        return out if self.dtype is None else out.astype(self.dtype)


class NGramEmbedding(nn.Module):
    """Hashed n-gram rows for one PLE layer; history is per sequence and carried across calls (AFN-012)."""

    def __init__(self, args: ModelArgs, ple_index: int):
        super().__init__()
        self.ngram_size = args.ngram_size
        self.heads_per_ngram = args.heads_per_ngram
        self.eos = args.eos_id
        sizes = ple_head_vocab_sizes(args, ple_index)
        self._multipliers = mx.array(ple_layer_multipliers(args, ple_index), dtype=mx.int64)
        self._head_sizes = mx.array(sizes, dtype=mx.int64)
        self._head_offsets = mx.array(ple_head_offsets(sizes), dtype=mx.int64)
        self.ngram_embedding = nn.Embedding(ple_table_rows(args, ple_index), args.ple_embed_dim // args.ngram_heads)

    def row_ids(self, history: mx.array, n_new: int) -> mx.array:
        """Row ids [B, n_new, heads] for the last n_new tokens of `history` [B, ctx + n_new] (int64)."""
        fn = _row_ids_fn(self.ngram_size, self.heads_per_ngram, self.eos, n_new)
        return fn(history, self._multipliers, self._head_sizes, self._head_offsets)

    def __call__(self, ids, cache: LinearCache, capture_rows: list | None = None):
        B, L = ids.shape
        context = cache.ngram_context
        if context is None:
            context = mx.full((B, self.ngram_size - 1), self.eos, dtype=mx.int64)
        history = mx.concatenate([context, ids.astype(mx.int64)], axis=1)
        cache.ngram_context = history[:, -(self.ngram_size - 1) :]
        rows, emb = self.lookup(history, L)
        if capture_rows is not None:
            capture_rows.append(rows)
        return emb

    def lookup(self, history, n_new: int):
        """(row ids [B, n_new, heads], their embeddings concatenated [B, n_new, ple_embed_dim])."""
        rows = self.row_ids(history, n_new)
        return rows, self.ngram_embedding(rows).reshape(history.shape[0], n_new, -1)


class PLELayer(nn.Module):
    def __init__(self, args: ModelArgs, ple_index: int):
        super().__init__()
        self.hc_count = args.hc_count
        self.hidden_size = args.hidden_size
        width = args.hc_count * args.hidden_size
        self.dilation = args.ngram_size
        self.state_len = (args.ple_conv_kernel_size - 1) * args.ngram_size
        self.ple_embedding = NGramEmbedding(args, ple_index)
        self.key_proj = nn.Linear(args.ple_embed_dim, width, bias=False)
        self.value_proj = nn.Linear(args.ple_embed_dim, args.hidden_size, bias=False)
        eps = args.rms_norm_eps
        self.norm_key = ZeroCenteredRMSNorm(width, eps, group_size=args.hidden_size)
        self.norm_query = ZeroCenteredRMSNorm(width, eps, group_size=args.hidden_size)
        self.norm_conv = ZeroCenteredRMSNorm(width, eps, group_size=args.hidden_size)
        self.conv1d = nn.Conv1d(width, width, args.ple_conv_kernel_size, groups=width, bias=False)

    def projections(self):
        """The Linears that read the n-gram embedding (joined into one matmul by models/optimize)."""
        return children(self, "key_proj", "value_proj")

    def __call__(self, streams, ids, cache: LinearCache):
        B, L, width = streams.shape
        emb = self.ple_embedding(ids, cache)
        key, value = _project(self, self.projections(), emb)
        state = cache.ple_conv_state
        if state is None:
            state = mx.zeros((B, self.state_len, width), dtype=streams.dtype)
        out, cache.ple_conv_state = self.mix(key, value, streams, state)
        return out

    def mix(self, key, value, streams, state):
        """After the projections: norms, gate and the dilated causal conv -> (output, conv state)."""
        split = (*streams.shape[:-1], self.hc_count, self.hidden_size)
        key = self.norm_key(key).reshape(split)
        query = self.norm_query(streams).reshape(split)
        gated = ple_gate(key, query, value)
        conv, state = causal_depthwise_conv(self.norm_conv(gated), state, self.conv1d.weight, dilation=self.dilation)
        return gated + silu(conv), state


def ple_gate(key, query, value):
    """key, query [B, L, hc, hidden], value [B, L, hidden] -> the gated value on every stream."""
    B, L, hc, hidden = key.shape
    gate = (key * query).sum(axis=-1, keepdims=True) / math.sqrt(hidden)
    gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6)) * mx.sign(gate)
    return (mx.sigmoid(gate) * value[:, :, None, :]).reshape(B, L, hc * hidden)


# ---- MoE ---------------------------------------------------------------------------------------------


@compiled_region
def _swiglu(gate, up):
    return silu(gate) * up


@compiled_region
def _moe_combine(routed, scores, shared_logit, shared):
    return (routed * scores[..., None]).sum(axis=-2) + mx.sigmoid(shared_logit) * shared


class SharedExpert(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x):
        return linear(self.down_proj, _swiglu(linear(self.gate_proj, x), linear(self.up_proj, x)))


def ranked_experts(probs: mx.array, k: int) -> mx.array:
    """The `k` most probable experts of router probabilities `probs` (float32 >= 0, last axis) in
    rank order: probability descending, then expert id ascending (AFN-001's frozen tie rule, one
    rule for the model, its fast paths and trace replay). Each expert's key is its probability's
    float32 bits (ordered as integers for values >= 0) above its reversed id, so no two keys are
    equal and argpartition/argsort have no order of their own left to choose. uint32 [..., k]."""
    n = probs.shape[-1]
    bits = mx.view(mx.stop_gradient(probs).astype(mx.float32), mx.uint32).astype(mx.int64)
    key = bits * n + (n - 1 - mx.arange(n, dtype=mx.int64))
    inds = mx.argpartition(-key, kth=k - 1, axis=-1)[..., :k]
    order = mx.argsort(-mx.take_along_axis(key, inds, axis=-1), axis=-1)
    return mx.take_along_axis(inds, order, axis=-1)


def route_logits(logits, k: int, norm_topk_prob: bool):
    """(expert ids [..., k] in rank order, their float32 weights) for router logits [..., experts]."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    # Indices carry no gradient (as in mlx-lm); stopping them lets the graph train (MTP head).
    inds = mx.stop_gradient(ranked_experts(probs, k))
    scores = mx.take_along_axis(probs, inds, axis=-1)
    if norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


@cache
def _route_fn(k: int, norm_topk_prob: bool):
    @compiled_region
    def route(logits):
        return route_logits(logits, k, norm_topk_prob)

    return route


class SparseMoE(nn.Module):
    """float32 softmax router, top-k (`ranked_experts`: probability desc, then expert id asc), shared
    expert with sigmoid gate.

    `switch_mlp` is the routed-expert interface (x, indices) -> [..., k, hidden]; the streaming
    engine substitutes its own module with the same call shape.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        self.shared_expert = SharedExpert(args.hidden_size, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def route(self, x):
        inds, scores = _route_fn(self.top_k, self.norm_topk_prob)(linear(self.gate, x))
        return inds, scores.astype(x.dtype)

    def projections(self):
        """The Linears that read the MoE input (joined into one matmul by models/optimize)."""
        return [*children(self, "gate", "shared_expert_gate"), *children(self.shared_expert, "gate_proj", "up_proj")]

    def __call__(self, x, capture: Capture | None = None, layer: int = -1):
        out, inds, scores = self.experts(x, *_project(self, self.projections(), x))
        if capture is not None:
            capture.routes[layer] = inds
            capture.route_weights[layer] = scores
            if capture.router_inputs is not None:
                capture.router_inputs[layer] = x  # post-hyper-connection MLP input
        return out

    def experts(self, x, logits, shared_logit, shared_gate, shared_up):
        """After the projections: route, routed and shared experts, combined -> (output, expert ids,
        their weights in x's dtype)."""
        inds, scores = _route_fn(self.top_k, self.norm_topk_prob)(logits)
        scores = scores.astype(x.dtype)
        routed = self.routed_experts(x, inds)
        shared = linear(self.shared_expert.down_proj, _swiglu(shared_gate, shared_up))
        return _moe_combine(routed, scores, shared_logit, shared), inds, scores

    def routed_experts(self, x, inds):
        """The routed experts' outputs [..., k, hidden] for the chosen expert ids `inds` [..., k]."""
        return self.switch_mlp(x, inds)


# ---- layers and model ---------------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.is_linear = args.layer_types[layer] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = QSAAttention(args)
        ple_index = args.ple_index(layer)
        if ple_index is not None:
            self.ple = PLELayer(args, ple_index)
        self.has_ple = ple_index is not None
        self.mlp = SparseMoE(args)
        self.attn_hyper_connection = HyperConnection(args)
        self.mlp_hyper_connection = HyperConnection(args)

    def __call__(self, streams, ids, cache, capture: Capture | None = None, streaming: Streaming | None = None):
        get = dict.get  # a Module's children are dict items, slower to reach as attributes (per layer per token)
        if self.has_ple:
            streams = streams + get(self, "ple")(streams, ids, cache)
        attn_hc, mlp_hc = get(self, "attn_hyper_connection"), get(self, "mlp_hyper_connection")
        # attn_hyper_connection(streams, mixer), then mlp_hyper_connection(streams, moe), with the
        # first's inject and the second's mix in one call (one compiled graph where swapped in).
        mixed, _, logits = attn_hc.mix(streams, inject=True)
        if self.is_linear:
            out = get(self, "linear_attn")(mixed, cache)
        else:
            out = get(self, "self_attn")(mixed, cache, capture, self.layer)
        streams, h, _, logits = mlp_hc.inject_then_mix(streams, out, logits)
        if streaming is not None:
            # Cross-layer route predictors see this layer's MoE input and its streams.
            h = streaming.before_router(self.layer, streams, h)
        out = get(self, "mlp")(h, capture, self.layer)
        return hc_fns(mlp_hc.hc_count, mlp_hc.hidden_size).inject(streams, out, logits)


class TextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.hyper_connection_mixer = HyperConnection(args, inject=False)
        self.streaming: Streaming | None = None

    def __call__(self, ids, cache, capture: Capture | None = None, return_hidden: bool = False):
        h = self.embed_tokens(ids)
        streams = mx.concatenate([h] * self.args.hc_count, axis=-1)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            if self.streaming is not None:
                # Streamed experts start their lookahead reads when the layer starts.
                streams = self.streaming.layer_start(i, streams)
            streams = layer(streams, ids, layer_cache, capture, self.streaming)
            if capture is not None:
                if capture.hidden is not None:
                    capture.hidden.append(streams)
            elif self.streaming is None or not self.streaming.streams_experts:
                # Resident layers: compute this layer while the next one's graph is built. Streamed
                # layers keep their own ordering (their reads are issued from inside the graph).
                mx.async_eval(streams)
        mixed, _ = self.hyper_connection_mixer.mix(streams)
        return (mixed, streams) if return_hidden else mixed


class Model(nn.Module):
    # The checkpoint's optional MTP head (models/mtp_head.py), set by the loaders; not a child module.
    mtp_head = None
    # The GraphOptions models/optimize.apply built this model with; None: the active ones.
    options: graph_options.GraphOptions | None = None
    # The tokenizer's IDs [0, effective_vocab_size) (AFN-005), set by the loader for a product
    # family (admission.EFFECTIVE_VOCAB; an HF checkpoint by admission.product_vocabulary): the
    # logits of the unassigned rows past it are -inf,
    # so a loop that samples without hebrus's vocabulary mask (mlx-lm's) cannot pick one. None: no
    # mask.
    effective_vocab_size: int | None = None
    # Called as after_update(model, model.options) once `update` / `update_modules` replaced weights:
    # models/optimize.apply sets it to itself, to run the pass again. Not a child module or parameter.
    after_update = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = TextModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(
        self,
        inputs: mx.array,
        cache: SequenceCache | None = None,
        capture: Capture | None = None,
        position: int | None = None,
        return_hidden: bool = False,
    ):
        """inputs [B, L] token ids -> logits [B, L, vocab_size (physical)].

        `return_hidden` also returns the last decoder layer's output streams before
        `hyper_connection_mixer`, [B, L, hc_count * hidden_size]: (logits, streams). Row t is the
        state after consuming inputs[:, t] (the speculative drafters' capture, see
        hebrus_mlx/speculative/base.py).

        `position`, when given, is the logical position of inputs[:, 0]; it must continue the cached
        run exactly (AFN-018). The request is rejected before any work if it would pass
        max_position_embeddings.
        """
        if inputs.ndim != 2:
            raise ValueError(f"inputs must be [batch, length], got shape {inputs.shape}")
        if cache is None:
            cache = self.make_cache()
        cache.check_append(inputs.shape[1], self.args.max_position_embeddings, position)
        # The graph is built under this model's options (models/optimize.apply set them).
        with graph_options.use(self.options or graph_options.active()):
            out = self.model(inputs, cache, capture, return_hidden)
            cache.advance(inputs.shape[1])
            if return_hidden:
                return self.head_logits(out[0]), out[1]
            return self.head_logits(out)

    def update(self, parameters: dict, strict: bool = True) -> Model:
        """nn.Module.update, then the load-time pass again (its joined weights, layouts and one-graph
        arguments were made from the arrays this replaces)."""
        super().update(parameters, strict)
        self._weights_changed()
        return self

    def update_modules(self, modules: dict, strict: bool = True) -> Model:
        super().update_modules(modules, strict)
        self._weights_changed()
        return self

    def _weights_changed(self):
        if self.after_update is not None:
            self.after_update(self, self.options)

    def head_logits(self, h):
        return self.mask_unassigned(linear(self.lm_head, h))

    def mask_unassigned(self, logits):
        """-inf on the logits of rows past `effective_vocab_size` (last axis); the rest unchanged."""
        n, width = self.effective_vocab_size, logits.shape[-1]
        if n is None or n >= width:
            return logits
        return mx.where(mx.arange(width) < n, logits, mx.array(-mx.inf, dtype=logits.dtype))

    @property
    def streaming(self) -> Streaming | None:
        """The streamed experts/PLE face (engine, chunk cap, layer hook); None when resident."""
        return self.model.streaming

    @streaming.setter
    def streaming(self, value: Streaming | None):
        self.model.streaming = value

    def make_cache(self) -> SequenceCache:
        return SequenceCache([LinearCache() if layer.is_linear else AttentionCache() for layer in self.model.layers])

    @property
    def layers(self):
        return self.model.layers

    # ---- checkpoint mapping ------------------------------------------------------------------------
    def sanitize(self, weights: dict) -> dict:
        """Map HF checkpoint tensors (CausalLM or ConditionalGeneration, unfused or fused experts)
        onto runtime names. Idempotent: runtime-named input passes through unchanged.

        Every tensor is consumed by a key rule or excluded by a named one; missing or unexpected
        tensors raise CheckpointKeyError naming the tensor.
        """
        if self._is_runtime_layout(weights):
            return dict(weights)
        args = self.args
        check_key_set(weights.keys(), args)
        out: dict[str, mx.array] = {}
        experts: dict[tuple[int, str], dict[int, mx.array]] = {}
        shards: dict[int, dict[int, mx.array]] = {}
        for raw_key, value in weights.items():
            cls = classify(raw_key, args)
            if cls.kind == "excluded":
                continue
            if cls.kind == "dense":
                out[cls.runtime_key] = value.swapaxes(1, 2) if cls.depthwise_conv else value
            elif cls.kind == "expert":
                experts.setdefault((cls.layer, cls.component), {})[cls.expert] = value
            elif cls.kind == "fused_expert":
                prefix = f"model.layers.{cls.layer}.mlp.switch_mlp."
                if cls.component == "gate_up_proj":
                    half = value.shape[1] // 2
                    out[prefix + "gate_proj.weight"] = value[:, :half]
                    out[prefix + "up_proj.weight"] = value[:, half:]
                else:
                    out[prefix + "down_proj.weight"] = value
            elif cls.kind == "ple_shard":
                shards.setdefault(cls.layer, {})[cls.shard] = value
            elif cls.kind == "ple_constant":
                self._check_ple_constant(raw_key, cls.layer, cls.component, value)
        for (layer, component), per_expert in experts.items():
            out[f"model.layers.{layer}.mlp.switch_mlp.{component}.weight"] = mx.stack(
                [per_expert[e] for e in range(args.num_experts)]
            )
        for layer, parts in shards.items():
            out[f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"] = mx.concatenate(
                [parts[s] for s in range(args.split_ngram_parts)], axis=0
            )
        return out

    def _is_runtime_layout(self, weights) -> bool:
        return any(".switch_mlp." in k for k in weights) and not any(
            ".mlp.experts." in strip_prefix(k) for k in weights
        )

    def _check_ple_constant(self, raw_key, layer, name, value):
        expected = ple_constants(self.args, self.args.ple_index(layer))[name]
        got = np.array(value).astype(np.int64).tolist()
        if got != expected:
            raise CheckpointKeyError(f"{raw_key}: checkpoint value {got} differs from the config-derived {expected}")


# The overridable methods of each block (the module docstring): the written contract between this
# file and models/optimize.py, checked by `optimize.apply` when it swaps a block's class.
SEAMS: dict[type, tuple[str, ...]] = {
    HyperConnection: ("mix", "combine", "inject_then_mix"),
    PLELayer: ("mix",),
    NGramEmbedding: ("lookup",),
    QSAAttention: ("rotations", "attend"),
    SparseMoE: ("experts", "routed_experts"),
    Model: ("head_logits",),
}
