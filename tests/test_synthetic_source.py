"""The generated checkpoint source of the full-scale run (hebrus_mlx/testing/synthetic_source.py):
its inventory against the pinned real source's identity (AFN-001), and `convert` from it at a tiny
config."""

import collections
import json

import numpy as np
from support.artifact_fixture import TEMPLATE, word_level_tokenizer

from hebrus_mlx import admission
from hebrus_mlx.artifact import expert_major
from hebrus_mlx.artifact import manifest as M
from hebrus_mlx.convert import convert, sources
from hebrus_mlx.format import checkpoint_keys as keys
from hebrus_mlx.testing import synthetic_source as S
from hebrus_mlx.testing.tiny_configs import TINY_QWEN4EXP, TINY_VISION

# 16 experts: twice the source's templates, so masked copies are converted too.
TINY = dict(TINY_QWEN4EXP, num_experts=16)


def _tiny_config():
    from transformers import Qwen4ExpConfig

    return Qwen4ExpConfig(text_config=TINY, vision_config=dict(TINY_VISION, patch_size=4)).to_dict()


def test_real_inventory_matches_the_pinned_source_counts():
    """AFN-001: transformers' meta model of the real config has the pinned source's tensors less its
    31 MTP tensors (upstream's model has no MTP head): 1,658 - 31 = 1,627, 333 of them vision; and
    our key tables classify every text key of it."""
    config = S.real_config()
    inv = S.inventory(config)
    groups = collections.Counter(
        "vision" if k.startswith("model.visual.") else "mtp" if ".mtp." in k or k.startswith("mtp.") else "text"
        for k in inv
    )
    assert groups["mtp"] == 0
    assert groups["vision"] == S.REAL_VISION_TENSORS
    assert groups["text"] + groups["vision"] + S.REAL_MTP_TENSORS == S.REAL_TENSORS
    counts = keys.check_key_set(list(inv), M.model_args(config))
    assert counts["expert_layout"] == "fused"
    assert inv["model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"][1] == (
        320_001_536 // 128,
        160,
    )


def test_values_are_seeded_and_follow_the_upstream_init(tmp_path):
    config = _tiny_config()
    S.write(tmp_path, config, seed=3)
    a, b = S.SyntheticSource(str(tmp_path)), S.SyntheticSource(str(tmp_path))
    key = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
    x, dt = a.read(key)
    assert dt == "BF16" and np.array_equal(x, b.read(key)[0])
    assert np.array_equal(a.read(key, 2, 5)[0], x[2:5])  # a row range is that range of the whole
    assert 0.015 < float(x.std()) < 0.025  # initializer_range 0.02
    layer = "model.language_model.layers.0."
    assert not a.read(layer + "attn_hyper_connection.hc_norm.weight")[0].any()  # a (1 + w) RMSNorm
    assert not a.read(layer + "ple.conv1d.weight")[0].any()
    assert (a.read("model.language_model.layers.0.linear_attn.dt_bias")[0] == 1).all()
    other = S.SyntheticSource.__new__(S.SyntheticSource)
    other.__dict__.update(a.__dict__, seed=4, _pool=None)
    assert not np.array_equal(other.read(key)[0], x)


def test_convert_from_the_synthetic_source(tmp_path):
    """`convert(source=...)` writes an admissible artifact of the generated checkpoint; every expert
    record is distinct (masked copies of the encoded templates)."""
    config = _tiny_config()
    src_dir, out = tmp_path / "src", tmp_path / "art"
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps(word_level_tokenizer()))
    template = tmp_path / "chat_template.jinja"
    template.write_text(TEMPLATE)
    S.write(src_dir, config, files=[tok, template])
    fam = S.register_family(config)
    m = convert(str(src_dir), str(out), mtp=False, quiet=True, source=S.SyntheticSource(str(src_dir)))
    assert m.family == fam
    admission.admit(str(out))
    r = expert_major.ExpertMajorReader(str(out / M.EXPERTS_PATH), fam, m.experts.codec)
    records = {bytes(r.read_record(0, e)) for e in range(fam.num_experts)}
    assert len(records) == fam.num_experts


def test_large_dense_tensors_are_encoded_in_row_blocks(tmp_path, monkeypatch):
    """A dense tensor bigger than DENSE_CHUNK_VALUES is read and encoded in row blocks (convert's
    memory holds one block's floats, not the whole embedding), with the parts of the whole."""
    config = _tiny_config()
    S.write(tmp_path, config)
    src = S.SyntheticSource(str(tmp_path))
    key = "model.embed_tokens.weight"
    raw = src.key(key)
    shape = src.shape(raw)
    whole = sources.encode(*src.read(raw), "affine4-g64")
    spans = []
    read = src.read

    def spy(k, start=None, stop=None):
        spans.append((start, stop))
        return read(k, start, stop)

    monkeypatch.setattr(src, "read", spy)
    monkeypatch.setattr(sources, "DENSE_CHUNK_VALUES", shape[1] * 100)
    parts = src.dense_parts(key, shape, "affine4-g64")
    assert spans[0] == (0, 100) and len(spans) == -(-shape[0] // 100)
    assert parts.keys() == whole.keys()
    for part in whole:
        assert np.array_equal(parts[part], whole[part])


def test_row_blocks_hold_for_float_codecs(tmp_path, monkeypatch):
    config = _tiny_config()
    S.write(tmp_path, config)
    src = S.SyntheticSource(str(tmp_path))
    raw = src.key("lm_head.weight")
    shape = src.shape(raw)
    monkeypatch.setattr(sources, "DENSE_CHUNK_VALUES", shape[1] * 7)
    whole = sources.encode(*src.read(raw), "bf16")["weight"]
    assert np.array_equal(src.dense_parts("lm_head.weight", shape, "bf16")["weight"], whole)
