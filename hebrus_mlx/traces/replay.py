"""Replay a recorded token history as causal prefill and check exact route parity (AFN-021 gate 1).

For every recorded sequence the token IDs are fed to a fresh cache in chunks of `chunk` tokens;
the native router's top-k IDs at every (position, layer) must equal the recorded ones, in rank
order. Weights are compared with a declared tolerance (WEIGHT_ATOL) and reported separately.

Tie rule (AFN-001): the router ranks experts by probability descending, then expert id ascending
(`models.qwen4exp.ranked_experts`, the one rule of every path), so equal probabilities have one
order and parity is exact on every row, tied or not. The replay also ranks the router's full
float32 probabilities; rows where two of the top-(k+1) are exactly equal are counted as `tied`
(reported, not excused).

Failures are named: identity (artifact/tokenizer digests), a sequence that does not start at
position 0 (wrong position offset), position gaps (dropped token; caught by the reader), routes
that match the replay shifted by d positions (misaligned offset), a clean prefix followed by
divergence (a dropped or changed token, or state corruption) and mismatches from the first token
on (a different artifact than its digest claims).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..generate import prefill_chunks
from ..models.qwen4exp import Capture, ranked_experts
from .capture import stack_capture
from .schema import TraceError, model_identity
from .shards import TraceSet

WEIGHT_ATOL = 1e-5
MAX_EXAMPLES = 5


@dataclass
class Recomputed:
    topk_ids: np.ndarray  # int32 [N, L, k]
    topk_weights: np.ndarray  # float32 [N, L, k]
    ranked_ids: np.ndarray  # int32 [N, L, k+1] replay probability order
    ranked_probs: np.ndarray  # float32 [N, L, k+1]


def check_token_ids(model, token_ids, sequence=None) -> None:
    """Refuse token IDs outside the model's embedding rows: the embedding gather does not check
    its indices, and an ID past the table reads outside it (a crash, or garbage routes)."""
    ids = np.asarray(token_ids)
    vocab = model.args.vocab_size
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        i = int(bad[0])
        at = f"sequence {sequence.sequence_id} position {int(sequence.positions[i])}" if sequence else f"row {i}"
        raise TraceError("token_ids", f"{at}: token ID {int(ids[i])} is outside the model's vocabulary [0, {vocab})")


def recompute(model, token_ids, chunk: int, on_chunk: Callable | None = None) -> Recomputed:
    """Causal prefill of `token_ids` on a fresh cache by generate's prefill (chunks of `chunk`
    tokens, capped as a streamed model needs); one readback per chunk. `on_chunk(start, capture)`
    may add device work per chunk (it sees router inputs)."""
    if chunk < 1:
        raise TraceError("prefill_step_size", f"must be >= 1, got {chunk}")
    check_token_ids(model, token_ids)
    a = model.args
    L, k = a.num_hidden_layers, a.num_experts_per_tok
    cache = model.make_cache()
    start = [0]

    def forward(ids):
        cap = Capture(hidden=on_chunk is not None and getattr(on_chunk, "wants_hidden", False), router_inputs=True)
        out = model(ids[None], cache=cache, capture=cap)
        topk, w = stack_capture(cap, L)
        ranked_i, ranked_p = [], []
        for layer in range(L):
            x = cap.router_inputs[layer]
            probs = mx.softmax(model.model.layers[layer].mlp.gate(x).astype(mx.float32), axis=-1)
            order = ranked_experts(probs, k + 1)
            ranked_i.append(order)
            ranked_p.append(mx.take_along_axis(probs, order, axis=-1))
        ri, rp = mx.stack(ranked_i, axis=-2)[0], mx.stack(ranked_p, axis=-2)[0]
        extra = on_chunk(start[0], cap) if on_chunk is not None else []
        start[0] += ids.size
        rows = [topk[0], w[0], ri, rp]
        return out, rows + list(extra), rows

    parts = [
        (np.array(t), np.array(w), np.array(ri).astype(np.int32), np.array(rp))
        for _, (t, w, ri, rp) in prefill_chunks(
            model, mx.array(np.asarray(token_ids, dtype=np.int32)), cache, chunk, forward
        )
    ]
    cols = list(zip(*parts))
    return Recomputed(*(np.concatenate(c) for c in cols))


def route_parity(rec_ids, rep_ids, ranked_probs):
    """Rows [..., k] of recorded and replayed routes: (match [...] bool: the same IDs in the same
    order, ties included; tied [...] bool: two of the replay's top-(k+1) probabilities are equal)."""
    match = np.all(rec_ids == rep_ids, axis=-1)
    tied = (ranked_probs[..., 1:] == ranked_probs[..., :-1]).any(axis=-1)
    return match, tied


@dataclass
class SequenceParity:
    sequence_id: str
    owner: str
    tokens: int
    decode_tokens: int
    mismatches_per_layer: list
    tied_per_layer: list
    max_weight_diff: float
    examples: list = field(default_factory=list)
    diagnosis: str | None = None

    @property
    def ok(self) -> bool:
        return sum(self.mismatches_per_layer) == 0 and self.max_weight_diff <= WEIGHT_ATOL


def _diagnose(match: np.ndarray, rec_ids, rep_ids, first_position=0) -> str | None:
    """match [N, L] bool; name the most likely fault."""
    rows = match.all(axis=1)
    if rows.all():
        return None
    n = len(rows)
    base = rows.mean()
    best = (0.0, 0)
    for d in (-3, -2, -1, 1, 2, 3):
        if n <= abs(d) + 1:
            continue
        a = rec_ids[max(0, -d) : n - max(0, d)]
        b = rep_ids[max(0, d) : n - max(0, -d)]
        rate = np.all(a == b, axis=(1, 2)).mean()
        best = max(best, (rate, d))
    if best[0] > 0.5 and best[0] > 2 * base:
        return (
            f"wrong position offset: the recorded routes match the replay shifted by {best[1]:+d} "
            f"position(s) ({best[0]:.0%} of rows)"
        )
    p0 = int(np.flatnonzero(~rows)[0])
    after = 1.0 - rows[p0:].mean()
    if p0 == 0 and after > 0.5:
        return (
            "mismatches from the first token in most rows: the weights are not the artifact the "
            "trace names (a different artifact)"
        )
    if after > 0.5:
        return (
            f"divergence from position {first_position + p0}: exact before it, {after:.0%} of rows differ "
            f"after (a dropped or changed token, or corrupted state, just before it)"
        )
    return (
        f"{int((~rows).sum())} scattered row mismatches (first at position {first_position + p0}): "
        f"numerical near-ties between the prefill and decode paths"
    )


def replay(model, tokenizer, traces: TraceSet, chunk: int = 2048, check_identity: bool = True) -> list:
    """Replay every sequence; returns [SequenceParity]. Identity and offset faults raise TraceError."""
    if check_identity:
        mine = model_identity(model, tokenizer)
        diff = traces.identity.mismatch(mine)
        if diff is not None:
            field_name = diff.split(":", 1)[0]
            raise TraceError(field_name, f"the trace was recorded against a different runtime ({diff})")
    for seq in traces.sequences:  # before any sequence is replayed
        check_token_ids(model, seq.token_ids, seq)
    out = []
    for seq in traces.sequences:
        if seq.positions[0] != 0:
            raise TraceError(
                "positions",
                f"sequence {seq.sequence_id} starts at position {int(seq.positions[0])}: "
                "wrong position offset (the history before it is not in the trace)",
            )
        rep = recompute(model, seq.token_ids, chunk)
        n = len(seq.positions)
        match, tied = route_parity(seq.topk_ids, rep.topk_ids, rep.ranked_probs)
        wdiff = np.abs(seq.topk_weights - rep.topk_weights).max(axis=2)
        res = SequenceParity(
            sequence_id=seq.sequence_id,
            owner=seq.owner,
            tokens=n,
            decode_tokens=int((seq.kinds == 1).sum()),
            mismatches_per_layer=(~match).sum(axis=0).astype(int).tolist(),
            tied_per_layer=tied.sum(axis=0).astype(int).tolist(),
            max_weight_diff=float(np.where(match, wdiff, 0).max()) if n else 0.0,
        )
        for p, layer in zip(*np.nonzero(~match)):
            if len(res.examples) == MAX_EXAMPLES:
                break
            res.examples.append(
                {
                    "position": int(seq.positions[p]),
                    "layer": int(layer),
                    "recorded": seq.topk_ids[p, layer].tolist(),
                    "replayed": rep.topk_ids[p, layer].tolist(),
                }
            )
        res.diagnosis = _diagnose(match, seq.topk_ids, rep.topk_ids, int(seq.positions[0]))
        if res.diagnosis is None and res.max_weight_diff > WEIGHT_ATOL:
            res.diagnosis = f"IDs exact but weights differ by {res.max_weight_diff:.2e} (> {WEIGHT_ATOL})"
        out.append(res)
    return out
