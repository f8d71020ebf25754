"""MTP drafter: the checkpoint's own multi-token-prediction head proposes draft tokens.

Pair i of the head is (h_i, token i+1) at position i, where h_i is the target's final pre-mixer
state after consuming token i; its output predicts token i+2 and its pre-mixer streams stand in
for h_{i+1} when drafting further (autoregressive on the head's own streams, as mlx-vlm does).
The head's one QSA layer keeps its own KV cache. Only pairs built from real target states stay in
it: everything `propose` appends is rolled back at the next `commit`; the pairs the newly
verified states complete are fed (so accepted drafts are re-encoded from the target's real
states, not from the head's stand-ins) in one call when the next proposal needs them, so a run of
plain steps (the governor's B=0) costs the head nothing per token.
"""

from __future__ import annotations

import mlx.core as mx

from .base import Drafter, Proposal


class MTPDrafter(Drafter):
    name = "mtp"
    needs_hidden = True

    def __init__(self, model, mtp_head, candidates: int = 0):
        if mtp_head is None:
            raise ValueError("draft_model: this model has no MTP head (its checkpoint/artifact ships no mtp.* tensors)")
        self.model, self.head = model, mtp_head
        self.width = model.args.hc_count * model.args.hidden_size
        self.n_candidates = candidates
        self.reset()

    def reset(self) -> None:
        self.cache = self.head.make_cache()
        self.tokens: list[int] = []
        self.n_states = 0  # target states known: h_0 .. h_{n_states-1}
        self._pending = []  # known states not yet in a fed pair ([k, W] pieces, joined when fed)
        self.fed = 0  # pairs in the head's cache (all from real states)
        self.last = None  # (logits [1, 1, V], streams [1, 1, W]) of the last fed pair
        self.speculation = None  # cache snapshot taken by propose

    # ---- state --------------------------------------------------------------------------------
    def _states(self, hidden) -> mx.array:
        if hidden is None:
            return mx.zeros((0, self.width))
        if hidden.ndim == 3:
            if hidden.shape[0] != 1:
                raise ValueError(f"hidden: one sequence expected, got batch {hidden.shape[0]}")
            hidden = hidden[0]
        if hidden.ndim != 2 or hidden.shape[-1] != self.width:
            raise ValueError(f"hidden: expected [L, {self.width}] target pre-mixer streams, got {hidden.shape}")
        return hidden

    def _add(self, tokens, hidden) -> None:
        states = self._states(hidden)
        self.tokens.extend(int(t) for t in tokens)
        if self.n_states + states.shape[0] > len(self.tokens):
            raise ValueError(f"hidden: {self.n_states + states.shape[0]} states for {len(self.tokens)} tokens")
        self.n_states += states.shape[0]
        if states.shape[0]:
            self._pending.append(states.astype(mx.float32))  # as the head was always fed

    @property
    def pending(self) -> mx.array:
        if len(self._pending) != 1:
            self._pending = [mx.concatenate(self._pending) if self._pending else mx.zeros((0, self.width))]
        return self._pending[0]

    def _embed(self, tokens) -> mx.array:
        return self.model.model.embed_tokens(mx.array([tokens], dtype=mx.int32))

    def _step(self, tokens, states):
        mixed, streams = self.head(self._embed(tokens), states, self.cache)
        return self.model.lm_head(mixed[:, -1:]), streams[:, -1:]

    def _feed(self) -> None:
        """Feed every pair (h_i, token i+1) whose state and token are both known, in one call."""
        n = min(self.n_states, len(self.tokens) - 1) - self.fed
        if n <= 0:
            return
        pending = self.pending
        self.last = self._step(self.tokens[self.fed + 1 : self.fed + 1 + n], pending[None, :n])
        mx.eval(self.last)
        self._pending = [pending[n:]]
        self.fed += n

    def _rollback(self) -> None:
        if self.speculation is not None:
            self.cache.restore(self.speculation)
            self.speculation = None

    # ---- protocol -----------------------------------------------------------------------------
    def begin(self, prompt, hidden) -> None:
        self.reset()
        self._add(prompt, hidden)

    def flush(self) -> None:
        """Feed every pair already known now (propose does it lazily, in one call)."""
        self._rollback()
        self._feed()

    def propose(self, n: int) -> Proposal:
        self._rollback()
        if n > 0:
            self._feed()
        T = len(self.tokens)
        if n <= 0 or self.n_states == 0:
            return Proposal(tokens=[])
        self.speculation = self.cache.snapshot()
        if self.n_states == T:
            # The state after the last token is known: the first draft is the target's own
            # prediction from it, and it seeds the head's first pair.
            state = self.pending[None, -1:]
            mixed, _ = self.model.model.hyper_connection_mixer.mix(state)
            logits = self.model.lm_head(mixed)
        else:
            logits, state = self.last
            # Tokens whose target state is not known yet ride on the head's own streams.
            for t in self.tokens[self.fed + 1 :]:
                logits, state = self._step([t], state)
        drafts, candidates = [], []
        while True:
            if self.n_candidates > 1:
                top = mx.argsort(-logits.reshape(-1))[: self.n_candidates].tolist()
                drafts.append(top[0])
                candidates.append(top)
            else:
                drafts.append(mx.argmax(logits.reshape(-1)).item())
            if len(drafts) == n:
                break
            logits, state = self._step([drafts[-1]], state)
        return Proposal(tokens=drafts, candidates=candidates or None)

    def commit(self, accepted, hidden) -> None:
        self._rollback()
        self._add(accepted, hidden)
