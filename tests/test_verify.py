"""`hebrus-mlx verify` (docs/INTEGRITY.md): by default one SHA-256 pass over every byte against the
manifest's whole-file digests, then a diagnostic pass naming the bad record, page or tensor;
`--deep` also checks every digest the stores hold for their records, pages and payloads.

Provenance: the shipped demo (fast checks on every per-unit store), copied per test and corrupted
on disk here; the expected unit boundaries come from the stores' readers.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from support.artifact_fixture import edit_manifest, refresh_store
from support.stream_store import flip_byte

from hebrus_mlx import verify as V
from hebrus_mlx.admission import admit
from hebrus_mlx.artifact.errors import DigestError
from hebrus_mlx.artifact.expert_major import ExpertMajorReader
from hebrus_mlx.artifact.ple_pages import PleReader
from hebrus_mlx.loader import DEMO_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = open(os.devnull, "w")


@pytest.fixture
def art(tmp_path):
    return str(shutil.copytree(DEMO_DIR, tmp_path / "art"))


@pytest.fixture(params=[0, 2], ids=["inline", "read-ahead"])
def read_ahead(request, monkeypatch):
    monkeypatch.setattr(V, "READ_AHEAD", request.param)
    return request.param


def _experts(d):
    m = admit(d)
    with ExpertMajorReader(m.file(m.experts), m.family, m.experts.codec) as r:
        return r.geometry


def _ple(d, i):
    m = admit(d)
    with PleReader(m.file(m.ple[i]), m.family, m.ple[i].codec) as r:
        return r.geometry


def _dense_tensor(d):
    """(name, absolute offset of its first byte) of a dense tensor in the middle of the file."""
    m = admit(d)
    with open(m.file(m.dense), "rb") as f:
        base = 8 + int.from_bytes(f.read(8), "little")
    name = sorted(m.tensors)[len(m.tensors) // 2]
    return name, base + m.tensors[name]["data_offsets"][0]


def _flip(d, store, offset):
    flip_byte(os.path.join(d, store), offset, 0x10)


def test_a_flipped_byte_in_each_store_is_named_by_default_verify(art, read_ahead):
    """One byte flipped inside an expert record, a page of each PLE table, a dense tensor and the
    MTP head's second chunk: the default pass catches each by the whole-file digest, and the error
    names the record, page, tensor or chunk."""
    original = {n: open(os.path.join(art, n), "rb").read() for n in os.listdir(art)}
    g = _experts(art)
    i = g.index(5, 9)
    pg = [_ple(art, t) for t in (0, 1)]
    name, tensor_at = _dense_tensor(art)
    mtp_size = os.path.getsize(os.path.join(art, "mtp.safetensors"))
    cases = [
        ("experts.hbem", g.record_offset(i) + 11, rf"experts\.record\[{i}\]", "record digest mismatch"),
        ("ple.0.hbpl", pg[0].payload_offset + 3 * pg[0].page_stride + 300, r"ple\.page\[3\]", "ple.0.hbpl"),
        ("ple.1.hbpl", pg[1].payload_offset + pg[1].page_stride + 100, r"ple\.page\[1\]", "ple.1.hbpl"),
        ("model.safetensors", tensor_at, rf"tensors\.{name}\.sha256", "model.safetensors"),
        ("mtp.safetensors", mtp_size - 5, r"stores\.mtp\.safetensors\.sha256", "first bad chunk"),
    ]
    for store, offset, field, said in cases:
        _flip(art, store, offset)
        with pytest.raises(DigestError, match=field) as e:
            V.verify(art, stream=QUIET)
        assert said in e.value.message and "whole-file digest mismatch" in e.value.message, e.value
        with open(os.path.join(art, store), "wb") as f:
            f.write(original[store])
    assert V.verify(art, stream=QUIET)[1]["stores"] == 5


def test_a_flipped_padding_byte_is_caught_by_the_whole_file_digest(art):
    """A byte no record digest covers (the padding after a record) still fails default verify."""
    g = _experts(art)
    pad = next(i for i in range(g.count) if g.record_stride_of(i) > g.record_size(i))
    _flip(art, "experts.hbem", g.record_offset(pad) + g.record_size(pad))
    with pytest.raises(DigestError, match=r"experts\.payload_sha256"):
        V.verify(art, stream=QUIET)


def test_the_manifest_whole_file_digest_is_what_default_verify_trusts(art):
    """Store bytes and their own digest tables untouched, only the manifest's whole-file digest of
    the expert store changed: default verify refuses, naming the manifest field."""
    edit_manifest(art, lambda m: m["stores"][1].__setitem__("sha256", hashlib.sha256(b"other").hexdigest()))
    with pytest.raises(DigestError) as e:
        V.verify(art, stream=QUIET)
    assert e.value.field == "stores.experts.hbem.sha256"


@pytest.mark.parametrize("store", ["experts.hbem", "ple.1.hbpl"])
def test_a_store_table_that_disagrees_with_its_bytes_is_caught_by_deep_only(art, store):
    """A unit's bytes edited, then the manifest's whole-file digest (and the fast table) recomputed
    to match, the store's own SHA-256 table left as it was: default verify passes (it trusts the
    manifest, which now describes these bytes); --deep refuses, naming the record or page."""
    if store == "experts.hbem":
        g = _experts(art)
        i = g.index(2, 5)
        offset, field = g.record_offset(i) + 7, rf"experts\.record\[{i}\]"
    else:
        g = _ple(art, 1)
        offset, field = g.payload_offset + 2 * g.page_stride + 500, r"ple\.page\[2\]"
    _flip(art, store, offset)
    refresh_store(art, store)
    assert V.verify(art, stream=QUIET)[1]["stores"] == 5
    with pytest.raises(DigestError, match=field):
        V.verify(art, stream=QUIET, deep=True)
    rc = subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.cli", "verify", "--deep", art],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert rc.returncode == 2 and re.search(r"hebrus-mlx verify: error: " + field, rc.stderr), rc.stderr


def test_a_fast_table_that_disagrees_with_verified_bytes_is_caught(art, read_ahead):
    """One XXH3-128 entry of the expert table changed (and the table's SHA-256 in the manifest):
    admission passes, the bytes match every SHA-256, verify (default and deep) names the unit."""
    path = os.path.join(art, "experts.hbem.xxh3")
    table = bytearray(open(path, "rb").read())
    table[16 * 7] ^= 1
    open(path, "wb").write(bytes(table))
    edit_manifest(art, lambda m: m["stores"][1]["fast_check"].update(sha256=hashlib.sha256(table).hexdigest()))
    for deep in (False, True):
        with pytest.raises(DigestError, match=r"stores\.experts\.hbem\.fast_check") as e:
            V.verify(art, stream=QUIET, deep=deep)
        assert "unit 7" in e.value.message


class _Counting:
    """hashlib.sha256 stand-in that adds up the bytes it is fed."""

    fed = 0

    def __init__(self, data=b""):
        self._h = _SHA256(data)
        _Counting.fed += len(data)

    def update(self, data):
        _Counting.fed += memoryview(data).nbytes
        self._h.update(data)

    def digest(self):
        return self._h.digest()

    def hexdigest(self):
        return self._h.hexdigest()


_SHA256 = hashlib.sha256


def test_default_verify_hashes_every_byte_once_and_deep_three_times(monkeypatch):
    """The bytes fed to SHA-256: once per store byte by default (plus headers and digest tables
    read on open); with --deep the expert and PLE stores' bytes three times (record or page, payload
    and whole-file digests)."""
    monkeypatch.setattr(hashlib, "sha256", _Counting)
    m = admit(str(DEMO_DIR))
    total = sum(s.size for s in m.stores)
    fed = {}
    for deep in (False, True):
        _Counting.fed = 0
        admit(str(DEMO_DIR))
        base = _Counting.fed
        _Counting.fed = 0
        V.verify(str(DEMO_DIR), stream=QUIET, deep=deep)
        fed[deep] = _Counting.fed - base
    assert total <= fed[False] < 1.1 * total, (fed, total)
    per_unit = sum(s.size for s in m.stores if s.role in ("experts", "ple"))
    assert fed[True] > total + 1.7 * per_unit, (fed, total, per_unit)


def test_reads_cover_the_file_in_order_with_whole_units():
    units = [(100, 30), (140, 30), (170, 5), (400, 50)]
    reads = V._reads(1000, units, chunk=64)
    assert reads[0][0] == 0 and reads[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(reads, reads[1:]))
    assert [u for _, _, g in reads for u in g] == units
    for start, end, group in reads:
        assert all(start <= off and off + n <= end for off, n in group)
    want = [(0, 130), (130, 450)] + [(s, min(1000, s + 64)) for s in range(450, 1000, 64)]
    assert [(s, e) for s, e, _ in reads] == want


def test_the_cli_flag_reaches_the_library(art):
    out = subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.cli", "verify", "--deep", art],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        check=True,
    ).stdout
    assert json.loads(out)["deep"] is True
