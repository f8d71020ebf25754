"""AFN-001: the router's top-k has one frozen order for equal probabilities (probability
descending, then expert id ascending), on the model's route and everywhere that ranks experts
(`ranked_experts`; trace replay: tests/test_traces.py). argpartition/argsort alone promise no
order between equal keys. Expected orders come from Python's sort of (-p, id)."""

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx.loader import DEMO_DIR, load_model
from hebrus_mlx.models.qwen4exp import ranked_experts


def _rule(probs, k):
    return sorted(range(len(probs)), key=lambda e: (-probs[e], e))[:k]


@pytest.mark.parametrize("k", [1, 4, 10])
def test_ranked_experts_orders_ties_by_expert_id(k):
    rng = np.random.default_rng(k)
    probs = rng.integers(0, 5, size=(300, 64)).astype(np.float32) / 8  # many exact ties, also at rank k
    got = np.array(ranked_experts(mx.array(probs), k)).tolist()
    assert got == [_rule(p, k) for p in probs]


def test_model_route_with_tied_router_rows_follows_the_rule():
    """Duplicated gate rows give exactly equal router probabilities: the route (the graph's own
    top-k, the one the experts and traces get) lists the tied experts by id, and selects the lower
    ids where the tie straddles rank k."""
    model = load_model(DEMO_DIR)
    moe = model.model.layers[0].mlp
    E, D = moe.gate.weight.shape
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(6, D)).astype(np.float32)  # 6 distinct rows shared by 64 experts
    moe.gate.weight = mx.array(rows[rng.integers(0, 6, size=E)])
    x = mx.array(rng.normal(size=(1, 40, D)).astype(np.float32))
    inds, _ = moe.route(x)
    probs = np.array(mx.softmax(moe.gate(x).astype(mx.float32), axis=-1))[0]
    ties = sum(len(set(p.tolist())) < E for p in probs)
    assert ties == 40  # the precondition: every token has tied experts
    assert np.array(inds)[0].tolist() == [_rule(p, moe.top_k) for p in probs]
