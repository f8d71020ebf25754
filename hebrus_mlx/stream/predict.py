"""Cross-layer route predictors for streamed experts (issue 13, AFN-019 P1 tickets).

``--prefetch off|previous|router-reuse[:D]|hyper-reuse`` picks what is read ahead of the exact
(P0) reads a layer's router makes:

- ``previous``: each layer's previous-token top-k, issued when the layer starts (the control);
- ``router-reuse:D`` (D = 1 or 2): at layer l's router, layer l+D's own router applied to layer
  l's MoE input; its probabilities order the candidates;
- ``hyper-reuse``: at layer l's router, layer l+1's MLP hyper-connection mix applied to layer
  l's post-attention streams, then layer l+1's router.

Everything stays in the graph: the candidates are computed lazily at layer l's router and issued
right after layer l's exact reads were resolved (``StreamedSwitchGLU``), so the predicted reads
overlap layer l's expert compute and layer l+1's attention/GDN and never go ahead of layer l's
own P0 misses. A per-layer ``budget`` (candidates, highest probability first) and a probability
``threshold`` bound the predicted bytes. Predictions are advisory: they only ever change which
records are already cached, never which experts run, so tokens are identical for every predictor.
Prediction runs for one-token forwards (decode); a prefill chunk touches most experts anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..errors import UsageError

KINDS = ("off", "previous", "router-reuse", "hyper-reuse")
# The default: router-reuse:1 won the interleaved A/B runs against the previous-token control with
# identical tokens on every I/O measure (issue 13; real-geometry decode bench: bytes read -18%,
# wasted bytes -73%, exposed wait -21%, p99 issue->ready 153 -> 106 ms, precision 51 -> 85%; demo
# streamed at 5%: exact misses 19.7 -> 13.8 per token, wasted 11.3 -> 2.9 MB). Wall-clock on this
# 2-core CPU machine is compute-bound and within the run-to-run spread (no time claim). hyper-reuse
# misses as little but costs an extra hyper-connection mix per layer. (It was held back by a
# thread-count test that counted threads earlier tests left to the GC; that test now checks sets.)
DEFAULT = "router-reuse:1"
_SKIP = 0xFFFFFFFF  # an out-of-range record id: the prefetch op skips it


@dataclass(frozen=True)
class PrefetchSpec:
    """What to read ahead. ``budget``: candidates per layer (None: the model's top-k);
    ``threshold``: minimum router probability of a candidate."""

    kind: str
    depth: int = 1
    budget: int | None = None
    threshold: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UsageError("prefetch", f"must be one of {', '.join(KINDS)}, got {self.kind!r}")
        max_depth = 2 if self.kind == "router-reuse" else 1
        if not 1 <= self.depth <= max_depth:
            raise UsageError("prefetch", f"depth of {self.kind} must be in [1, {max_depth}], got {self.depth}")
        if self.budget is not None and self.budget < 1:
            raise UsageError("prefetch-budget", f"must be >= 1, got {self.budget}")
        if not 0.0 <= self.threshold < 1.0:
            raise UsageError("prefetch-threshold", f"must be in [0, 1), got {self.threshold}")

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.depth}" if self.kind == "router-reuse" else self.kind

    @property
    def ahead(self) -> bool:
        """Predicts from a layer's router for a later layer."""
        return self.kind in ("router-reuse", "hyper-reuse")


def parse_prefetch(text, budget: int | None = None, threshold: float = 0.0) -> PrefetchSpec:
    """``"router-reuse:2"`` -> PrefetchSpec; a PrefetchSpec passes through. UsageError names
    ``prefetch`` on anything else."""
    if isinstance(text, PrefetchSpec):
        return text
    if not isinstance(text, str):
        raise UsageError("prefetch", f"must be a string such as 'router-reuse:2', got {type(text).__name__}")
    kind, sep, depth = text.strip().partition(":")
    if sep:
        if not depth.isdigit():
            raise UsageError("prefetch", f"depth must be an integer, got {depth!r}")
        d = int(depth)
    else:
        d = 1
    return PrefetchSpec(kind, d, budget, threshold)


def candidates(probs: mx.array, budget: int, threshold: float) -> mx.array:
    """The ``budget`` most probable experts of one token's router ``probs`` (last axis), most
    probable first; those below ``threshold`` become a skipped id. uint32, flattened."""
    probs = probs.reshape(-1, probs.shape[-1])
    k = min(budget, probs.shape[-1])
    inds = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
    p = mx.take_along_axis(probs, inds, axis=-1)
    order = mx.argsort(-p, axis=-1)
    inds = mx.take_along_axis(inds, order, axis=-1).astype(mx.uint32)
    if threshold > 0.0:
        p = mx.take_along_axis(p, order, axis=-1)
        inds = mx.where(p >= threshold, inds, mx.array(_SKIP, mx.uint32))
    return inds.reshape(-1)


def router_probs(moe, x: mx.array) -> mx.array:
    """A SparseMoE's own router probabilities for input ``x`` (float32, as its route())."""
    return mx.softmax(moe.gate(x).astype(mx.float32), axis=-1)


class Predictor:
    """Builds each layer's candidates for a later layer from the decoder layers' own routers
    (and MLP hyper-connections); see the module doc."""

    def __init__(self, spec: PrefetchSpec, layers, top_k: int):
        self.spec = spec
        self.layers = layers
        self.budget = spec.budget or top_k

    def predict(self, layer: int, streams: mx.array, x: mx.array):
        """(target layer, candidate expert ids) or None, at layer ``layer``'s router; ``streams``:
        the post-attention streams, ``x``: the MoE input. One-token forwards only."""
        if not self.spec.ahead or x.size // x.shape[-1] != 1:
            return None
        target = layer + self.spec.depth
        if target >= len(self.layers):
            return None
        nxt = self.layers[target]
        if self.spec.kind == "hyper-reuse":
            x, _ = nxt.mlp_hyper_connection.mix(streams)
        return target, candidates(router_probs(nxt.mlp, x), self.budget, self.spec.threshold)
