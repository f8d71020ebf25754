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
