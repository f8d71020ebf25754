"""Failures reach the user as one line (issue 10): every typed error of `generate`, `admit`,
`verify` and `convert` ends as `hebrus-mlx VERB: error: FIELD: MESSAGE` on stderr with exit 2 and
no traceback; a bug is never relabelled.

Done-when: corrupting any byte of an artifact makes `generate` either refuse with one line (exit 2)
or print exactly the pristine text. Contract controls: single-bit flips of a copy of the shipped
demo artifact at the header bytes, the last byte and seeded random offsets of every file.
"""

import io
import os
import random
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest

from hebrus_mlx.cli import main
from hebrus_mlx.loader import DEMO_DIR

ARGV = ["-p", "def fibonacci(n):", "--ignore-chat-template", "-m", "6", "--verbose", "false"]
OFFSETS_PER_FILE = 5


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _one_line(verb, rc, out, err):
    return (
        rc == 2
        and out == ""
        and err.count("\n") == 1
        and err.startswith(f"hebrus-mlx {verb}: error: ")
        and "Traceback" not in err
    )


@pytest.fixture(scope="module")
def demo_copy(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo") / "model"
    shutil.copytree(DEMO_DIR, d)
    rc, out, err = _run(["generate", "--model", str(d), *ARGV])
    assert rc == 0 and out.strip(), err
    return d, out


def _offsets(size, rng):
    # Header bytes (magic, version, lengths) plus the last byte and seeded random ones.
    fixed = {0, 1, 7, 8, 9, 16, size - 1}
    return sorted({o for o in fixed if o < size} | {rng.randrange(size) for _ in range(OFFSETS_PER_FILE)})


def test_flipped_byte_in_any_file_refuses_in_one_line_or_prints_the_pristine_text(demo_copy):
    d, pristine = demo_copy
    rng = random.Random(10)
    names = sorted(os.listdir(d))
    assert {
        "manifest.json",
        "config.json",
        "tokenizer_config.json",
        "generation_config.json",
        "model.safetensors",
        "experts.hbem",
        "ple.0.hbpl",
        "tokenizer.json",
    } <= set(names)
    refused, identical = {}, {}
    for name in names:
        path = d / name
        original = path.read_bytes()
        for off in _offsets(len(original), rng):
            data = bytearray(original)
            data[off] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(data))
            try:
                rc, out, err = _run(["generate", "--model", str(d), *ARGV])
            finally:
                path.write_bytes(original)
            if rc == 0:
                assert out == pristine, (name, off, out)
                identical[name] = identical.get(name, 0) + 1
            else:
                assert _one_line("generate", rc, out, err), (name, off, rc, out, err)
                refused[name] = refused.get(name, 0) + 1
    # Every file had at least one refused flip: the test is not passing by never corrupting anything.
    assert set(refused) == set(names), (refused, identical)


def _corrupt_copy(src, dst, name, at, mask):
    """A copy of artifact `src` with byte `at(size)` of file `name` XORed with `mask`."""
    shutil.copytree(src, dst)
    p = dst / name
    data = bytearray(p.read_bytes())
    data[at(len(data))] ^= mask
    p.write_bytes(bytes(data))
    return dst


def test_flipped_ple_page_byte_as_a_subprocess(demo_copy, tmp_path):
    bad = _corrupt_copy(demo_copy[0], tmp_path / "bad", "ple.1.hbpl", lambda n: n - 5, 0x10)
    r = subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.cli", "generate", "--model", str(bad), *ARGV],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.startswith("hebrus-mlx generate: error: ple.page[") and r.stderr.count("\n") == 1, r.stderr


def test_traceback_switch_shows_the_traceback_of_a_typed_error(monkeypatch):
    """HEBRUS_TRACEBACK=1 is for debugging; the last line is still the one-line error."""
    monkeypatch.setenv("HEBRUS_TRACEBACK", "1")
    rc, out, err = _run(["admit", "/nonexistent/artifact"])
    assert rc == 2 and "Traceback" in err
    assert (
        err.splitlines()[-1] == "hebrus-mlx admit: error: path: /nonexistent/artifact is not a directory "
        "(admission stage bounds)"
    )


def test_verify_and_admit_refuse_in_one_line(demo_copy, tmp_path):
    bad = _corrupt_copy(demo_copy[0], tmp_path / "bad", "experts.hbem", lambda n: n // 2, 1)
    rc, out, err = _run(["verify", str(bad)])
    assert _one_line("verify", rc, out, err) and ": error: experts." in err, err
    (bad / "stray.bin").write_bytes(b"x")
    rc, out, err = _run(["admit", str(bad)])
    assert _one_line("admit", rc, out, err) and "bounds.stray.bin" in err, err


def test_convert_refuses_a_missing_local_dir_in_one_line(tmp_path):
    """A local path that does not exist is not sent to the Hub as a repo id."""
    rc, out, err = _run(["convert", "--hf-path", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    assert _one_line("convert", rc, out, err) and "hf_path:" in err, err
    assert not (tmp_path / "out").exists()


def test_a_bug_is_not_turned_into_a_one_line_error(monkeypatch):
    """Only typed errors are shortened: an untyped exception keeps its traceback."""
    from support.verb_loading import patch_load_from_args

    def bug(*a, **k):
        raise KeyError("planted bug")

    patch_load_from_args(monkeypatch, bug)
    with pytest.raises(KeyError, match="planted bug"):
        main(["generate", "-p", "hi"])


def test_server_on_a_taken_port_names_it_before_loading():
    """`server --port P` with P taken: one line naming --port and P (exit 2), before any model load."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run(
            [sys.executable, "-m", "hebrus_mlx.cli", "server", "--model", "/nonexistent/model", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == (
        f"hebrus-mlx server: error: --port: port {port} on 127.0.0.1 is in use; "
        "give another --port (0 picks a free one)\n"
    )
