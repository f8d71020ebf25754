"""Issue 16: `hebrus-mlx convert` imports the 4-bit MLX conversions users
already downloaded (mlx-vlm / mlx-community layout) without dequantizing or
requantizing the quantized weights.

Provenance (AFN-014): the source checkpoint is written by mlx-vlm 0.7.10's own
sanitize / quantize_model / save_weights (tests/support/mlx_vlm_fixture.py) from the
tiny transformers checkpoint. The oracles are that file's bytes, read with
safetensors' own numpy reader (not the product's), and the logits of the
model mlx-vlm's own `load_model` builds from it.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from support import mlx_vlm_fixture as V
from support.artifact_fixture import tiny_checkpoint

from hebrus_mlx.cli import main as cli_main

pytestmark = pytest.mark.skipif(not V.available(), reason=f"mlx-vlm 0.7.10 not unpacked at {V.MLX_VLM_ROOT}")

IDS = [[2, 3, 3, 2, 1, 0, 2, 3, 5, 7, 11, 2, 300, 17]]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(mlx-vlm dir, artifact dir, convert report)."""
    from hebrus_mlx.convert import convert

    root = tmp_path_factory.mktemp("mlxq")
    hf = tiny_checkpoint(str(root / "hf"))
    src = str(root / "mlx")
    V.mlx_vlm_checkpoint(hf, src, bits=4, group_size=64)
    art = str(root / "art")
    return src, art, convert(src, art, quiet=True).report


def test_profile_and_exclusions(imported):
    src, art, report = imported
    assert report["profile"] == "text-affine4-g64"
    assert report["exclusions"]["vision"] == sum(k.startswith("vision_tower.") for k in V.shard_tensors(src))
    assert report["exclusions"]["vision"] > 0


def test_expert_records_are_the_mlx_vlm_packed_arrays(imported):
    """Every ExpertMajor record part is byte-identical to expert e's slice of
    mlx-vlm's stacked switch_mlp weight/scales/biases."""
    from hebrus_mlx.artifact import constants as C
    from hebrus_mlx.artifact import expert_major as em

    src, art, _ = imported
    t = V.shard_tensors(src)
    checked = 0
    with em.ExpertMajorReader(os.path.join(art, "experts.hbem")) as r:
        layout = em.record_layout(r.family, "affine4-g64")
        for layer in range(r.family.num_hidden_layers):
            for e in range(r.family.num_experts):
                rec = r.read_record(layer, e)
                for comp, part, dtype, shape, off, n in layout:
                    want = t[f"language_model.model.layers.{layer}.mlp.switch_mlp.{comp}_proj.{part}"][e]
                    assert want.dtype == np.dtype(dtype) and want.shape == tuple(shape)
                    assert bytes(rec[off : off + n]) == np.ascontiguousarray(want).tobytes(), (layer, e, comp, part)
                    checked += 1
    assert checked == 4 * 8 * 9 and C.codec("affine4-g64").bits == 4


