"""Pipeline-parallel generation over `mx.distributed` (ring over TCP/Thunderbolt, or whatever
backend `mlx.launch` sets up): each rank holds a contiguous range of decoder layers.

Rank 0 drives. Per forward it sends a fixed-size header, then one payload — the 4-stream
hyper-connection state after its layers plus the token ids (PLE layers need them) — to rank 1,
which runs its layers and passes both on; the last rank applies the final mixer and lm_head and
sends the logits back to rank 0, which samples (the last row's, unless every row is asked for, as
a speculative verify does). To draft with the MTP head, rank 0 holds a copy of the mixer, lm_head
and MTP head, and the last rank sends the final pre-mixer state of every row after the logits.

Every rank keeps the caches of its own layers; snapshots (AFN-010 rollback) are named by rank 0
and taken by the other ranks when the next forward's header reaches them, so a snapshot costs no
message of its own. Detached snapshots
(prefix reuse across requests: another sequence continues from them) are taken at once by a
DETACH header, kept by every rank until rank 0 drops its handle, and restored into any sequence.

Messages on one link are plain byte streams, so each send is evaluated before the next one is
built: a header always precedes its payload.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import weakref

import mlx.core as mx

from ..errors import HebrusError
from ..models.cache import AttentionCache, LinearCache, SequenceCache
from .split import Stage

FORWARD, RESTORE, FREE, STOP, DETACH = 1, 2, 3, 4, 5
HEADER = 8  # [cmd, batch, length, position (-1: none), flags, cache id, snapshot id (-1), oldest live snapshot]
ALL_LOGITS, HIDDEN = 1, 2  # flags: every row's logits (else the last row's); the pre-mixer state too
DEFAULT_TIMEOUT_S = 60.0


class PipelineError(HebrusError, RuntimeError):
    """A pipeline rank died, stalled or failed; the request ends, the message names the rank."""

    default_field = "pipeline"


def link_lost(e: RuntimeError) -> bool:
    """A collective failed because a peer rank went away (the ring backend's wording)."""
    return "[ring]" in str(e) or "connection" in str(e)


def collective(group, what: str, array):
    """Evaluate a collective outside the forward loop (the split agreement, the final counters):
    a peer that died turns into a PipelineError naming this rank, not a RuntimeError traceback."""
    try:
        mx.eval(array)
    except RuntimeError as e:
        if link_lost(e):
            raise PipelineError(f"rank {group.rank()} lost its link during {what}: {e}") from None
        raise
    return array


class _Watchdog:
    """Bounds every wait on another rank. MLX's collectives cannot be interrupted from Python,
    so on expiry the process reports the typed error on one line and exits (status 3): a stalled
    peer ends the request within `timeout` instead of hanging it forever."""

    def __init__(self, rank: int, timeout: float):
        self.rank, self.timeout = rank, timeout
        self.on_stall = None  # called with the message before the exit (the server answers the request)
        self._deadline = None
        self._what = ""
        self._cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name="hebrus-pipeline-watchdog").start()

    def _run(self):
        with self._cv:
            while True:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                message = f"rank {self.rank} waited more than {self.timeout:g} s for {self._what}; a rank stalled"
                if self.on_stall is not None:
                    try:
                        self.on_stall(message)
                    except Exception:
                        pass
                sys.stderr.write(f"hebrus-mlx: error: PipelineError: pipeline: {message}\n")
                sys.stderr.flush()
                os._exit(3)

    def eval(self, what: str, *arrays):
        with self._cv:
            self._deadline, self._what = time.monotonic() + self.timeout, what
            self._cv.notify()
        try:
            mx.eval(*arrays)
        except RuntimeError as e:
            if link_lost(e):
                raise PipelineError(f"rank {self.rank} lost its link while waiting for {what}: {e}") from None
            raise
        finally:
            with self._cv:
                self._deadline = None


def set_nodelay() -> int:
    """Turn off Nagle on this process's TCP sockets (the ring backend's links). MLX leaves it on,
    so every small header waits for the peer's delayed ACK: ~40 ms per message measured here, ~6 ms
    with it off. Returns the number of sockets changed."""
    import socket
    import stat

    changed = 0
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                changed += 1
        except OSError:
            pass
        finally:
            s.close()
    return changed


def _layer_cache(layer):
    return LinearCache() if layer.is_linear else AttentionCache()


