"""Which implementations a loaded model runs (models/optimize.implementations): what the load-time
pass swapped in is visible to a user (generate --verbose, the bench record), not only in the code."""

import subprocess
import sys

from hebrus_mlx.loader import load
from hebrus_mlx.models import optimize
from hebrus_mlx.models.options import GraphOptions
from hebrus_mlx.testing.processes import child_env


def test_plain_options_run_the_plain_blocks_and_defaults_name_their_swaps():
    plain, _ = load("demo", options=GraphOptions.plain())
    impl = optimize.implementations(plain)
    assert impl["blocks"] and all(list(c) == [base] for base, c in impl["blocks"].items())
    assert impl["joined_projection_groups"] == 0 and impl["in_major"] is False
    fast, _ = load("demo", options=GraphOptions(join_projections=True, cpu_streams=1))
    blocks = optimize.implementations(fast)["blocks"]
    assert blocks["HyperConnection"] == {"OneGraphHyperConnection": sum(blocks["HyperConnection"].values())}
    assert optimize.implementations(fast)["joined_projection_groups"] > 0
    assert "SplitSparseMoE" not in blocks["SparseMoE"]  # one CPU stream: the plain MoE
    line = optimize.implementations_line(fast)
    assert line.startswith("Graph: ") and "HyperConnection -> OneGraphHyperConnection x" in line


def test_generate_verbose_prints_the_graph_line_on_stderr():
    proc = subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.cli", "generate", "--model", "demo", "-p", "hi", "-m", "2"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert any(line.startswith("Graph: ") for line in proc.stderr.splitlines())
    assert proc.stdout.splitlines()[-1].startswith("Peak memory: ")  # mlx_lm.generate's layout kept


def test_a_block_missing_a_seam_is_refused_at_load_naming_it(monkeypatch):
    """qwen4exp.SEAMS is the contract the load-time pass overrides; a block class without one of its
    methods (or taking other parameters) is refused when the pass swaps it, not when the method runs."""
    import pytest

    from hebrus_mlx.models import qwen4exp as q

    monkeypatch.delattr(q.HyperConnection, "inject_then_mix")
    with pytest.raises(optimize.SeamError, match=r"HyperConnection\.inject_then_mix"):
        load("demo", options=GraphOptions(join_projections=True, cpu_streams=1))
    monkeypatch.undo()
    monkeypatch.setattr(q.QSAAttention, "attend", lambda self, queries, keys, values: None)
    with pytest.raises(optimize.SeamError, match=r"QSAAttention\.attend: QSAAttention takes \(self, queries, keys"):
        load("demo", options=GraphOptions(rope_tables=True, cpu_streams=1))
    monkeypatch.undo()
    assert load("demo", options=GraphOptions(join_projections=True, rope_tables=True, cpu_streams=1))[0] is not None


def test_a_swap_overriding_a_method_that_is_no_seam_is_refused():
    import pytest

    from hebrus_mlx.models import qwen4exp as q

    class Bad(q.SparseMoE):
        def projections(self):
            return []

    with pytest.raises(optimize.SeamError, match=r"SparseMoE\.projections: not a seam"):
        optimize.check_seams(q.SparseMoE, Bad)
    for cls in optimize.SWAPS:
        base = next(b for b in cls.__mro__[1:] if b in optimize.SWAPPABLE)
        optimize.check_seams(base, cls)  # every shipped swap keeps to the contract


def test_the_pass_runs_again_from_the_plain_blocks_when_weights_change():
    """A second apply, and nn.quantize on a loaded model (update_modules), start from the plain
    blocks: a one-graph mix or MoE is no longer swapped in where its Linears became quantized (a float
    checkpoint: the demo's quantized experts never get the one-graph MoE)."""
    import mlx.nn as nn
    from support.parity_fixtures import PARITY

    from hebrus_mlx.loader import load_hf_model

    demo, _ = load("demo", options=GraphOptions(join_projections=True, cpu_streams=1))
    assert set(optimize.implementations(demo)["blocks"]["SparseMoE"]) == {"SparseMoE"}
    model = load_hf_model(PARITY / "tiny_a", options=GraphOptions(join_projections=True, cpu_streams=1))
    before = optimize.implementations(model)
    assert set(before["blocks"]["SparseMoE"]) == {"OneGraphSparseMoE"}
    optimize.apply(model, model.options)
    assert optimize.implementations(model) == before
    nn.quantize(
        model,
        group_size=32,
        bits=8,
        class_predicate=lambda p, m: p.endswith(("input_mix_weight_down", "switch_mlp.gate_proj")),
    )
    blocks = optimize.implementations(model)["blocks"]
    assert blocks["HyperConnection"] == {"HyperConnection": sum(before["blocks"]["HyperConnection"].values())}
    assert blocks["SparseMoE"] == {"SparseMoE": sum(before["blocks"]["SparseMoE"].values())}
