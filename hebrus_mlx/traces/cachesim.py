"""Trace-driven expert-cache simulator (no MLX; reusable by benchmarks and simulators).

The access stream is the native routes in execution order: token by token, layer by layer, the
layer's top-k experts in rank order. An item is one (layer, expert) record; a cache holds
`capacity` records. Every access is a hit or a miss that loads the record (demand paging, no
prefetch, no bypass), so misses x record bytes is the demand I/O. Policies:

- LRU: evict the least recently used record.
- CLOCK: second-chance approximation of LRU (one reference bit per slot, a rotating hand).
- LFU: evict the record with the fewest accesses since it was loaded (ties: least recent).
- Belady: evict the record whose next use is farthest in the future (the offline optimum for
  demand paging; it needs the whole trace, so it is a bound, not a policy).

Accesses inside one (token, layer) group are simulated sequentially, identically for all
policies; capacities below top_k would thrash within a layer and are rejected.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

POLICIES = ("lru", "clock", "lfu", "belady")


@dataclass
class SimResult:
    policy: str
    capacity: int
    accesses: int
    hits: int

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def access_stream(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, L, k] routes -> flat int64 item IDs (layer * num_experts + expert) in execution order."""
    t, L, k = topk_ids.shape
    layer = np.arange(L, dtype=np.int64)[None, :, None]
    return (layer * num_experts + topk_ids.astype(np.int64)).reshape(-1)


def _lru(stream, cap):
    cache, hits = OrderedDict(), 0
    for x in stream.tolist():
        if x in cache:
            hits += 1
            cache.move_to_end(x)
        else:
            if len(cache) >= cap:
                cache.popitem(last=False)
            cache[x] = None
    return hits


def _clock(stream, cap):
    slots, ref, where, hand, hits = [None] * cap, [False] * cap, {}, 0, 0
    for x in stream.tolist():
        s = where.get(x)
        if s is not None:
            hits += 1
            ref[s] = True
            continue
        while ref[hand]:
            ref[hand] = False
            hand = (hand + 1) % cap
        old = slots[hand]
        if old is not None:
            del where[old]
        slots[hand], ref[hand], where[x] = x, True, hand
        hand = (hand + 1) % cap
    return hits


def _lfu(stream, cap):
    state, heap, hits = {}, [], 0  # item -> (count, tick)
    for tick, x in enumerate(stream.tolist()):
        if x in state:
            hits += 1
            c = state[x][0] + 1
        else:
            c = 1
            if len(state) >= cap:
                while True:
                    cnt, t, y = heapq.heappop(heap)
                    if state.get(y) == (cnt, t):
                        del state[y]
                        break
        state[x] = (c, tick)
        heapq.heappush(heap, (c, tick, x))
        if len(heap) > 8 * cap + 1024:  # drop stale entries
            heap = [(c2, t2, y) for c2, t2, y in heap if state.get(y) == (c2, t2)]
            heapq.heapify(heap)
    return hits


def _belady(stream, cap):
    n = len(stream)
    nxt = np.full(n, n, dtype=np.int64)
    last = {}
    for i in range(n - 1, -1, -1):
        x = int(stream[i])
        nxt[i] = last.get(x, n + i)  # never used again: farther than any real use, distinct
        last[x] = i
    cur, heap, hits = {}, [], 0  # resident item -> its next use
    for i, x in enumerate(stream.tolist()):
        if x in cur:
            hits += 1
        elif len(cur) >= cap:
            while True:
                negnu, y = heapq.heappop(heap)
                if cur.get(y) == -negnu:
                    del cur[y]
                    break
        cur[x] = int(nxt[i])
        heapq.heappush(heap, (-cur[x], x))
        if len(heap) > 8 * cap + 1024:
            heap = [(a, y) for a, y in heap if cur.get(y) == -a]
            heapq.heapify(heap)
    return hits


_IMPL = {"lru": _lru, "clock": _clock, "lfu": _lfu, "belady": _belady}


def simulate(policy: str, stream: np.ndarray, capacity: int) -> SimResult:
    if policy not in _IMPL:
        raise ValueError(f"policy: unknown {policy!r}; choose from {', '.join(POLICIES)}")
    if capacity < 1:
        raise ValueError(f"capacity: must be >= 1 record, got {capacity}")
    return SimResult(policy, capacity, len(stream), _IMPL[policy](np.asarray(stream), capacity))


def sweep(topk_ids: np.ndarray, num_experts: int, percents, record_bytes: int, policies=POLICIES) -> list:
    """Hit rate and demand bytes/token for every policy at each cache size (percent of L x E records)."""
    t, L, k = topk_ids.shape
    stream = access_stream(topk_ids, num_experts)
    rows = []
    for pct in percents:
        cap = max(1, int(round(pct / 100 * L * num_experts)))
        if cap < k:
            raise ValueError(f"cache_sizes: {pct}% is {cap} records, fewer than top_k={k}")
        for pol in policies:
            r = simulate(pol, stream, cap)
            rows.append(
                {
                    "policy": pol,
                    "percent": pct,
                    "capacity": cap,
                    "hit_rate": r.hit_rate,
                    "misses": r.misses,
                    "accesses": r.accesses,
                    "bytes_per_token": r.misses * record_bytes / max(t, 1),
                }
            )
    return rows
