"""PLE rows below 16 bits (AFN-003's codec fields): `convert --ple-dtype q8|q4` stores affine
rows (ple-affine8 / ple-affine4, group 32 or the whole row when narrower), admitted strictly,
streamed bitwise equal to the resident table.

Provenance: the source is the tiny transformers capture (artifact_fixture.tiny_checkpoint); the
decoded rows are checked against the checkpoint's own PLE shards (read with safetensors, not
through the converter) and, for the real table's 160-value rows, against MLX's own
`mx.dequantize` of the same packed bytes; row sizes come from `mx.quantize`'s output shapes.
"""

import os
import shutil
import struct

import mlx.core as mx
import numpy as np
import pytest
from support.artifact_fixture import (
    copy_artifact,
    edit_manifest,
    load_manifest,
    patch_bytes,
    quantized_artifacts,
    tiny_checkpoint,
)

from hebrus_mlx.admission import admit
from hebrus_mlx.artifact import constants as C
from hebrus_mlx.artifact import ple_pages as pp
from hebrus_mlx.artifact.errors import ArtifactError, CodecError, GeometryError
from hebrus_mlx.cli import main as cli_main
from hebrus_mlx.loader import load_model
from hebrus_mlx.models.qwen4exp import QuantizedNGramTable, dequantize_ple_rows
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream.ple import StreamedNGramTable

WIDTHS = ("bfloat16", "q8", "q4")
PLE = "ple.0.hbpl"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny_checkpoint(str(tmp_path_factory.mktemp("ple-widths") / "hf"))


@pytest.fixture(scope="module")
def arts(hf, tmp_path_factory):
    variants = {w: (w, {"ple_dtype": w, "mtp": False}) for w in WIDTHS}
    return quantized_artifacts(hf, tmp_path_factory.mktemp("ple-widths-art"), variants)


def _source_table(hf):
    """The checkpoint's PLE table: its shards concatenated, as float32 (read independently)."""
    from safetensors.numpy import load_file

    w = {}
    for f in sorted(os.listdir(hf)):
        if f.endswith(".safetensors"):
            w.update({k: v for k, v in load_file(os.path.join(hf, f)).items() if ".ngram_embedding.shard_" in k})
    keys = sorted(w, key=lambda k: int(k.split("shard_")[1].split(".")[0]))
    return np.concatenate([w[k].astype(np.float32) for k in keys])


def _mlx_row_bytes(bits, width, group):
    q, s, b = mx.quantize(mx.zeros((1, width), mx.bfloat16), group_size=group, bits=bits)
    return q.nbytes + s.nbytes + b.nbytes


def test_manifest_codec_and_row_sizes(arts):
    """The profile records the PLE codec; a row is what mx.quantize makes of it (the real table's
    160-value rows at group 32: 180 / 100 bytes against bf16's 320)."""
    for w, name in zip(WIDTHS, ("bf16", "ple-affine8", "ple-affine4")):
        m = admit(arts[w])
        assert m.codecs["ple"] == name and all(s.codec == name for s in m.ple)
    fam = C.QWEN38_FLASH_NEXT
    for bits in (8, 4):
        g = pp.Geometry(fam, 0, C.ple_affine_name(bits))
        assert (g.group_size, g.row_bytes) == (32, _mlx_row_bytes(bits, 160, 32))
    assert pp.Geometry(fam, 0, "bf16").row_bytes == 320
    sizes = [admit(arts[w]).ple[0].size for w in WIDTHS]
    assert sizes[0] > sizes[1] > sizes[2]


