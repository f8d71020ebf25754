"""The server's request preparation (chat-template rendering, tokenization) in a child process.

Rendering and tokenizing a megabyte request is seconds of Python. On a thread it shares the GIL
with the event loop, which then waits for every hand-off (gaps of ~100 ms on a loaded machine:
/health and other clients' streams stall). In a child process it takes none of the server's
GIL. The child is spawned, never forked (the server already runs MLX threads), and is given the
server's tokenizer as loaded (tokenizer.json, template, template limits, stop set, special
tokens): the same bytes, so the same IDs, without reading any file again. It exits with the
server: killed at shutdown, and it ends itself if its parent dies (no orphan).
"""

from __future__ import annotations

import array
import logging
import os
import pickle
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

log = logging.getLogger("hebrus_mlx.server")

_TOK = None  # the child's TextTokenizer


def tokenizer_spec(tok) -> dict:
    """What rebuilds `tok` (a TextTokenizer) in another process, byte for byte."""
    renderer = getattr(tok, "_renderer", None)
    return {
        "tokenizer_json": tok.backend.to_str(),
        "physical_vocab_size": tok.physical_vocab_size,
        "stop_token_ids": sorted(tok.stop_token_ids),
        "chat_template": tok.chat_template,
        "special_tokens_map": dict(tok.special_tokens_map),
        "limits": None if renderer is None else renderer.limits,
    }


def _start(spec: dict, parent: int):
    """The child's initializer: the tokenizer, and a watch on the parent."""
    import signal

    from tokenizers import Tokenizer

    from ..text.chat_template import ChatRenderer
    from ..text.tokenizer import TextTokenizer

    global _TOK
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is the server's to handle
    tok = TextTokenizer(
        Tokenizer.from_str(spec["tokenizer_json"]),
        spec["physical_vocab_size"],
        spec["stop_token_ids"],
        spec["chat_template"],
        spec["special_tokens_map"],
    )
    if spec["limits"] is not None and tok.chat_template is not None:
        tok._renderer = ChatRenderer(tok.chat_template, tok.special_tokens_map, spec["limits"])
    _TOK = tok
    threading.Thread(target=_watch, args=(parent,), name="hebrus-prep-watch", daemon=True).start()


def _watch(parent: int):
    # A server killed with SIGKILL cannot stop us: leave once we are reparented.
    while os.getppid() == parent:
        time.sleep(0.25)
    os._exit(0)


def _ready() -> int:
    return os.getpid()


def _call(method: str, args: tuple, kwargs: dict):
    """`_TOK.method(*args, **kwargs)`; token IDs come back as one array (a buffer, not millions of
    int objects for the server to unpickle while holding its GIL)."""
    try:
        out = getattr(_TOK, method)(*args, **kwargs)
    except Exception as e:
        raise _portable(e) from None
    return array.array("q", out) if isinstance(out, list) else out


def _portable(e: Exception) -> Exception:
    # The error travels back pickled; one that cannot would break the pool, so it goes as text.
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


class PrepProcess:
    """One spawned child preparing requests, FIFO (one child: a render is GIL-bound on threads
    too, and one tokenizer copy bounds the memory). `submit` returns a concurrent future."""

    def __init__(self, tok):
        import multiprocessing

        self._spec = tokenizer_spec(tok)
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._stopped = False
        self._killed: list = []
        self._pool = self._new()

    def _new(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(1, mp_context=self._ctx, initializer=_start, initargs=(self._spec, os.getpid()))
        pool.submit(_ready)  # start the child now, not on the first big request
        return pool

    def submit(self, method: str, *args, **kwargs):
        with self._lock:
            if self._stopped:
                raise RuntimeError("request preparation is stopped")
            try:
                return self._pool.submit(_call, method, args, kwargs)
            except BrokenProcessPool:  # the child died (e.g. killed for memory): a fresh one
                log.warning("request preparation process died; starting a new one")
                self._pool = self._new()
                return self._pool.submit(_call, method, args, kwargs)

    def processes(self) -> list:
        return list((self._pool._processes or {}).values())  # no public accessor before 3.14

    def stop(self):
        """Cancel what is queued and kill the child (a render in progress is abandoned)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._killed = self.processes()
            self._pool.shutdown(wait=False, cancel_futures=True)
        for p in self._killed:
            p.kill()

    def join(self, timeout: float) -> bool:
        """Wait for the child to be gone; True when it is."""
        end = time.monotonic() + timeout
        procs = self._killed + self.processes()
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        return not any(p.is_alive() for p in procs)
