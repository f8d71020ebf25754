"""The decode-time model of `hebrus-mlx simulate` (no MLX: numbers in, numbers out).

One decode token runs the layers in order. Layer l computes for ``layer_s`` seconds; its router
runs after ``pre_router`` of that time (attention/GDN first), and the layer then waits for the
records of its top-k experts that are not in the arena. A miss costs ``io_time(n)``: n records
read at queue depth min(n, threads) from the machine's bandwidth-by-queue-depth table, plus the
record check the readers run (``check``: the fast XXH3-128 check, SHA-256, or none). A
prediction hints records ahead of the exact (P0) reads: ``previous`` (the previous token's
top-k) when the layer starts, ``window = pre_router * layer_s`` before its router;
``router-reuse:D`` / ``hyper-reuse`` right after layer l - D's exact reads,
``window = D * layer_s``. The disk serves the layer's predicted reads (used or wasted) too:

    exposed_l = max(io(demand_l), io(demand_l + predicted_reads_l) - window_l)
    landed_l  = min(1, window_l / io(predicted_reads_l))      (timely; the rest joins late)
    token_s   = compute_s * (1 + predictor_overhead) + sum_l exposed_l + reads * read_cpu_us

The engine counts an exact lookup a prediction served as a predicted hit (landed) or join (in
flight); `landed` splits the replay's predicted hits the same way (Projection.timely_recall /
late_recall). `read_cpu_us` is the readers' CPU time the compute loses (the CPU backend computes
on every core; 0 on a Mac). A predictor taken from a peer's measurement instead of a replay
multiplies the prefetch-off projection by its gain, capped at its exposed read time
(`with_gain`). The runtime predicts only in one-token forwards, so with a draft depth an ahead
predictor reads like prefetch off.

Speculative decoding with draft depth d and per-token acceptance a verifies d+1 tokens per step:
tokens/step = (1 - a^(d+1)) / (1 - a); a step costs compute_s * (1 + verify_extra * d) plus the
misses of the union of the d+1 tokens' routes (from the trace).

Which accesses hit comes from the route trace replayed through the engine's arena (`_Arena`,
record for record as metal_ext/engine.cpp: CLOCK or LRU order, the computing layer's records
pinned, staging rows, predictions that only displace predictions; a test checks it against the
engine's counters) for lru/clock, and through `traces.cachesim` demand paging for lfu/belady.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import UsageError
from ..traces import cachesim

GIB = 1 << 30
PREFETCH = ("off", "previous")  # what synthetic routes support
PREDICTORS = ("off", "previous", "router-reuse:1", "router-reuse:2", "hyper-reuse")


CHECKS = ("fast", "sha256", "off")  # what every streamed record is checked with on the read path


@dataclass
class Machine:
    """What a machine costs: SSD bandwidth by queue depth, compute per decode token, check speed."""

    name: str
    ssd_gbps: dict[int, float]  # queue depth -> GB/s (1e9 bytes/s) of record-sized random reads
    layer_s: float  # decode compute per layer per token (resident experts), seconds
    other_s: float = 0.0  # per token outside the layers (embedding, head, sampling)
    pre_router: float = 0.5  # fraction of a layer's compute before its router (the prefetch window)
    threads: int = 8  # reader threads (the engine's queue depth)
    verify_gbps: float | None = None  # SHA-256 GB/s of one reader core (None: not on the path)
    verify_extra: float = 0.15  # cost of each extra verified token relative to one decode token
    memory_gb: float | None = None
    sources: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    # The fast per-read check (XXH3-128 of each record beside its SHA-256, stream.engine): GB/s
    # of one reader core. `check` picks what the readers pay per record: the fast check
    # (artifacts that carry it), SHA-256 (artifacts without it) or nothing.
    fast_check_gbps: float | None = None
    check: str = "sha256"
    # Extra decode compute of an ahead predictor (its extra router / mix per layer), as a
    # fraction of compute_s; measured by --validate, assumed in the profiles.
    predictor_overhead: dict[str, float] = field(default_factory=dict)
    # CPU time the readers spend per record (pread, copy/widen, check, wake-ups) that the compute
    # loses: on the CPU backend compute already takes every core (validation on this machine
    # measures it); 0 where the readers use cores the compute leaves idle (a Mac's GPU decodes).
    read_cpu_us: float = 0.0
    # The GPU<->host hand-off of every streamed layer, per step: how long the GPU waits while a
    # host task resolves the layer's routed records (its event signalled, the host thread woken,
    # slots resolved and pinned, the event signalled back), hit or miss. 0 on the CPU backend,
    # where that host task runs inline on the compute stream and is part of layer_ms.
    handoff_ms: float = 0.0
    # Fraction of a token's PLE page reads that the PLE row cache serves (--ple-cache-gb).
    ple_hit: float = 0.0
    # The wavefront (stream.switch, one-token steps): a layer's resident experts compute while its
    # misses are read, and each miss computes as it lands. expert_share is the routed experts'
    # share of a layer's decode compute (on a memory-bound GPU their share of the bytes a token
    # reads; on the CPU measured); 0 or wavefront False: a layer waits for all top-k.
    wavefront: bool = False
    expert_share: float = 0.0

    @property
    def check_gbps(self) -> float | None:
        if self.check not in CHECKS:
            raise UsageError("check", f"must be one of {', '.join(CHECKS)}, got {self.check!r}")
        return {"fast": self.fast_check_gbps, "sha256": self.verify_gbps, "off": None}[self.check]

    def bandwidth(self, qd: float) -> float:
        """Bytes/s at queue depth qd: linear between table points, flat beyond them."""
        qs = sorted(self.ssd_gbps)
        return float(np.interp(qd, qs, [self.ssd_gbps[q] for q in qs])) * 1e9

    def io_time(self, n: float, record_bytes: int) -> float:
        """Seconds to read (and check) n records issued together."""
        if n <= 0:
            return 0.0
        t = n * record_bytes / self.bandwidth(min(max(n, 1.0), self.threads))
        gbps = self.check_gbps
        if gbps:
            t += n * record_bytes / (gbps * 1e9) / min(max(n, 1.0), self.threads)
        return t

    @classmethod
    def from_dict(cls, d: dict, where: str = "profile") -> Machine:
        opt = lambda k: None if d.get(k) is None else float(d[k])  # noqa: E731
        try:
            ssd = {int(k): float(v) for k, v in d["ssd_gbps"].items()}
            m = cls(
                name=str(d["name"]),
                ssd_gbps=ssd,
                layer_s=float(d["layer_ms"]) / 1e3,
                other_s=float(d.get("other_ms", 0.0)) / 1e3,
                pre_router=float(d.get("pre_router", 0.5)),
                threads=int(d.get("threads", 8)),
                verify_gbps=opt("verify_gbps"),
                verify_extra=float(d.get("verify_extra", 0.15)),
                memory_gb=opt("memory_gb"),
                sources=list(d.get("sources", [])),
                assumptions=list(d.get("assumptions", [])),
                fast_check_gbps=opt("fast_check_gbps"),
                predictor_overhead={str(k): float(v) for k, v in (d.get("predictor_overhead") or {}).items()},
                read_cpu_us=float(d.get("read_cpu_us", 0.0)),
                handoff_ms=float(d.get("handoff_ms", 0.0)),
                ple_hit=float(d.get("ple_hit", 0.0)),
                wavefront=bool(d.get("wavefront", False)),
                expert_share=float(d.get("expert_share", 0.0)),
            )
        except KeyError as e:
            raise UsageError(f"{where}.{e.args[0]}", "missing") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise UsageError(where, f"bad value: {e}") from None
        if not ssd or min(ssd) < 1 or min(ssd.values()) <= 0:
            raise UsageError(f"{where}.ssd_gbps", "needs positive GB/s at queue depths >= 1")
        if m.layer_s < 0 or not 0 <= m.pre_router <= 1 or m.threads < 1:
            raise UsageError(where, "layer_ms >= 0, 0 <= pre_router <= 1 and threads >= 1 are required")
        for k in ("verify_gbps", "fast_check_gbps"):
            if getattr(m, k) is not None and getattr(m, k) <= 0:
                raise UsageError(f"{where}.{k}", f"must be > 0 GB/s, got {getattr(m, k)}")
        if not (m.handoff_ms >= 0 and m.handoff_ms < 1e3):
            raise UsageError(f"{where}.handoff_ms", f"must be in [0, 1000) ms, got {m.handoff_ms}")
        for k in ("ple_hit", "expert_share"):
            if not 0 <= getattr(m, k) <= 1:
                raise UsageError(f"{where}.{k}", f"must be in [0, 1], got {getattr(m, k)}")
        for k, v in m.predictor_overhead.items():
            if not 0 <= v < 1:
                raise UsageError(f"{where}.predictor_overhead.{k}", f"must be in [0, 1), got {v}")
        return m

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "ssd_gbps": {str(k): v for k, v in sorted(self.ssd_gbps.items())},
            "layer_ms": self.layer_s * 1e3,
            "other_ms": self.other_s * 1e3,
            "pre_router": self.pre_router,
            "threads": self.threads,
            "verify_gbps": self.verify_gbps,
            "fast_check_gbps": self.fast_check_gbps,
            "check": self.check,
            "verify_extra": self.verify_extra,
            "memory_gb": self.memory_gb,
            "predictor_overhead": dict(self.predictor_overhead),
            "read_cpu_us": self.read_cpu_us,
            "handoff_ms": self.handoff_ms,
            "ple_hit": self.ple_hit,
            "wavefront": self.wavefront,
            "expert_share": self.expert_share,
            "sources": self.sources,
            "assumptions": self.assumptions,
        }


@dataclass(frozen=True)
class ModelGeometry:
    name: str
    num_layers: int
    num_experts: int
    top_k: int
    record_bytes: int  # bytes read per record (the aligned stride)
    resident_gb: float = 0.0  # dense weights + PLE/state kept in memory besides the expert cache
    # PLE pages a token reads (one per n-gram head of each PLE table: hashed rows land on random
    # pages) and the bytes of one page read (artifact/ple_pages.py: fixed pages, one read each).
    ple_reads_per_token: int = 0
    ple_page_bytes: int = 0

    @property
    def store_bytes(self) -> int:
        return self.num_layers * self.num_experts * self.record_bytes


AFFINE_BITS = (2, 3, 4, 6, 8)  # the expert widths issue 23 asks for (MLX affine modes gather_qmm runs)
AFFINE_GROUPS = (32, 64, 128)
ANCHOR_CODEC = "affine4-g64"  # the width the profiles' compute figure was measured at


def expert_codec(name: str, field_name: str = "--codec"):
    """The artifact's codec of that name, or an affine width the format does not register (yet):
    `affineB-gG` with B in MLX's affine widths; record sizes follow from the same parts
    (uint32 packed weights, bf16 scales and biases per group), so a projection can size them."""
    import re

    from ..artifact import constants as C

    if name in C.CODECS and name not in C.PLE_AFFINE_CODECS:  # a PLE row codec is no expert codec
        return C.CODECS[name]
    m = re.fullmatch(r"affine(\d+)-g(\d+)", name)
    if not m or int(m.group(1)) not in AFFINE_BITS or int(m.group(2)) not in AFFINE_GROUPS:
        raise UsageError(
            field_name,
            f"unknown expert codec {name!r}: affineB-gG with B in "
            f"{'/'.join(map(str, AFFINE_BITS))} and G in {'/'.join(map(str, AFFINE_GROUPS))}, "
            f"or one of {', '.join(sorted(C.CODECS))}",
        )
    return C.Codec(name, 0, int(m.group(1)), int(m.group(2)))


def expert_record_bytes(family, codec: str) -> tuple[int, int]:
    """(record bytes, aligned stride) of one routed expert (gate, up, down) at `codec`."""
    from ..artifact import constants as C

    c = expert_codec(codec)
    if codec in C.CODECS:  # the format's own layout
        from ..artifact.expert_major import Geometry

        g = Geometry(family, codec)
        return g.record_bytes, g.record_stride
    n = sum(c.nbytes(r, k, f"--codec {codec}") for r, k in family.component_shapes().values())
    return n, C.align_up(n)


def bits_per_weight(codec: str) -> float:
    """Stored bits per weight of an affine codec: B plus a bf16 scale and bias per group."""
    c = expert_codec(codec)
    return c.bits + (32.0 / c.group_size if c.affine else 0.0)


def geometry_of_family(family, codec: str = "affine4-g64", resident_gb: float = 0.0) -> ModelGeometry:
    """From the artifact format: ExpertMajor v2 record stride for (family, codec)."""
    from ..artifact import constants as C

    _, stride = expert_record_bytes(family, codec)
    return ModelGeometry(
        family.name,
        family.num_hidden_layers,
        family.num_experts,
        family.num_experts_per_tok,
        stride,
        resident_gb,
        ple_reads_per_token=family.ple_tables * family.ple_heads,
        ple_page_bytes=C.PLE_DEFAULT_PAGE_BYTES if family.ple_tables else 0,
    )


def compute_scale(family, dense_gb: float | None, expert: str, dense: str = ANCHOR_CODEC) -> float | None:
    """Decode compute at (dense width, expert width) over compute at the anchor (affine4-g64 for
    both), taking decode on Apple GPUs as memory-bandwidth-bound: a token reads the dense weights
    once and top_k expert records per layer, so its time scales with those bytes. None when the
    profile gives no dense_gb (then compute does not follow the width)."""
    if dense_gb is None:
        return None
    active = family.num_hidden_layers * family.num_experts_per_tok / 1e9

    def at(d, e):  # GB a token reads: dense weights at width d, the active experts at width e
        return (
            dense_gb * bits_per_weight(d) / bits_per_weight(ANCHOR_CODEC) + active * expert_record_bytes(family, e)[0]
        )

    return at(dense, expert) / at(ANCHOR_CODEC, ANCHOR_CODEC)


def expert_share(family, dense_gb: float | None, expert: str, dense: str = ANCHOR_CODEC) -> float:
    """The routed experts' share of the bytes a decode token reads at (dense width, expert width):
    their share of a layer's compute on memory-bound decode (0 without dense_gb)."""
    if dense_gb is None:
        return 0.0
    experts = family.num_hidden_layers * family.num_experts_per_tok * expert_record_bytes(family, expert)[0] / 1e9
    return experts / (dense_gb * bits_per_weight(dense) / bits_per_weight(ANCHOR_CODEC) + experts)


