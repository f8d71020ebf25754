"""The MTP head as an optional artifact component: convert -> admit -> load round trips with and
without it, the same codecs as the text model, and malformed MTP stores rejected at their stage
with the field named. Checkpoint: transformers `save_pretrained` tiny model (artifact_fixture)
plus random `mtp.*` tensors in the released per-expert layout (mtp_fixture, contract control)."""

import os

import mlx.core as mx
import numpy as np
import pytest
from support.artifact_fixture import (
    copy_artifact,
    edit_manifest,
    edit_safetensors_header,
    load_manifest,
    tiny_checkpoint,
)
from support.mtp_fixture import add_mtp_tensors

from hebrus_mlx.admission import admit
from hebrus_mlx.artifact.errors import ArtifactError
from hebrus_mlx.convert import add_mtp, convert
from hebrus_mlx.format import checkpoint_keys as keys
from hebrus_mlx.loader import load_hf_model, load_model
from hebrus_mlx.models.qwen4exp import Capture

IDS = mx.array([[5, 9, 3, 7, 11, 2, 4, 8, 13, 6, 7, 19, 3, 3, 4, 30, 2]])  # > QSA window (11)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_art")
    hf = add_mtp_tensors(tiny_checkpoint(str(root / "hf")), seed=5)
    out = {}
    for name, kw in (
        ("f32", dict(dtype="float32")),
        ("affine4", dict(q_bits=4)),
        ("f32-nomtp", dict(dtype="float32", mtp=False)),
    ):
        out[name] = str(root / name)
        convert(hf, out[name], quiet=True, **kw)
    return hf, out


def _draft_logits(model):
    cap = Capture()
    model(IDS, capture=cap)
    head = model.mtp_head
    mixed, _ = head(model.model.embed_tokens(IDS[:, 1:]), cap.hidden[-1][:, :-1], head.make_cache())
    return np.array(model.lm_head(mixed))


def test_f32_round_trip_equals_checkpoint_head(built):
    hf, out = built
    report = admit(out["f32"]).report
    assert "mtp.safetensors" in report["owners"]
    m = load_manifest(out["f32"])
    assert m["policy"]["mtp"] == "included" and m["exclusions"]["mtp"] == 0
    art = load_model(out["f32"])
    np.testing.assert_array_equal(_draft_logits(art), _draft_logits(load_hf_model(hf)))


def test_affine_head_uses_the_text_codecs(built):
    """Quantized MTP tensors are exactly MLX's own quantization of the same bf16 weights."""
    hf, out = built
    raw = mx.load(os.path.join(hf, "model.safetensors"))
    head = load_model(out["affine4"]).mtp_head
    inv = load_manifest(out["affine4"])["stores"][-1]["tensors"]
    assert inv["mtp.layers.0.self_attn.q_proj.weight"]["codec"] == "affine4-g64"
    assert inv["mtp.layers.0.mlp.switch_mlp.down_proj.weight"]["codec"] == "affine4-g64"
    assert inv["mtp.fc_hidden.weight"]["codec"] == "f32"  # not a quantized suffix, like routers/norms
    cases = [
        (head.layers[0].self_attn.q_proj, raw["mtp.layers.0.self_attn.q_proj.weight"]),
        (
            head.layers[0].mlp.switch_mlp.up_proj,
            mx.stack([raw[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] for e in range(8)]),
        ),
    ]
    for layer, w in cases:
        q, s, b = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
        np.testing.assert_array_equal(np.array(layer.weight), np.array(q))
        np.testing.assert_array_equal(np.array(layer.scales), np.array(s.astype(mx.float32)))
        np.testing.assert_array_equal(np.array(layer.biases), np.array(b.astype(mx.float32)))
    np.testing.assert_array_equal(np.array(head.fc_hidden.weight), np.array(raw["mtp.fc_hidden.weight"]))


def test_without_head(built):
    hf, out = built
    admit(out["f32-nomtp"])
    m = load_manifest(out["f32-nomtp"])
    assert m["policy"]["mtp"] == "excluded"
    assert m["exclusions"]["mtp"] == len(keys.expected_mtp_keys(load_hf_model(hf).args))
    assert not os.path.exists(os.path.join(out["f32-nomtp"], "mtp.safetensors"))
    assert load_model(out["f32-nomtp"]).mtp_head is None


