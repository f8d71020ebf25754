"""Issue 22 §1: `convert` never deletes what it did not write, and a killed conversion's
temporaries are removed by the next run (never a live writer's).

`--out` that is an existing non-empty directory, a regular file, a symlink, the source itself, a
parent of the source or `.` is refused in one line (exit 2) with every byte of it left in place;
`--overwrite` replaces only an earlier hebrus-mlx artifact whose manifest owns every entry, and never
the source or a parent of it. The kill test sends real SIGKILLs to `hebrus-mlx convert`
subprocesses while their temp directory is being written.

Provenance (AFN-014): the source is the committed upstream-captured tiny_a checkpoint
(convert_fixture.parity_source); bystander files are contract controls written here.
"""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.convert_fixture import parity_source

from hebrus_mlx.artifact import atomic

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# The tiny families are registered by tests/support/families.py; the child is the real CLI entry point.
_CLI = textwrap.dedent("""
    import sys
    from support import families
    from hebrus_mlx.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))


def _convert(args, cwd=None):
    return subprocess.run(
        [sys.executable, "-c", _CLI, "convert", *args, "--dtype", "float32"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=cwd,
        timeout=300,
    )


def _snapshot(path):
    """Every file under `path` (or the file itself) with its bytes: what must survive a refusal."""
    p = Path(path)
    if p.is_file() or p.is_symlink():
        return {".": (os.readlink(p) if p.is_symlink() else p.read_bytes())}
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def _one_line(r, field="--out"):
    return (
        r.returncode == 2
        and r.stderr.count("\n") == 1
        and "Traceback" not in r.stderr
        and r.stderr.startswith(f"hebrus-mlx convert: error: {field}: ")
    )


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return parity_source("tiny_a", str(tmp_path_factory.mktemp("ckpt") / "hf"))


def test_refuses_every_path_it_did_not_write(src, tmp_path):
    """Each case once without and once with --overwrite: exit 2, one line, nothing changed."""
    user = tmp_path / "notes"
    user.mkdir()
    (user / "thesis.txt").write_text("years of work")
    (user / "sub").mkdir()
    (user / "sub" / "data.bin").write_bytes(os.urandom(64))
    afile = tmp_path / "file.txt"
    afile.write_text("a regular file")
    link = tmp_path / "link"
    link.symlink_to(user)
    parent = Path(src).parent
    cases = [
        (str(user), None),
        (str(afile), None),
        (str(link), None),
        (src, None),
        (str(parent), None),
        (".", str(tmp_path)),
        (".", src),
    ]
    for out, cwd in cases:
        watched = cwd or out
        before = _snapshot(watched if out != "." else cwd)
        for extra in ([], ["--overwrite"]):
            r = _convert(["--hf-path", src, "--out", out, *extra], cwd=cwd)
            assert _one_line(r), (out, cwd, extra, r.returncode, r.stderr[-2000:])
            assert _snapshot(watched if out != "." else cwd) == before, (out, extra)
    assert _snapshot(src) and os.listdir(parent) == ["hf"]


def test_overwrite_replaces_only_an_earlier_artifact(src, tmp_path):
    out = tmp_path / "art"
    out.mkdir()  # an empty directory holds nothing to lose
    r = _convert(["--hf-path", src, "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    first = _snapshot(out)
    assert "manifest.json" in first
    r = _convert(["--hf-path", src, "--out", str(out)])
    assert _one_line(r) and "--overwrite" in r.stderr, r.stderr
    r = _convert(["--hf-path", src, "--out", str(out), "--overwrite"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert _snapshot(out) == first  # deterministic conversion, replaced whole
    # A file the user put inside an artifact is not the manifest's: even --overwrite refuses.
    (out / "my-notes.txt").write_text("mine")
    r = _convert(["--hf-path", src, "--out", str(out), "--overwrite"])
    assert _one_line(r) and "my-notes.txt" in r.stderr, r.stderr
    assert (out / "my-notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["art"]


def _temps(out):
    parent, name = os.path.split(out)
    return sorted(n for n in os.listdir(parent) if n.startswith(f".{name}.tmp"))


def _start_and_wait_for_temp(src, out, rng):
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLI, "convert", "--hf-path", src, "--out", out, "--dtype", "float32", "--overwrite"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    deadline = time.monotonic() + 120
    known = set(_temps(out))
    while not (set(_temps(out)) - known):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.002)
    time.sleep(rng.uniform(0, 0.2))  # somewhere inside the build
    return proc


def test_kill_9_leaves_old_artifact_and_next_run_cleans_its_temps(src, tmp_path):
    """Real SIGKILLs mid-conversion: the earlier artifact stays byte-identical, the killed runs'
    temporaries are left (nothing else could remove them), and the next run removes them all."""
    out = str(tmp_path / "art")
    assert _convert(["--hf-path", src, "--out", out]).returncode == 0
    first = _snapshot(out)
    rng = random.Random(22)
    kills = 0
    for _ in range(3):
        proc = _start_and_wait_for_temp(src, out, rng)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stderr.close()
        kills += proc.returncode == -signal.SIGKILL
        assert _snapshot(out) == first
    assert kills >= 1
    stale = _temps(out)
    assert stale, "a killed conversion left no temporary: the kill came too late to test anything"
    r = _convert(["--hf-path", src, "--out", out, "--overwrite"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert _temps(out) == [] and _snapshot(out) == first
    for t in stale:
        assert f"removed {os.path.join(tmp_path, t)}" in r.stderr


def test_a_live_writers_temp_is_never_removed(src, tmp_path):
    """A conversion in progress holds the lock on its temp: another run's cleanup leaves it, and
    the writer still publishes."""
    out = str(tmp_path / "art")
    proc = _start_and_wait_for_temp(src, out, random.Random(1))
    live = _temps(out)
    assert atomic.clean_stale(out) == []
    assert all(os.path.exists(os.path.join(tmp_path, t)) for t in live) or proc.poll() is not None
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert _temps(out) == [] and (Path(out) / "manifest.json").is_file()


def test_stale_file_temps_of_every_publisher(tmp_path):
    """publish_file (stores, traces, bench output, profiles) cleans its own target's stale temps,
    never another target's, never a locked one, never a symlink that looks like one."""
    import fcntl

    target = tmp_path / "bench.json"
    stale = tmp_path / ".bench.json.tmp-0123456789ab"
    stale.write_bytes(b"half")
    other = tmp_path / ".other.json.tmp-0123456789ab"
    other.write_bytes(b"not ours")
    held = tmp_path / ".bench.json.tmp-aaaaaaaaaaaa"
    held.write_bytes(b"live")
    decoy = tmp_path / ".bench.json.tmp-bbbbbbbbbbbb"
    decoy.symlink_to(other)
    stale_dir = tmp_path / ".bench.json.tmpdir-cccccccccccc"
    (stale_dir / "x").mkdir(parents=True)
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        atomic.publish_file(target, lambda w: w.write(b"{}"))
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["bench.json", ".other.json.tmp-0123456789ab", ".bench.json.tmp-aaaaaaaaaaaa", ".bench.json.tmp-bbbbbbbbbbbb"]
    )
    assert atomic.clean_stale(target) == [str(held)]  # its writer has gone now