# ---- the arena -----------------------------------------------------------------------------------


@dataclass
class Replay:
    """Per-token averages of one route trace through one arena."""

    tokens: int
    demand_misses: np.ndarray  # [L] exact misses per token (not covered by a prediction)
    predicted_used: np.ndarray  # [L] predicted reads that the layer then used, per token
    predicted_reads: np.ndarray  # [L] predicted reads issued, per token
    accesses: int  # exact accesses per token
    prefetch_lookups: float = 0.0  # hinted records looked up per token (dropped hints not counted)
    prefetch_hits: float = 0.0  # hinted records already in the arena, per token
    predicted_wasted: float = 0.0  # predicted reads no layer of the same token used, per token
    predicted_hits: float = 0.0  # exact lookups served by any earlier prediction (the engine's count)
    # Of those, the ones whose read was still in flight (the engine's predicted_joins), when the
    # replay modelled reads in flight (`landed` < 1); None: every read landed before its layer.
    predicted_joins: float | None = None

    @property
    def hit_rate(self) -> float:
        """Exact accesses whose record was already in the arena, or read by a prediction."""
        return 1.0 - float(self.demand_misses.sum()) / self.accesses if self.accesses else 0.0

    @property
    def timely_recall(self) -> float:
        """Exact misses a prediction had already issued (upper bound on what prefetch hides)."""
        miss = float(self.demand_misses.sum() + self.predicted_used.sum())
        return float(self.predicted_used.sum()) / miss if miss else 0.0

    @property
    def precision(self) -> float | None:
        """Predicted reads the target layer used (the rest is wasted bytes)."""
        r = float(self.predicted_reads.sum())
        return float(self.predicted_used.sum()) / r if r else None

    @property
    def engine_hit_rate(self) -> float:
        """The hit rate as the engine counts it: a prediction's own lookups count too (a hinted
        record already cached is a hit), so with prefetch on it is not `hit_rate`."""
        a = self.accesses
        p = self.prefetch_lookups
        served = a - float(self.demand_misses.sum()) + self.prefetch_hits
        return served / (a + p) if a + p else 0.0

    def reads_per_token(self) -> float:
        return float(self.demand_misses.sum() + self.predicted_reads.sum())


