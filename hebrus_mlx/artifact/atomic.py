"""Atomic publication of files and directories (AFN-003, AFN-010).

Both publishers walk the same explicit state machine:

    TEMP -> WRITTEN -> SYNCED -> VERIFIED -> DIR_SYNCED -> RENAMED -> COMMITTED

A failure before RENAMED removes the sibling temp and leaves the old target
untouched. RENAMED is the commit point: a failing directory fsync after it is
reported (PublishError with committed=True) but never "rolled back", because
the new, complete target is already visible.

`Faults` injects the failures tests need: fsync failure, short write, ENOSPC
and rename failure.

Temporaries are siblings named `.NAME.tmp-HEX` (files) and `.NAME.tmpdir-HEX` (directories). The
writer holds an exclusive flock on each until it is renamed, so a process killed mid-write (kill -9
included: the kernel drops the lock) leaves a temp nobody holds. Every publish of NAME first
removes such stale temporaries of NAME (`clean_stale`); a temp whose lock is held belongs to a live
writer and is never touched.

`check_replaceable` is the rule for publishing over a path the caller did not write (`convert
--out`, `traces export --out`): never a file, a symlink, the source, a parent of the source or of
the working directory; an existing non-empty directory only with overwrite and only when the
caller recognises it as its own earlier output.
"""

import ctypes
import ctypes.util
import enum
import errno
import fcntl
import logging
import os
import re
import shutil
import sys
import uuid

from ..errors import UsageError
from .errors import ArtifactError, PublishError

log = logging.getLogger("hebrus_mlx.atomic")
_TEMP_KINDS = ("tmp", "tmpdir")


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


# A temp may carry one of these suffixes when a library writing it by name insists on its own
# (MLX's save_safetensors appends ".safetensors").
_TEMP_SUFFIXES = ("", ".safetensors")


def _sibling(target, kind, suffix=""):
    d, name = os.path.split(os.path.abspath(target))
    return os.path.join(d, f".{name}.{kind}-{uuid.uuid4().hex[:12]}{suffix}")