def test_stored_rows_decode_close_to_the_source(hf, arts):
    """Every stored row decodes to the checkpoint's row within half a step of its group (plus the
    bf16 rounding of scale and bias); the decode of the real geometry equals mx.dequantize's."""
    src = _source_table(hf)
    for w, bits in (("q8", 8), ("q4", 4)):
        m = admit(arts[w])
        with pp.PleReader(m.file(m.ple[0])) as r:
            g = r.geometry
            got = pp.decode_rows(r.read_rows(range(len(src))), g.codec.name, g.width)
        x = src.reshape(len(src), -1, g.group_size)
        lo = x.min(axis=2)
        # half a step of the group's range widened by the bias's bf16 rounding (< 2**-7 relative)
        step = (x.max(axis=2) - lo + np.abs(lo) * 2**-7) / ((1 << bits) - 1) * (1 + 2**-7)
        err = np.abs(got.reshape(x.shape) - x)
        assert (err <= step[..., None] * 0.5 + 1e-6).all()
        assert err.max() > 0  # quantized, not copied
    rows = np.random.default_rng(1).standard_normal((64, 160)).astype(np.float32) * 0.05
    for bits in (8, 4):
        name = C.ple_affine_name(bits)
        enc = pp.encode_rows(rows, name)
        packed = 160 * bits // 8
        q = mx.array(np.ascontiguousarray(enc[:, :packed]).view(np.uint32))
        s = (
            mx.array(np.ascontiguousarray(enc[:, packed : packed + 10]).view(np.uint16))
            .view(mx.bfloat16)
            .astype(mx.float32)
        )
        b = mx.array(np.ascontiguousarray(enc[:, packed + 10 :]).view(np.uint16)).view(mx.bfloat16).astype(mx.float32)
        want = np.array(mx.dequantize(q, s, b, group_size=32, bits=bits))
        np.testing.assert_array_equal(pp.decode_rows(enc, name, 160), want)
        np.testing.assert_array_equal(np.array(dequantize_ple_rows(mx.array(enc), bits, 32, 160)), want)


@pytest.mark.skipif(not se.available(), reason="extension not built")
@pytest.mark.parametrize("width", WIDTHS)
def test_streamed_rows_equal_resident_bitwise(arts, width):
    """AFN-003/AFN-019: at every PLE width, logits over prefill chunks and single-token decode
    with rows from streamed page snapshots equal the resident table's bitwise; the resident
    affine table stays at its stored bytes."""
    resident, streamed = load_model(arts[width]), load_model(arts[width], ple_cache_gb=0.001)
    table = resident.model.layers[0].ple.ple_embedding.ngram_embedding
    assert isinstance(streamed.model.layers[0].ple.ple_embedding.ngram_embedding, StreamedNGramTable)
    if width != "bfloat16":
        g = pp.Geometry(admit(arts[width]).family, 0, C.PLE_DTYPES[width])
        assert isinstance(table, QuantizedNGramTable)
        assert table.weight.dtype == mx.uint8 and table.weight.shape == (g.total_rows, g.row_bytes)
    ids = np.random.default_rng(3).integers(2, resident.args.vocab_size, 20).tolist()
    outs = []
    for model in (resident, streamed):
        cache, got = model.make_cache(), []
        for part in (ids[:7], ids[7:12], *[[t] for t in ids[12:]]):
            out = model(mx.array([part]), cache)
            mx.eval(out)
            got.append(np.array(out))
        outs.append(got)
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


def test_quantized_rows_change_the_logits(arts):
    """The widths are really different tables: q8 close to bf16, q4 further, neither equal."""
    ids = mx.array([[5, 6, 7, 8, 9, 10, 11, 3, 4, 5]])
    out = {}
    for w in WIDTHS:
        model = load_model(arts[w])
        out[w] = model(ids, model.make_cache()).astype(mx.float32)
    d8 = float(mx.abs(out["q8"] - out["bfloat16"]).max())
    d4 = float(mx.abs(out["q4"] - out["bfloat16"]).max())
    assert 0 < d8 < d4


def _header(d, offset, fmt, value):
    patch_bytes(os.path.join(d, PLE), offset, fmt, value)


def _set_codec(name):
    """The manifest names codec `name` for the PLE store everywhere (profile, codecs, store)."""

    def edit(m):
        m["codecs"]["ple"] = name
        m["profile"] = C.profile_name(m["codecs"])
        for s in m["stores"]:
            if s["role"] == "ple":
                s["codec"] = name

    return lambda d: edit_manifest(d, edit)


def _profile_ple(name):
    def edit(m):
        m["codecs"]["ple"] = name
        m["profile"] = f"{C.MIXED_PREFIX}dense=affine4-g64,experts=affine4-g64,ple={name}"

    return lambda d: edit_manifest(d, edit)


def _store_codec(name):
    return lambda d: edit_manifest(d, lambda m: [s.update(codec=name) for s in m["stores"] if s["role"] == "ple"])