def _local_cache(model, stage: Stage) -> SequenceCache:
    return SequenceCache([_layer_cache(model.model.layers[i]) for i in stage.layers])


def _run_layers(model, stage: Stage, streams, ids, cache: SequenceCache):
    from ..models import options as graph_options

    with graph_options.use(model.options or graph_options.active()):  # as Model.__call__ builds its graph
        for i, layer_cache in zip(stage.layers, cache):
            if model.streaming is not None:
                streams = model.streaming.layer_start(i, streams)  # this stage's lookahead reads
            streams = model.model.layers[i](streams, ids, layer_cache)
    return streams


def _payload(streams, ids):
    # One message per hop: the streams plus the ids as one extra float32 column (ids < 2**24).
    return mx.concatenate([streams.astype(mx.float32), ids.astype(mx.float32)[..., None]], axis=-1)


class PipelineCache(SequenceCache):
    """Rank 0's handle on one sequence across the pipeline: its own layers' caches (the list)
    plus the id under which the other ranks keep theirs."""

    def __init__(self, pipe: PipelineModel, layers, cache_id: int):
        super().__init__(layers)
        self.pipe, self.cache_id = pipe, cache_id
        weakref.finalize(self, pipe._pending_free.append, cache_id)

    def snapshot(self):
        return _Snapshot(self.pipe, self.cache_id, super().snapshot())

    def restore(self, snap):
        super().restore(snap.local)
        self.pipe._restore(self.cache_id, snap)

    def detach(self):
        return _Detached(self.pipe, self.cache_id, super().detach())


class _Detached(list):
    """A detached snapshot (see `SequenceCache.detach`) of every rank's share: rank 0's is the
    list's one item (so the prompt cache counts its arrays); the others keep theirs under `id`
    until this handle is dropped."""

    def __init__(self, pipe, cache_id, local):
        super().__init__([local])
        self.local, self.id = local, pipe._next_snapshot
        pipe._next_snapshot += 1
        pipe._flush_frees()
        pipe._send_header([DETACH, 0, 0, -1, 0, cache_id, self.id, -1])
        weakref.finalize(self, pipe._pending_free_snaps.append, self.id)


class _Snapshot:
    """A named point in a sequence's history. The other ranks take their half when the next
    forward of this sequence reaches them; until then their state still equals it."""

    def __init__(self, pipe, cache_id, local):
        self.local, self.cache_id = local, cache_id
        self.id = pipe._next_snapshot
        pipe._next_snapshot += 1
        self.sent = False
        pipe._live[self.id] = None
        weakref.finalize(self, pipe._live.pop, self.id, None)
        pipe._unsent[cache_id] = self


def _of_local(name):
    """A read-only attribute that is the one of the same name on `self.local`."""
    return property(lambda self: getattr(self.local, name))