class _Arena:
    """The engine's arena rows (metal_ext/engine.cpp), record for record: exact and predicted
    records in separate buckets; CLOCK orders a bucket by the position a record took when it was
    read and gives a referenced record one more pass (its bit set by any later lookup), LRU by the
    last lookup; the records of the layer being computed are pinned; with `staging` rows kept
    for predictions, exact records hold at most rows - staging while one of theirs can be
    recycled, and a prediction only ever displaces another prediction (else it is dropped).

    One heap entry per (record, key): a CLOCK hit only sets the bit, a pin only counts, so a
    replay pushes about once per read (the eviction scan sets pinned entries aside)."""

    def __init__(self, rows: int, staging: int, policy: str):
        self.rows, self.staging, self.lru_order = rows, staging, policy == "lru"
        self.slots: dict[int, list] = {}  # item -> [exact, clock_pos, lru, ref, pins, ver, issued]
        self.heaps = ([], [])  # bucket 0 exact, 1 predicted: (key, item, ver)
        self.tick = 0
        self.ver = 0
        self.exact_rows = 0
        self.wasted = 0

    def _push(self, x, s):
        # Versions are drawn from one counter, so a stale heap entry of an evicted
        # incarnation (or of an old key or bucket) never matches the record's current one.
        self.ver += 1
        s[5] = self.ver
        heapq.heappush(self.heaps[0 if s[0] else 1], (s[2] if self.lru_order else s[1], x, self.ver))

    def _peek(self, b):
        h = self.heaps[b]
        held = []
        found = None
        slots = self.slots
        while h:
            _, x, ver = h[0]
            s = slots.get(x)
            if s is None or s[5] != ver:
                heapq.heappop(h)
                continue
            if s[4]:  # pinned: not evictable now, keeps its place
                held.append(heapq.heappop(h))
                continue
            if not self.lru_order and s[3]:  # second chance: clear the bit, behind the hand
                heapq.heappop(h)
                s[3] = False
                self.tick += 1
                s[1] = self.tick
                self._push(x, s)
                continue
            found = x
            break
        for e in held:
            heapq.heappush(h, e)
        return found

    def _evict(self, x):
        s = self.slots.pop(x)
        if s[0]:
            self.exact_rows -= 1
        else:
            self.wasted += 1

    def _victim(self, exact: bool):
        if not exact:
            return self._peek(1)
        e, p = self._peek(0), self._peek(1)
        if e is None or p is None:
            return p if e is None else e
        se, sp = self.slots[e], self.slots[p]
        k = 2 if self.lru_order else 1
        return e if se[k] <= sp[k] else p

    def _reserve(self, exact: bool) -> bool:
        if exact:
            while self.staging and self.exact_rows >= self.rows - self.staging:
                v = self._peek(0)
                if v is None:
                    break
                self._evict(v)
        while len(self.slots) >= self.rows:
            v = self._victim(exact)
            if v is None:
                return False
            self._evict(v)
        return True

    def lookup(self, x: int, exact: bool, issued=None):
        """One request: "hit" (with the prediction's `issued` tag when an exact lookup promotes a
        predicted record), "miss" (read), or "dropped" (a prediction with no row to take)."""
        s = self.slots.get(x)
        self.tick += 1
        if s is not None:
            s[2] = self.tick
            s[3] = True
            tag = None
            moved = self.lru_order
            if exact:
                s[4] += 1
                if not s[0]:
                    s[0] = True
                    self.exact_rows += 1
                    tag = s[6]
                    moved = True
            if moved:
                self._push(x, s)
            return "hit", tag
        if not self._reserve(exact):
            return "dropped", None
        self.tick += 1
        s = self.slots[x] = [exact, self.tick, self.tick, False, 1 if exact else 0, 0, issued]
        if exact:
            self.exact_rows += 1
        self._push(x, s)
        return "miss", None

    def pin(self, x: int):
        self.slots[x][4] += 1

    def unpin(self, x: int):
        s = self.slots.get(x)
        if s is not None and s[4]:
            s[4] -= 1