def _try_lock(fd):
    """Exclusive, non-blocking flock; False when another open file holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def _locked_temp(target, kind, create, suffix=""):
    """(path, fd) of a fresh temp that this process holds the lock of. `create(path)` makes it and
    returns an fd. A cleaner that took the lock first (or unlinked the name) makes us retry."""
    for _ in range(8):
        tmp = _sibling(target, kind, suffix)
        fd = create(tmp)
        try:
            if _try_lock(fd) and os.path.samestat(os.fstat(fd), os.lstat(tmp)):
                return tmp, fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise PublishError(os.path.basename(target), "could not lock a fresh temporary (another process removes them)")


def _temp_pattern(target):
    name = os.path.basename(os.path.abspath(target))
    suffixes = "|".join(re.escape(x) for x in _TEMP_SUFFIXES)
    return re.compile(r"\." + re.escape(name) + r"\.(tmp|tmpdir)-[0-9a-f]{12}(" + suffixes + r")\Z")


def _open_temp(path):
    # Never follows a symlink: a link with a temp's name is not ours.
    flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK
    try:
        return os.open(path, flags)
    except OSError:
        return None


def clean_stale(target):
    """Remove the temporaries of `target` left by killed writers; returns the removed paths.
    Each is removed while this process holds its lock, so a writer that starts meanwhile cannot
    adopt it; a temp whose lock is held (a live writer) is left alone."""
    parent = os.path.dirname(os.path.abspath(target))
    pattern = _temp_pattern(target)
    try:
        names = sorted(e.name for e in os.scandir(parent) if pattern.match(e.name))
    except OSError:  # no parent yet: nothing stale; an unusable one fails the publish itself
        return []
    removed = []
    for name in names:
        path = os.path.join(parent, name)
        fd = _open_temp(path)
        if fd is None:
            continue
        try:
            if not _try_lock(fd) or not os.path.samestat(os.fstat(fd), os.lstat(path)):
                continue
            _remove(path)
            removed.append(path)
            log.info("removed stale temporary %s (left by an interrupted run)", path)
        except FileNotFoundError:
            continue
        finally:
            os.close(fd)
    return removed


def _inside(path, root):
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_replaceable(target, *, overwrite, is_ours, protect=(), what="output", field="--out"):
    """Refuse (UsageError naming `field`) to publish a directory at `target` over anything the
    caller did not write. Never: a path that is or contains one of `protect` (the source), the
    working directory or a parent of it, a symlink, a non-directory. An existing non-empty
    directory only with `overwrite` and only when `is_ours(path)` returns None (else the reason it
    is not ours). An empty directory holds nothing to lose."""
    p = os.path.abspath(target)
    real = os.path.realpath(p)
    for src in protect:
        if src is not None and _inside(os.path.realpath(src), real):
            rel = "is" if os.path.realpath(src) == real else "contains"
            raise UsageError(field, f"{target} {rel} the source {src}; refusing to replace it")
    cwd = os.path.realpath(os.getcwd())
    if _inside(cwd, real):
        raise UsageError(field, f"{target} is the working directory or one of its parents; refusing to replace it")
    if not _existing(p, target, field, os.path.isdir, "a directory"):
        return
    if not os.listdir(p):
        return
    if not overwrite:
        raise UsageError(field, f"{target} exists and is not empty; pass --overwrite to replace an earlier {what}")
    reason = is_ours(p)
    if reason is not None:
        raise UsageError(
            field, f"{target} is not a hebrus-mlx {what} ({reason}); refusing to replace it, even with --overwrite"
        )


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
    if tmp is not None:
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
    return _publish_file(target, faults, "", lambda m, tmp, fd: write(AtomicWriter(fd, m.faults)), verify)


def publish_file_by_path(target, write_path, verify=None, suffix=""):
    """`publish_file` for a writer that only takes a file name (MLX's save_safetensors, mlx-lm's
    save_prompt_cache): it writes into our locked temp by path. Writing by name keeps the temp's
    inode (the library opens it with O_TRUNC), so our lock still covers it; a writer that replaced
    the inode is refused. Stale temps of `target` are cleaned first, as by every publisher."""

    def fill(m, tmp, fd):
        write_path(tmp)
        if not os.path.samestat(os.fstat(fd), os.lstat(tmp)):
            raise PublishError(os.path.basename(target), "the writer replaced its temporary file")

    return _publish_file(target, None, suffix, fill, verify)


def _publish_file(target, faults, suffix, fill, verify):
    """The one file publisher: locked temp, `fill(machine, tmp, fd)`, fsync, verify, rename, commit."""
    m = _Machine(target, faults)
    clean_stale(m.target)
    # Locked until renamed: a later run's clean_stale leaves it alone while we live.
    _publish_temp(
        m,
        "tmp",
        lambda t: os.open(t, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644),
        lambda tmp, fd: fill(m, tmp, fd),
        verify,
        lambda tmp: m.rename(tmp, m.target),
        suffix,
    )
    _commit(m)
    return m.trace


def _publish_temp(m, kind, create, fill, verify, place, suffix=""):
    """A locked temp made by `create`, `fill(tmp, fd)`, fsynced and verified, then `place(tmp)` puts it
    at the target; returns what `place` returns. On any error the temp is closed and removed."""
    tmp, fd = None, None
    try:
        tmp, fd = _locked_temp(m.target, kind, create, suffix)
        m.to(State.TEMP)
        fill(tmp, fd)
        m.to(State.WRITTEN)
        m.fsync(fd)
        _verify_synced(m, tmp, verify)
        placed = place(tmp)
        m.to(State.RENAMED)
    except BaseException as e:
        if fd is not None:
            os.close(fd)
        _abort(m, tmp, e)
        raise
    os.close(fd)
    return placed


def _mkdir_open(path):
    os.mkdir(path, 0o755)
    return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def publish_dir(target, build, verify=None, faults=None, replace=None):
    """Build a whole directory in a sibling temp and swap it into place.

    build(tmpdir): creates the files (each normally via publish_file).
    verify(tmpdir): admits the finished directory through the real reader.
    replace(target): called right before an existing target is swapped out; raises to refuse
    (e.g. `check_replaceable`, again after a conversion of hours).
    An existing target is exchanged atomically (renameat2 RENAME_EXCHANGE on
    Linux, renamex_np RENAME_SWAP on macOS) and the old tree removed after the
    commit point.
    """
    m = _Machine(target, faults)
    clean_stale(m.target)

    def place(tmp):
        if not os.path.lexists(m.target):
            m.rename(tmp, m.target)
            return None
        if replace is not None:
            replace(m.target)
        if m.faults.rename:
            m.faults.rename = False
            raise OSError(errno.EXDEV, "injected rename failure")
        _exchange(tmp, m.target)
        return tmp  # tmp now names the previous tree

    # Locked until renamed (see the module doc); the lock is on the directory itself.
    old = _publish_temp(m, "tmpdir", _mkdir_open, lambda tmp, fd: build(tmp), verify, place)
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
        raise PublishError(
            os.path.basename(m.target), f"renamed but directory fsync failed: {e}", committed=True
        ) from e
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


# -- output files a user names (bench, qualify, simulate, traces reports) -------------------------

# How hebrus-mlx recognises a file it wrote: one of these within its first OUTPUT_HEAD bytes. Every
# output carries one (publish_output refuses to write one that does not), so a second run may
# replace the first run's file, and nothing else without --overwrite.
OUTPUT_SIGNATURES = (
    b'"schema": "hebrus-mlx',  # JSON: bench, machine profile, qualify report, simulate, traces
    b"**hebrus-mlx bench**",  # bench.md
    b"# hebrus-mlx qualify report",  # qualify --report summary
    b"Generated by `hebrus-mlx simulate --table",  # simulate --table
    b"Software\x00hebrus-mlx",  # PNG plots (a tEXt chunk before the image data)
)
OUTPUT_HEAD = 4096


def _is_own_output(head):
    return any(s in head for s in OUTPUT_SIGNATURES)


def _existing(p, target, field, is_kind, kind) -> bool:
    """Whether something is at `p`; a symlink there, or anything but `kind`, is refused (never replaced)."""
    if not os.path.lexists(p):
        return False
    if os.path.islink(p):
        raise UsageError(field, f"{target} is a symlink; refusing to replace it")
    if not is_kind(p):
        raise UsageError(field, f"{target} exists and is not {kind}; refusing to replace it")
    return True


def check_output_file(target, *, overwrite, field):
    """Refuse (UsageError naming `field`) to publish a file at `target` over one hebrus-mlx did not
    write: a symlink never (a rename would not follow it, but the user meant its target), anything
    but a regular file never, a regular file without an output signature only with `overwrite`."""
    p = os.path.abspath(target)
    if not _existing(p, target, field, os.path.isfile, "a regular file"):
        return
    if overwrite:
        return
    fd = _open_temp(p)  # O_NOFOLLOW | O_NONBLOCK: a link or FIFO swapped in is not read through
    head = b""
    if fd is not None:
        try:
            head = os.read(fd, OUTPUT_HEAD)
        except OSError:
            pass
        finally:
            os.close(fd)
    if not _is_own_output(head):
        raise UsageError(field, f"{target} exists and was not written by hebrus-mlx; pass --overwrite to replace it")


def publish_output(target, data, *, field, overwrite=False):
    """Publish the bytes of a user-named output file: `check_output_file`, then `publish_file`
    (which cleans this target's stale temporaries first). Creates the parent directory."""
    if not _is_own_output(bytes(data[:OUTPUT_HEAD])):
        raise AssertionError(f"output for {field} carries no hebrus-mlx signature")  # a writer's bug
    check_output_file(target, overwrite=overwrite, field=field)
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    return publish_file(target, lambda w: w.write(data))
