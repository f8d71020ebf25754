"""tools/train_demo.py: the demo-model build runs end to end and is deterministic for a seed.

Everything here runs on a miniature config (hidden 64, 8 layers, 64 experts) and a corpus of
eight small CPython stdlib files, so the suite stays in seconds. Expected values are either
derived in the test from the definition (contract controls) or are relations between two runs
of the code (determinism); nothing is a stored output of the code under test (AFN-014).
"""

import importlib.util
import json
import math
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_demo", ROOT / "tools" / "train_demo.py")
td = importlib.util.module_from_spec(_spec)
sys.modules["train_demo"] = td
_spec.loader.exec_module(td)

CORPUS_FILES = [
    "abc.py", "bisect.py", "colorsys.py", "copyreg.py",
    "fnmatch.py", "genericpath.py", "keyword.py", "stat.py",
]  # fmt: skip

MINI = td.DemoDims(
    bpe_vocab=320,
    hidden_size=64,
    num_attention_heads=2,
    head_dim=32,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    shared_expert_intermediate_size=64,
    hc_lowrank=8,
    ngram_vocab_size_base=67,
    split_ngram_parts=2,
    indexer_n_heads=2,
    indexer_head_dim=16,
    indexer_budget=16,
    indexer_compress_ratio=4,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for name in CORPUS_FILES:
        shutil.copy(td.DEFAULT_CORPUS / name, d / name)
    return d


@pytest.fixture(scope="module")
def split(corpus):
    return td.split_files(td.list_corpus(corpus), 0.25, seed=0)


@pytest.fixture(scope="module")
def tok(split):
    return td.train_tokenizer(split[0], MINI.bpe_vocab)


def test_split_is_by_file_disjoint_and_seeded(corpus, split):
    train, held = split
    assert set(train).isdisjoint(held)
    assert sorted(train + held) == td.list_corpus(corpus)
    assert len(held) == 2
    assert td.split_files(td.list_corpus(corpus), 0.25, seed=0) == split
    # Control: the split really depends on the seed.
    others = {tuple(td.split_files(td.list_corpus(corpus), 0.25, seed=s)[1]) for s in range(1, 6)}
    assert others - {tuple(held)}


def test_tokenizer_specials_follow_bpe_ranks_and_nfc(split, tok):
    for i, s in enumerate(td.SPECIAL_TOKENS):
        assert tok.token_to_id(s) == MINI.bpe_vocab + i
    assert tok.get_vocab_size() == td.effective_vocab(MINI)
    # Decomposed and precomposed e-acute must encode identically under the NFC normalizer.
    assert tok.encode("caf\u00e9").ids == tok.encode("cafe\u0301").ids
    text = "def f(x):\n    return x  # ok\n"
    assert tok.decode(tok.encode(text).ids) == text
    # Same files, same order -> same tokenizer.
    assert td.train_tokenizer(split[0], MINI.bpe_vocab).to_str() == tok.to_str()


def test_physical_rows_exceed_effective_vocab():
    for dims in (MINI, td.DemoDims()):
        phys, eff = td.physical_vocab(dims), td.effective_vocab(dims)
        assert phys % 128 == 0 and phys > eff
        cfg = td.build_config(dims)
        assert cfg.vocab_size == phys
        assert cfg.layer_types == ["linear_attention"] * 3 + ["indexed_attention"] + ["linear_attention"] * 3 + [
            "indexed_attention"
        ]


@pytest.mark.parametrize(
    "field,value",
    [("hidden_size", 96), ("moe_intermediate_size", 100), ("num_experts", 32), ("num_experts_per_tok", 2)],
)
def test_bad_dims_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        td.build_config(replace(MINI, **{field: value}))


def test_ple_on_attention_layer_is_rejected():
    with pytest.raises(ValueError, match="ple_layer_ids"):
        td.validate_dims(replace(MINI, ple_layer_ids=(4,)))


def test_unigram_baseline_matches_add_one_definition():
    # Contract control from the definition: counts [2, 1, 0] + 1 over V=3 -> p = [3, 2, 1] / 6.
    train = torch.tensor([0, 0, 1])
    targets = torch.tensor([0, 2])
    want = -(math.log(3 / 6) + math.log(1 / 6)) / 2
    assert td.unigram_nll(train, targets, 3) == pytest.approx(want, rel=1e-12)


def _two_steps(windows, seed):
    torch.set_num_threads(1)
    model = td.new_model(td.build_config(MINI), seed)
    hist = td.train(model, windows, steps=2, batch=2, lr=1e-3, warmup=1, seed=seed, log=lambda *_: None)
    return model.state_dict(), hist


def test_two_steps_are_deterministic_for_a_seed(split, tok):
    windows = td.make_windows(td.encode_stream(tok, split[0]), 32)
    a, ha = _two_steps(windows, seed=0)
    b, hb = _two_steps(windows, seed=0)
    assert ha["loss"] == hb["loss"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Control: a different seed gives different weights, so the equality above is not vacuous.
    c, _ = _two_steps(windows, seed=1)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    # Training moved the weights away from the seed's initialisation.
    init = td.new_model(td.build_config(MINI), 0).state_dict()
    assert not torch.equal(init["lm_head.weight"], a["lm_head.weight"])


def test_main_writes_a_reloadable_checkpoint(corpus, tmp_path):
    out = tmp_path / "hf"
    argv = [
        "--out", str(out), "--corpus", str(corpus), "--steps", "2", "--batch", "2", "--seq-len", "32",
        "--heldout-fraction", "0.25", "--eval-windows", "2", "--final-eval-windows", "2", "--eval-every", "1",
        "--threads", "1", "--warmup", "1",
    ]  # fmt: skip
    assert td.main(argv, dims=MINI) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json", "training_record.json"} <= names  # fmt: skip
    cfg = json.loads((out / "config.json").read_text())
    eot = MINI.bpe_vocab + td.SPECIAL_TOKENS.index("<|endoftext|>")
    im_end = MINI.bpe_vocab + td.SPECIAL_TOKENS.index("<|im_end|>")
    assert cfg["eos_token_id"] == [eot, im_end]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [eot, im_end]
    record = json.loads((out / "training_record.json").read_text())
    assert set(record["train_files"]).isdisjoint(record["heldout_files"])
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    # Real checkpoint layout: per-expert projections and the sharded PLE table.
    assert "model.layers.0.mlp.experts.63.gate_proj.weight" in keys
    assert "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight" in keys
    # A published directory is never replaced.
    with pytest.raises(FileExistsError, match="--out"):
        td.main(argv, dims=MINI)


def test_mtp_head_state_is_the_released_layout_and_round_trips():
    """The MTP trainer's export is the released `mtp.*` per-expert layout: loading it back through
    the checkpoint key tables gives the same head (what `train_demo.py mtp --publish` ships)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from hebrus_mlx.format.checkpoint_keys import check_mtp_key_set
    from hebrus_mlx.format.qwen4exp_config import ModelArgs
    from hebrus_mlx.models.mtp_head import MTPHead, load_mtp_head

    with open(ROOT / "hebrus_mlx" / "demo" / "model" / "config.json") as f:
        args = ModelArgs.from_dict(json.load(f))
    mx.random.seed(4)
    head = MTPHead(args)
    state = td.mtp_head_state(head)
    assert check_mtp_key_set(list(state), args)["expert_layout"] == "unfused"
    back = load_mtp_head({k: mx.array(v) for k, v in state.items()}, args)
    ours, theirs = dict(tree_flatten(head.parameters())), dict(tree_flatten(back.parameters()))
    assert ours.keys() == theirs.keys()
    for k in ours:
        np.testing.assert_array_equal(np.array(ours[k]), np.array(theirs[k]), err_msg=k)
