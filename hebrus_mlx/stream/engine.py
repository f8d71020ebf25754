"""Python face of the C++ streaming engine (``hebrus_mlx._ext``).

A request names bytes in a store: ``(store, offset, length)`` plus scheduling
metadata (priority, exact vs predicted, owner/generation, layer, expert,
deadline, and the digest the bytes must have: ``fast_digest`` (XXH3-128, the
per-read check) or ``digest`` (SHA-256, for artifacts without fast digests)).
It returns an integer ticket. The record
lands in a bounded slot cache; ``wait``/``read`` block until it is published,
``release``/``cancel`` drop the ticket's ownership exactly once.

Graph evaluation consumes records through MLX primitives, none of which
needs a Python-side read-back of routes:

- ``resolve(table, indices) -> (rows, lease)``: zero-copy. Records live in a
  fixed-row arena whose parts are MLX arrays; ``rows`` index them (e.g.
  ``gather_qmm`` ``rhs_indices``) and ``release_after(y, lease)`` unpins them
  once ``y`` is computed. This is the streamed-SwitchGLU path.
- ``prefetch(table, indices, priority)``: non-blocking predicted reads.
- ``gather(table, indices)``: copies the records into a new uint8 array.
- ``gather_rows(table, row_ids, ...)``: PLE rows from deduplicated,
  verified single-snapshot page reads.
- ``load(tickets)``: copies already issued tickets into one array.

If the extension is not built, :func:`available` is False and constructing a
:class:`StreamEngine` raises :class:`StreamUnavailableError`; the rest of the
package keeps working (resident weights only).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx  # loads libmlx before the extension needs it
import numpy as np

from .errors import StreamError, StreamRequestError

try:
    from hebrus_mlx import _ext
except ImportError as e:  # not built (e.g. a metadata-only install)
    _ext = None
    _IMPORT_ERROR: BaseException | None = e
else:
    _IMPORT_ERROR = None

P0, P1, P2 = 0, 1, 2  # exact critical, near-term predicted, speculative


def prediction_stats(counters: dict) -> dict:
    """Read-ahead quality from :meth:`StreamEngine.counters`:

    - ``timely_recall``: exact requests served by a prediction that had already
      landed, over the exact requests nothing exact had cached (those plus
      predictions still in flight plus exact misses);
    - ``precision``: predicted reads an exact request later used, over predicted reads.
    None where the denominator is 0."""
    c = counters
    hits, joins = c["predicted_hits"], c["predicted_joins"]
    need = hits + joins + c["exact_misses"]
    return {
        "timely_recall": hits / need if need else None,
        "precision": (hits + joins) / c["predicted_reads"] if c["predicted_reads"] else None,
    }


def io_summary(counters: dict, prefetch=None) -> str:
    """One line for generate's stats: bytes read, hit rate, exposed wait,
    hidden fraction (from :meth:`StreamEngine.counters`); with ``prefetch``
    (the PrefetchSpec in use) also the predictor's name, timely recall and
    precision (wasted bytes are in the main line)."""
    c = counters
    read = (c["exact_bytes"] + c["predicted_bytes"]) / 1e9
    lookups = c["hits"] + c["joins"] + c["misses"]
    hit = 100.0 * (c["hits"] + c["joins"]) / lookups if lookups else 0.0
    hidden = c.get("hidden_fraction")
    hidden = "n/a" if hidden is None else f"{100.0 * hidden:.0f}%"
    return (
        f"I/O: {read:.3f} GB read ({c['predicted_bytes'] / 1e9:.3f} GB predicted, "
        f"{c['wasted_bytes'] / 1e9:.3f} GB wasted), hit rate {hit:.1f}%, "
        f"exposed wait {c['exposed_wait_ns'] / 1e9:.3f} s, hidden {hidden}, "
        f"p50/p99 {c['latency_p50_ns'] / 1e6:.2f}/{c['latency_p99_ns'] / 1e6:.2f} ms"
    ) + ("" if prefetch is None else "; " + _prefetch_summary(c, prefetch))


def io_by_kind(counters: dict, kinds: dict) -> dict:
    """``{kind: {"reads", "bytes", "exposed_wait_ns"}}``: the engine's per-store counters summed by
    what each store holds (``StreamEngine.store_kinds``): expert records and PLE pages apart."""
    out: dict = {}
    for field in ("reads", "bytes", "exposed_wait_ns"):
        for store, n in (counters.get(f"{field}_by_store") or {}).items():
            kind = kinds.get(int(store), "other")
            out.setdefault(kind, {"reads": 0, "bytes": 0, "exposed_wait_ns": 0})[field] += int(n)
    return out


def io_split_summary(counters: dict, kinds: dict) -> str | None:
    """``I/O by store: experts 1.234 GB in 456 reads, exposed wait 0.1 s; ple ...`` (None: nothing read)."""
    split = io_by_kind(counters, kinds)
    if not split:
        return None
    parts = [
        f"{k} {v['bytes'] / 1e9:.3f} GB in {v['reads']} reads, exposed wait {v['exposed_wait_ns'] / 1e9:.3f} s"
        for k, v in sorted(split.items())
    ]
    return "I/O by store: " + "; ".join(parts)


def mirror_summary(files: dict) -> str:
    """``mirror: reads 120 store / 118 mirror, 0 fallbacks`` from :meth:`StreamEngine.file_reads`."""
    r = files["reads"]
    return f"mirror: reads {r[0]} store / {' / '.join(str(n) for n in r[1:])} mirror, {files['fallbacks']} fallbacks"


def _prefetch_summary(c: dict, prefetch) -> str:
    s = prediction_stats(c)
    pct = lambda v: "n/a" if v is None else f"{100.0 * v:.1f}%"  # noqa: E731
    return f"prefetch {prefetch.name}: timely recall {pct(s['timely_recall'])}, precision {pct(s['precision'])}"


# Engine trace (metal_ext/trace.h). Times are steady-clock ns, the clock of
# time.monotonic_ns() (see trace_clock_ns).
TRACE_KINDS = ("read", "wait", "mark")
TRACE_DTYPE = np.dtype(
    [
        ("kind", "U4"),
        ("outcome", "U12"),
        ("priority", np.int8),  # read: queue it ran from, -1 if it never ran
        ("exact", np.bool_),  # read: issued exact (else predicted)
        ("promoted", np.bool_),  # read: predicted, then joined by an exact request
        ("layer", np.int32),
        ("expert", np.int32),  # mark: the tag
        ("bytes", np.uint64),
        ("issue_ns", np.int64),  # read: request; wait: begin; mark: time
        ("start_ns", np.int64),  # read: a worker picked it (0: never ran)
        ("end_ns", np.int64),  # read: published / failed / dropped; wait: end
    ]
)


def _trace_array(d: dict) -> np.ndarray:
    n = len(d["kind"])
    out = np.zeros(n, TRACE_DTYPE)
    if n == 0:
        return out
    out["kind"] = [TRACE_KINDS[k] for k in d["kind"]]
    # Named by the engine: "published", ..., "error:<name>" ("" for marks).
    out["outcome"] = d["outcome"]
    for field, col in (
        ("priority", "priority"),
        ("exact", "exact"),
        ("promoted", "promoted"),
        ("layer", "layer"),
        ("expert", "expert"),
        ("bytes", "bytes"),
        ("issue_ns", "t0"),
        ("start_ns", "t1"),
        ("end_ns", "t2"),
    ):
        out[field] = d[col]
    return out


def trace_clock_ns() -> int:
    """Now on the engine trace's clock (steady clock, as time.monotonic_ns)."""
    if _ext is None:
        raise StreamUnavailableError(unavailable_reason())
    return _ext.trace_clock_ns()