def _unpack(w, bits):
    """numpy: uint32 [rows, cols*bits/32] -> uint8 codes [rows, cols] (low bits first)."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * bits
    return ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*w.shape[:-1], -1).astype(np.float32)


def _bf16(a):
    return (np.ascontiguousarray(a).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def test_dense_tensors_copied_or_decoded_exactly(imported):
    """Quantized dense tensors the profile quantizes: copied byte for byte.
    Ones the profile keeps float (routers at 8 bits, mixers, decay inputs):
    float32 `scale * code + bias`, computed here with numpy. Float tensors:
    the bf16 values, widened."""
    src, art, _ = imported
    t = V.shard_tensors(src)
    cfg = json.load(open(os.path.join(src, "config.json")))["quantization"]
    stored = V.shard_tensors(art)
    man = json.load(open(os.path.join(art, "manifest.json")))["tensors"]
    kinds = {"copied": 0, "decoded": 0, "float": 0}
    for name, arr in stored.items():
        raw = "language_model." + name
        if man[name]["codec"] == "affine4-g64":
            assert arr.tobytes() == t[raw].tobytes(), name
            kinds["copied"] += 1
        elif raw.endswith(".weight") and raw[:-6] + "scales" in t:
            stem = raw[:-7]
            bits = (cfg.get(stem) or cfg)["bits"]
            group = (cfg.get(stem) or cfg)["group_size"]
            codes = _unpack(t[stem + ".weight"], bits)
            s = np.repeat(_bf16(t[stem + ".scales"]), group, axis=-1)
            b = np.repeat(_bf16(t[stem + ".biases"]), group, axis=-1)
            want = (s * codes + b).astype(np.float32)
            assert np.array_equal(arr, want), name
            kinds["decoded"] += 1
        else:
            v = t[raw]
            want = _bf16(v) if v.dtype == np.uint16 else v  # depthwise convs are MLX [C, K, 1] in both
            assert arr.dtype == np.float32 and np.array_equal(arr, want), name
            kinds["float"] += 1
    # every quantized dense module of the source is accounted for exactly once
    quantized = [
        k
        for k in t
        if k.endswith(".scales")
        and ".switch_mlp." not in k
        and ".shards." not in k
        and not k.startswith("vision_tower.")
    ]
    assert kinds["copied"] == 3 * (len(quantized) - kinds["decoded"]) and kinds["copied"] > 0, kinds
    assert kinds["decoded"] >= 4 * 2 and kinds["float"] > 0, kinds  # at least the 8-bit routers


def test_logits_equal_mlx_vlm(imported):
    """hebrus-mlx on the artifact vs mlx-vlm's own loader on the source, both
    float32 activations over the same packed weights (mlx-vlm's bf16 norms,
    scales and biases widened to float32, as hebrus-mlx loads them)."""
    import mlx.core as mx
    from mlx.utils import tree_map

    from hebrus_mlx import load

    src, art, _ = imported
    _, _, utils = V.import_mlx_vlm()
    ref = utils.load_model(Path(src))
    ref.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, ref.parameters()))
    ids = mx.array(IDS)
    want = np.array(ref.language_model(ids).logits)
    got = np.array(load(art)[0](ids))
    assert want.shape == got.shape == (1, len(IDS[0]), 512)
    assert np.abs(want - got).max() <= 1e-5, np.abs(want - got).max()
    assert np.array_equal(want.argmax(-1), got.argmax(-1))


def test_ple_rows_decode_like_mlx_vlm_quantized_embedding():
    """Affine PLE rows (mlx-vlm quantizes 160-wide PLE shards at group 32)
    are stored as bf16 rows equal bit for bit to what mlx-vlm's quantized
    embedding returns. The tiny families' PLE rows are 16 wide (no affine
    group fits), so this checks the decoding step on a 32-wide table built
    by nn.QuantizedEmbedding, the module mlx-vlm's shards become."""
    import mlx.core as mx
    import mlx.nn as nn

    from hebrus_mlx.convert.mlx_source import MlxSource

    mx.random.seed(3)
    emb = nn.Embedding(300, 32)
    emb.update({"weight": (mx.random.normal((300, 32)) * 0.05).astype(mx.bfloat16)})
    q = nn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=4)
    want = np.array(q(mx.arange(300)).view(mx.uint16))
    parts = {
        "weight": np.array(q.weight),
        "scales": np.array(q.scales.view(mx.uint16)),
        "biases": np.array(q.biases.view(mx.uint16)),
    }
    got = MlxSource._dequantize(parts, 4, 32, mx.bfloat16)
    assert got.dtype == np.uint16 and np.array_equal(got, want)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny_checkpoint(str(tmp_path_factory.mktemp("mlxq-hf") / "hf"))


