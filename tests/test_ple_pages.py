"""PLE fixed-page store v1 (AFN-003): affine row location, single-snapshot
verified reads, three independent digest domains, checked geometry.

Provenance: the prime head sizes are cross-checked against the upstream
transformers `_find_nth_prime_after`; row data are contract controls."""

import hashlib
import os
import struct

import numpy as np
import pytest
from support import families

from hebrus_mlx.artifact import constants as C
from hebrus_mlx.artifact import ple_pages as pp
from hebrus_mlx.artifact.errors import ArtifactError, CodecError, DigestError, GeometryError, TruncatedError

FAM = families.QWEN4EXP_TINY_TEST
ROWS_PER_PAGE = 100


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    table = np.random.default_rng(0).standard_normal((4096, 16)).astype(np.float32)
    path = str(tmp_path_factory.mktemp("ple") / "ple.0.hbpl")
    pp.publish(path, FAM, 0, "f32", [table[:1000], table[1000:3333], table[3333:]], rows_per_page=ROWS_PER_PAGE)
    return path, table


def test_primes_match_upstream_and_the_pinned_flash_next_rows():
    """AFN-003: 16 prime heads sum to 320,001,446, padded to 320,001,536 rows of 160."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import _find_nth_prime_after

    f = C.QWEN38_FLASH_NEXT
    upstream = [_find_nth_prime_after(f.ngram_vocab_size_base - 1, h + 1) for h in range(16)]
    assert list(f.ple_head_sizes(0)) == upstream
    assert sum(upstream) == 320_001_446 and f.ple_rows == (320_001_536,) and f.ple_width == 160
    g = pp.Geometry(f, 0, "bf16")
    assert g.num_pages * g.rows_per_page >= 320_001_536 > (g.num_pages - 1) * g.rows_per_page


def test_every_row_reads_back_exactly(store):
    path, table = store
    with pp.PleReader(path, FAM, "f32") as r:
        assert r.geometry.num_pages == 41 and r.geometry.page_stride % 4096 == 0
        assert np.array_equal(r.read_rows(range(4096)), table)
        out = np.zeros(16, np.float32)
        r.read_row_into(4095, out)
        assert np.array_equal(out, table[4095])
        r.verify_all()


def test_locate_is_affine_and_checked(store):
    """AFN-003: page = r // rpp, slot = r % rpp; out-of-range rows are typed errors."""
    path, _ = store
    with pp.PleReader(path, FAM) as r:
        g = r.geometry
        assert g.locate(250) == (2, g.payload_offset + 2 * g.page_stride, 64 + 50 * 64)
        for bad in (-1, 4096, 1 << 70, 2.0):
            with pytest.raises(GeometryError):
                g.locate(bad)


def test_affine_codec_and_wrong_rows_rejected(tmp_path):
    """AFN-002/003: no affine PLE codec; wrong row count is a typed error, nothing published."""
    with pytest.raises(CodecError):
        pp.Geometry(FAM, 0, "affine4-g64")
    p = tmp_path / "x.hbpl"
    with pytest.raises(GeometryError, match="ple.total_rows"):
        pp.publish(str(p), FAM, 0, "f32", [np.zeros((4095, 16), np.float32)])
    with pytest.raises(GeometryError, match="ple.rows"):
        pp.publish(str(p), FAM, 0, "f32", [np.zeros((4096, 16), np.float64)])
    assert os.listdir(tmp_path) == []


def _copy_with(path, dst, offset, data):
    blob = bytearray(open(path, "rb").read())
    blob[offset : offset + len(data)] = data
    open(dst, "wb").write(blob)
    return dst


def test_corrupt_page_leaves_caller_buffer_untouched(store, tmp_path):
    """AFN-003: verify the snapshot, then copy; corruption never reaches `out`."""
    path, table = store
    with pp.PleReader(path) as r:
        g = r.geometry
    bad = _copy_with(path, str(tmp_path / "b"), g.payload_offset + 3 * g.page_stride + 64 + 7, b"\x01")
    with pp.PleReader(bad) as r:
        out = np.full(16, 7.0, np.float32)
        with pytest.raises(DigestError, match=r"ple.page\[3\]"):
            r.read_row_into(305, out)
        assert np.all(out == 7.0)
        assert np.array_equal(r.read_rows([299, 400]), table[[299, 400]])


def test_page_header_copied_from_elsewhere_is_detected(store, tmp_path):
    """AFN-003: a page moved to another slot fails on its repeated geometry."""
    path, _ = store
    with pp.PleReader(path) as r:
        g = r.geometry
        page5 = os.pread(r.fd, g.page_stride, g.payload_offset + 5 * g.page_stride)
    bad = _copy_with(path, str(tmp_path / "m"), g.payload_offset + 6 * g.page_stride, page5)
    with pp.PleReader(bad) as r:
        with pytest.raises(GeometryError, match=r"ple.page\[6\].page_index"):
            r.read_page(6)


def test_whole_payload_digest_is_isolated(store, tmp_path):
    """AFN-003: mutate a page, re-sign its page digest and the manifest digest;
    open and verify_page pass, verify_all fails on the payload digest only."""
    path, _ = store
    with pp.PleReader(path) as r:
        g = r.geometry
    blob = bytearray(open(path, "rb").read())
    start = g.payload_offset + 2 * g.page_stride
    blob[start + 64] ^= 0xFF
    blob[512 + 64 : 512 + 96] = hashlib.sha256(blob[start : start + g.page_stride]).digest()
    zeroed = bytearray(blob[: g.payload_offset])
    zeroed[280:312] = bytes(32)
    blob[280:312] = hashlib.sha256(zeroed).digest()
    bad = str(tmp_path / "p")
    open(bad, "wb").write(blob)
    with pp.PleReader(bad) as r:
        r.verify_page(2)
        with pytest.raises(DigestError, match="ple.payload_sha256"):
            r.verify_all()


def test_manifest_digest_covers_the_digest_table(store, tmp_path):
    path, _ = store
    bad = _copy_with(path, str(tmp_path / "d"), 512 + 40, b"\x00\x01")
    with pytest.raises(DigestError, match="ple.manifest_sha256"):
        pp.PleReader(bad)


def test_untrusted_header_fields_are_checked_before_reading(store, tmp_path):
    """Huge page counts or strides are rejected by geometry, not allocated."""
    path, _ = store
    for off, fmt, val, field in [
        (80, "<Q", 1 << 40, "ple.num_pages"),
        (36, "<I", 0, "ple.rows_per_page"),
        (88, "<Q", 1 << 62, "ple.page_stride"),
        (16, "<I", 12345, "ple.family_id"),
    ]:
        bad = _copy_with(path, str(tmp_path / field), off, struct.pack(fmt, val))
        with pytest.raises(ArtifactError) as e:
            pp.PleReader(bad)
        assert e.value.field == field
    short = tmp_path / "short"
    short.write_bytes(open(path, "rb").read()[:-100])
    with pytest.raises(TruncatedError):
        pp.PleReader(str(short))
