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


@pytest.mark.parametrize("kwargs", [
    {},
    {"temp": 1.0},
    {"temp": 0.8, "top_k": 1},
    {"temp": 0.8, "top_k": 50},
    {"temp": 1.0, "top_p": 0.5},
    {"temp": 1.0, "min_p": 0.5},
    {"temp": 2.0, "top_p": 0.9, "top_k": 5, "min_p": 0.1},
])
def test_last_valid_id_wins_over_dominant_invalid_rows(kwargs):
    """AFN-005: invalid rows numerically dominant, 248076 must still be chosen."""
    mx.random.seed(0)
    sampler = make_sampler(EFFECTIVE, **kwargs)
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
    draws = [make_sampler(EFFECTIVE, temp=1.0)(logits).item() for _ in range(50)]
    assert max(draws) < EFFECTIVE and len(set(draws)) > 1


def test_mask_values():
    x = mx.arange(6, dtype=mx.float32)[None]
    assert apply_vocab_mask(x, 4).tolist() == [[0, 1, 2, 3, -float("inf"), -float("inf")]]
    assert apply_vocab_mask(x, 6).tolist() == x.tolist()


@pytest.mark.parametrize("kwargs,field", [
    ({"temp": -0.1}, "temp"), ({"top_p": 1.5}, "top_p"), ({"min_p": -1}, "min_p"), ({"top_k": -2}, "top_k"),
])
def test_bad_sampling_args_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_sampler(EFFECTIVE, **kwargs)
