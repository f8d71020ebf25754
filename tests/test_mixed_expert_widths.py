"""Issue 23 §2: MLX conversions whose routed experts differ in width per layer and per projection
(mlx-lm's mixed recipes) import without requantizing: the manifest records each layer's
(gate, up, down) codecs, admission checks them strictly, and the artifact runs resident and
streamed.

Provenance (AFN-014): the source is written by mlx-vlm 0.7.10's own quantize_model / save_weights
(tests/support/mlx_vlm_fixture.py) with mlx-lm's own `mixed_quant_predicate_builder("mixed_3_6")` choosing
each routed-expert projection's width (down_proj at 6 bits in layers 2 and 3 of the tiny model, 3
bits elsewhere; dense at 4). The oracles are the source's bytes read with numpy here, the widths
in the source's own config.json, the logits of mlx-vlm's `load_model` on the source (MLX
dequantizes), and the same artifact loaded resident for the streamed run.
"""

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from support import mlx_vlm_fixture as V
from support.artifact_fixture import load_manifest, save_manifest, tiny_checkpoint
from support.chunked_greedy import assert_streamed_equals_resident

pytestmark = pytest.mark.skipif(not V.available(), reason=f"mlx-vlm 0.7.10 not unpacked at {V.MLX_VLM_ROOT}")

SHORT = [2, 3, 3, 2, 1, 0, 2, 3]  # as test_convert_mlx: below the QSA indexer's top-k
COMPS = ("gate", "up", "down")


def _stem(layer, comp):
    return f"language_model.model.layers.{layer}.mlp.switch_mlp.{comp}_proj"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(source dir, artifact dir): mixed_3_6 experts, dense at 4 bits / group 64."""
    from hebrus_mlx.convert import convert

    pytest.importorskip("mlx_lm.convert")  # the recipe's predicate is mlx-lm's own
    root = tmp_path_factory.mktemp("mixed")
    hf = tiny_checkpoint(str(root / "hf"))
    src, art = str(root / "src"), str(root / "art")
    V.mlx_vlm_checkpoint(hf, src, bits=4, group_size=64, expert_recipe="mixed_3_6")
    convert(src, art, quiet=True)
    return src, art


def _source_widths(src):
    """{(layer, comp): (bits, group)} of the routed experts, from the source's own config."""
    q = json.load(open(os.path.join(src, "config.json")))["quantization"]
    out = {}
    for key, v in q.items():
        if ".switch_mlp." in key:
            layer = int(key.split(".layers.")[1].split(".")[0])
            out[layer, key.rsplit(".", 1)[1][: -len("_proj")]] = (v["bits"], v["group_size"])
    return out


def test_import_records_each_layers_codecs_and_copies_the_bytes(mixed):
    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact import constants as C
    from hebrus_mlx.artifact.expert_major import ExpertMajorReader

    src, art = mixed
    widths = _source_widths(src)
    # The recipe really mixes: down_proj wider in some layers than in others, gate/up narrower.
    assert {widths[layer, "down"][0] for layer in range(4)} == {3, 6} and widths[0, "gate"] == (3, 64)
    m = admit(art)
    assert m.codecs == {"dense": "affine4-g64", "experts": C.PER_LAYER, "ple": "bf16"}
    assert m.experts.format == "expert_major.v3"
    want = tuple(tuple(f"affine{widths[layer, c][0]}-g{widths[layer, c][1]}" for c in COMPS) for layer in range(4))
    assert m.experts.layer_codecs == want
    t = V.shard_tensors(src)
    with ExpertMajorReader(m.file(m.experts), m.family, m.experts.layer_codecs) as r:
        for layer in range(4):
            for e in (0, 5):
                rec = r.read_expert(layer, e)
                for comp in COMPS:
                    for part in ("weight", "scales", "biases"):
                        assert np.array_equal(rec[comp][part], t[f"{_stem(layer, comp)}.{part}"][e]), (layer, comp)


