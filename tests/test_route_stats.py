"""tools/route_stats.py: routing statistics on hand-built top-k selections.

Expected values are contract controls computed in the test from the metric definitions on
selections small enough to count by hand (AFN-014); the capture hook is exercised on a tiny
random-init reference model, where the hooked IDs must equal the router's own top-k.
"""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("route_stats", ROOT / "tools" / "route_stats.py")
rs = importlib.util.module_from_spec(_spec)
sys.modules["route_stats"] = rs
_spec.loader.exec_module(rs)


def test_constant_route_has_full_reuse_and_minimal_union():
    topk = torch.tensor([[[1, 2]] * 10])  # one window, 10 tokens, k=2, always experts {1, 2}
    s = rs.layer_stats(topk, num_experts=8)
    assert s["entropy_bits"] == pytest.approx(1.0)  # two experts, equal use
    assert s["used_experts"] == 2
    assert s["reuse"] == pytest.approx(1.0)
    assert all(s["union"][b] == pytest.approx(2.0) for b in rs.BLOCKS)


def test_disjoint_alternating_route():
    # Tokens alternate {0,1} and {2,3}: no reuse, every 2-block unions to 4 experts.
    topk = torch.tensor([[[0, 1], [2, 3]] * 6])
    s = rs.layer_stats(topk, num_experts=4)
    assert s["entropy_bits"] == pytest.approx(2.0)
    assert s["entropy_fraction"] == pytest.approx(1.0)
    assert s["reuse"] == 0.0
    assert s["union"][2] == pytest.approx(4.0)
    # Blocks of 3 over 12 tokens: 4 blocks, each sees both sets.
    assert s["union"][3] == pytest.approx(4.0)


def test_reuse_does_not_cross_window_boundaries():
    # Within windows: w0 repeats {0,1} (reuse 1), w1 switches (reuse 0). The pair across the
    # boundary (w0 last {0,1} -> w1 first {0,1}) would pull the mean to 2/3 if it were counted.
    topk = torch.tensor([[[0, 1], [0, 1]], [[0, 1], [2, 3]]])
    s = rs.layer_stats(topk, num_experts=4)
    assert s["reuse"] == pytest.approx((1.0 + 0.0) / 2)


def test_uniform_expectations_definition():
    u = rs.uniform_expectations(64, 4)
    assert u["entropy_bits"] == 6.0
    assert u["reuse"] == 4 / 64
    assert u["union"][2] == pytest.approx(64 * (1 - (60 / 64) ** 2))


def test_hook_captures_the_routers_own_topk():
    pytest.importorskip("transformers")
    td_spec = importlib.util.spec_from_file_location("train_demo", ROOT / "tools" / "train_demo.py")
    td = importlib.util.module_from_spec(td_spec)
    sys.modules["train_demo"] = td
    td_spec.loader.exec_module(td)
    torch.set_num_threads(1)
    dims = td.DemoDims(
        bpe_vocab=320, hidden_size=64, head_dim=32, num_attention_heads=2, indexer_head_dim=16,
        indexer_budget=16, indexer_compress_ratio=4, hc_lowrank=8, ngram_vocab_size_base=67,
    )  # fmt: skip
    model = td.new_model(td.build_config(dims), 0)
    windows = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    captured = rs.capture_topk(model, windows)
    assert len(captured) == 8 and captured[0].shape == (2, 24, 4)
    # Independent cross-check: top-k of the router logits the model reports itself.
    with torch.no_grad():
        out = model(input_ids=windows[:1], use_cache=False, output_router_logits=True)
    for layer, logits in enumerate(out.router_logits):
        want = torch.topk(logits, 4, dim=-1).indices
        assert torch.equal(captured[layer][0].sort(-1).values, want.sort(-1).values)
    assert math.isfinite(rs.layer_stats(captured[0], 64)["entropy_bits"])
