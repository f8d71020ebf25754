"""Atomic publication of files and directories (AFN-003, AFN-010).

Both publishers walk the same explicit state machine:

    TEMP -> WRITTEN -> SYNCED -> VERIFIED -> DIR_SYNCED -> RENAMED -> COMMITTED

A failure before RENAMED removes the sibling temp and leaves the old target
untouched. RENAMED is the commit point: a failing directory fsync after it is
reported (PublishError with committed=True) but never "rolled back", because
the new, complete target is already visible.

`Faults` injects the failures tests need: fsync failure, short write, ENOSPC
and rename failure.
"""

import ctypes
import ctypes.util
import enum
import errno
import os
import shutil
import sys
import uuid

from .errors import ArtifactError, PublishError


class State(enum.Enum):
    INIT = "init"
    TEMP = "temp"
    WRITTEN = "written"
    SYNCED = "synced"
    VERIFIED = "verified"
    DIR_SYNCED = "dir_synced"
    RENAMED = "renamed"
    COMMITTED = "committed"
    ABORTED = "aborted"


class Faults:
    """Deterministic failure hooks. Each flag fires once at its step."""

    def __init__(self, fsync=False, short_write=False, enospc=False, rename=False, dir_fsync_after=False):
        self.fsync = fsync
        self.short_write = short_write
        self.enospc = enospc
        self.rename = rename
        self.dir_fsync_after = dir_fsync_after


NO_FAULTS = Faults()


class AtomicWriter:
    """Unbuffered writer over a raw fd that never accepts a short write."""

    def __init__(self, fd, faults):
        self.fd = fd
        self.faults = faults
        self.written = 0

    def write(self, data):
        view = memoryview(data).cast("B")
        while view:
            if self.faults.enospc:
                self.faults.enospc = False
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if self.faults.short_write:
                # The kernel accepted half, then nothing: a persistent short write.
                self.faults.short_write = False
                n = os.write(self.fd, view[: len(view) // 2])
                self.written += n
                view = view[n:]
                n = 0
            else:
                n = os.write(self.fd, view)
            if n <= 0:
                raise OSError(errno.EIO, f"short write: {len(view)} bytes not written")
            self.written += n
            view = view[n:]

    def pwrite(self, data, offset):
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self.fd, view, offset)
            if n <= 0:
                raise OSError(errno.EIO, "short pwrite")
            view, offset = view[n:], offset + n


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sibling(target, kind):
    d, name = os.path.split(os.path.abspath(target))
    return os.path.join(d, f".{name}.{kind}-{uuid.uuid4().hex[:12]}")


class _Machine:
    def __init__(self, target, faults):
        self.target = os.path.abspath(target)
        self.parent = os.path.dirname(self.target)
        self.faults = faults or Faults()
        self.state = State.INIT
        self.trace = [State.INIT]

    def to(self, state):
        self.state = state
        self.trace.append(state)

    def fsync(self, fd):
        if self.faults.fsync:
            self.faults.fsync = False
            raise OSError(errno.EIO, "injected fsync failure")
        os.fsync(fd)

    def rename(self, src, dst):
        if self.faults.rename:
            self.faults.rename = False
            raise OSError(errno.EXDEV, "injected rename failure")
        os.replace(src, dst)

    def dir_sync_after(self):
        if self.faults.dir_fsync_after:
            self.faults.dir_fsync_after = False
            raise OSError(errno.EIO, "injected directory fsync failure")
        fsync_dir(self.parent)



def _abort(m, tmp, e):
    """Remove the temp, record the abort, and surface OS errors as PublishError naming the state."""
    _remove(tmp)
    m.to(State.ABORTED)
    if isinstance(e, OSError) and not isinstance(e, ArtifactError):
        raise PublishError(os.path.basename(m.target), f"{m.trace[-2].value}: {e}") from e

def _verify_synced(m, tmp, verify):
    """SYNCED -> VERIFIED (the real reader accepts the temp) -> DIR_SYNCED (the parent holds it)."""
    m.to(State.SYNCED)
    if verify is not None:
        verify(tmp)
    m.to(State.VERIFIED)
    fsync_dir(m.parent)
    m.to(State.DIR_SYNCED)


def publish_file(target, write, verify=None, faults=None):
    """Write `target` atomically.

    write(w): writes the content through `w` (AtomicWriter: write/pwrite).
    verify(path): reopens the synced temp through the real reader; raises on
    any disagreement. Returns the state trace.
    """
    m = _Machine(target, faults)
    tmp = _sibling(m.target, "tmp")
    fd = None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        m.to(State.TEMP)
        write(AtomicWriter(fd, m.faults))
        m.to(State.WRITTEN)
        m.fsync(fd)
        os.close(fd)
        fd = None
        _verify_synced(m, tmp, verify)
        m.rename(tmp, m.target)
        m.to(State.RENAMED)
    except BaseException as e:
        if fd is not None:
            os.close(fd)
        _abort(m, tmp, e)
        raise
    _commit(m)
    return m.trace


def publish_dir(target, build, verify=None, faults=None):
    """Build a whole directory in a sibling temp and swap it into place.

    build(tmpdir): creates the files (each normally via publish_file).
    verify(tmpdir): admits the finished directory through the real reader.
    An existing target is exchanged atomically (renameat2 RENAME_EXCHANGE on
    Linux, renamex_np RENAME_SWAP on macOS) and the old tree removed after the
    commit point.
    """
    m = _Machine(target, faults)
    tmp = _sibling(m.target, "tmpdir")
    old = None
    try:
        os.mkdir(tmp, 0o755)
        m.to(State.TEMP)
        build(tmp)
        m.to(State.WRITTEN)
        dfd = os.open(tmp, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            m.fsync(dfd)
        finally:
            os.close(dfd)
        _verify_synced(m, tmp, verify)
        if os.path.lexists(m.target):
            if m.faults.rename:
                m.faults.rename = False
                raise OSError(errno.EXDEV, "injected rename failure")
            _exchange(tmp, m.target)
            old = tmp  # tmp now names the previous tree
        else:
            m.rename(tmp, m.target)
        m.to(State.RENAMED)
    except BaseException as e:
        _abort(m, tmp, e)
        raise
    try:
        _commit(m)
    finally:
        if old is not None:
            _remove(old)
    return m.trace


def _commit(m):
    try:
        m.dir_sync_after()
    except OSError as e:
        raise PublishError(os.path.basename(m.target), f"renamed but directory fsync failed: {e}", committed=True) from e
    m.to(State.COMMITTED)


def _remove(path):
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


_libc = None


def _exchange(a, b):
    """Atomically swap two paths on the same filesystem."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    if sys.platform.startswith("linux"):
        at_fdcwd, rename_exchange = -100, 2
        fn = _libc.renameat2
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    elif sys.platform == "darwin":
        rename_swap = 2
        fn = _libc.renamex_np
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
        rc = fn(os.fsencode(a), os.fsencode(b), rename_swap)
    else:
        raise OSError(errno.ENOSYS, "atomic directory exchange unsupported on this platform")
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
