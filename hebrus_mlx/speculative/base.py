"""The drafter interface: what a proposer gives the speculative protocol and what it gets back.

Authority (AFN-020): the target model alone decides token probabilities, acceptance, committed
cache state and expert routing. A drafter only proposes; nothing it returns can change what the
target commits, only how many target forwards that takes.

Hidden-state alignment (the contract the MTP drafter follows)
-------------------------------------------------------------
`h_t` is the target's pre-mixer state after consuming the token at sequence position t: the last
decoder layer's output streams before `hyper_connection_mixer`, `[hc_count * hidden_size]`, as
returned by ``Model(..., return_hidden=True)``. The target's logits at t predict token t+1; an MTP
head predicts token t+2 from ``(h_t, embed(token_{t+1}))``.

Every state is delivered exactly once, in sequence order (state i belongs to sequence position i):

- ``begin(prompt, hidden)``: after the target consumed the whole prompt (L tokens).
  ``hidden[i] = h_i`` for i in 0..L-1 ([L, D]): the pairs (h_i, prompt[i+1]) for i < L-1 are
  complete; h_{L-1} pairs with the first generated token.
- ``commit(accepted, hidden)``: the tokens appended to the sequence this step, in order (the accepted
  draft prefix plus the target's bonus token; the first commit after ``begin`` is the first
  generated token alone). ``hidden`` holds the states that became known this step: for a verify step
  ``len(accepted)`` rows, h at the positions of the block's kept inputs, i.e. of the token
  *preceding* each ``accepted[j]``; so ``(hidden[j], accepted[j])`` is one MTP input pair and
  ``(hidden[-1], accepted[-1])`` predicts the token after the sequence's last token. The first
  commit after ``begin`` has ``hidden`` with 0 rows (its predecessor's state h_{L-1} came with
  ``begin``).
- Anything a drafter speculated beyond ``accepted`` (its own cache over rejected drafts, rejected
  hidden rows) it must roll back in ``commit``; the sequence after ``commit`` is
  ``prompt + all committed tokens``, nothing else.

``hidden`` is None unless ``needs_hidden`` is True (then it is a float32 mx.array; the capture costs
the target nothing extra, but keeping it alive costs memory, so only drafters that ask get it).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..errors import HebrusError

__all__ = ["Proposal", "Drafter", "DrafterError", "CompatibilityError"]


class DrafterError(HebrusError, ValueError):
    """A drafter cannot be built or used (bad name, missing head, bad arguments). Raised as
    ``DrafterError("field: message")``; the CLI prints it as one line."""

    default_field = "draft_model"

    def __init__(self, field: str, message: str = None):
        if message is None:
            head, sep, rest = field.partition(": ")
            if sep and " " not in head:
                field, message = head, rest
        super().__init__(field, message)


class CompatibilityError(DrafterError):
    """A draft model does not share the target's token contract; the message names the field."""


@dataclass
class Proposal:
    """One step's draft.

    tokens: one coherent path of n draft tokens (after any tree -> path choice).
    candidates: optional several candidates per position, rank-ordered, candidates[i][0] == tokens[i].
    probs: optional [n, vocab] draft distribution q the tokens were drawn from, per position
        (None: a deterministic proposal, q is one-hot on tokens[i]).
    """

    tokens: list[int]
    candidates: list[list[int]] | None = None
    probs: mx.array | None = None

    def __post_init__(self):
        self.tokens = [int(t) for t in self.tokens]
        if self.candidates is not None:
            if len(self.candidates) != len(self.tokens):
                raise DrafterError(f"candidates: {len(self.candidates)} positions for {len(self.tokens)} tokens")
            for i, (c, t) in enumerate(zip(self.candidates, self.tokens)):
                if not c or int(c[0]) != t:
                    raise DrafterError(f"candidates[{i}][0] must be tokens[{i}]={t}, got {list(c)[:1]}")
        if self.probs is not None and (self.probs.ndim != 2 or self.probs.shape[0] != len(self.tokens)):
            raise DrafterError(f"probs: shape {tuple(self.probs.shape)} is not [{len(self.tokens)}, vocab]")

    def truncate(self, n: int) -> Proposal:
        """The first n positions (the governor may shorten a block; that never weakens exactness)."""
        if n >= len(self.tokens):
            return self
        return Proposal(
            self.tokens[:n],
            None if self.candidates is None else self.candidates[:n],
            None if self.probs is None else self.probs[:n],
        )


class Drafter:
    """Base class; subclasses override propose (and begin/commit/reset when they keep state)."""

    name: str = "drafter"
    needs_hidden: bool = False

    def begin(self, prompt: list[int], hidden: mx.array | None) -> None:
        """After the target's prefill of `prompt` (see the module docstring for `hidden`)."""

    def propose(self, n: int) -> Proposal:
        """Up to n draft tokens continuing the committed sequence (fewer, even none, is allowed)."""
        raise NotImplementedError

    def commit(self, accepted: list[int], hidden: mx.array | None) -> None:
        """Tokens appended this step; roll back anything speculated beyond them."""

    def reset(self) -> None:
        """Forget the sequence (a new request follows with begin)."""