class StreamUnavailableError(StreamError):
    """The C++ extension is not available in this installation."""


def available() -> bool:
    return _ext is not None


def native():
    """The compiled extension (``hebrus_mlx._ext``) for the callers that drive it directly (qualify's
    probes, the prefill sweep); StreamUnavailableError when it did not import."""
    if _ext is None:
        raise StreamUnavailableError(unavailable_reason())
    return _ext


def unavailable_reason() -> str | None:
    if _ext is not None:
        return None
    return f"hebrus_mlx._ext could not be imported: {_IMPORT_ERROR}"


def backends() -> list:
    """Read backends compiled into this build, the default first:
    ``["pread"]``, plus ``"mtlio"`` on a macOS build with Metal (unverified,
    opt-in only, AFN-013). Empty when the extension is not built."""
    return [] if _ext is None else list(_ext.backends())


# ---- what the machine profile switched on (AFN-013) ----------------------------------------------
# "mtlio" only where `hebrus-mlx qualify` measured it beating pread on this machine.
_profile_backend = "pread"


def gpu_events_compiled() -> bool:
    """The build has the GPU-event streaming path (Apple + Metal + HEBRUS_METAL_EVENTS only)."""
    return _ext is not None and bool(_ext.gpu_events_compiled())


def configure(profile: dict | None, options=None) -> dict:
    """Switch on the streaming features `profile.passed` honours for this machine, each only where
    this build has it and `options` (a GraphOptions) does not switch it off (gpu_events, mtlio):
    - gpu_event: streamed ops on the GPU stream, the GPU waiting on the host's event (else the
      CPU stream, the default);
    - mtlio: the default read backend of new engines (else pread).
    Returns {"gpu_event": bool, "backend": str}."""
    from ..machine_profile import passed
    from ..models.options import GraphOptions

    options = options or GraphOptions()

    global _profile_backend
    gpu = passed(profile, "streaming", "gpu_event") and gpu_events_compiled() and options.gpu_events
    mtlio = passed(profile, "io", "mtlio_vs_pread") and "mtlio" in backends() and options.mtlio
    if _ext is not None:
        _ext.set_gpu_events(gpu)  # off is always accepted
    _profile_backend = "mtlio" if mtlio else "pread"
    return {"gpu_event": gpu, "backend": _profile_backend}


