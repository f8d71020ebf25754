"""The oracle drafter: replays a recorded future, the acceptance upper bound (tests, benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence

from ..speculative.base import Drafter, Proposal


class OracleDrafter(Drafter):
    """Replays a recorded future (e.g. plain decoding's output): the acceptance upper bound. It
    proposes the recording's next tokens while the sequence still follows the recording."""

    name = "oracle"

    def __init__(self, future: Sequence[int]):
        self.future = [int(t) for t in future]
        self.done: list[int] = []
        self.on_track = True

    def begin(self, prompt, hidden):
        self.done, self.on_track = [], True

    def commit(self, accepted, hidden):
        for t in accepted:
            i = len(self.done)
            self.on_track = self.on_track and i < len(self.future) and self.future[i] == int(t)
            self.done.append(int(t))

    def reset(self):
        self.done, self.on_track = [], True

    def propose(self, n):
        if not self.on_track or n <= 0:
            return Proposal([])
        i = len(self.done)
        return Proposal(self.future[i : i + n])
