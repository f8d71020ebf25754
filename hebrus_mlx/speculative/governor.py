"""Block-size governor (AFN-019 H7): choose each step's draft length from the expected committed
tokens against the measured cost of a step of that length.

A block of B drafts commits tau(B) = 1 + alpha + ... + alpha^B tokens in expectation (alpha: the
per-position acceptance rate, a decayed estimate over recent steps). Its cost is the measured wall
time of a whole step of that length: drafting, the verify forward over B+1 tokens, and the re-run of
the accepted prefix after a rejection. On a streamed model that time contains the exposed reads of
every extra unique expert the block routes to, which is what makes long blocks lose on an SSD-bound
model (break-even U_B < k * tau(B)); so the governor chooses argmax tau(B) / cost(B) over
B = 0..max, where B = 0 is a plain decode step. Shortening a block never changes the output.

The governor never touches the random state (exploration is a fixed rotation), so greedy and sampled
outputs do not depend on its choices beyond what speculation already guarantees.
"""

from __future__ import annotations


class Governor:
    def __init__(self, max_block: int, decay: float = 0.9, explore_every: int = 16, alpha_prior: float = 0.5):
        self.max_block = max(0, int(max_block))
        self.decay = decay
        self.explore_every = explore_every
        self.trials = 2.0  # decayed per-position trials / accepts (prior alpha_prior over 2 trials)
        self.accepts = 2.0 * alpha_prior
        self.cost: dict[int, float] = {}
        self.seen: dict[int, int] = {}
        self.steps = 0
        # Measure the two ends first (a full block, a plain step); lengths between are interpolated
        # until chosen or explored. Short generations cannot afford a sweep over every length.
        self._warmup = [self.max_block, 0] if self.max_block > 0 else []
        self._explore = 0

    @property
    def alpha(self) -> float:
        return self.accepts / self.trials if self.trials > 0 else 0.0

    def tau(self, b: int) -> float:
        a = min(self.alpha, 0.999)
        return sum(a ** i for i in range(b + 1))

    def _cost(self, b: int) -> float:
        if b in self.cost:
            return self.cost[b]
        # Unseen: interpolate from the nearest measured lengths (optimistic enough to be tried).
        known = sorted(self.cost)
        lo = max((k for k in known if k < b), default=None)
        hi = min((k for k in known if k > b), default=None)
        if lo is not None and hi is not None:
            return self.cost[lo] + (self.cost[hi] - self.cost[lo]) * (b - lo) / (hi - lo)
        ref = lo if lo is not None else hi
        return self.cost[ref] * (1.0 + 0.1 * (b - ref))

    def best(self) -> int:
        if not self.cost:
            return self.max_block
        return max(range(self.max_block + 1), key=lambda b: (self.tau(b) / self._cost(b), -b))

    def block_size(self) -> int:
        if self.steps < len(self._warmup):
            return self._warmup[self.steps]
        best = self.best()
        if self.explore_every and self.steps % self.explore_every == 0 and self.max_block > 0:
            # Re-measure a neighbour: costs drift (cache warmth, context length).
            self._explore += 1
            nb = [b for b in (best - 1, best + 1) if 0 <= b <= self.max_block]
            return nb[self._explore % len(nb)]
        return best

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        self.steps += 1
        if drafted:
            # Geometric model: a rejection ends the block, so min(a + 1, B) positions were tried.
            self.trials = self.decay * self.trials + min(accepted + 1, drafted)
            self.accepts = self.decay * self.accepts + accepted
        prev = self.cost.get(drafted)
        self.cost[drafted] = seconds if prev is None else 0.7 * prev + 0.3 * seconds
        self.seen[drafted] = self.seen.get(drafted, 0) + 1
