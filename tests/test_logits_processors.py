"""mlx-lm-compatible logits processors (issue 24 §2, library level): logit_bias and the repetition,
presence and frequency penalties.

Oracles: a direct numpy computation of each rule, and a step-by-step loop written here (plain model
calls with the numpy rules applied between them) for the generate_step wiring.
"""

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx.errors import HebrusError
from hebrus_mlx.sample_utils import make_logits_processors

V = 97


def np_processed(
    tokens,
    logits,
    logit_bias=None,
    repetition_penalty=None,
    repetition_context_size=20,
    presence_penalty=None,
    presence_context_size=20,
    frequency_penalty=None,
    frequency_context_size=20,
):
    """The rules as OpenAI / mlx-lm describe them, in numpy float32."""
    x = np.array(logits, dtype=np.float32)
    tokens = list(tokens)
    for i, b in (logit_bias or {}).items():
        x[:, i] += np.float32(b)
    if repetition_penalty:
        for i in set(tokens[-repetition_context_size:]):
            col = x[:, i]
            x[:, i] = np.where(col < 0, col * np.float32(repetition_penalty), col / np.float32(repetition_penalty))
    if presence_penalty:
        for i in set(tokens[-presence_context_size:]):
            x[:, i] -= np.float32(presence_penalty)
    if frequency_penalty:
        counts = np.bincount(tokens[-frequency_context_size:], minlength=x.shape[-1]).astype(np.float32)
        x -= np.float32(frequency_penalty) * counts
    return x


def _apply(procs, tokens, logits):
    t = mx.array(tokens, dtype=mx.int32)
    for p in procs:
        logits = p(t, logits)
    return np.array(logits)


@pytest.fixture
def case():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, V)).astype(np.float32) * 4  # both signs, for the repetition rule
    tokens = [int(t) for t in rng.integers(0, 12, size=40)]  # small range: many repeats, some outside the window
    return tokens, logits


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logit_bias": {3: 5.0, 50: -2.5, 96: 0.25}},
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.7, "repetition_context_size": 5},
        {"presence_penalty": 0.8},
        {"presence_penalty": -0.5, "presence_context_size": 3},
        {"frequency_penalty": 0.4},
        {"frequency_penalty": 1.1, "frequency_context_size": 7},
        {"logit_bias": {1: 2.0}, "repetition_penalty": 1.2, "presence_penalty": 0.3, "frequency_penalty": 0.2},
    ],
)
def test_each_rule_equals_numpy(case, kwargs):
    tokens, logits = case
    got = _apply(make_logits_processors(**kwargs), tokens, mx.array(logits))
    np.testing.assert_array_equal(got, np_processed(tokens, logits, **kwargs))
    assert not np.array_equal(got, logits)  # the rule did something on this case


def test_same_results_as_mlx_lm_processors(case):
    """A second oracle: mlx-lm 0.32.2's own processors (frequency there subtracts once per
    occurrence, so it may round differently from penalty * count)."""
    from mlx_lm.sample_utils import make_logits_processors as mlx_processors

    tokens, logits = case
    kwargs = {"logit_bias": {5: 1.5}, "repetition_penalty": 1.4, "presence_penalty": 0.6, "frequency_penalty": 0.3}
    ours = _apply(make_logits_processors(**kwargs), tokens, mx.array(logits))
    theirs = _apply(mlx_processors(**kwargs), tokens, mx.array(logits))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


def test_no_tokens_and_off_values_change_nothing(case):
    _, logits = case
    assert make_logits_processors() == []
    assert (
        make_logits_processors(repetition_penalty=0, presence_penalty=0.0, frequency_penalty=None, logit_bias={}) == []
    )
    for p in make_logits_processors(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.0):
        np.testing.assert_array_equal(np.array(p(mx.array([], dtype=mx.int32), mx.array(logits))), logits)