def test_traces_export_out_refuses_what_it_did_not_write(tmp_path):
    """The same rule for `hebrus-mlx traces export --out`: checked before the traces are read."""
    from hebrus_mlx.errors import UsageError
    from hebrus_mlx.traces.export import export

    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    afile = tmp_path / "file.txt"
    afile.write_text("keep")
    for out in (user, afile, tmp_path):
        with pytest.raises(UsageError) as e:
            export(str(tmp_path / "traces"), str(out))
        assert e.value.field == "--out", e.value
    assert (user / "notes.txt").read_text() == "keep" and afile.read_text() == "keep"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_convert_keeps_no_descriptor_on_the_artifact(src, tmp_path):
    """Found at full size: each store's publication check left its reader's descriptor open, so an
    artifact removed later in the same process kept its bytes on disk (38 GB, the disk filled)."""
    from support import families  # noqa: F401  (registers the tiny families in this process)

    from hebrus_mlx.convert.build import convert

    out = tmp_path / "art"
    convert(src, str(out), dtype="float32", mtp=False, quiet=True)
    stores = [n for n in os.listdir(out) if n.endswith((".hbem", ".hbpl"))]
    assert stores  # an expert store at least: the check below must have something to find
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    assert [h for h in held if h.startswith(str(out))] == []
