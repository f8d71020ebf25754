"""The speculative decoding protocol, independent of any drafter (AFN-020):

    proposal (one or more candidates per position) -> one coherent path
    -> target verification of the whole block in one forward
    -> accepted prefix plus the target's bonus token committed
    -> rejected-suffix state restored exactly
    -> speculative expert tickets retired (a fresh generation of the request's ticket scope)

`Speculation` is that protocol as the strategy generate's one decode loop calls
(`generate.speculative_generate_step`, or `generate_step(..., draft_model=...)`): prefill, the
pipelined plain steps and the step guard are the loop's.

State rollback is the simple exact one: the whole SequenceCache (GDN conv + recurrent state, QSA
K/V, indexer keys and pooled block keys, PLE n-gram history and conv tail) is snapshotted before the
verify forward (references, free); when a suffix is rejected the snapshot is restored and only the
accepted prefix is run again, so the committed state is what a forward over exactly the committed
tokens produces. When every draft is accepted the verify forward's state is already the committed
one.

Acceptance:
- greedy (the sampler has no `distribution`, or it is None): the target's argmax at each position;
  drafts are accepted while they equal it, the bonus is the target's token at the first mismatch.
- sampling with `sampler.distribution` (hebrus_mlx.sample_utils.make_sampler): rejection sampling.
  Draft x ~ q is accepted with probability min(1, p(x)/q(x)); otherwise the bonus is drawn from
  normalize(max(p - q, 0)). A deterministic proposal (probs None) has q one-hot. The committed
  tokens are then distributed exactly as the target's sampler would draw them.
- any other sampler callable: the target's sampler is drawn at every position and drafts are
  accepted while they equal its draws (exact in distribution, lower acceptance).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from ..sample_utils import apply_vocab_mask, check_finite, make_sampler, masked_logprobs
from .base import Drafter, DrafterError, Proposal


@dataclass
class SpeculativeStats:
    """Counters of one speculative generation (read by generate's verbose stats)."""

    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, accepted
    verify_steps: int = 0  # target verify forwards (one per step)
    committed: int = 0  # tokens committed by verify steps (accepted + bonus)
    reruns: int = 0  # partial acceptances that re-ran the accepted prefix
    block_sizes: dict = field(default_factory=dict)  # draft length -> steps

    def summary(self) -> str:
        pct = 100.0 * self.accepted / self.drafted if self.drafted else 0.0
        per = self.committed / self.verify_steps if self.verify_steps else 0.0
        return (
            f"Speculative: accepted {self.accepted}/{self.drafted} draft tokens ({pct:.1f}%), "
            f"{per:.2f} tokens per verify step"
        )


@dataclass
class StepTrace:
    """One verified step, as the golden replay records it (AFN-020's proposal record)."""

    position: int  # sequence position of the block's first input (the last committed token)
    path: list[int]  # the selected draft path
    candidates: list[list[int]] | None
    target_tokens: list[int]  # the target's own token at every block position (greedy: argmax)
    accepted: int
    bonus: int


def accept_block(
    logprobs: mx.array, proposal: Proposal, sampler: Callable, key: mx.array | None = None
) -> tuple[int, int, list[int]]:
    """Decide a verified block. logprobs: [n+1, V] target log-probabilities (vocab-masked) at the
    block's positions; row i predicts the token after block input i. Returns
    (accepted draft count a, bonus token, target tokens per row for the trace). key: the
    sequence's own random key for this block's draws (None: MLX's global generator)."""
    keys = [None, None] if key is None else list(mx.random.split(key))
    drafts = proposal.tokens
    n = len(drafts)
    distribution = getattr(sampler, "distribution", "missing")
    if distribution is None:  # greedy
        target = np.array(mx.argmax(logprobs, axis=-1)).tolist()
        a = 0
        while a < n and drafts[a] == target[a]:
            a += 1
        return a, target[a], target
    if distribution == "missing":  # opaque sampler: draw it at each position
        drawn = sampler(logprobs) if key is None else sampler(logprobs, key=key)
        target = np.array(drawn).reshape(-1).tolist()
        a = 0
        while a < n and drafts[a] == target[a]:
            a += 1
        return a, target[a], target
    p = distribution(logprobs)  # [n+1, V]
    q = proposal.probs
    if n:
        rows = mx.arange(n)
        d = mx.array(drafts)
        p_d = p[rows, d]
        q_d = mx.ones((n,)) if q is None else q.astype(mx.float32)[rows, d]
        u = mx.random.uniform(shape=(n,), key=keys[0])
        ok = np.array(u * q_d < p_d).tolist()  # u < p/q without dividing by q
    else:
        ok = []
    a = 0
    while a < n and ok[a]:
        a += 1
    if a < n:
        if q is None:
            residual = p[a] * (mx.arange(p.shape[-1]) != drafts[a])
        else:
            residual = mx.maximum(p[a] - q[a].astype(mx.float32), 0.0)
        bonus = int(mx.random.categorical(mx.log(residual), key=keys[1]).item())
    else:
        bonus = int(mx.random.categorical(mx.log(p[n]), key=keys[1]).item())
    return a, bonus, drafts[:a] + [bonus]


class Speculation:
    """The speculative strategy generate's decode loop calls (generate._decode): while a plain step
    is in flight it asks `block_size`; a length > 0 means that, once the token is read, it
    `propose`s a draft path and `verify`s it against the target in one forward, committing the
    accepted prefix plus the bonus token (rejected-suffix state restored exactly, speculative
    expert tickets retired in the request's scope). Plain tokens are reported with `plain`.

    num_draft_tokens: the block limit (default 3); governor: "auto" (choose the block per step,
    see governor.py), None (always the limit) or a Governor (anything with its block_size /
    observe_block / observe_step / observe_routes); trace: a list receiving a StepTrace per verify;
    tickets: the request's ticket scope (Streaming.request(); None when nothing streams)."""

    def __init__(
        self,
        model,
        drafter: Drafter,
        cache,
        sampler: Callable,
        tickets,
        *,
        num_draft_tokens: int | None = None,
        governor: Any = "auto",
        stats: SpeculativeStats | None = None,
        max_tokens: int = 256,
        trace: list[StepTrace] | None = None,
    ):
        from ..errors import GenerationError
        from .governor import Governor

        check_drafter(drafter)  # names and directories resolve in stream_generate (they need the tokenizer)
        limit = 3 if num_draft_tokens is None else num_draft_tokens
        if not isinstance(limit, int) or limit < 0:
            raise GenerationError("num_draft_tokens", f"must be an int >= 0, got {num_draft_tokens}")
        if not hasattr(cache, "snapshot"):
            raise GenerationError("speculative decoding needs a SequenceCache (snapshot/restore)")
        streaming = getattr(model, "streaming", None)
        if streaming is not None and streaming.max_chunk_tokens is not None:
            limit = min(limit, streaming.max_chunk_tokens - 1)  # a verify pins every expert of its block
        self.limit = limit
        self.governor = Governor(limit) if governor == "auto" else governor
        self.drafter, self.cache, self.sampler, self.tickets = drafter, cache, sampler, tickets
        self.stats = stats if stats is not None else SpeculativeStats()
        self.max_tokens, self.trace = max_tokens, trace
        self.needs_hidden = bool(drafter.needs_hidden)
        # The governor's I/O model and unique-expert estimate: streamed experts only.
        self._io = streaming if streaming is not None and streaming.streams_experts else None
        self.track_routes = self.governor is not None and self._io is not None
        self._io_last = None  # engine counters at the previous plain token's read
        self._t_read, self._reads, self._t_draft = 0.0, 0, 0.0
        self._prompt = None

    # -- what the loop calls ------------------------------------------------------------------

    def begin(self, prompt: list[int], hidden_rows: list[mx.array]) -> None:
        """After the prefill of all but the last prompt token (`hidden_rows`: their states); the
        drafter begins once the first token's step gave the last one."""
        self._prompt, self._prompt_hidden = list(prompt), hidden_rows

    def block_size(self, done: int) -> int:
        """Draft length of the next step, `done` tokens produced before it (0: a plain step)."""
        room = self.limit if self.max_tokens == -1 else min(self.limit, self.max_tokens - done - 1)
        return room if self.governor is None else min(room, self.governor.block_size())

    def start_plain(self) -> None:
        """A run of plain steps starts (their I/O is measured from here)."""
        self._io_last = self._counters()
        self._t_read, self._reads = time.perf_counter(), 0

    def plain(self, token: int, step) -> None:
        """A plain step's token was read (`step`: its generate.PendingStep)."""
        now = time.perf_counter()
        if self.governor is not None:
            # Steady (pipelined) time per token: from the third read of a run on.
            self._observe(1, now - self._t_read if self._reads >= 2 else None, step.routes, 1)
        self._t_read, self._reads = now, self._reads + 1
        if self._prompt is not None:
            # The first token: h_{L-1} came with its step, the drafter gets the whole prompt's states.
            rows = self._prompt_hidden + ([] if step.hidden is None else [step.hidden])
            hidden = mx.concatenate(rows, axis=0) if self.needs_hidden else None
            self.drafter.begin(self._prompt, hidden)
            self.drafter.commit([token], None if hidden is None else hidden[:0])
            self._prompt = self._prompt_hidden = None
            return
        self.drafter.commit([token], step.hidden)
        self.stats.block_sizes[0] = self.stats.block_sizes.get(0, 0) + 1

    def propose(self, n: int) -> Proposal:
        if n > 0 and self._io is not None:
            # The draft tokens' records at P2 while the drafter runs (spare bandwidth only).
            self._io.prefetch_drafts()
        t0 = time.perf_counter()
        proposal = self.drafter.propose(n).truncate(n)
        self._t_draft = time.perf_counter() - t0
        return proposal

    def verify(self, step, y: int, proposal: Proposal) -> list[tuple[int, mx.array, bool]]:
        """Verify [y] + the draft path in one target forward (`step`: the loop's DecodeStep);
        returns the committed (token, logprobs, from_draft): the accepted drafts, then the bonus."""
        drafts = proposal.tokens
        block = mx.array([y] + drafts, dtype=mx.int32)
        cache = self.cache
        snap = cache.snapshot()
        position = cache.next_position
        io0 = self._counters()
        t1 = time.perf_counter()
        with step.guard(snap):
            logits, h, _, routes = step.forward(block, rows=True, routes=True)
            lp, finite = step.checked(logits, block)
            mx.eval(lp, finite, *(a for a in (h, routes) if a is not None), *cache.arrays)
            check_finite(finite)  # the rows of the tokens it would commit (AFN-010)
        t_verify = time.perf_counter() - t1
        a, bonus, target = accept_block(lp, proposal, self.sampler, step.next_key())
        if self.governor is not None:
            self.governor.observe_block(len(drafts), a)
            self._observe(len(drafts) + 1, t_verify, routes, a + 1, io0, self._t_draft, len(drafts))
        if a < len(drafts):
            # Rejected suffix: back to the state before the block, then only the accepted prefix.
            cache.restore(snap)
            if self.tickets is not None:  # streamed experts: reads for the rejected suffix fail stale
                self.tickets.retire()
            with step.guard(snap):
                step.forward(block[: a + 1])
                mx.eval(cache.arrays)
            self.stats.reruns += 1
        step.fed(block[: a + 1])
        committed = drafts[:a] + [bonus]
        self.drafter.commit(committed, None if h is None else h[: a + 1])
        s = self.stats
        s.drafted += len(drafts)
        s.accepted += a
        s.verify_steps += 1
        s.committed += len(committed)
        s.block_sizes[len(drafts)] = s.block_sizes.get(len(drafts), 0) + 1
        if self.trace is not None:
            self.trace.append(StepTrace(position, list(drafts), proposal.candidates, target, a, bonus))
        return [(tok, lp[i], i < a) for i, tok in enumerate(committed)]

    # -- the governor's measurements ------------------------------------------------------------

    def _counters(self):
        if self._io is None:
            return None
        c = self._io.counters()
        return c["exact_misses"], c["exposed_wait_ns"]

    def _observe(self, tokens, seconds, routes, committed, io0=None, draft_s=0.0, drafted=0):
        """Report a forward to the governor: time, engine misses / exposed wait, committed routes."""
        from .governor import unique_per_layer

        io1 = self._counters()
        if io0 is None:  # a plain step: since the previous plain read (pipelined)
            io0, self._io_last = self._io_last, io1
        misses, exposed, unique_reads = 0, 0.0, 0.0
        if routes is not None:
            r = np.array(routes)
            self.governor.observe_routes(r[:, :committed])
            unique_reads = r.shape[0] * unique_per_layer(r)
        if io0 is not None and io1 is not None:
            misses, exposed = io1[0] - io0[0], (io1[1] - io0[1]) * 1e-9
        elif tokens == 1:
            unique_reads = 0.0  # no counter baseline yet
        self.governor.observe_step(tokens, seconds, draft_s, drafted, misses, exposed, unique_reads)


# -- golden replay ------------------------------------------------------------------------------------

TRACE_SCHEMA = 1


class TraceMismatchError(ValueError):
    """A replay trace does not belong to this target / request; the message names the field."""


def target_contract(model, owner: int = 0, generation: int = 0) -> dict:
    """What a replay trace binds to (AFN-020): the target revision (a fingerprint: config plus a
    strided sample of lm_head and the embedding, not a full weight digest), the vocabulary width,
    the hidden-capture shape and stage, and the request's owner/generation."""
    args = model.args
    h = hashlib.sha256(
        json.dumps(vars(args) if not hasattr(args, "to_dict") else args.to_dict(), sort_keys=True, default=str).encode()
    )
    for w in (model.lm_head.weight, model.model.embed_tokens.weight):
        stride = max(1, w.shape[0] // 64)
        h.update(np.asarray(w[::stride].astype(mx.float32)).tobytes())
    return {
        "schema_version": TRACE_SCHEMA,
        "target_revision": h.hexdigest(),
        "vocab_size": int(args.vocab_size),
        "hidden_shape": [int(args.hc_count * args.hidden_size)],
        "captured_stage": f"layers.{args.num_hidden_layers - 1}.output.pre_mixer",
        "owner": int(owner),
        "generation": int(generation),
    }


def check_trace(header: dict, contract: dict) -> None:
    """Refuse a trace recorded against anything but this contract, naming the first field."""
    for key in (
        "schema_version",
        "target_revision",
        "vocab_size",
        "hidden_shape",
        "captured_stage",
        "owner",
        "generation",
    ):
        if header.get(key) != contract[key]:
            raise TraceMismatchError(f"{key}: trace has {header.get(key)!r}, this target has {contract[key]!r}")


def replay_step(
    model, cache, y: int, proposal: Proposal, effective_vocab_size: int, sampler: Callable | None = None
) -> tuple[int, int, list[int]]:
    """One protocol step against the native target outside the generator (golden replay):
    verify [y] + path in one forward, decide, roll the rejected suffix back. Returns
    (accepted, bonus, committed)."""
    sampler = sampler or make_sampler()  # the logits below are masked before it samples
    block = [int(y)] + proposal.tokens
    snap = cache.snapshot()
    logits = model(mx.array(block, dtype=mx.int32)[None], cache=cache)[0]
    lp = masked_logprobs(logits.astype(mx.float32), effective_vocab_size)
    mx.eval(lp, cache.arrays)
    a, bonus, _ = accept_block(lp, proposal, sampler)
    if a < len(proposal.tokens):
        cache.restore(snap)
        mx.eval(model(mx.array(block[: a + 1], dtype=mx.int32)[None], cache=cache), cache.arrays)
    return a, bonus, proposal.tokens[:a] + [bonus]


def replay(model, trace: dict, effective_vocab_size: int, owner: int = 0, generation: int = 0) -> list[StepTrace]:
    """Re-run a recorded trace ({"header": ..., "prompt": [...], "steps": [{"path", "candidates"}...]})
    against this target after checking its header; returns what the target decides at each step."""
    check_trace(trace.get("header", {}), target_contract(model, owner, generation))
    cache = model.make_cache()
    prompt = list(trace["prompt"])
    logits = model(mx.array(prompt, dtype=mx.int32)[None], cache=cache)
    y = int(mx.argmax(apply_vocab_mask(logits[0, -1], effective_vocab_size)).item())
    out = []
    for step in trace["steps"]:
        proposal = Proposal(step["path"], step.get("candidates"))
        position = cache.next_position
        a, bonus, committed = replay_step(model, cache, y, proposal, effective_vocab_size)
        out.append(StepTrace(position, proposal.tokens, proposal.candidates, [], a, bonus))
        y = bonus
    return out


def check_drafter(drafter) -> Drafter:
    for attr in ("propose", "begin", "commit", "reset"):
        if not callable(getattr(drafter, attr, None)):
            raise DrafterError(f"draft_model: {type(drafter).__name__} has no {attr}()")
    return drafter