def test_dtype_is_kept(case):
    tokens, logits = case
    x = mx.array(logits).astype(mx.bfloat16)
    for p in make_logits_processors(
        logit_bias={2: 1.0}, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5
    ):
        assert p(mx.array(tokens), x).dtype == mx.bfloat16


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": "1.2"}, "repetition_penalty"),
        ({"repetition_penalty": 1.2, "repetition_context_size": 0}, "repetition_context_size"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"presence_penalty": 0.5, "presence_context_size": 2.5}, "presence_context_size"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"frequency_penalty": 0.5, "frequency_context_size": None}, "frequency_context_size"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"12": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {7: float("nan")}}, "logit_bias.7"),
        ({"logit_bias": {7: "big"}}, "logit_bias.7"),
        ({"logit_bias": {V: 1.0}, "vocab_size": V}, "logit_bias"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_bad_values_are_typed_errors_naming_the_field(kwargs, field):
    with pytest.raises(HebrusError) as e:
        make_logits_processors(**kwargs)
    assert e.value.field == field


def test_bias_past_the_logits_width_fails_by_name():
    (p,) = make_logits_processors(logit_bias={200: 1.0})
    with pytest.raises(HebrusError, match="logit_bias"):
        p(mx.array([1]), mx.zeros((1, V)))


# -- wired into hebrus's generation loop ----------------------------------------------------------------


def reference_tokens(model, tok, prompt, n, **rules):
    """Greedy with the numpy rules between plain model calls, fed in generate_step's partition
    (prompt[:-1], then one token per call), so the logits are bitwise the loop's."""
    cache = model.make_cache()
    model(mx.array([prompt[:-1]]), cache=cache)
    seen, out, last = list(prompt), [], prompt[-1]
    for _ in range(n):
        logits = np.array(model(mx.array([[last]]), cache=cache)[:, -1].astype(mx.float32))
        x = np_processed(seen, logits, **rules) if rules else logits
        x[:, tok.effective_vocab_size :] = -np.inf
        last = int(x[0].argmax())
        out.append(last)
        seen.append(last)
    return out


def _generate_step(model, tok, prompt, n, processors):
    from hebrus_mlx.generate import generate_step

    steps = generate_step(
        mx.array(prompt),
        model,
        effective_vocab_size=tok.effective_vocab_size,
        max_tokens=n,
        logits_processors=processors,
    )
    return [t for t, _ in steps]


PROMPT = "Once upon a time"
N = 14


def test_greedy_without_processors_is_unchanged(demo):
    model, tok = demo
    prompt = tok.encode(PROMPT)
    plain = reference_tokens(model, tok, prompt, N)
    assert _generate_step(model, tok, prompt, N, None) == plain
    assert _generate_step(model, tok, prompt, N, []) == plain


@pytest.mark.parametrize(
    "rules",
    [
        {"repetition_penalty": 1.5},
        {"presence_penalty": 1.0, "presence_context_size": 8},
        {"frequency_penalty": 0.7},
        {"logit_bias": {294: -3.0, 266: 2.0}, "repetition_penalty": 1.2},
    ],
)
def test_generate_step_applies_processors_as_the_reference_loop(demo, rules):
    model, tok = demo
    prompt = tok.encode(PROMPT)
    got = _generate_step(model, tok, prompt, N, make_logits_processors(**rules, vocab_size=tok.effective_vocab_size))
    assert got == reference_tokens(model, tok, prompt, N, **rules)
    assert got != reference_tokens(model, tok, prompt, N)  # the rule changed the tokens


def test_stream_generate_passes_processors_through(demo):
    from hebrus_mlx import stream_generate

    model, tok = demo
    forced = 466
    rs = list(
        stream_generate(
            model, tok, PROMPT, max_tokens=5, logits_processors=make_logits_processors(logit_bias={forced: 1e4})
        )
    )
    assert [r.token for r in rs] == [forced] * 5


def test_bias_on_an_unassigned_row_cannot_select_it(demo):
    """AFN-005: processors run before the loop's vocabulary mask, so even a huge bias on a padded
    row (allowed only without vocab_size) never makes it a token."""
    model, tok = demo
    padded = tok.effective_vocab_size + 3
    assert padded < model.args.vocab_size
    prompt = tok.encode(PROMPT)
    got = _generate_step(model, tok, prompt, 6, make_logits_processors(logit_bias={padded: 1e9}))
    assert got == reference_tokens(model, tok, prompt, 6)