class PipelineModel:
    """Rank 0's model: same call as `Model.__call__`, the other ranks' layers run remotely. Only
    the last row's logits cross back unless `all_logits` (a prefill chunk needs one row)."""

    last_row_logits = True

    def __init__(self, model, stage: Stage, group, timeout: float = DEFAULT_TIMEOUT_S):
        if not stage.first:
            raise PipelineError("PipelineModel runs on rank 0; the other ranks run serve()")
        # `local`: this rank's pruned Model; `model` mirrors Model.model (the drafters use it).
        self.local, self.stage, self.group = model, stage, group
        self.args = model.args
        self.streaming = model.streaming  # rank 0's own stage (generate caps chunks by it)
        self._watchdog = _Watchdog(0, timeout)
        self._next_cache = 0
        self._next_snapshot = 0
        self._live = {}
        self._unsent = {}
        self._pending_free = []
        self._pending_free_snaps = []
        self.comm_seconds = 0.0
        self.comm_bytes = 0
        self.hidden_bytes = 0  # of comm_bytes: the final states sent back for MTP drafting
        self.forwards = 0

    # Read-only views of rank 0's pruned Model, as Model names them (the drafters use them). lm_head:
    # rank 0's copy when it drafts with MTP, else a placeholder.
    model = _of_local("model")
    layers = _of_local("layers")
    lm_head = _of_local("lm_head")
    mtp_head = _of_local("mtp_head")

    @property
    def on_stall(self):
        return self._watchdog.on_stall

    @on_stall.setter
    def on_stall(self, fn):
        self._watchdog.on_stall = fn

    def make_cache(self) -> PipelineCache:
        self._next_cache += 1
        return PipelineCache(
            self, [_layer_cache(self.local.model.layers[i]) for i in self.stage.layers], self._next_cache
        )

    def _send_header(self, header):
        sent = mx.distributed.send(mx.array(header, dtype=mx.int32), 1, group=self.group)
        self._watchdog.eval("rank 1 to take a header", sent)

    def _flush_frees(self):
        while self._pending_free:
            self._send_header([FREE, 0, 0, -1, 0, self._pending_free.pop(), -1, -1])
        while self._pending_free_snaps:
            self._send_header([FREE, 0, 0, -1, 0, -1, self._pending_free_snaps.pop(), -1])

    def _restore(self, cache_id, snap):
        if isinstance(snap, _Detached):
            self._flush_frees()
            self._send_header([RESTORE, 0, 0, -1, 0, cache_id, snap.id, -1])
            return
        if self._unsent.get(cache_id) is snap and not snap.sent:
            return  # never forwarded: the other ranks' state still equals it
        self._flush_frees()
        self._send_header([RESTORE, 0, 0, -1, 0, cache_id, snap.id, -1])

    def __call__(
        self,
        inputs: mx.array,
        cache: PipelineCache | None = None,
        capture=None,
        position: int | None = None,
        all_logits: bool = False,
        return_hidden: bool = False,
    ):
        if capture is not None:
            raise PipelineError("capture", "route capture across pipeline ranks is not supported")
        if return_hidden and not self.stage.heads:
            raise PipelineError(
                "return_hidden",
                "this pipeline was not loaded to draft with the MTP head "
                "(load_pipeline(..., mtp=True); the CLI does so for --draft-model mtp)",
            )
        if inputs.ndim != 2:
            raise ValueError(f"inputs must be [batch, length], got shape {inputs.shape}")
        if cache is None:
            cache = self.make_cache()
        batch, length = inputs.shape
        cache.check_append(length, self.args.max_position_embeddings, position)
        self._flush_frees()
        snap = self._unsent.pop(cache.cache_id, None)
        snap_id = -1
        if snap is not None:
            snap.sent, snap_id = True, snap.id
        oldest = min(self._live) if self._live else -1
        tic = time.perf_counter()
        flags = (ALL_LOGITS if all_logits else 0) | (HIDDEN if return_hidden else 0)
        self._send_header(
            [FORWARD, batch, length, -1 if position is None else position, flags, cache.cache_id, snap_id, oldest]
        )
        ids = inputs.astype(mx.int32)
        h = self.local.model.embed_tokens(ids)
        streams = mx.concatenate([h] * self.args.hc_count, axis=-1)
        payload = _payload(_run_layers(self.local, self.stage, streams, ids, cache), ids)
        mx.eval(payload)  # this rank's compute, kept out of the communication time
        tic_comm = time.perf_counter()
        self._watchdog.eval("rank 1 to take the hidden state", mx.distributed.send(payload, 1, group=self.group))
        cache.advance(length)
        out_len = length if all_logits else 1
        logits = mx.distributed.recv(
            (batch, out_len, self.args.vocab_size), mx.float32, self.stage.size - 1, group=self.group
        )
        self._watchdog.eval(f"rank {self.stage.size - 1} to return the logits", logits)
        hidden = None
        if return_hidden:
            hidden = mx.distributed.recv(
                (batch, length, payload.shape[-1] - 1), mx.float32, self.stage.size - 1, group=self.group
            )
            self._watchdog.eval(f"rank {self.stage.size - 1} to return the final state", hidden)
            self.hidden_bytes += hidden.nbytes
        self.comm_seconds += time.perf_counter() - tic_comm
        self.comm_bytes += payload.nbytes + logits.nbytes + 4 * HEADER + (0 if hidden is None else hidden.nbytes)
        self.forwards += 1
        del tic
        return logits if hidden is None else (logits, hidden)

    def stop(self):
        """Release the other ranks' serve() loops (idempotent)."""
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        try:
            self._send_header([STOP, 0, 0, -1, 0, 0, -1, -1])
        except PipelineError:
            pass


