from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class Proposal:
    tokens: list[int]                  # one coherent path of n draft tokens
    candidates: list[list[int]] | None = None  # optional several candidates per position, rank-ordered
    probs: mx.array | None = None      # optional [n, vocab] draft distribution q per drafted position (None = deterministic)


class Drafter:
    name: str
    needs_hidden: bool = False         # True -> the protocol passes the target's final pre-mixer streams [L, hc_count*hidden]
    def begin(self, prompt: list[int], hidden: mx.array | None) -> None: ...   # after target prefill; hidden[i] = target pre-mixer state after consuming prompt[i]
    def propose(self, n: int) -> Proposal: ...
    def commit(self, accepted: list[int], hidden: mx.array | None) -> None: ...  # tokens appended this step (accepted drafts + bonus); hidden[j] = target pre-mixer state after consuming the j-th token whose state is newly known; drafter rolls back what it speculated beyond `accepted`
    def reset(self) -> None: ...