def test_logits_and_tokens_equal_mlx_on_the_source(mixed):
    import mlx.core as mx
    from mlx.utils import tree_map

    from hebrus_mlx import load

    src, art = mixed
    _, _, utils = V.import_mlx_vlm()
    ref = utils.load_model(Path(src))
    ref.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, ref.parameters()))
    model = load(art)[0]
    # Each layer's switch layer runs at its own widths.
    sw = model.model.layers[2].mlp.switch_mlp
    assert (sw.gate_proj.bits, sw.down_proj.bits) == (3, 6)
    assert model.model.layers[0].mlp.switch_mlp.down_proj.bits == 3
    ids = mx.array([SHORT])
    want, mine = np.array(ref.language_model(ids).logits), np.array(model(ids))
    assert np.abs(want - mine).max() <= 1e-5, np.abs(want - mine).max()

    def greedy(forward, n=3):
        out = list(SHORT)
        for _ in range(n):
            out.append(int(mx.argmax(forward(mx.array([out]))[0, -1])))
        return out[-n:]

    assert greedy(lambda x: ref.language_model(x).logits) == greedy(model)


def test_streamed_equals_resident(mixed):
    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact import expert_major as em
    from hebrus_mlx.loader import load_model
    from hebrus_mlx.loading import plan
    from hebrus_mlx.stream import engine as se

    if not se.available():
        pytest.skip("extension not built")
    _, art = mixed
    m = admit(art)
    fam = m.family
    # One arena per distinct layer layout, each of `rows` rows (bf16 parts held as fp32).
    rows = max(math.ceil(0.25 * fam.num_hidden_layers * fam.num_experts), fam.num_experts_per_tok)
    record = sum(
        sum(2 * n if d == "uint16" else n for _, _, d, _, _, n in em.record_layout(fam, row))
        for row in set(m.experts.layer_codecs)
    )
    gb = (rows * record + record // 2) / plan.GIB
    resident, streamed = load_model(art), load_model(art, expert_cache_gb=gb)
    assert resident.streaming is None and streamed.streaming is not None
    e = streamed.streaming.experts
    assert e.per_layer and e.rows == rows and e.quant(2, "down") == (6, 64) and e.quant(0, "down") == (3, 64)
    prompt = np.random.default_rng(23).integers(2, resident.args.vocab_size, 9).tolist()
    assert_streamed_equals_resident(resident, streamed, prompt, 10)


def _tampered(art, tmp_path, edit):
    d = str(tmp_path / "t")
    shutil.copytree(art, d)
    m = load_manifest(d)
    (s,) = [s for s in m["stores"] if s["role"] == "experts"]
    edit(s)
    save_manifest(d, m)
    return d, m["stores"].index(s)


@pytest.mark.parametrize(
    "edit,field,what",
    [
        (lambda s: s["layer_codecs"][2].__setitem__(2, "affine5-g64"), "stores[{i}].layer_codecs[2].down", "unknown"),
        (lambda s: s["layer_codecs"][2].__setitem__(2, "affine3-g64"), "experts.layer_codecs", "digest"),
        (lambda s: s["layer_codecs"][0].__setitem__(0, "affine6-g64"), "experts.layer_codecs", "digest"),
        (lambda s: s["layer_codecs"].pop(), "stores[{i}].layer_codecs", "per layer"),
        (lambda s: s["layer_codecs"][1].pop(), "stores[{i}].layer_codecs[1]", "gate, up, down"),
        (lambda s: s.pop("layer_codecs"), "stores[{i}].layer_codecs", "required"),
        (lambda s: s.__setitem__("layer_codecs", [["affine3-g64"] * 3] * 4), "stores[{i}].layer_codecs", "uniform"),
        (lambda s: s.__setitem__("format", "expert_major.v2"), "stores[{i}].format", "expert_major.v3"),
        (lambda s: s.__setitem__("codec", "affine3-g64"), "stores[{i}].codec", "per-layer"),
    ],
)
def test_tampered_codec_entries_are_refused_naming_the_field(mixed, tmp_path, edit, field, what):
    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact.errors import ArtifactError

    d, i = _tampered(mixed[1], tmp_path, edit)
    with pytest.raises(ArtifactError) as e:
        admit(d)
    assert e.value.field == field.format(i=i) and what in str(e.value), str(e.value)


def test_codec_table_entries_without_a_codec_are_refused(mixed):
    """What has no artifact codec is still refused, naming the `quantization` entry."""
    from hebrus_mlx.convert.mlx_source import MlxSourceError, source_profile

    src, _ = mixed
    cfg = json.load(open(os.path.join(src, "config.json")))
    key = _stem(2, "down")
    for entry, field, what in (
        ({"group_size": 64, "bits": 6, "mode": "mxfp4"}, f"quantization.{key}.mode", "only affine"),
        ({"group_size": 64, "bits": 5, "mode": "affine"}, f"quantization.{key}", "no artifact codec"),
        ({"group_size": 16, "bits": 6, "mode": "affine"}, f"quantization.{key}", "no artifact codec"),
        (False, f"quantization.{key}", "unquantized"),
        (True, f"quantization.{key}", "bits, group_size"),
    ):
        bad = json.loads(json.dumps(cfg))
        bad["quantization"][key] = entry
        with pytest.raises(MlxSourceError) as e:
            source_profile(bad)
        assert e.value.field == field and what in str(e.value), str(e.value)
    for flag in ("expert_bits", "expert_group_size"):
        with pytest.raises(MlxSourceError) as e:
            source_profile(cfg, **{flag: 3})
        assert e.value.field == flag and "per-layer" in str(e.value)
    bad = json.loads(json.dumps(cfg))
    bad["quantization"][_stem(9, "down")] = {"group_size": 64, "bits": 6}
    with pytest.raises(MlxSourceError) as e:
        source_profile(bad)
    assert e.value.field == f"quantization.{_stem(9, 'down')}" and "4 layers" in str(e.value)


def test_verify_mirror_and_sweep_on_a_per_layer_store(mixed, tmp_path):
    """`verify` re-reads every record at its layer's size; a mirror is admitted against the
    per-layer store (and a copy with a tampered header refused); a forced prefill sweep is refused by name (one
    ring layout cannot hold records of different layouts)."""
    from hebrus_mlx.admission import admit, admit_mirror
    from hebrus_mlx.artifact.errors import AdmissionError
    from hebrus_mlx.errors import UsageError
    from hebrus_mlx.loader import load_model
    from hebrus_mlx.stream import engine as se
    from hebrus_mlx.verify import verify

    _, art = mixed
    m = admit(art)
    verify(art)
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    shutil.copy(m.file(m.experts), mirror / m.experts.path)
    assert admit_mirror(m, str(mirror)) == str(mirror / m.experts.path)
    raw = bytearray((mirror / m.experts.path).read_bytes())
    raw[200] ^= 1  # inside the header's codec table digest (reserved bytes from 192)
    (mirror / m.experts.path).write_bytes(bytes(raw))
    with pytest.raises(AdmissionError) as e:
        admit_mirror(m, str(mirror))
    assert e.value.field.startswith("expert-mirror.")
    if se.available():
        with pytest.raises(UsageError) as e:
            load_model(art, expert_cache_gb=0.01, prefill_sweep="on")
        assert e.value.field == "prefill_sweep" and "per-layer" in str(e.value)


def test_experts_stored_unquantized_are_refused_not_quantized(mixed, tmp_path):
    """A routed-expert projection the source stores as plain bf16 (no scales, no entry in
    `quantization`: what mlx-lm writes when its predicate says False) has no codec in a quantized
    profile: refused naming the tensor, never quantized here, nothing published."""
    import mlx.core as mx

    from hebrus_mlx.convert import convert
    from hebrus_mlx.convert.mlx_source import MlxSourceError

    src, _ = mixed
    d = str(tmp_path / "float-experts")
    shutil.copytree(src, d)
    stem = _stem(0, "gate")
    shard = os.path.join(d, "model.safetensors")
    w = mx.load(shard)
    bits, group = _source_widths(src)[0, "gate"]
    dense = mx.dequantize(
        w.pop(stem + ".weight"), w.pop(stem + ".scales"), w.pop(stem + ".biases"), group_size=group, bits=bits
    )
    w[stem + ".weight"] = dense.astype(mx.bfloat16)
    mx.save_safetensors(shard, w, metadata={"format": "mlx"})
    cfg = json.load(open(os.path.join(d, "config.json")))
    for key in ("quantization", "quantization_config"):
        cfg.get(key, {}).pop(stem, None)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    out = str(tmp_path / "out")
    with pytest.raises(MlxSourceError) as e:
        convert(d, out, quiet=True)
    assert e.value.field == f"source.{stem}.weight" and "refusing to quantize" in str(e.value), str(e.value)
    assert not os.path.exists(out)
