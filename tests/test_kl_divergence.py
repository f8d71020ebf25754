"""`hebrus-mlx perplexity --kl-divergence REF` (like llama.cpp's): KL(P_ref || P_model) per
predicted token, its mean and p99, and top-1 agreement, against a reference model on the same rows.

Oracles: a model against itself (KL exactly 0, agreement 100%); the mean KL and agreement
recomputed here in float64 numpy from both models' whole-row logits; a 2-bit conversion of the
same tiny checkpoint (a different table of weights: KL > 0); the CLI's refusal of a REF whose
vocabulary or tokenizer differs, naming the flag."""

import math

import mlx.core as mx
import numpy as np
import pytest
from support.artifact_fixture import tiny_checkpoint

from hebrus_mlx import perplexity as P
from hebrus_mlx.cli import main as cli_main
from hebrus_mlx.convert import convert
from hebrus_mlx.errors import UsageError
from hebrus_mlx.loader import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(bf16 artifact, 2-bit artifact, data rows) of the tiny checkpoint."""
    root = tmp_path_factory.mktemp("kl")
    hf = tiny_checkpoint(str(root / "hf"))
    ref, low = str(root / "bf16"), str(root / "q2")
    convert(hf, ref, dtype="bfloat16", quiet=True, mtp=False)
    convert(hf, low, q_bits=2, q_group_size=32, quiet=True, mtp=False)
    vocab = load_model(ref).args.vocab_size
    data = np.random.default_rng(5).integers(2, vocab, (3, 17)).astype(np.int32)
    return ref, low, data


def _numpy_kl(model, ref, data):
    def logp(m):
        x = np.array(m(mx.array(data[:, :-1])).astype(mx.float32), np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lq, lp = logp(model), logp(ref)
    kl = (np.exp(lp) * (lp - lq)).sum(-1).reshape(-1)
    return kl, (lp.argmax(-1) == lq.argmax(-1)).reshape(-1)


def test_against_itself_is_exactly_zero(tiny):
    ref, _, data = tiny
    k = P.kl_divergence(load_model(ref), load_model(ref), data, batch_size=2)
    assert (k["kl_mean"], k["kl_p99"], k["top1"]) == (0.0, 0.0, 1.0)
    assert (k["kl_mean_se"], k["kl_p99_se"], k["top1_se"]) == (0.0, 0.0, 0.0)
    assert k["tokens"] == data.shape[0] * (data.shape[1] - 1)


def test_against_a_2bit_conversion_matches_numpy(tiny):
    ref, low, data = tiny
    model, reference = load_model(low), load_model(ref)
    k = P.kl_divergence(model, reference, data, batch_size=2, chunk=5)  # chunked: the cache carries rows
    kl, same = _numpy_kl(model, reference, data)
    assert k["kl_mean"] > 1e-4 and k["kl_p99"] >= k["kl_mean"]
    assert k["kl_mean"] == pytest.approx(kl.mean(), rel=1e-3, abs=1e-6)
    assert k["kl_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-2, abs=1e-5)
    assert k["top1"] == pytest.approx(same.mean())
    assert k["kl_mean_se"] == pytest.approx(kl.std(ddof=1) / math.sqrt(kl.size), rel=1e-2)
    assert k["top1_se"] == pytest.approx(math.sqrt(same.mean() * (1 - same.mean()) / same.size))
    assert k["kl_p99_se"] > 0


def test_reference_with_another_vocabulary_is_refused_naming_the_flag(tiny, capsys):
    ref, _, _ = tiny
    capsys.readouterr()
    assert cli_main(["perplexity", "--model", "demo", "--kl-divergence", ref, "--num-samples", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hebrus-mlx perplexity: error: --kl-divergence: the reference's vocabulary"), err
    assert cli_main(["perplexity", "--model", "demo", "--kl-divergence", "/nonexistent/ref"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith("hebrus-mlx perplexity: error: --kl-divergence: no model")
    )


def test_reference_tokenizer_must_give_the_same_ids(tiny):
    class Tok:
        def __init__(self, shift):
            self.shift = shift

        def encode(self, text):
            return [ord(c) + self.shift for c in text]

    ref, _, _ = tiny
    model = load_model(ref)
    P.check_reference(model, Tok(0), model, Tok(0), P.DEFAULT_DATA)
    with pytest.raises(UsageError) as e:
        P.check_reference(model, Tok(0), model, Tok(1), P.DEFAULT_DATA)
    assert e.value.field == "--kl-divergence" and "tokenizer" in e.value.message
