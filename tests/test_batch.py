"""Continuous batching (issue 24 §1): hebrus_mlx/batch.py's batched decode step and
hebrus_mlx/batch_generate.py's scheduler give each sequence exactly its solo run.

Reference: the plain per-sequence path (`model(ids[None], cache)` / generate_step), which the
batch code does not call for the batched rows. Models: the shipped demo, resident and streamed
through a 5% expert cache (contract control, as tests/test_stream_model.py)."""

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx.batch import batch_forward
from hebrus_mlx.generate import prefill
from hebrus_mlx.stream import engine as se
from hebrus_mlx.utils import DEMO_DIR, load_model
from stream_store import cache_gb

# Rows at different positions: a 1-token prompt (fresh cache: its own group), short ones, and one
# past the QSA window (budget 64 + ratio 7: the sparse attention path).
PROMPTS = [[7, 40, 99, 3], [5], list(range(11, 31)) * 5, [100, 200]]
STEPS = 10


@pytest.fixture(scope="module")
def resident():
    return load_model(DEMO_DIR)


def _prefilled(model, prompt):
    cache = model.make_cache()
    if len(prompt) > 1:
        prefill(model, mx.array(prompt[:-1]), cache)
    return cache


def _solo(model, prompt, steps):
    """Greedy decode of one sequence: every step's logits [V] as numpy."""
    cache, y, out = _prefilled(model, prompt), prompt[-1], []
    for _ in range(steps):
        logits = model(mx.array([[y]]), cache=cache)[0, -1]
        mx.eval(logits)
        out.append(np.array(logits))
        y = int(out[-1].argmax())
    return out


def _batched(model, prompts, steps):
    caches = [_prefilled(model, p) for p in prompts]
    ys, out = [p[-1] for p in prompts], [[] for _ in prompts]
    for _ in range(steps):
        logits = batch_forward(model, ys, caches)
        mx.eval(logits)
        rows = np.array(logits)
        for b, row in enumerate(rows):
            out[b].append(row)
        ys = rows.argmax(-1).tolist()
    return out, caches


def _assert_rows_match(got, want):
    for b, (g, w) in enumerate(zip(got, want)):
        assert [int(x.argmax()) for x in g] == [int(x.argmax()) for x in w], f"row {b} tokens differ"
        # Bit for bit on this CPU (matmul rows are the same at M=1 and M=B; docs/GENERATION.md).
        np.testing.assert_array_equal(np.stack(g), np.stack(w), err_msg=f"row {b} logits differ")


def test_batch_forward_matches_solo_resident(resident):
    want = [_solo(resident, p, STEPS) for p in PROMPTS]
    got, caches = _batched(resident, PROMPTS, STEPS)
    _assert_rows_match(got, want)
    for p, c in zip(PROMPTS, caches):
        assert c.offset == len(p) - 1 + STEPS


def test_batch_forward_state_equals_solo_state(resident):
    """Each row's whole cache (attention K/V, block keys, GDN and PLE state) ends equal to its
    solo run's, so a sequence may leave the batch and continue alone (or be stored)."""
    prompts = PROMPTS[:3]
    got, caches = _batched(resident, prompts, 4)
    for p, c, g in zip(prompts, caches, got):
        solo = _prefilled(resident, p)
        y = p[-1]
        for row in g:
            mx.eval(resident(mx.array([[y]]), cache=solo))
            y = int(row.argmax())
        assert solo.digest() == c.digest()


def test_batch_forward_rejects_shared_or_mismatched_caches(resident):
    c = resident.make_cache()
    with pytest.raises(ValueError, match="own cache"):
        batch_forward(resident, [1, 2], [c, c])
    with pytest.raises(ValueError, match="tokens must be"):
        batch_forward(resident, [1, 2, 3], [c, resident.make_cache()])


@pytest.mark.skipif(not se.available(), reason="extension not built")
def test_batch_forward_matches_solo_streamed():
    """Streamed through a 5% expert cache (26 rows; a 4-row step pins up to 16 records), each
    row equals the resident solo run, and the batch reads fewer expert bytes per token than the
    same steps run one sequence at a time."""
    gb, rows = cache_gb(str(DEMO_DIR), 0.05)
    resident = load_model(DEMO_DIR)
    want = [_solo(resident, p, STEPS) for p in PROMPTS]
    model = load_model(DEMO_DIR, expert_cache_gb=gb)
    assert model.streaming.max_chunk_tokens >= len(PROMPTS)
    got, _ = _batched(model, PROMPTS, STEPS)
    _assert_rows_match(got, want)
    eng = model.streaming.engine
    assert eng.memory()["pinned_slots"] == 0
