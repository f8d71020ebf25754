"""XXH3-128, the per-read fast check (metal_ext/xxh3.cpp, docs/INTEGRITY.md).

Provenance: expected digests come from the xxHash project's published sanity vectors (seed 0,
over its sanity buffer) and from the independent `xxhash` package (PyPI, the test extra); every
usable backend (AVX2/SSE2/NEON and the scalar fallback, forced by argument) is checked, in
process and through the C++ driver (one-shot and streamed in uneven pieces); the arm64 NEON path
runs under qemu when the cross toolchain is installed.
"""

import importlib.util
import os
import random
from pathlib import Path

import pytest
import xxhash

_hash = pytest.importorskip("hebrus_mlx._hash", reason="extension not built")

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("check_xxh3", ROOT / "tools" / "check_xxh3.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_backend_matches_the_published_vectors_and_the_xxhash_package():
    tool = _tool()
    backends = _hash.xxh3_backends()
    assert backends[0] == _hash.xxh3_backend() and backends[-1] == "scalar"
    sanity = tool.sanity_buffer(512)
    for n, low, high in tool.PUBLISHED:
        want = tool.published_hex(low, high)
        assert xxhash.xxh3_128(sanity[:n]).hexdigest() == want  # the oracle agrees with the vector
        for b in backends + ["auto"]:
            assert _hash.xxh3_128(sanity[:n], backend=b).hex() == want, (n, b)
    rng = random.Random(11)
    for n in list(range(230, 260)) + [1023, 1024, 1025, 1089, 4096, 100_003, 2_764_800]:
        m = rng.randbytes(n)
        want = xxhash.xxh3_128(m).digest()
        for b in backends:
            assert _hash.xxh3_128(m, backend=b) == want, (n, b)


def test_any_contiguous_buffer_is_hashed_in_place_and_others_are_refused():
    """verify and the converter hash slices of their read buffers (memoryview of a bytearray)
    without copying them to bytes: the digest is the bytes' digest. A non-contiguous view or a
    str is a TypeError/BufferError, never a digest of something else."""
    data = bytearray(random.Random(5).randbytes(300_000))
    for a, b in ((0, 300_000), (7, 100_007), (1, 2), (250_001, 299_999)):
        view = memoryview(data)[a:b]
        want = xxhash.xxh3_128(bytes(view)).digest()
        assert _hash.xxh3_128(view) == _hash.xxh3_128(bytes(view)) == want
    with pytest.raises((TypeError, BufferError)):
        _hash.xxh3_128(memoryview(data)[::2])
    with pytest.raises(TypeError):
        _hash.xxh3_128("text")


def test_native_driver_streams_every_backend_like_one_shot():
    """The C++ incremental hasher (what the engine feeds arena parts through) against the oracle,
    for every backend of this CPU."""
    tool = _tool()
    try:
        backends, bad, oracled = tool.check("native", require_oracle=True)
    except tool.ToolchainMissing as e:
        pytest.skip(str(e))
    assert backends == _hash.xxh3_backends() and oracled > 300 and bad == []


def test_arm64_neon_path_under_qemu():
    """The NEON accumulate/scramble (the Apple-silicon / arm64 path) and the scalar fallback,
    cross-compiled and run under qemu-aarch64 against the same vectors."""
    tool = _tool()
    try:
        backends, bad, oracled = tool.check("aarch64", require_oracle=True)
    except tool.ToolchainMissing as e:
        pytest.skip(str(e))
    assert backends == ["neon", "scalar"] and oracled > 300 and bad == []


def test_whole_file_digest_and_bad_backends(tmp_path):
    data = os.urandom(9 << 20)  # more than one 8 MiB read
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert _hash.xxh3_128_fd(fd) == _hash.xxh3_128_fd(fd, backend="scalar") == xxhash.xxh3_128(data).digest()
    finally:
        os.close(fd)
    for bad in ("nope", "neon" if "neon" not in _hash.xxh3_backends() else "avx2"):
        with pytest.raises(ValueError, match="backend"):
            _hash.xxh3_128(b"abc", backend=bad)
