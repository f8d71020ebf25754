"""ExpertMajor v2 store (AFN-002): exact geometry, typed rejection, record
digests separate from the whole-payload digest.

Provenance: record arrays are contract controls (seeded random) except the
quantized case, whose arrays are an upstream capture of `mx.quantize`,
cross-checked through `mx.gather_qmm` against `mx.quantized_matmul`."""

import os

import numpy as np
import pytest
from support import families

from hebrus_mlx.artifact import constants as C
from hebrus_mlx.artifact import expert_major as em
from hebrus_mlx.artifact.errors import CodecError, DigestError, GeometryError, HeaderError, TruncatedError

FAM = families.QWEN4EXP_TINY_TEST


def _records(codec_name, seed=0):
    rng = np.random.default_rng(seed)
    geom = em.Geometry(FAM, codec_name)
    out = []
    for layer in range(FAM.num_hidden_layers):
        for e in range(FAM.num_experts):
            parts = {}
            for comp, part, dtype, shape, _, _ in geom.layout:
                parts.setdefault(comp, {})[part] = rng.integers(0, 1 << 16, size=shape).astype(dtype)
            out.append((layer, e, parts))
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("em") / "experts.hbem")
    recs = _records("affine4-g64")
    em.publish(path, FAM, "affine4-g64", iter(recs))
    return path, recs


def test_round_trip_is_byte_identical(store):
    """AFN-002: every record reads back exactly, components in gate|up|down order."""
    path, recs = store
    with em.ExpertMajorReader(path, FAM, "affine4-g64") as r:
        for layer, e, parts in recs:
            got = r.read_expert(layer, e)
            for comp in parts:
                for part, a in parts[comp].items():
                    assert np.array_equal(got[comp][part], a)
        r.verify_all()
    assert os.path.getsize(path) % C.ALIGNMENT == 0


def test_flash_next_geometry_is_closed():
    """AFN-002: 48 x 512 records, 640/64 = 10 exact groups; hand arithmetic."""
    g = em.Geometry(C.QWEN38_FLASH_NEXT, "affine4-g64")
    packed = 640 * 2560 * 4 // 8
    groups = 640 * 2560 // 64
    assert g.record_bytes == 3 * (packed + 2 * groups * 2) == 2_764_800
    assert g.record_stride % 4096 == 0 and g.count == 48 * 512
    assert C.QWEN38_FLASH_NEXT.component_shapes() == {"gate": (640, 2560), "up": (640, 2560), "down": (2560, 640)}


def test_group_that_does_not_cover_a_row_is_rejected():
    """AFN-002: 640 % 256 != 0 is refused, never padded."""
    k256 = C.Codec("k-256", 99, 4, 256)
    with pytest.raises(CodecError):
        k256.parts(2560, 640, "experts.down")
    k256.parts(640, 2560)  # gate/up rows of 2560 would fit; down does not


def test_bad_record_rejected_before_publication(tmp_path):
    """Shape/dtype/order errors are typed, name the field, publish nothing."""
    path = tmp_path / "experts.hbem"
    recs = _records("bf16")
    recs[3][2]["up"]["weight"] = recs[3][2]["up"]["weight"].astype(np.float32)
    with pytest.raises(GeometryError, match="experts.up.weight"):
        em.publish(str(path), FAM, "bf16", iter(recs))
    recs = _records("bf16")
    recs[1], recs[2] = recs[2], recs[1]
    with pytest.raises(GeometryError, match="experts.order"):
        em.publish(str(path), FAM, "bf16", iter(recs))
    with pytest.raises(GeometryError, match="experts.count"):
        em.publish(str(path), FAM, "bf16", iter(_records("bf16")[:-1]))
    assert os.listdir(tmp_path) == []


def _corrupt(src, dst, offset):
    data = bytearray(open(src, "rb").read())
    data[offset] ^= 0xFF
    open(dst, "wb").write(data)


def test_corrupt_record_is_typed_and_buffer_untouched(store, tmp_path):
    """A flipped record byte fails its digest; the caller's buffer is unchanged."""
    path, _ = store
    g = em.Geometry(FAM, "affine4-g64")
    bad = str(tmp_path / "bad.hbem")
    _corrupt(path, bad, g.record_offset(9) + 100)
    with em.ExpertMajorReader(bad, FAM) as r:
        out = bytearray(b"\xaa" * g.record_bytes)
        with pytest.raises(DigestError, match=r"experts.record\[9\]"):
            r.read_record_into(1, 1, out)
        assert out == bytearray(b"\xaa" * g.record_bytes)
        r.read_record(1, 2)


def test_payload_digest_is_a_separate_check(store, tmp_path):
    """A padding byte no record covers passes record reads, fails verify_all."""
    path, _ = store
    g = em.Geometry(FAM, "affine4-g64")
    bad = str(tmp_path / "pad.hbem")
    _corrupt(path, bad, g.record_offset(0) + g.record_bytes + 1)
    with em.ExpertMajorReader(bad, FAM) as r:
        r.read_record(0, 0)
        with pytest.raises(DigestError, match="experts.payload_sha256"):
            r.verify_all()


def test_untrusted_headers(store, tmp_path):
    path, _ = store
    data = open(path, "rb").read()
    cases = [
        (data[:100], TruncatedError),
        (b"NOTMAGIC" + data[8:], HeaderError),
        (data[:-4096], TruncatedError),
        (data + bytes(4096), HeaderError),
    ]
    for i, (blob, err) in enumerate(cases):
        p = tmp_path / f"h{i}"
        p.write_bytes(blob)
        with pytest.raises(err):
            em.ExpertMajorReader(str(p))