def test_width_without_codec_is_refused(hf, tmp_path, capsys):
    """An mlx-vlm 5-bit conversion: MLX runs it, the artifact has no affine5 codec (its widths
    are 2/3/4/6/8); refused (never requantized), one line at the CLI, nothing published."""
    src = str(tmp_path / "b5")
    V.mlx_vlm_checkpoint(hf, src, bits=5, group_size=64)
    out = str(tmp_path / "out")
    capsys.readouterr()
    assert cli_main(["convert", "--hf-path", src, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "quantization: bits=5 group_size=64 has no artifact codec" in err
    assert not os.path.exists(out)


# At most indexer_budget + compress_ratio - 1 = 11 tokens: the QSA indexer keeps every key, so no
# top-k selection runs. Past that, hebrus-mlx and mlx-vlm break exact ties between equal index
# scores differently (seen at position 11 of IDS at 2/6/8-bit dense widths: one position's logits
# differ by a routing flip, every other position bit for bit equal); the widths are not what differs.
SHORT = IDS[0][:8]


def _logits_vs_mlx_vlm(src, art):
    """(mlx-vlm's logits on the source, hebrus-mlx's on the artifact) over SHORT, float32 activations."""
    import mlx.core as mx
    from mlx.utils import tree_map

    from hebrus_mlx import load

    _, _, utils = V.import_mlx_vlm()
    ref = utils.load_model(Path(src))
    ref.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, ref.parameters()))
    ids = mx.array([SHORT])
    return np.array(ref.language_model(ids).logits), np.array(load(art)[0](ids))


def _greedy(forward, ids, n):
    import mlx.core as mx

    ids = list(ids)
    for _ in range(n):
        ids.append(int(mx.argmax(forward(mx.array([ids]))[0, -1])))
    return ids[-n:]


@pytest.mark.parametrize(
    "bits,group,expert_bits", [(2, 64, None), (3, 32, None), (6, 64, None), (8, 64, None), (4, 64, 2), (8, 32, 3)]
)
def test_widths_and_mixed_import_as_is(hf, tmp_path, bits, group, expert_bits):
    """MLX conversions at every artifact width (and mixed: dense at `bits`, the routed experts at
    `expert_bits` through per-module entries of the `quantization` block) import without
    requantizing: the profile records each component's width, the expert records are the
    source's packed bytes, and the logits and greedy tokens equal mlx-vlm's own model on the
    same weights."""
    import mlx.core as mx

    from hebrus_mlx import load
    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact import constants as C
    from hebrus_mlx.artifact.expert_major import ExpertMajorReader
    from hebrus_mlx.convert import convert

    src, art = str(tmp_path / "src"), str(tmp_path / "art")
    V.mlx_vlm_checkpoint(hf, src, bits=bits, group_size=group, expert_bits=expert_bits)
    if expert_bits is not None:  # the mixed config mlx-lm writes: one entry per expert module
        q = json.load(open(os.path.join(src, "config.json")))["quantization"]
        assert q["language_model.model.layers.1.mlp.switch_mlp.down_proj"]["bits"] == expert_bits and q["bits"] == bits
    convert(src, art, quiet=True)
    m = admit(art)
    ew = bits if expert_bits is None else expert_bits
    assert m.codecs == {"dense": C.affine_name(bits, group), "experts": C.affine_name(ew, group), "ple": "bf16"}
    t = V.shard_tensors(src)
    with ExpertMajorReader(m.file(m.experts), m.family, m.experts.codec) as r:
        got = r.read_expert(1, 2)["down"]
    stem = "language_model.model.layers.1.mlp.switch_mlp.down_proj"
    for part in ("weight", "scales", "biases"):
        assert np.array_equal(got[part], t[f"{stem}.{part}"][2]), part
    want, mine = _logits_vs_mlx_vlm(src, art)
    assert np.abs(want - mine).max() <= 1e-5, np.abs(want - mine).max()
    _, _, utils = V.import_mlx_vlm()
    ref = utils.load_model(Path(src))
    from mlx.utils import tree_map

    ref.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, ref.parameters()))
    model = load(art)[0]
    assert _greedy(lambda x: ref.language_model(x).logits, SHORT, 3) == _greedy(model, SHORT, 3)


