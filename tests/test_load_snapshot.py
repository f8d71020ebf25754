"""Issue 23 §1 leftover: the dense and MTP stores are parsed from the very bytes whose digest was
checked. A byte flipped on disk after the check (between check and use: the TOCTOU window the
loader used to have, re-reading the file after hashing it) never reaches the weights.

The flip is injected from inside the check itself: the digest function is wrapped so that, once
it has consumed the last chunk, it rewrites one payload byte of the file on disk. Oracle: the
shipped demo store read with mx.load directly (pristine bytes).
"""

import hashlib
import os
import shutil
import types

import mlx.core as mx
import pytest

from hebrus_mlx.admission import admit
from hebrus_mlx.artifact import fast_check as FC
from hebrus_mlx.loader import DEMO_DIR
from hebrus_mlx.loading import build_model as BM


def _flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def _same(got, path):
    want = mx.load(str(path))
    assert set(got) == set(want)
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)


@pytest.fixture
def demo(tmp_path):
    return shutil.copytree(DEMO_DIR, tmp_path / "demo")


@pytest.mark.skipif(FC.xxh3_128() is None, reason="extension not built")
def test_mtp_store_flipped_after_its_fast_check_loads_the_checked_bytes(demo, monkeypatch):
    m = admit(demo)
    s = m.mtp
    assert s is not None and m.fast_table(s) is not None  # the demo's MTP store carries XXH3-128 chunks
    real, units, calls = FC.xxh3_128(), len(m.fast_table(s)), []

    def xxh3(data, *a):
        out = real(data, *a)
        calls.append(len(data))
        if len(calls) == units:  # the check has seen every chunk: now the file changes
            _flip_last_byte(m.file(s))
        return out

    monkeypatch.setattr(BM.fast_check, "xxh3_128", lambda: xxh3)
    got = BM._load_hashed(m, s, "MTP")
    assert len(calls) == units
    _same(got, DEMO_DIR / s.path)
    with open(m.file(s), "rb") as f:  # the disk did change under the loader
        assert hashlib.sha256(f.read()).hexdigest() != s.sha256


def test_dense_store_flipped_after_its_sha256_loads_the_checked_bytes(demo, monkeypatch):
    m = admit(demo)
    s = m.dense
    flipped = []

    class Digest:
        def __init__(self, data=b""):
            self._h = hashlib.sha256(data)

        def update(self, b):
            self._h.update(b)

        def hexdigest(self):
            out = self._h.hexdigest()
            _flip_last_byte(m.file(s))
            flipped.append(True)
            return out

    monkeypatch.setattr(BM, "hashlib", types.SimpleNamespace(sha256=Digest))
    got = BM._load_hashed(m, s, "dense")
    assert flipped == [True]
    _same(got, DEMO_DIR / s.path)
