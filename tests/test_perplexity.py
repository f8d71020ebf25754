"""`hebrus-mlx perplexity` (issue 23 §2): mlx_lm.perplexity's flags and numbers, resident or
streamed, on the held-out text shipped for the demo.

Oracles: mlx_lm.perplexity.eval_ppl (mlx-lm's own function) on the same rows and model; the
streamed run against the resident run of the same artifact over the same chunks; the CLI's
refusals against the flags they name."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from support.stream_store import cache_gb

from hebrus_mlx import perplexity as P
from hebrus_mlx.cli import main as cli_main
from hebrus_mlx.loader import DEMO_DIR, load, load_model
from hebrus_mlx.stream import engine as se
from hebrus_mlx.testing.processes import flag_cases


@pytest.fixture(scope="module")
def demo():
    model, tok = load("demo")
    return model, tok, P.load_data(tok, P.DEFAULT_DATA, 2, 48, 123)


def test_shipped_heldout_text_is_small_and_scores_finite(demo):
    assert P.DEFAULT_DATA.is_file() and 1024 <= P.DEFAULT_DATA.stat().st_size <= 16384
    model, _, data = demo
    assert data.shape == (2, 48) and data.dtype == np.int32
    ppl, se_, n = P.perplexity(model, data, batch_size=2)
    assert math.isfinite(ppl) and 1 < ppl < model.args.vocab_size and se_ > 0 and n == 2 * 47


def test_equals_mlx_lm_eval_ppl(demo):
    from mlx_lm.perplexity import eval_ppl

    model, _, data = demo
    want, want_se = eval_ppl(model, mx.array(data), batch_size=2)
    got, got_se, _ = P.perplexity(model, data, batch_size=2)
    assert got == pytest.approx(want, rel=1e-5) and got_se == pytest.approx(want_se, rel=1e-3)


def test_changes_when_the_weights_change(demo):
    from mlx.utils import tree_unflatten

    model, tok, data = demo
    base = P.perplexity(model, data, 2)[0]
    other, _ = load("demo")
    name, w = next(
        (k, v)
        for k, v in tree_flatten(other.parameters())
        if k.endswith("norm.weight") and not any(p.isdigit() for p in k.split("."))
    )
    other.update(tree_unflatten([(name, w + 0.5)]))
    changed = P.perplexity(other, data, 2)[0]
    assert math.isfinite(changed) and changed != base


@pytest.mark.skipif(not se.available(), reason="extension not built")
def test_streamed_equals_resident(demo):
    """A 5%-of-records expert cache: every token's loss bitwise equal to the resident run's
    over the same chunks (the chunks a streamed forward can pin)."""
    resident, tok, data = demo
    gb, _ = cache_gb(str(DEMO_DIR), 0.05)
    streamed = load_model(str(DEMO_DIR), expert_cache_gb=gb)
    chunk, rows = P.stream_chunk(streamed, 2)
    assert chunk is not None and chunk * rows <= streamed.streaming.max_chunk_tokens
    want = P.token_losses(resident, data, rows, chunk)
    got = P.token_losses(streamed, data, rows, chunk)
    np.testing.assert_array_equal(got, want)
    assert streamed.streaming.experts.engine.counters()["misses"] > 0


def test_jsonl_and_txt_documents(tmp_path):
    j = tmp_path / "d.jsonl"
    j.write_text(json.dumps({"text": "a b"}) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    assert P.read_documents(j) == ["a b", "c"]
    t = tmp_path / "d.txt"
    t.write_text("one\n\ntwo\n\n\nthree\n")
    assert P.read_documents(t) == ["one\n\ntwo", "three"]


@pytest.mark.parametrize(
    "argv,field",
    flag_cases(
        ("--num-samples", "0"),
        ("--sequence-length", "1"),
        ("--batch-size", "0"),
        ("--seed", "-3"),
        ("--expert-cache-gb", "nan"),
        ("--data-path", "/nonexistent/x.txt"),
        ("--data-path", "BAD_JSONL"),
        ("--data-path", "CSV"),
        ("--sequence-length", "100000"),
    ),
)
def test_bad_flags_are_one_line_exit_2(argv, field, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": 1}\n')
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    argv = [{"BAD_JSONL": str(bad), "CSV": str(csv)}.get(x, x) for x in argv]
    capsys.readouterr()
    assert cli_main(["perplexity", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"hebrus-mlx perplexity: error: {field}"), err
    assert not any("Traceback" in line for line in err)