def test_per_layer_mixed_expert_widths_import_as_is(hf, tmp_path):
    """Routed experts at 2 bits in layer 1 only (the rest at the global 4): imported without
    requantizing into a per-layer expert store (each layer's codecs in the manifest; formerly
    refused), logits equal mlx-vlm's on the source. tests/test_mixed_expert_widths.py covers
    mlx-lm's mixed recipes (widths per projection) and admission of the table."""
    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact import constants as C
    from hebrus_mlx.artifact.expert_major import ExpertMajorReader
    from hebrus_mlx.convert import convert

    src, art = str(tmp_path / "src"), str(tmp_path / "art")
    V.mlx_vlm_checkpoint(hf, src, bits=4, group_size=64, expert_bits=2, expert_layers={1})
    convert(src, art, quiet=True)
    m = admit(art)
    assert m.codecs["experts"] == C.PER_LAYER and m.codecs["dense"] == "affine4-g64"
    assert m.experts.layer_codecs == tuple(("affine2-g64" if i == 1 else "affine4-g64",) * 3 for i in range(4))
    t = V.shard_tensors(src)
    with ExpertMajorReader(m.file(m.experts), m.family, m.experts.layer_codecs) as r:
        for layer in (0, 1):
            got = r.read_expert(layer, 2)["down"]
            stem = f"language_model.model.layers.{layer}.mlp.switch_mlp.down_proj"
            for part in ("weight", "scales", "biases"):
                assert np.array_equal(got[part], t[f"{stem}.{part}"][2]), (layer, part)
    want, mine = _logits_vs_mlx_vlm(src, art)
    assert np.abs(want - mine).max() <= 1e-5, np.abs(want - mine).max()


def test_flags_that_would_requantize_are_refused(imported, tmp_path):
    from hebrus_mlx.convert import convert
    from hebrus_mlx.convert.mlx_source import MlxSourceError

    src, _, _ = imported
    for kwargs, field in (
        ({"dtype": "float32"}, "dtype"),
        ({"q_bits": 8}, "q_bits"),
        ({"q_group_size": 128}, "q_group_size"),
    ):
        with pytest.raises(MlxSourceError) as e:
            convert(src, str(tmp_path / "out"), quiet=True, **kwargs)
        assert e.value.field == field
    assert not os.path.exists(tmp_path / "out")


def test_mixed_bits_tensor_is_refused_naming_it(imported, tmp_path):
    """A projection the profile quantizes at 4 bits that the source holds at
    8 bits (what mlx-vlm's mixed recipes write) is refused by name, never
    requantized."""
    import shutil

    import mlx.core as mx

    from hebrus_mlx.artifact.errors import CodecError
    from hebrus_mlx.convert import convert

    src, _, _ = imported
    d = str(tmp_path / "mixed")
    shutil.copytree(src, d)
    stem = "language_model.model.layers.3.self_attn.o_proj"
    shard = os.path.join(d, "model.safetensors")
    w = mx.load(shard)
    dense = mx.dequantize(w[stem + ".weight"], w[stem + ".scales"], w[stem + ".biases"], group_size=64, bits=4)
    w[stem + ".weight"], w[stem + ".scales"], w[stem + ".biases"] = mx.quantize(dense, group_size=64, bits=8)
    mx.save_safetensors(shard, w, metadata={"format": "mlx"})
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["quantization"][stem] = {"group_size": 64, "bits": 8, "mode": "affine"}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(CodecError) as e:
        convert(d, str(tmp_path / "out"), quiet=True)
    assert e.value.field == f"source.{stem}.weight" and "bits=8 group=64" in str(e.value)
    assert not os.path.exists(tmp_path / "out")
