"""hebrus_mlx.sample_utils: the vocabulary boundary comes before every selection rule (AFN-005)."""

import mlx.core as mx
import pytest

from hebrus_mlx.sample_utils import apply_vocab_mask, make_sampler

PHYSICAL, EFFECTIVE = 248320, 248077  # Qwen3.8-Flash-Next widths (contract control)


def dominant_invalid_logits(batch=1):
    """Valid rows low, the last valid row (248076) highest among them, every invalid row higher still."""
    valid = mx.concatenate([mx.zeros((EFFECTIVE - 1,)), mx.array([40.0])])
    invalid = mx.full((PHYSICAL - EFFECTIVE,), 1000.0)
    return mx.broadcast_to(mx.concatenate([valid, invalid])[None], (batch, PHYSICAL))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temp": 1.0},
        {"temp": 0.8, "top_k": 1},
        {"temp": 0.8, "top_k": 50},
        {"temp": 1.0, "top_p": 0.5},
        {"temp": 1.0, "min_p": 0.5},
        {"temp": 2.0, "top_p": 0.9, "top_k": 5, "min_p": 0.1},
    ],
)
def test_last_valid_id_wins_over_dominant_invalid_rows(kwargs):
    """AFN-005: invalid rows numerically dominant, 248076 must still be chosen."""
    mx.random.seed(0)
    sampler = make_sampler(**kwargs, effective_vocab_size=EFFECTIVE)
    for _ in range(5):
        assert sampler(dominant_invalid_logits(2)).tolist() == [EFFECTIVE - 1, EFFECTIVE - 1]


def test_unmasked_mlx_sampler_would_pick_invalid_row():
    """Control: without the mask the same logits select an unassigned row (the test can fail)."""
    from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

    assert mlx_make_sampler()(dominant_invalid_logits()).item() >= EFFECTIVE


def test_sampling_stays_in_domain_with_flat_valid_rows():
    """With temperature over many equal valid rows, no draw lands past the boundary."""
    mx.random.seed(1)
    logits = mx.concatenate([mx.zeros((1, EFFECTIVE)), mx.full((1, PHYSICAL - EFFECTIVE), 50.0)], axis=1)
    draws = [make_sampler(temp=1.0, effective_vocab_size=EFFECTIVE)(logits).item() for _ in range(50)]
    assert max(draws) < EFFECTIVE and len(set(draws)) > 1


def test_mask_values():
    x = mx.arange(6, dtype=mx.float32)[None]
    assert apply_vocab_mask(x, 4).tolist() == [[0, 1, 2, 3, -float("inf"), -float("inf")]]
    assert apply_vocab_mask(x, 6).tolist() == x.tolist()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temp": -0.1}, "temp"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -1}, "min_p"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_bad_sampling_args_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_sampler(**kwargs, effective_vocab_size=EFFECTIVE)


# -- mlx-lm's signature and draws (issue 26 §4) ---------------------------------------------------------


def test_make_sampler_takes_mlx_lm_signature():
    """Same parameter names, order and defaults as mlx_lm.sample_utils.make_sampler; the vocabulary
    boundary is an extra keyword-only argument."""
    import inspect

    from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

    ours = inspect.signature(make_sampler).parameters
    theirs = inspect.signature(mlx_make_sampler).parameters
    positional = [p for p in ours.values() if p.kind != p.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in positional] == [(p.name, p.default) for p in theirs.values()]
    assert [p.name for p in ours.values() if p.kind == p.KEYWORD_ONLY] == ["effective_vocab_size"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temp": 1.0},
        {"temp": 0.7, "top_p": 0.9},
        {"temp": 1.0, "min_p": 0.1, "min_tokens_to_keep": 3},
        {"temp": 1.3, "top_k": 5},
        {"temp": 1.0, "top_p": 0.8, "min_p": 0.05, "top_k": 10},
        {"temp": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.05},
        {"temp": 1.0, "xtc_probability": 1.0, "xtc_threshold": 0.02, "xtc_special_tokens": [0, 1]},
    ],
)
def test_draws_equal_mlx_lm_sampler_under_one_seed(kwargs):
    """Own filter code, mlx-lm's rules: under the same seed every draw is the token mlx-lm's sampler
    draws (the filters keep exactly the rows mlx-lm keeps and consume the random state alike)."""
    from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

    mx.random.seed(3)
    x = mx.random.normal((4, 300)) * 3
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    mx.random.seed(7)
    ours = [make_sampler(**kwargs)(logprobs).tolist() for _ in range(30)]
    mx.random.seed(7)
    theirs = [mlx_make_sampler(**kwargs)(logprobs).tolist() for _ in range(30)]
    assert ours == theirs
    assert len({tuple(d) for d in ours}) > 1  # the draws are random, not a constant both agree on


