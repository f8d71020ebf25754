"""`--prompt-cache-dir DIR`: prefix snapshots that survive restarts (issue 24 §4).

Each entry is one sequence's state after an exact token prefix, as two files named by a key
derived from the artifact digest, the runtime dtype and the tokens:

- `KEY.safetensors`: the state in mlx-lm's prompt-cache layout (`prompt_cache.save_prompt_cache`'s
  payload: format version, artifact digest, dtype, offset and the tokens in its metadata);
- `KEY.json`: the index record (format, artifact digest, dtype, tokens, bytes, SHA-256 of the
  data file), written second: it is the entry's commit point.

Both are published with `artifact.atomic.publish_file` (temp + fsync + rename) by a writer thread:
the generating thread only serializes the state (a memory copy), so a snapshot never delays a
token by its disk write; `flush()` waits for the writes (the server and chat call it on exit). The
directory is
bounded in bytes: least recently used entries of this artifact are removed (a hit touches the data
file's mtime, so the order survives restarts). An entry whose index is unreadable or of another
format version (stale), whose data fails its checksum (corrupted), or whose data belongs to another
artifact, dtype or layer layout (foreign) is refused with one log line, removed, and its prefix
recomputed; entries of other artifacts sharing the directory are left alone. Only files named
`<40 hex>.json|.safetensors` are ever touched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .artifact.atomic import publish_file
from .artifact.errors import PublishError
from .errors import UsageError
from .prompt_cache import (
    PromptCacheFileError,
    _artifact_digest,
    _runtime_dtype,
    load_prompt_cache,
    serialize_prompt_cache,
)

log = logging.getLogger("hebrus_mlx.prompt_cache")

INDEX_FORMAT = "hebrus-mlx/prompt-cache-dir/1"
DEFAULT_DIR_BYTES = 8 << 30
MAX_INDEX_BYTES = 64 << 20  # an index record holds the token IDs: bounded before it is parsed
ORPHAN_SECONDS = 60.0  # a data file without its index this old is a crashed write
_NAME = re.compile(r"[0-9a-f]{40}\.(json|safetensors)")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class DiskPromptCache:
    """The on-disk tier of `PromptCache` for one loaded model."""

    def __init__(self, directory, max_bytes: int, model):
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.model = model
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError("--prompt-cache-dir", f"{directory}: {e.strerror or e}") from None
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise UsageError("--prompt-cache-dir", f"{directory}: not a writable directory")
        self.digest = _artifact_digest(model)
        self.dtype = _runtime_dtype(model)
        self.entries: dict[tuple[int, ...], dict] = {}  # tokens -> {"key", "bytes", "used", "sha256"}
        self.nbytes = 0
        self.hits = self.saves = self.refused = 0
        self._lock = threading.RLock()  # entries, nbytes: the generating thread and the writer
        self._pending = set()  # tokens queued for the writer
        self._writes: queue.Queue = queue.Queue(maxsize=4)  # a full queue holds the generating thread back
        self._scan()
        threading.Thread(target=self._writer, name="hebrus-prompt-cache-writer", daemon=True).start()

    # -- keys and files ------------------------------------------------------------------------
    def key(self, tokens: Sequence[int]) -> str:
        h = hashlib.sha256(f"{self.digest}\0{self.dtype}\0".encode())
        h.update(json.dumps(list(tokens)).encode())
        return h.hexdigest()[:40]

    def _paths(self, key: str):
        return self.dir / f"{key}.safetensors", self.dir / f"{key}.json"

    def _remove(self, key: str):
        for p in self._paths(key):  # data first: an index never outlives its data
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("prompt cache %s: cannot remove (%s)", p, e.strerror or e)

    def _refuse(self, key: str, why: str, tokens=None):
        log.warning("prompt cache %s: refused (%s); removed, the prefix is recomputed", self._paths(key)[0], why)
        with self._lock:
            self.refused += 1
            if tokens is not None and tokens in self.entries:
                self.nbytes -= self.entries.pop(tokens)["bytes"]
            self._remove(key)

    # -- startup -------------------------------------------------------------------------------
    def _scan(self):
        names = {p.name for p in self.dir.iterdir() if _NAME.fullmatch(p.name)}
        for name in sorted(names):
            key, kind = name.split(".")
            if kind == "safetensors":
                if f"{key}.json" not in names:
                    data = self.dir / name
                    try:
                        if time.time() - data.stat().st_mtime > ORPHAN_SECONDS:
                            self._refuse(key, "no index record: an interrupted write")
                    except FileNotFoundError:
                        pass
                continue
            self._index(key)
        with self._lock:
            self._evict()

    def _index(self, key: str):
        data, index = self._paths(key)
        try:
            if index.stat().st_size > MAX_INDEX_BYTES:
                raise ValueError(f"index record over {MAX_INDEX_BYTES} bytes")
            rec = json.loads(index.read_bytes())
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except (OSError, ValueError) as e:
            return self._refuse(key, f"corrupted index record: {e}")
        if rec.get("artifact_digest") != self.digest or rec.get("dtype") != self.dtype:
            return  # another artifact's (or dtype's) entry in a shared directory: not ours to judge
        if rec.get("format") != INDEX_FORMAT:
            return self._refuse(key, f"stale format {rec.get('format')!r}, this build writes {INDEX_FORMAT!r}")
        tokens = rec.get("tokens")
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
            or self.key(tokens) != key
            or not isinstance(rec.get("sha256"), str)
        ):
            return self._refuse(key, "corrupted index record: tokens or checksum do not match its name")
        try:
            st = data.stat()
        except FileNotFoundError:
            return self._refuse(key, "data file missing")
        entry = {"key": key, "bytes": st.st_size, "used": st.st_mtime, "sha256": rec["sha256"]}
        self.entries[tuple(tokens)] = entry
        self.nbytes += st.st_size

    # -- lookups -------------------------------------------------------------------------------
    def longest(self, ids: Sequence[int], longer_than: int = 0) -> tuple[int, ...] | None:
        """The longest stored prefix of `ids` shorter than `ids` and longer than `longer_than`."""
        ids = tuple(ids)
        best = None
        with self._lock:
            stored = list(self.entries)
        for tokens in stored:
            n = len(tokens)
            if longer_than < n < len(ids) and (best is None or n > len(best)) and ids[:n] == tokens:
                best = tokens
        return best

    def load(self, tokens: tuple[int, ...]):
        """The stored `SequenceCache` after `tokens`, or None (refused: logged and removed)."""
        with self._lock:
            e = self.entries.get(tokens)
        if e is None:  # evicted meanwhile
            return None
        data, _ = self._paths(e["key"])
        try:
            if _sha256(data) != e["sha256"]:
                return self._refuse(e["key"], "corrupted: checksum mismatch", tokens)
            cache, meta = load_prompt_cache(data, self.model, return_metadata=True)
        except FileNotFoundError:
            return self._refuse(e["key"], "data file missing", tokens)
        except PromptCacheFileError as err:  # another artifact, dtype, layer layout or format
            return self._refuse(e["key"], f"foreign or stale: {err}", tokens)
        if meta.get("tokens") != list(tokens) or cache.offset != len(tokens):
            return self._refuse(e["key"], "corrupted: its tokens differ from its index record", tokens)
        now = time.time()
        with self._lock:
            e["used"] = now
        try:
            os.utime(data, (now, now))  # the LRU order survives restarts
        except OSError:
            pass
        self.hits += 1
        return cache

    # -- writes --------------------------------------------------------------------------------
    def save(self, tokens: Sequence[int], cache) -> bool:
        """Queue `cache` (holding exactly `tokens`) for publication; False when it cannot fit the
        bound. The state is serialized here (the caller's thread owns its arrays)."""
        tokens = tuple(int(t) for t in tokens)
        with self._lock:
            if tokens in self.entries:
                self.entries[tokens]["used"] = time.time()
                return True
            if tokens in self._pending:
                return True
            self._pending.add(tokens)
        payload = serialize_prompt_cache(cache, self.model, tokens)
        if len(payload) > self.max_bytes:
            with self._lock:
                self._pending.discard(tokens)
            return False
        self._writes.put((tokens, payload))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued snapshot is published (False: `timeout` seconds passed first)."""
        done = threading.Event()
        self._writes.put(done)
        return done.wait(timeout)

    def _writer(self):
        while True:
            item = self._writes.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            tokens, payload = item
            try:
                self._publish(tokens, payload)
            except Exception as e:  # never kills the writer: the prefix is recomputed next time
                log.warning("prompt cache: snapshot of %d tokens not saved (%s: %s)", len(tokens), type(e).__name__, e)
            finally:
                with self._lock:
                    self._pending.discard(tokens)

    def _publish(self, tokens: tuple[int, ...], payload: bytes):
        key = self.key(tokens)
        data, index = self._paths(key)
        rec = {
            "format": INDEX_FORMAT,
            "artifact_digest": self.digest,
            "dtype": self.dtype,
            "tokens": list(tokens),
            "bytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        try:
            publish_file(str(data), lambda w: w.write(payload))
            publish_file(str(index), lambda w: w.write(json.dumps(rec).encode()))
        except (OSError, PublishError) as e:
            log.warning("prompt cache %s: not saved (%s)", data, e)
            self._remove(key)
            return
        with self._lock:
            self.entries[tokens] = {"key": key, "bytes": len(payload), "used": time.time(), "sha256": rec["sha256"]}
            self.nbytes += len(payload)
            self.saves += 1
            self._evict()

    def _evict(self):  # under the lock
        while self.nbytes > self.max_bytes and self.entries:
            tokens = min(self.entries, key=lambda t: self.entries[t]["used"])
            e = self.entries.pop(tokens)
            self.nbytes -= e["bytes"]
            self._remove(e["key"])
