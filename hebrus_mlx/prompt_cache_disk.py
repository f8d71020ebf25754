"""`--prompt-cache-dir DIR`: prefix snapshots that survive restarts (issue 24 §4).

Each entry is one sequence's state after an exact token prefix, as two files named by a key
derived from the artifact digest, the runtime dtype and the tokens:

- `KEY.safetensors`: the state in mlx-lm's prompt-cache layout (`prompt_cache.save_prompt_cache`'s
  payload: format version, artifact digest, dtype, offset and the tokens in its metadata);
- `KEY.json`: the index record (format, artifact digest, dtype, tokens, bytes, SHA-256 of the
  data file), written second: it is the entry's commit point.

Both are published with `artifact.atomic.publish_file` (temp + fsync + rename) by a writer thread:
the generating thread only serializes the state (a memory copy), so a snapshot never delays a
token by its disk write; `flush()` waits for the writes (the server and chat call it on exit).

The directory is bounded in bytes for this artifact's entries, whichever process wrote them:
every process sharing it accounts from the directory itself (its index records and the data files'
sizes and mtimes) under an exclusive `flock` of `DIR/.hebrus-prompt-cache.lock`, and evicts the
least recently used entries (a hit touches the data file's mtime, so the order is shared and
survives restarts).

The cache deletes only what it can prove it wrote: an index record is the cache's when it is a
regular file holding a JSON object whose `format` is a prompt-cache-dir format, of this artifact and
dtype, and (current format) whose tokens hash to its own name; the data file beside such a record
is the cache's when it is a regular file. A data file without its record is removed only when its
own metadata proves the same (a write killed between the two files) and it is over a minute old.
Anything else with a cache-like name (a user's file, another artifact's entry, a FIFO, a symlink, a
directory, a record nested too deep) is left alone, with one log line for what is not another
artifact's. Files are opened without following links or blocking (`O_NOFOLLOW | O_NONBLOCK`),
checked to be regular and their size bounded before a byte is read (`artifact.untrusted`).

An entry of this artifact whose record is of another format version (stale), whose data fails its
size or checksum (corrupted), or whose data belongs to another artifact, dtype or layer layout
(foreign) is refused with one log line, removed, and its prefix recomputed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import queue
import re
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .artifact import untrusted
from .artifact.atomic import publish_file
from .artifact.errors import AdmissionError, PublishError
from .artifact.safetensors import read_safetensors_header
from .errors import UsageError
from .prompt_cache import (
    FORMAT,
    PromptCacheFileError,
    model_artifact_digest,
    read_prompt_cache,
    runtime_dtype,
    serialize_prompt_cache,
)

log = logging.getLogger("hebrus_mlx.prompt_cache")

INDEX_FORMAT = "hebrus-mlx/prompt-cache-dir/1"
_OURS = "hebrus-mlx/prompt-cache-dir/"  # the marker of every version's records
DEFAULT_DIR_BYTES = 8 << 30
ORPHAN_SECONDS = 60.0  # a data file without its index this old is a crashed write
LOCK_NAME = ".hebrus-prompt-cache.lock"
_NAME = re.compile(r"[0-9a-f]{40}\.(json|safetensors)")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_O_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def open_dir(directory, field: str = "--prompt-cache-dir") -> int:
    """Create `directory` if needed and open its lock file (a regular file, never through a link);
    the fd `DiskPromptCache` locks. UsageError naming `field` when the directory is unusable: the
    server calls it before the model loads."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(field, f"{directory}: {e.strerror or e}") from None
    if not d.is_dir() or not os.access(d, os.W_OK | os.X_OK):
        raise UsageError(field, f"{directory}: not a writable directory")
    try:
        fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT | _O_SAFE, 0o644)
    except OSError as e:
        raise UsageError(field, f"{d / LOCK_NAME}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(field, f"{d / LOCK_NAME}: not a regular file")
    return fd


def _sig(st) -> tuple:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _lstat(path: Path):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


class DiskPromptCache:
    """The on-disk tier of `PromptCache` for one loaded model."""

    def __init__(self, directory, max_bytes: int, model):
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.model = model
        self._lock_fd = open_dir(directory)
        self.digest = model_artifact_digest(model)
        self.dtype = runtime_dtype(model)
        self.entries: dict[tuple[int, ...], dict] = {}  # tokens -> {"key", "bytes", "used", "sha256", "index"}
        self.nbytes = 0
        self.hits = self.saves = self.refused = 0
        self._lock = threading.RLock()  # entries, nbytes: the generating thread and the writer
        self._depth = 0  # nesting of _dir_locked on the thread holding self._lock
        self._judged: dict[str, tuple] = {}  # name -> (ino, size, mtime) of what is not an entry of ours
        self._dir_mtime = None  # the directory's mtime at the last sync: unchanged, nothing to read
        self._pending = set()  # tokens queued for the writer
        self._writes: queue.Queue = queue.Queue(maxsize=4)  # a full queue holds the generating thread back
        with self._dir_locked():
            self._sync()
        threading.Thread(target=self._writer, name="hebrus-prompt-cache-writer", daemon=True).start()

    # -- keys and files ------------------------------------------------------------------------
    def key(self, tokens: Sequence[int]) -> str:
        h = hashlib.sha256(f"{self.digest}\0{self.dtype}\0".encode())
        h.update(json.dumps(list(tokens)).encode())
        return h.hexdigest()[:40]

    def _paths(self, key: str):
        return self.dir / f"{key}.safetensors", self.dir / f"{key}.json"

    @contextlib.contextmanager
    def _dir_locked(self):
        """This process's lock, then the directory's (every process sharing it); re-entrant on the
        thread holding it (the flock is taken once: an inner release must not drop it)."""
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _remove(self, key: str):
        """Remove an entry whose index record is ours: the data file only if it is a regular file
        (a link or FIFO there is not ours), data first (an index never outlives its data)."""
        data, index = self._paths(key)
        for p in (data, index):
            st = _lstat(p)
            if st is None or not stat.S_ISREG(st.st_mode):
                continue
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("prompt cache %s: cannot remove (%s)", p, e.strerror or e)

    def _drop(self, tokens):  # under self._lock
        if tokens is not None and tokens in self.entries:
            self.nbytes -= self.entries.pop(tokens)["bytes"]

    def _refuse(self, key: str, why: str, tokens=None):
        log.warning("prompt cache %s: refused (%s); removed, the prefix is recomputed", self._paths(key)[0], why)
        with self._dir_locked():
            self.refused += 1
            self._drop(tokens)
            self._remove(key)

    def _leave(self, path: Path, st, why: str):
        """`path` has a cache-like name but is not provably ours: never touched, logged once."""
        sig = _sig(st) if st is not None else None
        if self._judged.get(path.name) != sig:
            self._judged[path.name] = sig
            if why:
                log.warning("prompt cache %s: %s; not an entry this cache wrote, left alone", path, why)

    # -- the directory, under its lock -----------------------------------------------------------
    def _sync(self):
        """Account from the directory: add the records other processes published, drop the entries
        they evicted, take sizes and last use from the data files, remove proven crashed writes,
        then evict to the bound."""
        try:
            st_dir = os.stat(self.dir)
            names = {e.name for e in os.scandir(self.dir) if _NAME.fullmatch(e.name)}
        except OSError as e:
            log.warning("prompt cache %s: cannot list (%s)", self.dir, e.strerror or e)
            return
        self._dir_mtime = st_dir.st_mtime_ns
        known = {e["key"]: tokens for tokens, e in self.entries.items()}
        for key, tokens in known.items():
            st = _lstat(self._paths(key)[1])
            if st is None or _sig(st) != self.entries[tokens]["index"]:  # evicted, or published anew
                self._drop(tokens)
        known = {e["key"] for e in self.entries.values()}
        for name in sorted(names):
            key, kind = name.split(".")
            if key in known and kind == "json":
                continue
            if kind == "json":
                self._index(key)
            elif f"{key}.json" not in names:
                self._orphan(key)
        for e in self.entries.values():
            st = _lstat(self._paths(e["key"])[0])
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != e["bytes"]:
                continue  # judged when it is loaded
            e["used"] = st.st_mtime
        self._evict()

    def _index(self, key: str):
        data, index = self._paths(key)
        st = _lstat(index)
        if st is None or self._judged.get(index.name, ()) == _sig(st):
            return
        try:
            rec = untrusted.loads(untrusted.read_path(str(index), "prompt_cache_index"), index.name)
        except FileNotFoundError:
            return
        except OSError as e:  # a symlink (O_NOFOLLOW), unreadable
            return self._leave(index, st, e.strerror or str(e))
        except AdmissionError as e:  # not a regular file, over the cap, not JSON, nested too deep
            return self._leave(index, st, e.message)
        if not isinstance(rec, dict) or not str(rec.get("format", "")).startswith(_OURS):
            return self._leave(index, st, "no prompt-cache-dir format field")
        if rec.get("artifact_digest") != self.digest or rec.get("dtype") != self.dtype:
            return self._leave(index, st, "")  # another artifact's (or dtype's) entry: not ours to judge
        if rec["format"] != INDEX_FORMAT:
            return self._refuse(key, f"stale format {rec['format']!r}, this build writes {INDEX_FORMAT!r}")
        tokens, nbytes, sha = rec.get("tokens"), rec.get("bytes"), rec.get("sha256")
        if not (
            isinstance(tokens, list)
            and tokens
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
            and self.key(tokens) == key
            and isinstance(nbytes, int)
            and not isinstance(nbytes, bool)
            and nbytes >= 0
            and isinstance(sha, str)
            and _SHA256.fullmatch(sha)
        ):
            return self._leave(index, st, "its tokens, size or checksum do not match its name")
        st_data = _lstat(data)
        if st_data is None:
            return self._refuse(key, "data file missing")
        if not stat.S_ISREG(st_data.st_mode):
            return self._refuse(key, "data is not a regular file (left where it is)")
        self.entries[tuple(tokens)] = {
            "key": key,
            "bytes": nbytes,
            "used": st_data.st_mtime,
            "sha256": sha,
            "index": _sig(st),
        }
        self.nbytes += nbytes

    def _orphan(self, key: str):
        """A data file without its record: removed only when its own metadata proves it is a write
        of this cache killed before its record, over a minute ago."""
        data = self._paths(key)[0]
        st = _lstat(data)
        if st is None or self._judged.get(data.name, ()) == _sig(st):
            return
        if time.time() - st.st_mtime <= ORPHAN_SECONDS:
            return  # a live write may publish its record yet: judged later
        try:
            _, _, meta = read_safetensors_header(str(data))
            meta = meta if isinstance(meta, dict) else {}
            tokens = untrusted.loads(meta.get("0.tokens", "null"), "tokens")
        except OSError as e:
            return self._leave(data, st, e.strerror or str(e))
        except AdmissionError as e:
            return self._leave(data, st, e.message)
        if not (
            meta.get("0.format") == FORMAT
            and meta.get("0.artifact_digest") == self.digest
            and meta.get("0.dtype") == self.dtype
            and isinstance(tokens, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
            and self.key(tokens) == key
        ):
            return self._leave(data, st, "no index record, and its metadata is not this cache's")
        log.warning("prompt cache %s: no index record: an interrupted write; removed", data)
        self.refused += 1
        self._remove(key)

    def _evict(self):  # under the directory lock
        while self.nbytes > self.max_bytes and self.entries:
            tokens = min(self.entries, key=lambda t: self.entries[t]["used"])
            e = self.entries.pop(tokens)
            self.nbytes -= e["bytes"]
            self._remove(e["key"])

    def _refresh(self):
        """Sync when the directory changed (another process published or evicted)."""
        try:
            changed = os.stat(self.dir).st_mtime_ns != self._dir_mtime
        except OSError:
            return
        if changed:
            with self._dir_locked():
                self._sync()

    # -- lookups -------------------------------------------------------------------------------
    def longest(self, ids: Sequence[int], longer_than: int = 0) -> tuple[int, ...] | None:
        """The longest stored prefix of `ids` shorter than `ids` and longer than `longer_than`."""
        self._refresh()
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
        try:  # never through a link, never blocking on a FIFO
            fd = os.open(data, os.O_RDONLY | _O_SAFE)
        except FileNotFoundError:  # another process evicted it
            with self._lock:
                self._drop(tokens)
            return None
        except OSError as err:
            return self._refuse(e["key"], f"data file: {err.strerror or err} (left where it is)", tokens)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return self._refuse(e["key"], "data is not a regular file (left where it is)", tokens)
        with os.fdopen(fd, "rb", buffering=0) as f:
            if st.st_size != e["bytes"]:
                return self._refuse(e["key"], f"corrupted: {st.st_size} bytes, its record says {e['bytes']}", tokens)
            os.set_blocking(fd, True)
            payload = untrusted.read_exact(f, e["bytes"] + 1)
            if hashlib.sha256(payload).hexdigest() != e["sha256"]:
                return self._refuse(e["key"], "corrupted: checksum mismatch", tokens)
            try:
                cache, meta = read_prompt_cache(io.BytesIO(payload), self.model, True, str(data))
            except PromptCacheFileError as err:  # another artifact, dtype, layer layout or format
                return self._refuse(e["key"], f"foreign or stale: {err}", tokens)
            if meta.get("tokens") != list(tokens) or cache.offset != len(tokens):
                return self._refuse(e["key"], "corrupted: its tokens differ from its index record", tokens)
            now = time.time()
            with self._lock:
                e["used"] = now
            try:
                os.utime(fd, (now, now))  # the file checked above, not whatever the name points to now
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
        for p in (data, index):  # a rename would replace it: something not ours holds the name
            st = _lstat(p)
            if st is not None and (not stat.S_ISREG(st.st_mode) or p.name in self._judged):
                log.warning("prompt cache %s: not saved (the name is taken by something this cache did not write)", p)
                return
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
            with self._dir_locked():  # the record (the commit point) and the accounting
                publish_file(str(index), lambda w: w.write(json.dumps(rec).encode()))
                self._sync()  # takes this entry too, and every other process's
                self.saves += 1
        except (OSError, PublishError) as e:
            log.warning("prompt cache %s: not saved (%s)", data, e)
            with self._dir_locked():
                self._remove(key)