# (name, mutation of the q4 artifact, field named). Header offsets: ple_pages._HEADER.
NEGATIVE = [
    ("unknown-codec-id", lambda d: _header(d, 20, "<I", 0x250), "ple.codec_id"),
    ("expert-codec-id", lambda d: _header(d, 20, "<I", C.codec("affine4-g64").codec_id), "ple.codec"),
    ("other-width-codec-id", lambda d: _header(d, 20, "<I", C.codec("ple-affine8").codec_id), "ple.codec_id"),
    ("non-canonical-group", lambda d: _header(d, 24, "<I", 8), "ple.group_size"),
    ("row-bytes-not-its-width", lambda d: _header(d, 32, "<I", 40), "ple.row_bytes"),
    ("manifest-says-q8", _set_codec("ple-affine8"), "ple.codec_id"),
    ("store-entry-codec", _store_codec("ple-affine8"), "stores[2].codec"),
    ("unknown-profile-codec", _profile_ple("ple-affine3"), "profile"),
    ("expert-codec-as-ple", lambda d: edit_manifest(d, lambda m: m["codecs"].update(ple="affine4-g64")), "codecs"),
]


@pytest.mark.parametrize("name,mutate,field", NEGATIVE, ids=[n[0] for n in NEGATIVE])
def test_bad_ple_codec_is_refused_naming_the_field(arts, tmp_path, name, mutate, field):
    """AFN-004/AFN-003: an unknown, mismatched or non-canonical PLE codec, or a row size that is not
    its width's, is refused at admission naming the field."""
    d = copy_artifact(arts["q4"], str(tmp_path / "a"))
    assert [s["path"] for s in load_manifest(d)["stores"]][2] == PLE
    mutate(d)
    with pytest.raises(ArtifactError) as e:
        admit(d)
    assert e.value.field.startswith(field), str(e.value)


def test_page_whose_row_size_is_not_its_width_is_refused(arts, tmp_path):
    """A page header claiming another row size or codec is refused on read, naming the page's field
    (before its digest is looked at), and nothing is decoded from it."""
    d = copy_artifact(arts["q4"], str(tmp_path / "a"))
    with pp.PleReader(os.path.join(d, PLE)) as r:
        page0 = r.geometry.payload_offset
    for off, field in ((32, "row_bytes"), (40, "codec_id"), (44, "group_size")):
        shutil.copy(os.path.join(arts["q4"], PLE), os.path.join(d, PLE))
        (old,) = struct.unpack_from("<I", open(os.path.join(d, PLE), "rb").read(), page0 + off)
        patch_bytes(os.path.join(d, PLE), page0 + off, "<I", old + 1)
        with pp.PleReader(os.path.join(d, PLE)) as r, pytest.raises(GeometryError) as e:
            r.read_rows([0])
        assert e.value.field == f"ple.page[0].{field}", str(e.value)


def test_geometry_refuses_codecs_that_do_not_fit(tmp_path):
    """An expert codec is no PLE codec; a PLE codec is no dense/expert codec; rows that do not
    split into groups are refused naming the width."""
    fam = C.QWEN38_FLASH_NEXT
    with pytest.raises(CodecError, match="ple.codec"):
        pp.Geometry(fam, 0, "affine4-g32")
    for comp in ("dense", "experts"):
        codecs = {"dense": "affine4-g64", "experts": "affine4-g64", "ple": "bf16", comp: "ple-affine4"}
        with pytest.raises(CodecError) as e:
            C.profile_name(codecs, "quantization")
        assert e.value.field == f"quantization.{comp}"
    with pytest.raises(CodecError) as e:
        pp.encode_rows(np.zeros((2, 7), np.float32), "ple-affine4")
    assert e.value.field == "ple.width"
    with pytest.raises(CodecError) as e:
        pp.encode_rows(np.full((2, 8), np.nan, np.float32), "ple-affine8")
    assert e.value.field == "ple.rows"


def test_convert_cli_refuses_an_unknown_ple_width(hf, tmp_path, capsys):
    """One line naming the flag and the widths there are; nothing written."""
    rc = cli_main(["convert", "--hf-path", hf, "--out", str(tmp_path / "o"), "--ple-dtype", "q3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--ple-dtype" in err[0] and not os.path.exists(tmp_path / "o")
    assert "'q8', 'q4'" in err[0], err  # the widths it offers
