"""manifest.norm_weights: how the artifact stores the ZeroCenteredRMSNorm weights, read by admission
into the typed Manifest and obeyed by the loader (fold 1 + w at load, or use them as is).

Provenance (AFN-014): the shipped demo artifact (converted by the project's converter from a trained
checkpoint) and copies of it in which exactly one thing is changed: the field, or the field together
with the norm tensors rewritten as 1 + w in place (f32 codec, so the rewrite is exact). Which tensors
are norms is read off the graph's module types, not their names.
"""

import json
import os
import struct

import mlx.core as mx
import numpy as np
import pytest
from support.artifact_fixture import copy_artifact, edit_manifest, load_manifest, refresh_store

from hebrus_mlx.admission import admit
from hebrus_mlx.artifact.errors import ArtifactError
from hebrus_mlx.loader import load_model
from hebrus_mlx.models.mtp_head import MTPHead
from hebrus_mlx.models.qwen4exp import Model, ZeroCenteredRMSNorm

DEMO = os.path.join(os.path.dirname(__file__), "..", "hebrus_mlx", "demo", "model")


def _norm_keys(module, prefix=""):
    return {prefix + name + ".weight" for name, m in module.named_modules() if isinstance(m, ZeroCenteredRMSNorm)}


def _fold_in_place(d, path, keys):
    """Rewrite the named F32 tensors of a safetensors store as 1 + w, bytes in place."""
    p = os.path.join(d, path)
    with open(p, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        for key in keys:
            e = header[key]
            assert e["dtype"] == "F32", key
            start, end = e["data_offsets"]
            f.seek(8 + n + start)
            w = np.frombuffer(f.read(end - start), dtype="<f4")
            f.seek(8 + n + start)
            f.write((np.float32(1.0) + w).astype("<f4").tobytes())
    refresh_store(d, path)


def _outputs(model, ids):
    logits, hidden = model(ids, return_hidden=True)
    head = model.mtp_head
    mixed, _ = head(model.model.embed_tokens(ids), hidden, head.make_cache())
    mx.eval(logits, mixed)
    return np.array(logits), np.array(mixed)


@pytest.fixture(scope="module")
def demo_reference():
    m = admit(DEMO)
    ids = mx.array(np.random.default_rng(0).integers(3, m.args.vocab_size, (1, 24)))
    return m, ids, _outputs(load_model(DEMO), ids)


def test_demo_records_zero_centered(demo_reference):
    m, _, _ = demo_reference
    assert load_manifest(DEMO)["norm_weights"] == "zero_centered"
    assert m.norm_weights == "zero_centered"


def test_folded_store_gives_bit_identical_outputs(demo_reference, tmp_path):
    """Norm weights stored as 1 + w with norm_weights=folded load to the same logits and MTP output
    bit for bit: the loader used them as the scale and did not add 1 again."""
    m, ids, (logits, mixed) = demo_reference
    d = copy_artifact(DEMO, str(tmp_path / "a"))
    dense = _norm_keys(Model(m.args))
    assert len(dense) > 10  # hc norms, q/k norms, indexer norms, PLE norms
    _fold_in_place(d, "model.safetensors", dense)
    _fold_in_place(d, "mtp.safetensors", _norm_keys(MTPHead(m.args), "mtp."))
    edit_manifest(d, lambda man: man.__setitem__("norm_weights", "folded"))
    assert admit(d).norm_weights == "folded"
    got = _outputs(load_model(d), ids)
    np.testing.assert_array_equal(got[0], logits)
    np.testing.assert_array_equal(got[1], mixed)


def test_the_field_not_the_weights_decides(demo_reference, tmp_path):
    """Same zero-centred bytes, field flipped to folded: the loader obeys the field (no guessing from
    the values), so the outputs change."""
    m, ids, (logits, mixed) = demo_reference
    d = copy_artifact(DEMO, str(tmp_path / "a"))
    edit_manifest(d, lambda man: man.__setitem__("norm_weights", "folded"))
    got = _outputs(load_model(d), ids)
    assert not np.array_equal(got[0], logits)
    assert not np.array_equal(got[1], mixed)


def test_absent_field_means_zero_centered_in_schema_v1(demo_reference, tmp_path):
    """Schema v1 rule: artifacts written before the field existed hold the source's zero-centred
    weights; they admit as zero_centered and load to the same outputs."""
    m, ids, (logits, mixed) = demo_reference
    d = copy_artifact(DEMO, str(tmp_path / "a"))
    edit_manifest(d, lambda man: man.pop("norm_weights"))
    assert admit(d).norm_weights == "zero_centered"
    got = _outputs(load_model(d), ids)
    np.testing.assert_array_equal(got[0], logits)
    np.testing.assert_array_equal(got[1], mixed)


@pytest.mark.parametrize("value", ["one_plus_w", "", 1, None, ["folded"]])
def test_unknown_value_refused_naming_the_field(tmp_path, value):
    d = copy_artifact(DEMO, str(tmp_path / "a"))
    edit_manifest(d, lambda man: man.__setitem__("norm_weights", value))
    with pytest.raises(ArtifactError) as e:
        admit(d)
    assert (e.value.stage, e.value.field) == ("bounds", "manifest.norm_weights"), str(e.value)