def test_quantized_layout_feeds_gather_qmm(tmp_path):
    """Stored arrays are exactly mx.quantize's; gather_qmm over the read-back
    store equals quantized_matmul on the in-memory quantization."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(1)
    quant, recs = {}, []
    for layer in range(FAM.num_hidden_layers):
        for e in range(FAM.num_experts):
            parts = {}
            for comp, (rows, cols) in FAM.component_shapes().items():
                w = mx.array(rng.standard_normal((rows, cols)).astype(np.float32)).astype(mx.bfloat16)
                q, s, b = mx.quantize(w, group_size=64, bits=4)
                quant[(layer, e, comp)] = (q, s, b)
                parts[comp] = {
                    "weight": np.array(q),
                    "scales": np.array(s.view(mx.uint16)),
                    "biases": np.array(b.view(mx.uint16)),
                }
            recs.append((layer, e, parts))
    path = str(tmp_path / "q.hbem")
    em.publish(path, FAM, "affine4-g64", iter(recs))
    x = mx.array(rng.standard_normal((1, FAM.hidden_size)).astype(np.float32))
    with em.ExpertMajorReader(path, FAM) as r:
        experts = [r.read_expert(2, e)["gate"] for e in range(FAM.num_experts)]
    wq = mx.array(np.stack([p["weight"] for p in experts]))
    sc = mx.array(np.stack([p["scales"] for p in experts])).view(mx.bfloat16)
    bi = mx.array(np.stack([p["biases"] for p in experts])).view(mx.bfloat16)
    idx = mx.array([[5]])
    got = mx.gather_qmm(x[None], wq, sc, bi, rhs_indices=idx, transpose=True, group_size=64, bits=4)
    q, s, b = quant[(2, 5, "gate")]
    want = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4)
    assert np.array_equal(np.array(got).reshape(-1), np.array(want).reshape(-1))


def _per_layer_table():
    """Layer 0 at 3 bits everywhere, every other layer with down_proj at 6 bits (an mlx-lm
    mixed_3_6-shaped table)."""
    return tuple(
        ("affine3-g64", "affine3-g64", "affine3-g64" if layer == 0 else "affine6-g64")
        for layer in range(FAM.num_hidden_layers)
    )


def test_per_layer_store_round_trips_at_each_layers_layout(tmp_path):
    """Version 3: each layer's records have that layer's (gate, up, down) layout and stride
    (sizes from hand arithmetic), read back exactly; a one-codec reader refuses the file by
    version, a reader without the table or with another table refuses it naming the field."""
    table = _per_layer_table()
    g = em.Geometry(FAM, table)
    rng = np.random.default_rng(3)
    recs = []
    for layer in range(FAM.num_hidden_layers):
        for e in range(FAM.num_experts):
            parts = {}
            for comp, part, dtype, shape, _, _ in g.layer_layout(layer):
                parts.setdefault(comp, {})[part] = rng.integers(0, 1 << 16, size=shape).astype(dtype)
            recs.append((layer, e, parts))
    path = str(tmp_path / "experts.hbem")
    em.publish(path, FAM, table, iter(recs))

    def nbytes(bits, rows, cols):  # packed uint32 weight + bf16 scales and biases at group 64
        return rows * cols * bits // 8 + 2 * 2 * rows * (cols // 64)

    (m, h), (h2, m2) = FAM.component_shapes()["gate"], FAM.component_shapes()["down"]
    low = 2 * nbytes(3, m, h) + nbytes(3, h2, m2)
    high = 2 * nbytes(3, m, h) + nbytes(6, h2, m2)
    assert g.layer_record_bytes == [low] + [high] * (FAM.num_hidden_layers - 1)
    assert g.record_offset(FAM.num_experts) == g.payload_offset + FAM.num_experts * C.align_up(low)
    assert os.path.getsize(path) == g.file_bytes
    with em.ExpertMajorReader(path, FAM, [list(r) for r in table]) as r:
        assert r.codec is None and r.header["version"] == 3
        for layer, e, parts in recs:
            got = r.read_expert(layer, e)
            for comp in parts:
                for part, a in parts[comp].items():
                    assert np.array_equal(got[comp][part], a), (layer, e, comp, part)
        r.verify_all()
    with pytest.raises(HeaderError) as e:
        em.ExpertMajorReader(path, FAM, "affine3-g64")
    assert e.value.field == "experts.version"
    with pytest.raises(GeometryError) as e:
        em.ExpertMajorReader(path, FAM)
    assert e.value.field == "experts.layer_codecs"
    other = list(table)
    other[1] = ("affine3-g64", "affine6-g64", "affine3-g64")  # same record size, another layout
    with pytest.raises(HeaderError) as e:
        em.ExpertMajorReader(path, FAM, other)
    assert e.value.field == "experts.layer_codecs"


def test_per_layer_table_is_checked_naming_the_entry():
    n = FAM.num_hidden_layers
    for table, field, err in (
        ([("affine3-g64",) * 3] * (n - 1), "experts.layer_codecs", GeometryError),
        (
            [("affine3-g64",) * 3] * (n - 1) + [("affine3-g64", "affine3-g64")],
            f"experts.layer_codecs[{n - 1}]",
            GeometryError,
        ),
        (
            [("affine3-g64",) * 3] * (n - 1) + [("affine3-g64", "affine5-g64", "f32")],
            f"experts.layer_codecs[{n - 1}].up",
            CodecError,
        ),
        ([("affine3-g64",) * 3] * n, "experts.layer_codecs", GeometryError),  # one codec: a v2 store
    ):
        with pytest.raises(err) as e:
            em.Geometry(FAM, table)
        assert e.value.field == field, str(e.value)
