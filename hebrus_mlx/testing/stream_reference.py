"""Pure-Python reference of the streaming engine: the oracle in tests.

Same request/ticket surface as :class:`~hebrus_mlx.stream.engine.StreamEngine`
but no cache, no threads and no scheduling: each ticket is read on ``wait``
with ``os.preadv`` into a fresh numpy buffer, verified as one snapshot, and
turned into an ``mx.array``. It fails with the same typed errors.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..stream.errors import (
    DigestMismatchError,
    ShortReadError,
    StaleGenerationError,
    StreamIOError,
    StreamRequestError,
    TicketCancelledError,
)


@dataclass
class _Ticket:
    store: int
    offset: int
    length: int
    owner: int
    generation: int
    digest: bytes | None
    stale: bool = False


class ReferenceEngine:
    def __init__(self):
        self._fds: list = []
        self._tables: list = []
        self._tickets: dict = {}
        self._next = 1
        self._generations: dict = {}

    def add_store(self, path: str, digest_id: str = "") -> int:
        self._fds.append(os.open(str(path), os.O_RDONLY))
        return len(self._fds) - 1

    def register_table(self, store, offsets, lengths, digests=None) -> int:
        rows = list(zip(offsets, lengths, digests or [None] * len(offsets)))
        self._tables.append((store, rows))
        return len(self._tables) - 1

    def request(
        self,
        store: int,
        offset: int,
        length: int,
        *,
        owner: int = 0,
        generation: int = 0,
        digest: bytes | None = None,
        **_scheduling,
    ) -> int:
        if not 0 <= store < len(self._fds):
            raise StreamRequestError(f"store: unknown store id {store}")
        if length <= 0:
            raise StreamRequestError(f"length: must be positive, got {length}")
        if generation < self._generations.get(owner, generation):
            raise StaleGenerationError(f"generation {generation} of owner {owner} is stale")
        t = self._next
        self._next += 1
        self._tickets[t] = _Ticket(store, offset, length, owner, generation, digest)
        return t

    def _read_np(self, ticket: int) -> np.ndarray:
        t = self._tickets.get(ticket)
        if t is None:
            raise TicketCancelledError(f"ticket {ticket} was released or cancelled")
        if t.stale:
            raise StaleGenerationError(f"ticket {ticket} is stale")
        buf = np.empty(t.length, dtype=np.uint8)
        where = f"store {t.store} offset {t.offset} length {t.length}"
        got = 0
        try:
            while got < t.length:
                n = os.preadv(self._fds[t.store], [buf[got:]], t.offset + got)
                if n == 0:
                    break
                got += n
        except OSError as e:
            raise StreamIOError(f"I/O error reading {where}: {e}") from e
        if got < t.length:
            raise ShortReadError(f"short read of {where}: got {got} bytes")
        if t.digest is not None and hashlib.sha256(buf).digest() != t.digest:
            raise DigestMismatchError(f"SHA-256 mismatch for {where}")
        return buf

    def wait(self, ticket: int, timeout=None) -> int:
        return int(self._read_np(ticket).size)

    def read(self, ticket: int, timeout=None) -> bytes:
        return self._read_np(ticket).tobytes()

    def release(self, ticket: int) -> bool:
        return self._tickets.pop(ticket, None) is not None

    cancel = release

    def advance_generation(self, owner: int, generation: int) -> int:
        cur = max(self._generations.get(owner, generation), generation)
        self._generations[owner] = cur
        n = 0
        for t in self._tickets.values():
            if t.owner == owner and t.generation < cur and not t.stale:
                t.stale = True
                n += 1
        return n

    def load(self, tickets: Sequence[int]) -> mx.array:
        try:
            rows = [self._read_np(t) for t in tickets]
        finally:
            for t in tickets:
                self.release(t)
        return mx.array(np.stack(rows))

    def gather(self, table: int, indices, owner: int = 0, generation: int = 0):
        store, rows = self._tables[table]
        idx = np.array(indices).astype(np.int64)
        out = []
        for i in idx.reshape(-1):
            offset, length, digest = rows[int(i)]
            t = self.request(
                store,
                offset,
                length,
                owner=owner,
                generation=generation,
                digest=digest,
            )
            out.append(self.load([t]))
        flat = mx.concatenate(out, axis=0)
        return flat.reshape(*idx.shape, flat.shape[-1])

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
