"""The speculative decoding protocol, independent of any drafter (AFN-020):

    proposal (one or more candidates per position) -> one coherent path
    -> target verification of the whole block in one forward
    -> accepted prefix plus the target's bonus token committed
    -> rejected-suffix state restored exactly
    -> speculative expert tickets retired (owner/generation)

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
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..sample_utils import apply_vocab_mask, make_sampler
from .base import Drafter, DrafterError, Proposal

_OWNERS = itertools.count(1 << 20)  # engine owners of speculative runs (0 is the plain path's)


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
        return (f"Speculative: accepted {self.accepted}/{self.drafted} draft tokens ({pct:.1f}%), "
                f"{per:.2f} tokens per verify step")


@dataclass
class StepTrace:
    """One verified step, as the golden replay records it (AFN-020's proposal record)."""

    position: int  # sequence position of the block's first input (the last committed token)
    path: List[int]  # the selected draft path
    candidates: Optional[List[List[int]]]
    target_tokens: List[int]  # the target's own token at every block position (greedy: argmax)
    accepted: int
    bonus: int


def accept_block(logprobs: mx.array, proposal: Proposal, sampler: Callable) -> Tuple[int, int, List[int]]:
    """Decide a verified block. logprobs: [n+1, V] target log-probabilities (vocab-masked) at the
    block's positions; row i predicts the token after block input i. Returns
    (accepted draft count a, bonus token, target tokens per row for the trace)."""
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
        target = np.array(sampler(logprobs)).reshape(-1).tolist()
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
        u = mx.random.uniform(shape=(n,))
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
        bonus = int(mx.random.categorical(mx.log(residual)).item())
    else:
        bonus = int(mx.random.categorical(mx.log(p[n])).item())
    return a, bonus, drafts[:a] + [bonus]


class _ExpertTickets:
    """Owner/generation of a streamed model's expert reads during speculation (AFN-020): every
    verify forward resolves under (owner, generation); after a rejection the generation advances,
    so a read still in flight for the rejected suffix fails stale and can never be waited on by,
    or publish into, the new state (a late completion may still fill an ordinary cache slot)."""

    def __init__(self, model):
        streaming = getattr(model, "streaming", None)
        self.switches = list(streaming.switches) if streaming is not None else []
        self.engine = streaming.engine if streaming is not None else None
        self.owner = next(_OWNERS)
        self.generation = 0
        self.saved = [(s.owner, s.generation) for s in self.switches]
        self._set()

    def _set(self):
        for s in self.switches:
            s.owner, s.generation = self.owner, self.generation

    def retire(self):
        if not self.switches or self.engine is None:
            return
        self.generation += 1
        self.engine.advance_generation(self.owner, self.generation)
        self._set()

    def close(self):
        for s, (o, g) in zip(self.switches, self.saved):
            s.owner, s.generation = o, g


def speculative_generate_step(
    prompt: mx.array,
    model,
    drafter: Drafter,
    *,
    effective_vocab_size: int,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
    prompt_cache: Optional[Any] = None,
    prefill_step_size: int = 2048,
    num_draft_tokens: Optional[int] = None,
    governor: Any = "auto",
    stats: Optional[SpeculativeStats] = None,
    trace: Optional[List[StepTrace]] = None,
    stream: Optional[Any] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs, from_draft) like generate_step (plus whether the token was a
    drafted one the target accepted). num_draft_tokens: the block limit (default 3); governor:
    "auto" (default: choose the block per step, see governor.py), None (always the limit) or a
    Governor (anything with its block_size / observe_block / observe_step / observe_routes).
    Steps with no draft (B = 0, or a drafter with nothing to propose) run pipelined like
    generate_step: the next plain step is queued before the current token is read whenever the
    governor chooses B = 0 again, on `stream` (generate passes its generation stream; None: the
    default stream)."""
    from ..errors import GenerationError
    from ..models.cache import rollback_on_error
    from ..models.qwen4exp import Capture
    from .governor import Governor, unique_per_layer

    if prompt.ndim != 1 or prompt.size == 0:
        raise GenerationError("prompt must be a non-empty 1-D array of token IDs")
    if prefill_step_size < 1:
        raise GenerationError("prefill_step_size", f"must be >= 1, got {prefill_step_size}")
    limit = 3 if num_draft_tokens is None else num_draft_tokens
    if not isinstance(limit, int) or limit < 0:
        raise GenerationError("num_draft_tokens", f"must be an int >= 0, got {num_draft_tokens}")
    cache = model.make_cache() if prompt_cache is None else prompt_cache
    if not hasattr(cache, "snapshot"):
        raise GenerationError("speculative decoding needs a SequenceCache (snapshot/restore)")
    sampler = sampler or make_sampler()  # the loop masks the vocabulary before sampling
    processors = logits_processors or []
    stats = stats if stats is not None else SpeculativeStats()
    streaming = getattr(model, "streaming", None)
    if streaming is not None and streaming.max_chunk_tokens is not None:
        # A streamed forward pins every expert of its chunk at once (a swept prefill chunk need not).
        if streaming.prefill_chunk_cap is not None:
            prefill_step_size = min(prefill_step_size, streaming.prefill_chunk_cap)
        limit = min(limit, streaming.max_chunk_tokens - 1)
    if governor == "auto":
        governor = Governor(limit)
    need_h = bool(drafter.needs_hidden)
    plain_stream = stream if stream is not None else mx.default_stream(mx.default_device())
    tickets = _ExpertTickets(model)

    engine = streaming.engine if streaming is not None and streaming.experts is not None else None
    pipeline = getattr(model, "last_row_logits", False)  # rank 0 of a pipeline: no route capture
    track_routes = governor is not None and engine is not None and not pipeline  # U_B: streamed only
    io_last = [None]  # engine counters at the previous plain token's read

    def forward(ids: List[int], cap=None, rows: bool = False):
        # rows: every row's logits (a verify); a pipeline sends only the last row's unless asked.
        kw = {"all_logits": True} if rows and pipeline else {}
        if cap is not None:
            kw["capture"] = cap
        out = model(mx.array(ids, dtype=mx.int32)[None], cache=cache, return_hidden=need_h, **kw)
        return out if need_h else (out, None)

    def decide(done: int) -> int:
        """Draft length of the next step, `done` tokens produced before it."""
        room = limit if max_tokens == -1 else min(limit, max_tokens - done - 1)
        return room if governor is None else min(room, governor.block_size())

    def stack_routes(cap):
        """[layers, T, k] routes of a forward (lazy), None when not tracked."""
        if cap is None or not cap.routes:
            return None
        return mx.stack([cap.routes[i][0] for i in sorted(cap.routes)])

    def io_counters():
        if engine is None:
            return None
        c = engine.counters()
        return c["exact_misses"], c["exposed_wait_ns"]

    def observe(tokens, seconds, routes, committed, io0=None, draft_s=0.0, drafted=0):
        """Report a forward to the governor: time, engine misses / exposed wait, committed routes."""
        io1 = io_counters()
        if io0 is None:  # a plain step: since the previous plain read (pipelined)
            io0, io_last[0] = io_last[0], io1
        misses, exposed, unique_reads = 0, 0.0, 0.0
        if routes is not None:
            r = np.array(routes)
            governor.observe_routes(r[:, :committed])
            unique_reads = r.shape[0] * unique_per_layer(r)
        if io0 is not None and io1 is not None:
            misses, exposed = io1[0] - io0[0], (io1[1] - io0[1]) * 1e-9
        elif tokens == 1:
            unique_reads = 0.0  # no counter baseline yet
        governor.observe_step(tokens, seconds, draft_s, drafted, misses, exposed, unique_reads)

    def queue_plain(tok: mx.array):
        """One plain decode step on `tok` ([1], possibly not yet evaluated), queued with async_eval
        like generate_step's; returns its lazy token, log-probabilities, hidden row and routes."""
        snap = cache.snapshot()
        with rollback_on_error(cache, snap), mx.stream(plain_stream):
            cap = Capture(hidden=False) if track_routes else None
            out = model(tok[None], cache=cache, return_hidden=need_h, **({"capture": cap} if cap is not None else {}))
            logits, h = out if need_h else (out, None)
            logits = logits[:, -1, :]
            if processors:
                hist = mx.concatenate([mx.array(history, dtype=mx.int32), tok])
                for proc in processors:
                    logits = proc(hist, logits)
            logits = apply_vocab_mask(logits, effective_vocab_size)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            nxt = sampler(logprobs)
            routes = stack_routes(cap)
            mx.async_eval(nxt, logprobs, *([h] if h is not None else []), *([routes] if routes is not None else []))
        return {"y": nxt, "lp": logprobs[0], "h": None if h is None else h[0], "routes": routes, "snap": snap}

    def rows_logprobs(logits: mx.array, history: List[int]) -> mx.array:
        """[L, V] log-probabilities; processors see the history up to each row."""
        if processors:
            out = []
            for i in range(logits.shape[0]):
                row = logits[i:i + 1]
                hist = mx.array(history[: len(history) - logits.shape[0] + i + 1], dtype=mx.int32)
                for proc in processors:
                    row = proc(hist, row)
                out.append(row)
            logits = mx.concatenate(out, axis=0)
        logits = apply_vocab_mask(logits.astype(mx.float32), effective_vocab_size)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def guarded(snap, fn):
        with rollback_on_error(cache, snap):
            return fn()

    if max_tokens == 0:
        return
    try:
        ids = prompt.astype(mx.int32).tolist()
        history = list(ids)
        hidden_rows = []
        # Prefill the whole prompt; its last row gives the first token.
        start = 0
        while start < len(ids):
            chunk = ids[start:start + prefill_step_size]
            snap = cache.snapshot()
            logits, h = guarded(snap, lambda: forward(chunk))
            guarded(snap, lambda: mx.eval([logits] + ([h] if h is not None else []) + cache.arrays))
            if h is not None:
                hidden_rows.append(h[0])
            start += len(chunk)
        hidden = mx.concatenate(hidden_rows, axis=0) if need_h else None
        lp = rows_logprobs(logits[0, -1:], history)
        y = int(sampler(lp).reshape(-1)[0].item())
        drafter.begin(ids, hidden)
        drafter.commit([y], None if hidden is None else hidden[:0])  # h_{L-1} came with begin
        produced = 1
        history.append(y)
        yield y, lp[0], False
        decided = None  # a block size chosen while the last plain step was in flight
        while max_tokens == -1 or produced < max_tokens:
            n = decide(produced) if decided is None else decided
            decided = None
            t0 = time.perf_counter()
            proposal = drafter.propose(n) if n > 0 else Proposal([])
            proposal = proposal.truncate(n)
            drafts = proposal.tokens
            t_draft = time.perf_counter() - t0
            if not drafts:
                # B = 0: plain steps, pipelined exactly like generate_step (the next step is queued
                # before this one's token is read) for as long as the governor keeps choosing 0.
                io_last[0] = io_counters()
                cur = queue_plain(mx.array([y], dtype=mx.int32))
                t_read, reads = time.perf_counter(), 0
                while True:
                    last = max_tokens != -1 and produced + 1 >= max_tokens
                    nxt = None
                    if not last:
                        decided = decide(produced + 1)
                        if decided == 0:
                            # Until its token is read, the current step and the one queued on
                            # top of it roll back together to the state before the current step.
                            nxt = guarded(cur["snap"], lambda: queue_plain(cur["y"]))
                            decided = None
                    tok = guarded(cur["snap"], lambda: int(cur["y"].item()))
                    now = time.perf_counter()
                    if governor is not None:
                        # Steady (pipelined) time per token: from the third read of a run on.
                        observe(1, now - t_read if reads >= 2 else None, cur["routes"], 1)
                    t_read, reads = now, reads + 1
                    drafter.commit([tok], cur["h"])
                    stats.block_sizes[0] = stats.block_sizes.get(0, 0) + 1
                    history.append(tok)
                    produced += 1
                    yield tok, cur["lp"], False
                    if last:
                        return
                    if nxt is None:
                        y = tok
                        break
                    cur = nxt
                continue
            block = [y] + drafts
            snap = cache.snapshot()
            position = cache.next_position
            io0 = io_counters()
            t1 = time.perf_counter()
            cap = Capture(hidden=False) if track_routes else None
            logits, h = guarded(snap, lambda: forward(block, cap, rows=True))
            routes = stack_routes(cap)
            lp = guarded(snap, lambda: rows_logprobs(logits[0], history + drafts))
            guarded(snap, lambda: mx.eval([lp] + ([h] if h is not None else []) + ([routes] if routes is not None
                                                                                   else []) + cache.arrays))
            t_verify = time.perf_counter() - t1
            a, bonus, target = accept_block(lp, proposal, sampler)
            if governor is not None:
                governor.observe_block(len(drafts), a)
                observe(len(block), t_verify, routes, a + 1, io0, t_draft, len(drafts))
            if a < len(drafts):
                # Rejected suffix: back to the state before the block, then only the accepted prefix.
                cache.restore(snap)
                tickets.retire()
                guarded(snap, lambda: mx.eval(forward(block[: a + 1])[0], cache.arrays))
                stats.reruns += 1
            committed = drafts[:a] + [bonus]
            drafter.commit(committed, None if h is None else h[0, : a + 1])
            stats.drafted += len(drafts)
            stats.accepted += a
            stats.verify_steps += 1
            stats.committed += len(committed)
            stats.block_sizes[len(drafts)] = stats.block_sizes.get(len(drafts), 0) + 1
            if trace is not None:
                trace.append(StepTrace(position, list(drafts), proposal.candidates, target, a, bonus))
            for i, tok in enumerate(committed):
                history.append(tok)
                produced += 1
                yield tok, lp[i], i < a
                if max_tokens != -1 and produced >= max_tokens:
                    return
            y = bonus
    finally:
        tickets.close()


# -- golden replay ------------------------------------------------------------------------------------

TRACE_SCHEMA = 1


class TraceMismatchError(ValueError):
    """A replay trace does not belong to this target / request; the message names the field."""


def target_contract(model, owner: int = 0, generation: int = 0) -> dict:
    """What a replay trace binds to (AFN-020): the target revision (a fingerprint: config plus a
    strided sample of lm_head and the embedding, not a full weight digest), the vocabulary width,
    the hidden-capture shape and stage, and the request's owner/generation."""
    args = model.args
    h = hashlib.sha256(json.dumps(vars(args) if not hasattr(args, "to_dict") else args.to_dict(),
                                  sort_keys=True, default=str).encode())
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
    for key in ("schema_version", "target_revision", "vocab_size", "hidden_shape", "captured_stage", "owner",
                "generation"):
        if header.get(key) != contract[key]:
            raise TraceMismatchError(f"{key}: trace has {header.get(key)!r}, this target has {contract[key]!r}")


def replay_step(model, cache, y: int, proposal: Proposal, effective_vocab_size: int,
                sampler: Optional[Callable] = None) -> Tuple[int, int, List[int]]:
    """One protocol step against the native target outside the generator (golden replay):
    verify [y] + path in one forward, decide, roll the rejected suffix back. Returns
    (accepted, bonus, committed)."""
    sampler = sampler or make_sampler()  # the loop masks the vocabulary before sampling
    block = [int(y)] + proposal.tokens
    snap = cache.snapshot()
    logits = model(mx.array(block, dtype=mx.int32)[None], cache=cache)[0]
    logits = apply_vocab_mask(logits.astype(mx.float32), effective_vocab_size)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(lp, cache.arrays)
    a, bonus, _ = accept_block(lp, proposal, sampler)
    if a < len(proposal.tokens):
        cache.restore(snap)
        mx.eval(model(mx.array(block[: a + 1], dtype=mx.int32)[None], cache=cache), cache.arrays)
    return a, bonus, proposal.tokens[:a] + [bonus]


def replay(model, trace: dict, effective_vocab_size: int, owner: int = 0, generation: int = 0) -> List[StepTrace]:
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
