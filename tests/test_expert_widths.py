"""Issue 23 §2: each component at its own width (`convert --q-bits --expert-bits --ple-dtype`),
recorded per component in the manifest, admitted strictly, and streamed at the width's record
size with greedy tokens identical to the same artifact run resident.

Provenance: the source is the tiny transformers capture (artifact_fixture.tiny_checkpoint); the
reference for every streamed run is the same artifact loaded resident (plain MLX gather_qmm over
the whole stacked expert tensors), and the record sizes are derived here from MLX's own
`mx.quantize` output shapes, not from the product's codec table.
"""

import os
import shutil

import mlx.core as mx
import numpy as np
import pytest
from support.artifact_fixture import load_manifest, quantized_artifacts, save_manifest, tiny_checkpoint
from support.chunked_greedy import assert_streamed_equals_resident
from support.stream_store import cache_gb

from hebrus_mlx.admission import admit
from hebrus_mlx.artifact import constants as C
from hebrus_mlx.artifact.errors import AdmissionError, ArtifactError
from hebrus_mlx.cli import main as cli_main
from hebrus_mlx.convert import convert
from hebrus_mlx.loader import load_model
from hebrus_mlx.stream import engine as se

WIDTHS = [(2, 64), (3, 32), (4, 64), (6, 64), (8, 32)]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny_checkpoint(str(tmp_path_factory.mktemp("widths") / "hf"))


@pytest.fixture(scope="module")
def artifacts(hf, tmp_path_factory):
    """{expert bits: artifact dir}, dense at 4 bits / group 64, experts at each width."""
    variants = {bits: (f"e{bits}", {"expert_bits": bits, "expert_group_size": group}) for bits, group in WIDTHS}
    return quantized_artifacts(hf, tmp_path_factory.mktemp("widths-art"), variants)


def _record_bytes(bits, group, fam):
    """One expert record's payload bytes, from mx.quantize's own output (uint32 weight, bf16
    scales and biases) for each projection."""
    n = 0
    for rows, cols in fam.component_shapes().values():
        q, s, b = mx.quantize(mx.zeros((rows, cols), mx.bfloat16), group_size=group, bits=bits)
        n += q.nbytes + s.nbytes + b.nbytes
    return n


def test_manifest_records_each_component_width(artifacts):
    for bits, group in WIDTHS:
        m = admit(artifacts[bits])
        want = {"dense": "affine4-g64", "experts": f"affine{bits}-g{group}", "ple": "bf16"}
        assert m.codecs == want and m.experts.codec == want["experts"]
        assert m.profile == ("text-affine4-g64" if bits == 4 else C.profile_name(want))
        assert all(rec["codec"] in ("affine4-g64", "f32") for rec in m.tensors.values())
        from hebrus_mlx.artifact.expert_major import Geometry

        g = Geometry(m.family, m.experts.codec)
        assert g.record_bytes == _record_bytes(bits, group, m.family)
    sizes = [admit(artifacts[b]).experts.size for b, _ in WIDTHS]
    assert sizes[0] < sizes[1] < sizes[2] < sizes[3] < sizes[4] or sizes == sorted(sizes)


def test_uniform_and_float_dense_profiles(hf, tmp_path):
    """--q-bits 3 alone: one width everywhere, a named profile; --dtype bfloat16 --expert-bits 2:
    float dense, 2-bit experts; --ple-dtype float32 changes the PLE store only."""
    a = str(tmp_path / "u3")
    convert(hf, a, q_bits=3, quiet=True)
    assert admit(a).profile == "text-affine3-g64"
    b = str(tmp_path / "bf")
    convert(hf, b, dtype="bfloat16", expert_bits=2, ple_dtype="float32", quiet=True)
    m = admit(b)
    assert m.codecs == {"dense": "bf16", "experts": "affine2-g64", "ple": "f32"}
    assert m.profile == "text-mixed/dense=bf16,experts=affine2-g64,ple=f32"
    assert all(s.codec == "f32" for s in m.ple)


def test_legacy_profile_name_unchanged(hf, tmp_path):
    """A conversion with the old flags writes exactly the old profile and codecs (older
    manifests keep being admitted exactly as before: same names, same codec ids)."""
    a = str(tmp_path / "old")
    convert(hf, a, quiet=True)
    man = load_manifest(a)
    assert man["profile"] == "text-affine4-g64"
    assert man["codecs"] == {"dense": "affine4-g64", "experts": "affine4-g64", "ple": "bf16"}
    assert C.codec("affine4-g64").codec_id == 1 and C.codec("affine8-g64").codec_id == 2