def prefetch_kind(prefetch: str) -> tuple[str, int]:
    """("off" | "previous" | "ahead", depth) of a --prefetch value."""
    if prefetch in ("off", "previous"):
        return prefetch, 0
    kind, _, d = prefetch.partition(":")
    if kind == "router-reuse" and d in ("", "1", "2"):
        return "ahead", int(d or 1)
    if kind == "hyper-reuse" and d in ("", "1"):
        return "ahead", 1
    raise UsageError("prefetch", f"unknown {prefetch!r}; this model knows {', '.join(PREDICTORS)}")


def replay_arena(
    topk: np.ndarray,
    num_experts: int,
    capacity: int,
    prefetch: str = "off",
    warm: np.ndarray | None = None,
    policy: str = "clock",
    predicted: np.ndarray | None = None,
    staging: int | None = None,
    landed=1.0,
    batch_landed: float = 0.0,
) -> Replay:
    """Replay [T, L, k] routes through the engine's arena of `capacity` rows (`_Arena`), as the
    streamed layers drive it: with prefetch="previous" each layer first hints the previous
    token's top-k (StreamedSwitchGLU.layer_start); with "router-reuse:D" / "hyper-reuse" the
    predicted sets `predicted` [T0 + T, L, B] (for token t, target layer l; -1 = none) are hinted
    right after layer l - D's exact reads (predict_after_resolve). Staging rows default to the
    loader's min(B * D, rows // 4). `warm` [T0, L, k] routes run first and are not counted.

    `landed` (a fraction, or one per target layer): of each hint batch's reads, the share (first
    issued first) read before the target layer's exact requests. The rest are still in flight
    there, and the engine cannot evict a read in flight (metal_ext/engine.cpp indexes only ready,
    unpinned slots): they hold their rows through the target layer's exact requests, an exact
    lookup of one joins it (a late prediction, `Replay.predicted_joins`), and an exact miss that
    finds every row pinned or in flight waits for the oldest read to land (ops.cpp
    request_with_room) and then takes a row. They land once the target layer's exact reads are
    resolved. `batch_landed`: the share of a hint batch's reads in flight that land before its
    next hint is requested (the oldest first; `calibrate.hint_probe` measures it through the
    engine): a landed, released prediction is evictable, so a later hint of the same batch can
    displace it (a read ahead wasted). batch_landed=0 and landed=1 is the replay that holds every
    batch in flight while it is issued and lands it before the next exact request."""
    kind, depth = prefetch_kind(prefetch)
    if policy not in ("lru", "clock"):
        raise UsageError("policy", f"the engine's arena is lru or clock, not {policy!r}")
    t, L, k = topk.shape
    if capacity < k:
        raise UsageError("cache", f"{capacity} records is fewer than top_k={k}")
    t0 = 0 if warm is None else len(warm)
    ids = (topk if warm is None else np.concatenate([warm, topk])).astype(np.int64).tolist()
    if kind == "ahead":
        if predicted is None or len(predicted) != len(ids) or predicted.shape[1] != L:
            raise UsageError("prefetch", f"{prefetch} needs the predicted sets of every token and layer")
        pred = predicted.astype(np.int64).tolist()
        budget = predicted.shape[2]
    else:
        budget = k
    if staging is None:
        staging = 0 if kind == "off" else min(budget * max(depth, 1), capacity // 4)
    fracs = np.broadcast_to(np.asarray(landed, float), (L,))
    if not np.all((fracs >= 0) & (fracs <= 1)):
        raise UsageError("landed", f"fractions in [0, 1] are required, got {landed!r}")
    if not 0 <= batch_landed <= 1:
        raise UsageError("batch_landed", f"a fraction in [0, 1] is required, got {batch_landed!r}")
    owed_batch = 0.0
    arena = _Arena(capacity, staging, policy)
    slots, clock = arena.slots, policy == "clock"
    demand, used, reads = np.zeros(L), np.zeros(L), np.zeros(L)
    hint_lookups = hint_hits = promoted = joins = 0
    inflight: list[tuple[int, int]] = []  # (target layer, record): predicted reads still being read
    flying_set: set[int] = set()
    owed = np.zeros(L)  # error diffusion: fractional landings carried to the next batch

    def land(pred=lambda tl: True, oldest=False):
        """Reads in flight land (unpinned: evictable again): the oldest one, or all for which pred."""
        keep = []
        for n, (tl, x) in enumerate(inflight):
            if (n == 0) if oldest else pred(tl):
                arena.unpin(x)
                flying_set.discard(x)
            else:
                keep.append((tl, x))
        inflight[:] = keep

    for i in range(len(ids)):
        count = i >= t0

        def hint(l, experts):
            # One prefetch op issues its hints together: a read still in flight is not
            # evictable, so a hint never displaces another of the same batch.
            nonlocal hint_lookups, hint_hits, owed_batch
            flying = []
            for e in experts:
                if e < 0:
                    continue
                if flying and batch_landed:  # reads of this batch that landed before this hint
                    owed_batch += batch_landed * len(flying)
                    n_land = min(len(flying), int(owed_batch + 1e-9))
                    owed_batch -= n_land
                    for x in flying[:n_land]:
                        arena.unpin(x)
                    del flying[:n_land]
                x = l * num_experts + e
                res, _ = arena.lookup(x, False, (i, l))
                if res == "miss":
                    arena.pin(x)
                    flying.append(x)
                if count and res != "dropped":
                    hint_lookups += 1
                    hint_hits += res == "hit"
                    reads[l] += res == "miss"
            owed[l] += fracs[l] * len(flying)
            n_land = min(len(flying), int(owed[l] + 1e-9))
            owed[l] -= n_land
            for x in flying[:n_land]:
                arena.unpin(x)
            for x in flying[n_land:]:
                inflight.append((l, x))
                flying_set.add(x)

        for l in range(L):
            base = l * num_experts
            if kind == "previous" and i > 0:
                hint(l, ids[i - 1][l])
            for e in ids[i][l]:
                x = base + e
                s = slots.get(x)
                if s is not None and s[0] and clock:  # the common case, inlined: a CLOCK hit on an exact row
                    s[3] = True
                    s[4] += 1
                    continue
                late = x in flying_set
                res, tag = arena.lookup(x, True)
                while res == "dropped":  # every row pinned or in flight: wait for the oldest read
                    if not inflight:
                        raise UsageError("cache", f"{capacity} rows cannot hold layer {l}'s {k} records")
                    land(oldest=True)
                    res, tag = arena.lookup(x, True)
                if count:
                    demand[l] += res == "miss"
                    promoted += tag is not None
                    joins += late and tag is not None
                    used[l] += tag == (i, l)  # read by this token's prediction for this layer
            if inflight:  # the layer's exact reads are resolved: its late predictions have landed
                land(lambda tl, l=l: tl <= l)
            if kind == "ahead" and l + depth < L:
                hint(l + depth, pred[i][l + depth])
            for e in ids[i][l]:
                s = slots.get(base + e)
                if s is not None and s[4]:
                    s[4] -= 1
    n = max(t, 1)
    return Replay(
        t,
        demand / n,
        used / n,
        reads / n,
        L * k,
        hint_lookups / n,
        hint_hits / n,
        float(np.sum(reads) - np.sum(used)) / n,
        promoted / n,
        None if np.all(fracs >= 1) else joins / n,
    )


def replay_with_prefetch(
    topk: np.ndarray, num_experts: int, capacity: int, prefetch: str = "off", warm: np.ndarray | None = None
) -> Replay:
    """The engine arena with LRU order (the control policy)."""
    return replay_arena(topk, num_experts, capacity, prefetch, warm, "lru")


def replay(
    topk: np.ndarray,
    num_experts: int,
    capacity: int,
    policy: str = "lru",
    prefetch: str = "off",
    warm: np.ndarray | None = None,
    predicted: np.ndarray | None = None,
    landed=1.0,
    batch_landed: float = 0.0,
) -> Replay:
    """The engine's arena for its policies (lru, clock; any prediction); demand paging through
    cachesim for the others (lfu, belady; no prediction). `warm` routes run first, uncounted (for
    online policies hits(warm + trace) - hits(warm) are the trace's own hits; for Belady, a bound
    anyway, it is the same subtraction). `landed`, `batch_landed`: see replay_arena (reads ahead in flight)."""
    if policy in ("lru", "clock"):
        return replay_arena(
            topk, num_experts, capacity, prefetch, warm, policy, predicted, landed=landed, batch_landed=batch_landed
        )
    if prefetch != "off":
        raise UsageError("policy", f"prefetch={prefetch} is modelled with the engine's arena (lru, clock) only")
    t, L, k = topk.shape
    if capacity < k:
        raise UsageError("cache", f"{capacity} records is fewer than top_k={k}")
    if policy not in cachesim.POLICIES:
        raise UsageError("policy", f"unknown {policy!r}; choose from {', '.join(cachesim.POLICIES)}")
    full = topk if warm is None else np.concatenate([warm, topk])
    misses = cachesim.simulate(policy, cachesim.access_stream(full, num_experts), capacity).misses
    if warm is not None and len(warm):
        misses -= cachesim.simulate(policy, cachesim.access_stream(warm, num_experts), capacity).misses
    # cachesim counts totals: spread them over the layers (the timing model sums layers anyway,
    # only the per-layer queue depth sees the spread).
    per_layer = np.full(L, misses / L / max(t, 1))
    return Replay(t, per_layer, np.zeros(L), np.zeros(L), L * k)


def batch_union(topk: np.ndarray, batch: int, seed: int = 0, samples: int = 64) -> float:
    """Mean distinct experts per layer of ``batch`` tokens from unrelated requests (positions drawn
    apart in the trace), divided by batch * k: how much concurrent requests' routes overlap."""
    t, L, k = topk.shape
    if batch <= 1 or t < batch:
        return 1.0
    rng = np.random.default_rng(seed)
    total = 0
    for _ in range(samples):
        rows = topk[rng.choice(t, size=batch, replace=False)]  # [batch, L, k]
        total += sum(len(np.unique(rows[:, l])) for l in range(L))
    return total / (samples * L * batch * k)


def union_factor(topk: np.ndarray, depth: int) -> float:
    """Mean distinct experts per layer over windows of depth+1 consecutive tokens, divided by
    (depth+1) * k: how much a verify step's routes overlap."""
    t, L, k = topk.shape
    w = depth + 1
    if depth == 0 or t < w:
        return 1.0
    total = 0
    windows = 0
    for i in range(0, t - w + 1, w):
        for l in range(L):
            total += len(set(topk[i : i + w, l].reshape(-1).tolist()))
            windows += 1
    return total / (windows * w * k)


# ---- the projection ------------------------------------------------------------------------------


@dataclass
class Projection:
    cache_gb: float
    capacity: int
    policy: str
    prefetch: str
    draft_depth: int
    acceptance: float
    tok_s: float
    token_ms: float
    compute_ms: float
    exposed_ms: float
    hit_rate: float
    bytes_per_token: float
    # As the engine counts them (stream.engine.prediction_stats): exact lookups a prediction had
    # brought in and that had landed (timely) or were still being read (late), over those plus
    # the exact misses.
    timely_recall: float | None = None
    late_recall: float | None = None
    codec: str = ""
    check: str = ""
    basis: str = "replay"  # how the predictor's effect was obtained (replay, or a peer's measured gain)
    read_cpu_ms: float = 0.0  # reader CPU time taken from the compute, per token (Machine.read_cpu_us)
    handoff_ms: float = 0.0  # the GPU waiting on the host per streamed layer, per token (Machine.handoff_ms)
    ple_ms: float = 0.0  # exposed PLE page reads per token
    ple_bytes_per_token: float = 0.0  # PLE bytes read per token (after the PLE cache)
    batch: int = 1  # concurrent requests decoding together (tok_s is their aggregate)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def landed_fraction(machine: Machine, n: float, record_bytes: int, window: float) -> float:
    """Of n predicted reads issued together `window` seconds before their layer's router, the
    fraction read and checked by then: completions spread evenly over io_time(n) (the readers
    share the disk; a record lands once its last byte is read and checked)."""
    t = machine.io_time(n, record_bytes)
    return 1.0 if t <= window else max(window, 0.0) / t


def project(
    machine: Machine,
    geom: ModelGeometry,
    rep: Replay,
    *,
    cache_gb: float,
    capacity: int,
    policy: str,
    prefetch: str,
    draft_depth: int = 0,
    acceptance: float = 0.0,
    union: float = 1.0,
    codec: str = "",
    batch: int = 1,
) -> Projection:
    """Tokens/s of one configuration from the replay's per-token misses and the machine's costs.

    ``batch`` > 1: that many requests decode together (continuous batching), one token each per
    step; ``union`` is then the overlap of their routes (``batch_union``): each routed record is
    read once per step and, decode being memory-bound, the experts' compute follows the distinct
    records while the dense weights are read once. Returns the aggregate tokens/s."""
    R = geom.record_bytes
    L = geom.num_layers
    if batch > 1 and draft_depth:
        raise UsageError("batch", "a batched projection has no draft depth")
    compute = (L * machine.layer_s + machine.other_s) * (1 + machine.predictor_overhead.get(prefetch, 0.0))
    kind, depth = prefetch_kind(prefetch)
    # How long before a layer's router its predicted reads were issued: at the layer's start
    # (previous), or right after layer l - D's exact reads (router-reuse:D / hyper-reuse).
    window = {"off": 0.0, "previous": machine.pre_router * machine.layer_s}.get(kind, depth * machine.layer_s)
    exposed = 0.0
    late = 0.0
    w = max(batch, draft_depth + 1)
    k = geom.top_k
    for l in range(L):
        # A verify step routes w tokens; their distinct experts miss at the per-token rate. The
        # disk serves the layer's predicted reads (used or wasted) and then its exact misses.
        d = rep.demand_misses[l] * w * union
        p = rep.predicted_reads[l] * w * union
        wait = max(machine.io_time(d, R), machine.io_time(d + p, R) - window)
        if machine.wavefront and w == 1 and d > 0:
            # A one-token step's wavefront (stream.switch): the k - d resident experts compute
            # first, then each miss as it lands (landings spread evenly over `wait`), so compute
            # waits only where the reads run ahead of it: for the first miss (wait / d against the
            # residents' compute) or for the last (wait against every expert's compute but its own).
            e = machine.expert_share * machine.layer_s / k  # one routed expert's compute
            h = max(k - d, 0.0)
            wait = max(0.0, wait / max(d, 1.0) - h * e, wait - (h + max(d, 1.0) - 1.0) * e)
        exposed += wait
        if p > 0 and rep.predicted_used[l] > 0:
            late += rep.predicted_used[l] * (1.0 - landed_fraction(machine, p, R, window))
    # PLE pages: known from the token ids, read exact at the step's start on their own queue; the
    # first PLE layer needs them (taken as layer 0 after its attention: the pessimistic case).
    ple_n = geom.ple_reads_per_token * w * (1.0 - machine.ple_hit)
    ple_io = machine.io_time(ple_n, geom.ple_page_bytes) if ple_n > 0 and geom.ple_page_bytes else 0.0
    ple = max(0.0, ple_io - machine.pre_router * machine.layer_s)
    # The GPU waits on the host once per streamed layer per step, hit or miss.
    handoff = L * machine.handoff_ms * 1e-3
    # The readers' CPU time taken from the compute (0 on a Mac, see Machine.read_cpu_us).
    steal = (rep.reads_per_token() * w * union + ple_n) * machine.read_cpu_us * 1e-6
    if batch > 1:
        # Memory-bound decode: dense weights once per step, the experts' share per distinct record.
        share = machine.expert_share
        work = compute * ((1.0 - share) + share * batch * union)
    else:
        work = compute * (1 + machine.verify_extra * draft_depth)
    step = work + exposed + ple + handoff + steal
    if batch > 1:
        per_step = float(batch)
    elif draft_depth and acceptance > 0:
        a = min(acceptance, 0.999999)
        per_step = (1 - a**w) / (1 - a)
    else:
        per_step = 1.0
    token = step / per_step
    reads = rep.reads_per_token() * w * union / per_step
    need = rep.predicted_hits + float(rep.demand_misses.sum())
    late = min(late, rep.predicted_hits)
    timely, late_r = (None, None) if kind == "off" or not need else ((rep.predicted_hits - late) / need, late / need)
    return Projection(
        cache_gb,
        capacity,
        policy,
        prefetch,
        draft_depth,
        acceptance,
        1.0 / token,
        token * 1e3,
        (work / per_step if batch > 1 else compute) * 1e3,  # per token: a batched step shares its compute
        exposed * 1e3 / per_step,
        rep.hit_rate,
        reads * R,
        timely,
        late_r,
        codec,
        machine.check,
        read_cpu_ms=steal * 1e3 / per_step,
        handoff_ms=handoff * 1e3 / per_step,
        ple_ms=ple * 1e3 / per_step,
        ple_bytes_per_token=ple_n * geom.ple_page_bytes / per_step,
        batch=batch,
    )


def with_gain(base: Projection, prefetch: str, gain: float, source: str) -> Projection:
    """`base` (the same configuration without read-ahead) sped up by a predictor's measured decode
    gain; a gain cannot hide more than the exposed read time (then it is capped there)."""
    token = max(base.token_ms / gain, base.token_ms - base.exposed_ms)
    got = base.token_ms / token
    basis = f"peer x{gain:.2f} over off ({source})" + ("" if got >= gain - 1e-9 else f", capped at x{got:.2f}")
    return dataclasses.replace(
        base,
        prefetch=prefetch,
        tok_s=1e3 / token,
        token_ms=token,
        exposed_ms=base.exposed_ms - (base.token_ms - token),
        basis=basis,
    )


def capacity_of(cache_gb: float, geom: ModelGeometry) -> int:
    return int(min(cache_gb * GIB // geom.record_bytes, geom.num_layers * geom.num_experts))


def sweep(
    machine: Machine,
    geom: ModelGeometry,
    topk: np.ndarray,
    cache_gbs: Sequence[float],
    policies: Sequence[str] = ("clock",),
    prefetches: Sequence[str] = PREFETCH,
    draft_depths: Sequence[int] = (0,),
    acceptance: float = 0.0,
    warm: np.ndarray | None = None,
    predicted: dict | None = None,
    gains: dict[str, tuple[float, str]] | None = None,
    codec: str = "",
    replays: dict | None = None,
    progress=None,
) -> list[Projection]:
    """Every configuration (cache size x policy x prefetch x draft depth); the replay of each
    (cache, policy, prefetch) is shared by the draft depths. `predicted`: prefetch name ->
    [len(warm) + T, L, B] predicted sets for the ahead predictors replayed (router-reuse:D,
    hyper-reuse); `gains`: prefetch name -> (measured decode gain, source) for predictors taken
    from a peer's measurement instead (applied to the same configuration with prefetch off).
    The runtime predicts ahead in one-token forwards only (stream.predict): with a draft depth
    an ahead predictor's verify steps read like prefetch off.
    `replays`: a dict reused across calls (keyed by routes, capacity, policy, prefetch: the same
    routes at another machine or check need no new replay); `progress(n)`: called per replay."""
    out = []
    predicted = predicted or {}
    gains = gains or {}
    replays = {} if replays is None else replays
    unions = {d: union_factor(topk, d) for d in draft_depths}
    need_off = any(prefetch_kind(p)[0] == "ahead" for p in prefetches) and (gains or any(draft_depths))
    order = (["off"] if need_off and "off" not in prefetches else []) + list(prefetches)
    for gb in cache_gbs:
        cap = capacity_of(gb, geom)
        for pol in policies:
            base = {}
            for pf in order:
                if pf != "off" and pol not in ("lru", "clock"):
                    continue
                ahead = prefetch_kind(pf)[0] == "ahead"
                if pf not in gains and (not ahead or 0 in draft_depths):
                    key = (id(topk), id(warm), cap, pol, pf, id(predicted.get(pf)))
                    if key not in replays:
                        replays[key] = (
                            replay(topk, geom.num_experts, cap, pol, pf, warm, predicted.get(pf)),
                            topk,
                            warm,
                            predicted.get(pf),
                        )  # keeps the keyed arrays alive
                        if progress:
                            progress(1)
                    rep = replays[key][0]
                for d in draft_depths:
                    if pf in gains and d == 0:
                        p = with_gain(base[d], pf, *gains[pf])
                    elif ahead and d > 0:
                        p = dataclasses.replace(
                            base[d],
                            prefetch=pf,
                            basis="verify steps predict nothing (multi-token forwards): as prefetch off",
                        )
                    else:
                        p = project(
                            machine,
                            geom,
                            rep,
                            cache_gb=gb,
                            capacity=cap,
                            policy=pol,
                            prefetch=pf,
                            draft_depth=d,
                            acceptance=acceptance if d else 0.0,
                            union=unions[d],
                            codec=codec,
                        )
                    if pf == "off":
                        base[d] = p
                    if pf in prefetches:
                        out.append(p)
    return out


def project_batches(
    machine: Machine,
    geom: ModelGeometry,
    topk: np.ndarray,
    cache_gb: float,
    batches: Sequence[int] = (1, 2, 4, 8),
    warm: np.ndarray | None = None,
    policy: str = "clock",
    codec: str = "",
    replays: dict | None = None,
) -> list[Projection]:
    """Aggregate decode of ``batch`` concurrent requests (continuous batching) at one cache size.
    A batched step is a multi-row forward, which predicts nothing ahead (as a verify step), so the
    replay is prefetch off; each request's misses are the single stream's (the arena's reuse
    across requests is not credited beyond the routes' overlap within a step)."""
    replays = {} if replays is None else replays
    cap = capacity_of(cache_gb, geom)
    key = (id(topk), id(warm), cap, policy, "off", id(None))
    if key not in replays:
        replays[key] = (replay(topk, geom.num_experts, cap, policy, "off", warm), topk, warm, None)
    rep = replays[key][0]
    return [
        project(
            machine,
            geom,
            rep,
            cache_gb=cache_gb,
            capacity=cap,
            policy=policy,
            prefetch="off",
            union=batch_union(topk, b),
            codec=codec,
            batch=b,
        )
        for b in batches
    ]


def replays_needed(cache_gbs, policies, prefetches, gains=None, draft_depths=(0,)) -> int:
    """How many replays `sweep` runs (for a progress bar)."""
    gains = gains or {}
    need_off = any(prefetch_kind(p)[0] == "ahead" for p in prefetches) and (gains or any(draft_depths))
    pfs = (["off"] if need_off and "off" not in prefetches else []) + [
        p for p in prefetches if p not in gains and (prefetch_kind(p)[0] != "ahead" or 0 in draft_depths)
    ]
    return len(cache_gbs) * sum(1 for pol in policies for pf in pfs if pf == "off" or pol in ("lru", "clock"))


def best(projections: Sequence[Projection], exclude_bounds: bool = True) -> Projection:
    """The fastest real configuration (Belady needs the future: a bound, never a recommendation)."""
    cands = [p for p in projections if not (exclude_bounds and p.policy == "belady")]
    return max(cands, key=lambda p: p.tok_s)


def synthetic_routes(
    tokens: int, num_layers: int, num_experts: int, top_k: int, reuse: float, skew: float, seed: int = 0
) -> np.ndarray:
    """[T, L, k] stand-in routes for a model whose trace we do not have: each layer keeps each of
    the previous token's experts with probability `reuse` and draws the rest from a popularity
    with weights (rank + 1) ** -skew (a permutation per layer). Only for projections that say so."""
    rng = np.random.default_rng(seed)
    pop = (np.arange(num_experts) + 1.0) ** -skew
    pop /= pop.sum()
    perms = [rng.permutation(num_experts) for _ in range(num_layers)]
    out = np.zeros((tokens, num_layers, top_k), np.int64)
    for l in range(num_layers):
        prev = None
        for t in range(tokens):
            keep = [] if prev is None else [e for e in prev if rng.random() < reuse]
            chosen = set(keep)
            while len(chosen) < top_k:
                for e in perms[l][rng.choice(num_experts, top_k, p=pop)]:
                    if len(chosen) < top_k:
                        chosen.add(int(e))
            row = list(chosen)
            out[t, l] = row
            prev = row
    return out


def synthetic_predictions(
    routes: np.ndarray, num_experts: int, recall: float, budget: int, seed: int = 0
) -> np.ndarray:
    """[T, L, budget] stand-in predicted sets for an ahead predictor on routes we only have
    synthetically: each true expert of (t, l) is predicted with probability `recall`, the rest of
    the budget is filled with experts the token does not use (wrong guesses that cost reads).
    Precision is then recall x top_k / budget. Only for projections that say so."""
    rng = np.random.default_rng(seed)
    t, L, k = routes.shape
    out = np.full((t, L, budget), -1, np.int64)
    for i in range(t):
        for l in range(L):
            true = routes[i, l]
            hit = [int(e) for e in true if rng.random() < recall][:budget]
            taken = set(int(e) for e in true)
            fill = []
            while len(hit) + len(fill) < budget:
                e = int(rng.integers(num_experts))
                if e not in taken:
                    taken.add(e)
                    fill.append(e)
            out[i, l, :budget] = hit + fill
    return out