def test_xtc_sampler_has_no_distribution_and_the_others_do():
    """XTC excludes at random, so no fixed distribution describes it: the speculative protocol then
    draws the sampler itself at every position (exact) instead of rejection sampling."""
    assert make_sampler().distribution is None
    assert callable(make_sampler(temp=1.0, top_k=3).distribution)
    assert not hasattr(make_sampler(temp=1.0, xtc_probability=0.5), "distribution")


def test_sampler_without_the_keyword_does_not_mask():
    """The boundary is the loop's unless asked for: a bare sampler behaves as mlx-lm's does (the
    control that makes the masked tests above able to fail)."""
    assert make_sampler()(dominant_invalid_logits()).item() >= EFFECTIVE


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temp": float("nan")}, "temp"),
        ({"min_tokens_to_keep": 0}, "min_tokens_to_keep"),
        ({"top_k": 1.5}, "top_k"),
        ({"xtc_probability": 2.0}, "xtc_probability"),
        ({"xtc_threshold": 0.6}, "xtc_threshold"),
        ({"xtc_special_tokens": ["a"]}, "xtc_special_tokens"),
        ({"effective_vocab_size": 0}, "effective_vocab_size"),
        ({"temp": True}, "temp"),
    ],
)
def test_more_bad_sampling_args_are_typed_and_name_the_field(kwargs, field):
    from hebrus_mlx.errors import HebrusError

    with pytest.raises(HebrusError) as e:
        make_sampler(**kwargs)
    assert e.value.field == field


def test_from_logprobs_draws_the_same_chain_on_masked_input():
    """generate's decode step masks and renormalises once, then calls `from_logprobs`: on input
    already masked it draws exactly what the sampler itself draws."""
    x = apply_vocab_mask(dominant_invalid_logits(2), EFFECTIVE)
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    for kwargs in ({}, {"temp": 1.0, "top_k": 5}, {"temp": 0.7, "top_p": 0.9, "min_p": 0.01}):
        s = make_sampler(**kwargs, effective_vocab_size=EFFECTIVE)
        mx.random.seed(11)
        a = [s(x).tolist() for _ in range(3)]
        mx.random.seed(11)
        b = [s.from_logprobs(x).tolist() for _ in range(3)]
        assert a == b


@pytest.mark.parametrize(
    "kwargs", [{"temp": 1.0}, {"temp": 0.7, "top_k": 20, "top_p": 0.9}, {"temp": 1.0, "xtc_probability": 0.5}]
)
def test_keyed_draws_are_the_keys_and_leave_the_global_generator_alone(kwargs):
    """A request's own key (generate.DecodeStep's seed) decides its draws: the same key, the same
    tokens, whatever the global generator holds, and the global generator is not moved by them (a
    seeded request must not decide what the unseeded ones draw next)."""
    mx.random.seed(3)
    x = mx.random.normal((4, 300)) * 3
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    sampler = make_sampler(**kwargs)
    assert sampler.takes_key
    keys = mx.random.split(mx.random.key(5), 30)
    mx.random.seed(1)
    first = [sampler(logprobs, key=k).tolist() for k in keys]
    after_keyed = mx.random.uniform(shape=(8,))
    mx.random.seed(2)
    assert [sampler(logprobs, key=k).tolist() for k in keys] == first
    assert len({tuple(d) for d in first}) > 1
    mx.random.seed(1)
    assert mx.array_equal(mx.random.uniform(shape=(8,)), after_keyed)
