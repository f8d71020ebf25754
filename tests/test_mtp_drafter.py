"""MTPDrafter: greedy speculative decoding with the MTP head drafting is token-for-token plain
greedy decoding (tests/support/spec_loop.py is a minimal exact verify loop; the real protocol is
hebrus_mlx.speculative's), the head's cache is rolled back exactly, and acceptance on the shipped
demo is real (its trained head)."""

import mlx.core as mx
import numpy as np
import pytest
from support.mtp_fixture import mtp_checkpoint
from support.parity_fixtures import PARITY, capture
from support.spec_loop import plain_greedy, speculative_greedy

from hebrus_mlx.loader import load_hf_model, load_model
from hebrus_mlx.models.qwen4exp import Capture
from hebrus_mlx.speculative.base import Drafter, Proposal
from hebrus_mlx.speculative.mtp_drafter import MTPDrafter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_hf_model(mtp_checkpoint(tmp_path_factory.mktemp("mtp_drafter"), "tiny_a", seed=1))


def _states(model, tokens):
    cap = Capture()
    mx.eval(model(mx.array([tokens]), capture=cap))
    return cap.hidden[-1][0]


def test_interface(tiny):
    d = MTPDrafter(tiny, tiny.mtp_head)
    assert isinstance(d, Drafter) and d.needs_hidden and d.name == "mtp"
    with pytest.raises(ValueError, match="draft_model"):
        MTPDrafter(load_hf_model(PARITY / "tiny_a"), None)
    prompt = capture("tiny_a")["input_ids"][0].tolist()[:20]
    with pytest.raises(ValueError, match="hidden"):
        d.begin(prompt, mx.zeros((21, 4 * tiny.args.hidden_size)))  # more states than tokens
    with pytest.raises(ValueError, match="hidden"):
        d.begin(prompt, mx.zeros((20, 7)))


def test_speculative_greedy_equals_plain_greedy_tiny(tiny):
    prompt = capture("tiny_a")["input_ids"][0].tolist()
    V = tiny.args.vocab_size
    ref = plain_greedy(tiny, prompt, 24, V)
    out, drafted, _ = speculative_greedy(tiny, MTPDrafter(tiny, tiny.mtp_head), prompt, 24, 3, V)
    assert out == ref and drafted > 0


def test_first_draft_from_a_known_last_state_is_the_target_greedy(tiny):
    prompt = capture("tiny_a")["input_ids"][0].tolist()[:30]
    d = MTPDrafter(tiny, tiny.mtp_head)
    d.begin(prompt, _states(tiny, prompt))  # the state after the last prompt token is known
    p = d.propose(3)
    assert isinstance(p, Proposal) and len(p.tokens) == 3
    assert p.tokens[0] == plain_greedy(tiny, prompt, 1, tiny.args.vocab_size)[0]


def test_rollback_leaves_the_same_state_as_a_fresh_drafter(tiny):
    """After speculating and committing (some drafts rejected), the drafter's head cache and next
    prediction equal a drafter that only ever saw the committed tokens and their real states."""
    prompt = capture("tiny_a")["input_ids"][0].tolist()[:30]
    tokens = prompt + plain_greedy(tiny, prompt, 6, tiny.args.vocab_size)
    states = _states(tiny, tokens)
    running = MTPDrafter(tiny, tiny.mtp_head)
    running.begin(prompt, states[: len(prompt)])
    for i in range(len(prompt), len(tokens)):
        running.propose(4)  # speculates 3 head pairs beyond the committed run
        running.commit([tokens[i]], states[i : i + 1])
    fresh = MTPDrafter(tiny, tiny.mtp_head)
    fresh.begin(tokens, states)
    running.flush(), fresh.flush()  # pairs are fed lazily (at the next proposal)
    assert running.cache.length == fresh.cache.length == len(tokens) - 1
    np.testing.assert_allclose(
        np.array(running.cache.keys[:, :, : running.cache.length]),
        np.array(fresh.cache.keys[:, :, : fresh.cache.length]),
        atol=1e-5,
    )
    assert running.propose(4).tokens == fresh.propose(4).tokens


def test_demo_ships_a_trained_head_and_speculation_is_exact():
    """Demo: greedy with the MTP drafter == plain greedy, with a real (nonzero) acceptance."""
    from support.demo_reference import PROMPT_TEXT

    from hebrus_mlx.loader import resolve_model_path
    from hebrus_mlx.text.tokenizer import load_tokenizer

    path = resolve_model_path("demo")
    model = load_model(path)
    assert model.mtp_head is not None
    vocab = load_tokenizer(path, physical_vocab_size=model.args.vocab_size).effective_vocab_size
    tok = load_tokenizer(path, physical_vocab_size=model.args.vocab_size)
    prompt = tok.encode(PROMPT_TEXT)[:120]
    ref = plain_greedy(model, prompt, 40, vocab)
    out, drafted, accepted = speculative_greedy(model, MTPDrafter(model, model.mtp_head), prompt, 40, 3, vocab)
    assert out == ref
    print(f"demo MTP acceptance: {accepted}/{drafted} drafts")
    assert accepted > 0 and accepted < drafted