def serve(model, stage: Stage, group, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """The loop of every rank but 0: run this rank's layers for each forward rank 0 starts,
    until STOP. Returns counters (forwards, communication seconds and bytes)."""
    if stage.first:
        raise PipelineError("serve() runs on ranks > 0")
    prev, nxt = stage.rank - 1, (stage.rank + 1) % stage.size
    watchdog = _Watchdog(stage.rank, timeout)
    caches, snaps, detached = {}, {}, {}
    stats = {"forwards": 0, "comm_seconds": 0.0, "comm_bytes": 0}
    while True:
        header = mx.distributed.recv((HEADER,), mx.int32, prev, group=group)
        try:
            mx.eval(header)  # idle between requests: no deadline here; a dead rank 0 closes the link
        except RuntimeError as e:
            raise PipelineError(f"rank {stage.rank} lost its link to rank {prev}: {e}") from None
        cmd, batch, length, position, flags, cache_id, snap_id, oldest = header.tolist()
        if not stage.last:
            watchdog.eval(f"rank {nxt} to take a header", mx.distributed.send(header, nxt, group=group))
        if cmd == STOP:
            return stats
        if cmd == FREE:
            if cache_id < 0:
                detached.pop(snap_id, None)
                continue
            caches.pop(cache_id, None)
            for k in [k for k, (cid, _) in snaps.items() if cid == cache_id]:
                del snaps[k]
            continue
        if cmd == DETACH:
            cache = caches.get(cache_id)
            detached[snap_id] = (cache if cache is not None else _local_cache(model, stage)).detach()
            continue
        if cmd == RESTORE and snap_id in detached:
            cache = caches.get(cache_id)
            if cache is None:
                cache = caches[cache_id] = _local_cache(model, stage)
            cache.restore(detached[snap_id])
            continue
        if cmd == RESTORE:
            if snap_id not in snaps:
                raise PipelineError(f"rank {stage.rank} has no snapshot {snap_id} to restore")
            cid, snap = snaps[snap_id]
            caches[cid].restore(snap)
            continue
        if cmd != FORWARD:
            raise PipelineError(f"rank {stage.rank} got unknown command {cmd}")
        cache = caches.get(cache_id)
        if cache is None:
            cache = caches[cache_id] = _local_cache(model, stage)
        for k in [k for k in snaps if k < oldest]:
            del snaps[k]
        if snap_id >= 0:
            snaps[snap_id] = (cache_id, cache.snapshot())
        width = model.args.hc_count * model.args.hidden_size
        tic = time.perf_counter()
        payload = mx.distributed.recv((batch, length, width + 1), mx.float32, prev, group=group)
        watchdog.eval(f"rank {prev} to send the hidden state", payload)
        stats["comm_seconds"] += time.perf_counter() - tic
        ids = payload[..., -1].astype(mx.int32)
        streams = payload[..., :-1].astype(model.model.layers[stage.start].attn_hyper_connection.hc_norm.weight.dtype)
        cache.check_append(length, model.args.max_position_embeddings, None if position < 0 else position)
        streams = _run_layers(model, stage, streams, ids, cache)
        cache.advance(length)
        if stage.last:
            # The same ops over the same rows as one process (then sliced), so logits match bit for bit.
            mixed, _ = model.model.hyper_connection_mixer.mix(streams)
            out = model.mask_unassigned(model.lm_head(mixed)).astype(mx.float32)
            out = out if flags & ALL_LOGITS else out[:, -1:]
        else:
            out = _payload(streams, ids)
        mx.eval(out)
        tic = time.perf_counter()
        watchdog.eval(f"rank {nxt} to take the output", mx.distributed.send(out, nxt, group=group))
        if stage.last and flags & HIDDEN:
            final = streams.astype(mx.float32)
            watchdog.eval(f"rank {nxt} to take the final state", mx.distributed.send(final, nxt, group=group))
            stats["comm_bytes"] += final.nbytes
        stats["comm_seconds"] += time.perf_counter() - tic
        stats["comm_bytes"] += payload.nbytes + out.nbytes + 8 * HEADER
        stats["forwards"] += 1


def terminate_as_error():
    """`mlx.launch` ends the other ranks with SIGTERM when one exits: on rank 0 that becomes a
    typed error (one line at the CLI) instead of a silent kill."""

    def handler(signum, frame):
        raise PipelineError("a peer rank exited and the launcher ended this one")

    signal.signal(signal.SIGTERM, handler)