def default_backend() -> str:
    """The read backend engines get when none is named: pread unless the profile promoted mtlio."""
    return _profile_backend


def gpu_task_wait_bound(seconds: float | None = None) -> float:
    """The longest a host task the GPU waits on may wait for one read (seconds; set it with
    ``seconds``, <= 0 for no bound): past it the read fails typed and the step rolls back, so a
    stalled SSD never holds a command buffer open into macOS's GPU watchdog. CPU-stream tasks
    (the default path) are not bounded: they hold no GPU."""
    if _ext is None:
        raise StreamUnavailableError(unavailable_reason())
    if seconds is not None:
        _ext.set_gpu_task_wait_bound(float(seconds))
    return float(_ext.gpu_task_wait_bound())


def check_gpu_event_errors() -> None:
    """Raise (once) the first failure of a GPU-event host task since the last check (the records
    of that step were never written). A tagged RuntimeError, typed by `errors.translate`."""
    if _ext is not None:
        _ext.check_gpu_event_errors()


class StreamEngine:
    """Thread-pool pread engine with a bounded, pinning slot cache.

    Args:
        cache_bytes: Slot cache capacity; every slab (cached, in flight or
            pooled) counts against it.
        threads: Reader threads.
        direct: Use O_DIRECT on Linux when offset, length and buffer align.
        policy: ``"lru"`` (control), ``"clock"`` (second chance, pinned
            records off the ring) or ``"score"`` (stall removed per byte).
        nocache / rdadvise: macOS ``F_NOCACHE`` / ``F_RDADVISE``.
        backend: How bytes move: ``"pread"`` or ``"mtlio"``
            (``MTLIOCommandQueue`` into arena rows; macOS Metal builds only,
            not verified on hardware). None: :func:`default_backend`, i.e.
            pread unless this machine's profile promoted mtlio.
            Anything else, or ``"mtlio"`` where :func:`backends` lacks it,
            raises :class:`StreamRequestError` naming ``backend``.

    Every read is checked before it is published against the digest its
    request (or table row) names, by the reader thread that read it, on the
    bytes it publishes (one snapshot). Fault injection is not part of this
    class: tests attach it from the test-only ``hebrus_mlx._testing`` module.
    """

    def __init__(
        self,
        cache_bytes: int,
        threads: int = 4,
        direct: bool = True,
        policy: str = "lru",
        nocache: bool = False,
        rdadvise: bool = False,
        backend: str | None = None,
    ):
        if _ext is None:
            raise StreamUnavailableError(unavailable_reason())
        if backend is None:
            backend = default_backend()
        self._e = _ext.Engine(
            threads=threads,
            cache_bytes=cache_bytes,
            direct=direct,
            nocache=nocache,
            rdadvise=rdadvise,
            policy=policy,
            backend=backend,
        )
        self._threads = threads
        self.store_kinds: dict[int, str] = {}  # store id -> what it holds ("experts", "ple", ...)

    @property
    def backend(self) -> str:
        return self._e.backend

    def __repr__(self) -> str:
        cap = self._e.memory()["capacity"]
        return f"StreamEngine(backend={self.backend!r}, threads={self._threads}, cache_bytes={cap})"

    # Stores and record tables -------------------------------------------
    def add_store(self, path: str, digest_id: str = "", kind: str = "other") -> int:
        """Open a store file; ``kind`` names what it holds (``experts``, ``ple``) so the I/O it
        costs is reported apart (:func:`io_by_kind`)."""
        store = self._e.add_store(str(path), digest_id)
        self.store_kinds[store] = kind
        return store

    def add_mirror(self, store: int, path: str) -> int:
        """A byte-identical copy of ``store`` (``--expert-mirror``): reads alternate between
        the files; a read that fails on the mirror (I/O, short read, digest) is redone from the
        store. Not verified on two disks here (AFN-013)."""
        return self._e.add_mirror(int(store), str(path))

    def file_reads(self, store: int) -> dict:
        """``{"paths", "reads", "bytes"}`` per file of ``store`` (the store first, then its
        mirrors) and ``fallbacks`` (mirror reads redone from the store)."""
        return self._e.file_reads(int(store))

    def register_table(
        self,
        store: int,
        offsets: Sequence[int],
        lengths: Sequence[int],
        digests: Sequence[bytes] | None = None,
        arena: int = -1,
        fast_digests: Sequence[bytes] | None = None,
    ) -> int:
        """Record table for the graph ops: row i is (offsets[i], lengths[i]),
        read into ``arena`` rows if given (lengths must equal its record),
        checked on every read against ``fast_digests[i]`` (XXH3-128, 16
        bytes) or ``digests[i]`` (SHA-256, 32 bytes); at most one of the two."""
        return self._e.register_table(
            store,
            [int(o) for o in offsets],
            [int(n) for n in lengths],
            None if digests is None else [bytes(d) for d in digests],
            None if fast_digests is None else [bytes(d) for d in fast_digests],
            arena,
        )

    def create_arena(self, part_bytes: Sequence[int], rows: int, expand: Sequence[bool] | None = None):
        """Fixed-row slot arena for one record geometry.

        Returns ``(arena_id, parts)``: ``parts[p]`` is an MLX uint8 array
        ``[rows, part_bytes[p]]`` that one preadv per record fills in place
        (the record is the concatenation of its parts). View a part as typed
        weights with ``parts[p].view(dtype).reshape(rows, ...)`` and index it
        with the rows returned by :meth:`resolve`.

        ``expand[p]`` marks a part stored as bf16 that the arena holds as
        fp32 (``[rows, 2 * part_bytes[p]]``, widened after the digest check):
        MLX's CPU quantized matmul is exact only with fp32 scales/biases.
        """
        flags = [] if expand is None else [int(bool(f)) for f in expand]
        return _ext.create_arena(self._e, [int(b) for b in part_bytes], int(rows), flags)

    # Tickets --------------------------------------------------------------
    def request(
        self,
        store: int,
        offset: int,
        length: int,
        *,
        priority: int = P0,
        exact: bool = True,
        owner: int = 0,
        generation: int = 0,
        layer: int = -1,
        expert: int = -1,
        deadline_ns: int | None = None,
        confidence: float = 1.0,
        digest: bytes | None = None,
        arena: int = -1,
        fast_digest: bytes | None = None,
    ) -> int:
        """Issue a read; never blocks on I/O. ``deadline_ns`` is in
        ``time.monotonic_ns()`` units. ``fast_digest`` (XXH3-128) or
        ``digest`` (SHA-256): what the bytes are checked against. Requests
        share a slot (one read, one snapshot) only if they name the same
        bytes and the same check, domain and value (or both none): a
        digest-carrying request is never served bytes that were not checked
        against its own digest."""
        return self._e.request(
            store,
            offset,
            length,
            priority=priority,
            exact=exact,
            owner=owner,
            generation=generation,
            layer=layer,
            expert=expert,
            deadline_ns=deadline_ns,
            confidence=confidence,
            digest=digest,
            fast_digest=fast_digest,
            arena=arena,
        )

    def wait(self, ticket: int, timeout: float | None = None) -> int:
        return self._e.wait(ticket, -1.0 if timeout is None else timeout)

    def read(self, ticket: int, timeout: float | None = None) -> bytes:
        """Wait and copy the record (the ticket stays owned)."""
        return self._e.read(ticket, -1.0 if timeout is None else timeout)

    def release(self, ticket: int) -> bool:
        return self._e.release(ticket)

    def cancel(self, ticket: int) -> bool:
        return self._e.cancel(ticket)

    def advance_generation(self, owner: int, generation: int) -> int:
        return self._e.advance_generation(owner, generation)

    def set_staging(self, arena: int, rows: int) -> None:
        """Keep ``rows`` of ``arena`` for predicted records: exact records
        then hold at most the rest while any of theirs can be recycled, and a
        prediction never displaces an exact record (advisory read-ahead)."""
        self._e.set_staging(int(arena), int(rows))

    def set_hint(
        self,
        store: int,
        offset: int,
        length: int,
        p_use: float,
        arena: int = -1,
        digest: bytes | None = None,
        fast_digest: bytes | None = None,
    ) -> bool:
        """Scored policy: P(use before eviction) of a cached record (named
        as its requests named it, ``digest``/``fast_digest`` included)."""
        return self._e.set_hint(store, offset, length, p_use, arena, digest, fast_digest)

    def ticket_info(self, ticket: int) -> dict:
        return self._e.ticket_info(ticket)

    # Graph ops ------------------------------------------------------------
    def load(self, tickets: Sequence[int]) -> mx.array:
        """uint8 [n, length]; the op owns the tickets and releases them."""
        return _ext.load_tickets(self._e, list(tickets))

    def gather(self, table: int, indices: mx.array, owner: int = 0, generation: int = 0, layer: int = -1) -> mx.array:
        """uint8 [*indices.shape, length] streamed during graph evaluation."""
        return _ext.gather_records(self._e, table, indices, owner, generation, layer)

    def resolve(self, table: int, indices: mx.array, owner: int = 0, generation: int = 0, layer: int = -1):
        """Graph op: wait for ``table[indices]`` in the table's arena and pin
        them. Returns ``(rows, lease)``; ``rows`` (uint32, shape of indices)
        index the arena parts, e.g. as ``gather_qmm(..., rhs_indices=rows)``.
        Pass the consumer's output and ``lease`` to :meth:`release_after`."""
        return _ext.resolve_records(self._e, table, indices, owner, generation, layer)

    def resolve_wave(
        self,
        table: int,
        indices: mx.array,
        owner: int = 0,
        generation: int = 0,
        layer: int = -1,
        deadline_s: float = 0.0,
    ):
        """Graph op for a wavefront (AFN-019 H4): requests ``table[indices]``
        (P0 exact, due ``deadline_s`` after the op runs; 0: no deadline) and
        pins them without waiting. Returns a wave: ``wave.take(after)`` (once
        per record) gives ``(row, position)`` ([1] uint32 each) of the next
        record in arrival order, its task running after ``after``; pass the
        consumer's output and ``wave.lease`` to :meth:`release_after`."""
        return _ext.resolve_wave(self._e, table, indices, owner, generation, layer, float(deadline_s))

    def release_after(self, value: mx.array, lease: mx.array) -> mx.array:
        """Graph op: ``value`` unchanged; unpins the lease once ``value`` has
        been computed (so the rows stay valid while they are read)."""
        return _ext.release_after(self._e, value, lease)

    def prefetch(
        self,
        table: int,
        indices: mx.array,
        priority: int = P1,
        confidence: float = 1.0,
        exact: bool = False,
        owner: int = 0,
        generation: int = 0,
        layer: int = -1,
    ) -> mx.array:
        """Non-blocking reads; returns a uint32 scalar (requests issued).

        Predictions use P1/P2 with ``exact=False``; known-needed records
        issued early (PLE pages as soon as token ids are known) use P0 with
        ``exact=True``. Evaluate the result (``mx.async_eval``) or make it an
        input of a later op so the requests are issued.
        """
        return _ext.prefetch_records(
            self._e,
            table,
            indices,
            priority,
            confidence,
            exact,
            owner,
            generation,
            layer,
        )

    def gather_rows(
        self,
        table: int,
        row_ids: mx.array,
        rows_per_page: int,
        row_bytes: int,
        header_bytes: int = 0,
        owner: int = 0,
        generation: int = 0,
        layer: int = -1,
    ) -> mx.array:
        """Graph op for fixed-page stores (PLE, AFN-003): row r is in page
        ``r // rows_per_page`` at ``header_bytes + (r % rows_per_page) *
        row_bytes``. Each unique page is read once at P0, verified, and rows
        are copied from that same snapshot. uint8 ``[*row_ids.shape,
        row_bytes]``."""
        return _ext.gather_rows(
            self._e,
            table,
            row_ids,
            rows_per_page,
            row_bytes,
            header_bytes,
            owner,
            generation,
            layer,
        )

    # Observability --------------------------------------------------------
    def counters(self) -> dict:
        c = self._e.counters()
        exact_ns = c["exact_read_ns"]
        c["hidden_fraction"] = 1.0 - c["exposed_wait_ns"] / exact_ns if exact_ns > 0 else None
        return c

    def reset_counters(self) -> None:
        self._e.reset_counters()

    def enable_trace(self, capacity: int) -> None:
        """Record engine events in a ring of ``capacity`` (oldest dropped
        first, see :meth:`trace_events`); 0 turns tracing off. Off by
        default: then the engine pays one branch per read."""
        if int(capacity) < 0:
            raise StreamRequestError("capacity: must be >= 0")
        self._e.enable_trace(int(capacity))

    def trace_events(self, clear: bool = False):
        """``(events, dropped)``: a numpy structured array (``TRACE_DTYPE``,
        oldest first) and how many events the ring bound has dropped so far.

        - ``read``: one per miss (a read the engine issued), recorded when it
          published, failed (outcome = the error class), finished for a
          recycled slot (``stale``) or was dropped while queued.
        - ``wait``: one per wait that blocked (the exposed wait), labelled
          with the ticket's layer/expert.
        - ``mark``: :meth:`mark` or :meth:`mark_after` timestamps.

        Times are ns on :func:`trace_clock_ns`'s clock."""
        d = self._e.trace_events(clear)
        return _trace_array(d), d["dropped"]

    def mark(self, layer: int, tag: int = 0) -> None:
        """Host-side trace mark (no-op while tracing is off)."""
        self._e.mark(layer, tag)

    def mark_after(self, value: mx.array, layer: int, tag: int = 0) -> mx.array:
        """Graph op: ``value`` unchanged; adds a trace mark when the CPU
        stream has computed ``value``. Use the result in place of ``value``
        so the mark runs in line (no host sync)."""
        return _ext.mark_after(self._e, value, layer, tag)

    def memory(self) -> dict:
        return self._e.memory()

    def close(self) -> None:
        self._e.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
