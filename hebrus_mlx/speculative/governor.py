"""Block-size governor (AFN-019 H7): choose each step's draft length B from the expected committed
tokens against the predicted cost of a verify over B+1 tokens, counting the extra unique experts
that verify reads.

The decision is a pure function of a `CostModel` (unit-tested with given inputs); the `Governor`
keeps the running estimates the runtime actually has and builds one per step:

- acceptance per depth: alpha_d = P(draft d accepted | drafts 1..d-1 accepted), decayed counts.
  tau(B) = 1 + sum_{j<=B} prod_{d<=j} alpha_d (expected accepted drafts + the bonus token). An
  unseen depth is shrunk towards the depth before it, so a drafter that keeps being right is
  tried deeper and one that is wrong at depth 1 is wrong everywhere.
- unique experts: U(n) = mean unique routed experts per streamed layer over n consecutive
  committed tokens (from the routes of the last max_block+1 committed inputs, which is what a
  B+1 verify block of accepted drafts routes to). U(1) is top-k. The extra unique expert reads of
  a block over one token are U_B = U(B+1) - U(1) per layer.
- I/O: the fraction of unique expert reads that missed the streamed cache (engine exact misses
  / unique expert-layers of the same forward) and the exposed seconds per missed record. A
  resident model has no misses: U_B then costs nothing in I/O and only compute matters.
- compute: a plain step's seconds per token (pipelined, as generate_step runs it); a verify's
  compute (its time minus its exposed I/O) as a line over the block lengths measured, fixed +
  token per extra token (one length measured: anchored at a plain step's compute); the drafting
  seconds per drafted token. Samples are medians of the last few; the first verify of a length
  in the process is dropped (it pays for compiling the shapes).

    cost(0) = step                                                  (a plain step)
    cost(B) = B*draft + verify + B*token + layers*U_B*miss*read + E[re-run]
    E[re-run] = sum_{a<B} P(exactly a accepted) * (verify_compute + a*token)   (rejected suffix)
    B* = argmax_B tau(B) / cost(B)          (verify defaults to step: then H7's form below)

With everything exposed I/O (compute and drafting free, every draft accepted) this is H7's
break-even exactly: a block pays iff U(B+1) < k*tau(B), i.e. U_B < k*(tau(B) - 1). Shortening a
block never changes the output, so the governor may be wrong only about speed.

Start: plain steps (no block is chosen before a pipelined plain step was measured). Exploration:
the estimates of depths and lengths never run cannot improve by themselves, so every
`explore_every` steps (the first after half of that) a neighbour of the best length is tried; when
the best is 0, a block of 1 (the cheapest) until a verify was measured, then the most promising
length. While those probes keep losing the interval doubles (up to 16x), so a losing drafter costs
close to nothing over a long generation.
The governor never touches the random state.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class CostModel:
    """What the runtime knows at one decision; the rule is `best()`."""

    accept: Sequence[float]  # alpha_d for d = 1..max_block
    step_s: float  # a plain step, seconds per token (incl. its own exposed reads)
    token_s: float = 0.0  # extra verify compute seconds per extra token
    verify_s: float | None = None  # a verify forward's fixed cost (its first token; default step_s)
    draft_s: float = 0.0  # drafting seconds per drafted token
    unique: Sequence[float] = ()  # U(n), n = 1..max_block+1 (empty: no streamed experts)
    layers: int = 0  # streamed MoE layers
    miss_rate: float = 0.0  # fraction of unique expert reads that miss the cache
    read_s: float = 0.0  # exposed seconds per missed expert record

    @property
    def max_block(self) -> int:
        return len(self.accept)

    def reach(self, j: int) -> float:
        """P(drafts 1..j all accepted)."""
        p = 1.0
        for a in self.accept[:j]:
            p *= a
        return p

    def tau(self, b: int) -> float:
        return 1.0 + sum(self.reach(j) for j in range(1, b + 1))

    def extra_unique(self, b: int) -> float:
        """U_B: extra unique experts per layer a (b+1)-token verify reads over one token."""
        if b == 0 or not self.unique:
            return 0.0
        return max(0.0, self.unique[min(b, len(self.unique) - 1)] - self.unique[0])

    def io_s(self, b: int) -> float:
        """Exposed seconds of the extra reads of a block of b drafts."""
        return self.layers * self.extra_unique(b) * self.miss_rate * self.read_s

    def cost(self, b: int) -> float:
        if b == 0:
            return self.step_s
        own_io = self.layers * (self.unique[0] if self.unique else 0.0) * self.miss_rate * self.read_s
        verify = self.step_s if self.verify_s is None else self.verify_s
        # The re-run of an accepted prefix reads nothing new (the verify just read its experts).
        rerun_compute = max(verify - own_io, 0.0)
        rerun = sum((self.reach(a) - self.reach(a + 1)) * (rerun_compute + a * self.token_s) for a in range(b))
        return b * self.draft_s + verify + b * self.token_s + self.io_s(b) + rerun

    def speed(self, b: int) -> float:
        """Expected committed tokens per second with blocks of b drafts."""
        c = self.cost(b)
        return self.tau(b) / c if c > 0 else float("inf")

    def best(self) -> int:
        """The block size the rule implies (ties: the shorter block)."""
        return max(range(self.max_block + 1), key=lambda b: (self.speed(b), -b))


_COMPILED: set = set()  # verify lengths this process has already run


class _Recent:
    """Median of the last few samples: robust to the outliers of a shared machine, and it follows
    drift (cache warmth, context length). `skip` first samples are dropped (the first forward of a
    new shape pays for compiling it)."""

    def __init__(self, size: int = 8, skip: int = 0):
        self.samples: deque = deque(maxlen=size)
        self.skip = skip
        self.value: float | None = None

    def add(self, x: float) -> None:
        if self.skip > 0:
            self.skip -= 1
            return
        self.samples.append(x)
        self.value = statistics.median(self.samples)  # per token: no numpy call overhead


@dataclass
class _Depth:
    trials: float = 0.0
    accepts: float = 0.0


class Governor:
    """Running estimates -> a CostModel per step -> its best block size.

    The protocol calls `block_size()` before each step and reports back with `observe_block`
    (drafted, accepted), `observe_step` (time, drafting time, engine misses and exposed wait of
    the step's forward) and, on a streamed model, `observe_routes` (routes of committed inputs)."""

    def __init__(
        self,
        max_block: int,
        decay: float = 0.9,
        explore_every: int = 16,
        alpha_prior: float = 0.5,
        prior_weight: float = 2.0,
    ):
        self.max_block = max(0, int(max_block))
        self.decay = decay
        self.explore_every = explore_every
        self.alpha_prior = alpha_prior
        self.prior_weight = prior_weight
        self.depths = [_Depth() for _ in range(self.max_block)]
        self.step = _Recent()  # plain step seconds per token
        self.step_io = _Recent()  # exposed read seconds of a plain step
        self.verify: dict = {}  # tokens fed -> _Recent of verify compute seconds (I/O removed)
        self.draft = _Recent()
        self.miss = _Recent()
        self.read = _Recent()
        self.unique: list[_Recent] = [_Recent() for _ in range(self.max_block + 1)]
        self.layers = 0
        self._window: list[np.ndarray] = []  # per committed input: [layers, k] routes
        self.steps = 0
        self.block_sizes: dict = {}
        # Plain steps first (their pipelined cost is the reference); the first probe comes after
        # half an exploration interval.
        self._next_probe = max(explore_every // 2, 4)
        self._probe_gap = explore_every
        self._probing = False
        self._probe_sum = (0.0, 0.0)  # (tokens, seconds) since the probe

    # -- estimates ------------------------------------------------------------------------------

    def alpha(self) -> list[float]:
        out, prev = [], self.alpha_prior
        for d in self.depths:
            a = (d.accepts + self.prior_weight * prev) / (d.trials + self.prior_weight)
            out.append(min(a, 0.999))
            prev = a
        return out

    def _unique(self) -> list[float]:
        k = self.unique[0].value
        if k is None:
            return []
        out = [k]
        for n in range(2, self.max_block + 2):
            u = self.unique[n - 1].value
            # Unseen: no overlap assumed (the worst case a block of n tokens can read).
            out.append(n * k if u is None else u)
        return out

    def _verify_line(self, step_compute: float):
        """(fixed, per extra token) verify compute seconds: a line through the measured lengths;
        one length: all fixed; none yet: a plain step, nothing per token."""
        pts = [(n - 1, e.value) for n, e in sorted(self.verify.items()) if e.value is not None]
        if len(pts) >= 2:
            # Least squares by hand (called every step; np.polyfit costs ~0.1 ms).
            mx_ = sum(x for x, _ in pts) / len(pts)
            my_ = sum(y for _, y in pts) / len(pts)
            sxx = sum((x - mx_) ** 2 for x, _ in pts)
            slope = max(sum((x - mx_) * (y - my_) for x, y in pts) / sxx, 0.0)
            return max(my_ - slope * mx_, 0.0), slope
        if len(pts) == 1:
            # One length: all of it counted as fixed (optimistic), so a drafter that is right gets
            # a longer block tried and the line its second point.
            return pts[0][1], 0.0
        return step_compute, 0.0

    def model(self) -> CostModel | None:
        """The CostModel of the current estimates (None before a plain step was measured)."""
        if self.step.value is None:
            return None
        io1 = self.step_io.value or 0.0
        step_compute = max(self.step.value - io1, 0.0)
        fixed, per_token = self._verify_line(step_compute)
        return CostModel(
            accept=self.alpha(),
            step_s=self.step.value,
            token_s=per_token,
            verify_s=fixed + io1,
            draft_s=self.draft.value or 0.0,
            unique=self._unique(),
            layers=self.layers,
            miss_rate=self.miss.value or 0.0,
            read_s=self.read.value or 0.0,
        )

    def best(self) -> int:
        m = self.model()
        return 0 if m is None else m.best()

    # -- decisions ------------------------------------------------------------------------------

    def block_size(self) -> int:
        self.steps += 1
        b = self.best()
        if self.max_block > 0 and self.explore_every and self.steps >= self._next_probe:
            nb = [x for x in (b + 1, b - 1) if 0 <= x <= self.max_block]
            if b > 0:
                probe = nb[(self.steps // max(self.explore_every, 1)) % len(nb)]
            else:  # the shortest block first (cheapest), then the most promising one
                m = self.model()
                probe = (
                    1
                    if m is None or not any(e.value for e in self.verify.values())
                    else max(range(1, self.max_block + 1), key=lambda x: (m.speed(x), -x))
                )
            self._probing = b == 0
            self._next_probe = self.steps + self._probe_gap
            b = probe
        elif b > 0:
            self._probe_gap = self.explore_every  # speculation pays: keep probes frequent
        elif self._probing:
            # The probe did not make speculation pay: probe less often.
            self._probing = False
            self._probe_gap = min(self._probe_gap * 2, 16 * self.explore_every)
            self._next_probe = self.steps + self._probe_gap
        self.block_sizes[b] = self.block_sizes.get(b, 0) + 1
        return b

    # -- observations ---------------------------------------------------------------------------

    def observe_block(self, drafted: int, accepted: int) -> None:
        """A verified block: depths 1..min(accepted+1, drafted) were tried, 1..accepted passed."""
        for i, d in enumerate(self.depths):
            depth = i + 1
            d.trials *= self.decay
            d.accepts *= self.decay
            if depth <= drafted and depth <= accepted + 1:
                d.trials += 1.0
                d.accepts += 1.0 if depth <= accepted else 0.0

    def observe_step(
        self,
        tokens: int,
        seconds: float | None,
        draft_seconds: float = 0.0,
        drafted: int = 0,
        misses: int = 0,
        exposed_s: float = 0.0,
        unique_reads: float = 0.0,
    ) -> None:
        """A forward over `tokens` inputs took `seconds` (drafting and re-run excluded; a plain step:
        time per token as pipelined). misses / exposed_s: the engine's exact misses and exposed
        wait during it; unique_reads: unique expert-layers it routed to."""
        if unique_reads > 0:
            self.miss.add(min(1.0, misses / unique_reads))
        if misses > 0:
            self.read.add(exposed_s / misses)
        if seconds is None:
            pass  # not a steady measurement (e.g. the first plain step after a block)
        elif tokens == 1:
            self.step.add(seconds)
            self.step_io.add(exposed_s)
        else:
            # The first verify of a length in this process pays for compiling its shapes.
            est = self.verify.setdefault(tokens, _Recent(skip=0 if tokens in _COMPILED else 1))
            _COMPILED.add(tokens)
            est.add(max(seconds - exposed_s, 0.0))
        if drafted:
            self.draft.add(draft_seconds / drafted)

    def observe_routes(self, routes: np.ndarray) -> None:
        """routes: [layers, T, k] routed experts of T consecutive committed inputs."""
        self.layers = routes.shape[0]
        for t in range(routes.shape[1]):
            self._window.append(routes[:, t])
            del self._window[: -(self.max_block + 1)]
            w = self._window
            for n in range(1, len(w) + 1):
                self.unique[n - 1].add(unique_per_layer(np.stack(w[-n:], axis=1)))


def unique_per_layer(routes: np.ndarray) -> float:
    """Mean over layers of the distinct experts in routes [layers, T, k]."""
    flat = np.sort(routes.reshape(routes.shape[0], -1), axis=1)
    return 1.0 + float(np.mean(np.count_nonzero(np.diff(flat, axis=1), axis=1)))


class FixedSchedule:
    """A governor that replays given block sizes and observes nothing: cyclically with `repeat`,
    else 0 (plain steps) once they are used up. Forces plain <-> block switches (tests) or replays
    a governed run's recorded choices untimed (benchmarks)."""

    def __init__(self, sizes, repeat: bool = False):
        self.sizes, self.repeat, self.i = list(sizes), repeat, 0

    def block_size(self) -> int:
        self.i += 1
        if self.repeat:
            return self.sizes[(self.i - 1) % len(self.sizes)]
        return self.sizes[self.i - 1] if self.i <= len(self.sizes) else 0

    def observe_block(self, *a):
        pass

    def observe_step(self, *a, **k):
        pass

    def observe_routes(self, *a):
        pass