def test_add_mtp_republishes_with_a_head(built, tmp_path):
    """add_mtp grafts a head onto an artifact without one; the other files stay byte-identical."""
    hf, out = built
    d = copy_artifact(out["f32-nomtp"], str(tmp_path / "a"))
    before = {f: open(os.path.join(d, f), "rb").read() for f in os.listdir(d) if f != "manifest.json"}
    src = tmp_path / "mtp_only"
    src.mkdir()
    raw = mx.load(os.path.join(hf, "model.safetensors"))
    mx.save_safetensors(str(src / "mtp.safetensors"), {k: v for k, v in raw.items() if k.startswith("mtp.")})
    add_mtp(d, str(src), quiet=True)
    for f, data in before.items():
        assert open(os.path.join(d, f), "rb").read() == data, f
    np.testing.assert_array_equal(_draft_logits(load_model(d)), _draft_logits(load_model(out["f32"])))


def _mtp_index(m):
    return next(i for i, s in enumerate(m["stores"]) if s["role"] == "mtp")


def _drop_tensor(d):
    edit_safetensors_header(d, lambda h: h.pop("mtp.fc_hidden.weight"), path="mtp.safetensors")


def _reshape_tensor(d):
    edit_safetensors_header(
        d, lambda h: h["mtp.pre_fc_norm_hidden.weight"].__setitem__("shape", [64, 4]), path="mtp.safetensors"
    )


def _inventory(fn):
    return lambda d: edit_manifest(d, lambda m: fn(m["stores"][_mtp_index(m)]))


MALFORMED = [
    ("missing-tensor", _drop_tensor, "mtp", "mtp.tensors.mtp.fc_hidden.weight"),
    ("wrong-shape", _reshape_tensor, "mtp", "mtp.tensors.mtp.pre_fc_norm_hidden.weight.shape"),
    (
        "inventory-codec",
        _inventory(lambda s: s["tensors"]["mtp.fc_hidden.weight"].__setitem__("codec", "bf16")),
        "mtp",
        "stores[3].tensors.mtp.fc_hidden.weight.codec",
    ),
    (
        "inventory-offsets",
        _inventory(lambda s: s["tensors"]["mtp.fc_hidden.weight"].__setitem__("data_offsets", [0, 4])),
        "mtp",
        "stores[3].tensors.mtp.fc_hidden.weight.data_offsets",
    ),
    ("inventory-missing", _inventory(lambda s: s.__setitem__("tensors", None)), "mtp", "stores[3].tensors"),
    ("format", _inventory(lambda s: s.__setitem__("format", "expert_major.v2")), "mtp", "stores[3].format"),
    ("source-count", _inventory(lambda s: s.__setitem__("source_tensors", 3)), "mtp", "stores[3].source_tensors"),
    (
        "policy-says-excluded",
        lambda d: edit_manifest(d, lambda m: m["policy"].__setitem__("mtp", "excluded")),
        "policy",
        "policy.mtp",
    ),
    (
        "exclusion-count",
        lambda d: edit_manifest(d, lambda m: m["exclusions"].__setitem__("mtp", 5)),
        "policy",
        "exclusions.mtp",
    ),
    (
        "store-unlisted",
        lambda d: edit_manifest(d, lambda m: m["stores"].pop(_mtp_index(m))),
        "bounds",
        "bounds.mtp.safetensors",
    ),
]


@pytest.mark.parametrize("name,mutate,stage,field", MALFORMED, ids=[f[0] for f in MALFORMED])
def test_malformed_mtp_store_rejected(built, tmp_path, name, mutate, stage, field):
    d = copy_artifact(built[1]["f32"], str(tmp_path / "a"))
    mutate(d)
    with pytest.raises(ArtifactError) as e:
        admit(d)
    assert (getattr(e.value, "stage", None), e.value.field) == (stage, field), str(e.value)


def test_admit_cli_names_the_mtp_field(built, tmp_path):
    from hebrus_mlx.cli import main

    d = copy_artifact(built[1]["f32"], str(tmp_path / "a"))
    _drop_tensor(d)
    assert main(["admit", d]) == 2