def _mutated(src, tmp_path, name, edit):
    d = str(tmp_path / name)
    shutil.copytree(src, d)
    m = load_manifest(d)
    edit(m)
    save_manifest(d, m)
    return d


def test_admission_refuses_inconsistent_widths(artifacts, tmp_path):
    src = artifacts[3]

    def profile(m, name):
        m["profile"] = name

    cases = {
        # the profile says 2-bit experts, codecs and store say 3-bit
        "codecs.experts": lambda m: profile(m, "text-mixed/dense=affine4-g64,experts=affine2-g32,ple=bf16"),
        # a width with no codec
        "profile.experts": lambda m: profile(m, "text-mixed/dense=affine4-g64,experts=affine5-g32,ple=bf16"),
        # not the canonical spelling (components reordered)
        "profile": lambda m: profile(m, "text-mixed/experts=affine3-g32,dense=affine4-g64,ple=bf16"),
    }
    for field, edit in cases.items():
        with pytest.raises(AdmissionError) as e:
            admit(_mutated(src, tmp_path, field, edit))
        assert e.value.field == field, (field, str(e.value))


def test_store_bytes_not_matching_declared_width_refused(artifacts, tmp_path):
    """Manifest, profile and store entry all claim 2-bit experts while the store holds 3-bit
    records: the store's header names another codec and its size is not a 2-bit store's."""

    def claim2(m):
        m["profile"] = "text-mixed/dense=affine4-g64,experts=affine2-g32,ple=bf16"
        m["codecs"]["experts"] = "affine2-g32"
        for s in m["stores"]:
            if s["role"] in ("experts",):
                s["codec"] = "affine2-g32"

    d = _mutated(artifacts[3], tmp_path, "claim2", claim2)
    m = load_manifest(d)
    if any(s["role"] == "mtp" for s in m["stores"]):
        pytest.skip("tiny artifact carries an MTP head")
    with pytest.raises(ArtifactError) as e:
        admit(d)
    assert e.value.field.startswith("experts.") and "codec" in e.value.field, str(e.value)


def test_cli_refuses_unknown_width(hf, tmp_path, capsys):
    for flags, field in (
        (["--expert-bits", "5"], "expert_bits"),
        (["--expert-group-size", "16"], "expert_group_size"),
        (["--q-bits", "7"], "q_bits"),
    ):
        capsys.readouterr()
        out = str(tmp_path / "x")
        assert cli_main(["convert", "--hf-path", hf, "--out", out, *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"error: {field}: no codec for bits=" in err, err
        assert not os.path.exists(out)


@pytest.mark.skipif(not se.available(), reason="extension not built")
@pytest.mark.parametrize("bits", [b for b, _ in WIDTHS])
def test_streamed_equals_resident_at_each_width(artifacts, bits):
    """A 5%-of-records cache (misses and evictions on every step): the same greedy tokens and
    bitwise-equal logits as the same artifact resident, at every expert width."""
    art = artifacts[bits]
    gb, rows = cache_gb(art, 0.05)
    resident, streamed = load_model(art), load_model(art, expert_cache_gb=gb)
    assert resident.streaming is None and streamed.streaming is not None
    e = streamed.streaming.experts
    assert e.bits == bits and e.rows == rows
    prompt = np.random.default_rng(bits).integers(2, resident.args.vocab_size, 9).tolist()
    assert_streamed_equals_resident(resident, streamed, prompt, 12)


def test_mtp_head_experts_take_the_expert_width(hf, tmp_path):
    """The MTP head's routed experts are stored at the expert width, its dense tensors at the
    dense one; the artifact admits and the head loads at those widths."""
    from support.mtp_fixture import add_mtp_tensors

    src = add_mtp_tensors(shutil.copytree(hf, tmp_path / "hf"), seed=5)
    art = str(tmp_path / "art")
    convert(str(src), art, q_bits=4, expert_bits=2, quiet=True)
    m = admit(art)
    inv = m.mtp.tensors
    assert inv["mtp.layers.0.mlp.switch_mlp.down_proj.weight"]["codec"] == "affine2-g64"
    assert inv["mtp.layers.0.self_attn.q_proj.weight"]["codec"] == "affine4-g64"
    assert {r["codec"] for k, r in inv.items() if ".switch_mlp." not in k} <= {"affine4-g64", "f32"}
    model = load_model(art)
    assert model.mtp_head is not None
    sw = model.mtp_head.layers[0].mlp.switch_mlp if hasattr(model.mtp_head, "layers") else None
    if sw is not None:
        assert sw.down_proj.bits == 2
