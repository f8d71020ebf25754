"""Start-up stays fast: the generate path (CLI verb, load, the model graph, streaming) imports neither
mlx_lm nor transformers, whose package inits cost seconds (mlx_lm -> mlx_lm.utils -> transformers ->
torch). mlx-lm interop imports them where it is asked for."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHECK = """
import json, sys
import mlx.core as mx
import hebrus_mlx.cli, hebrus_mlx.generate, hebrus_mlx.loader, hebrus_mlx.models.qwen4exp
import hebrus_mlx.stream.switch, hebrus_mlx.loading.build_model
from hebrus_mlx.loader import load_model, resolve_model_path
model = load_model(resolve_model_path("demo"))
mx.eval(model(mx.array([[1, 2, 3]])))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("mlx_lm", "transformers", "torch"))))
"""


def test_generate_path_imports_neither_mlx_lm_nor_transformers(tmp_path):
    """... and, on the CPU backend with the default options, a cold forward JIT-compiles nothing
    (MLX's kernel cache under a fresh TMPDIR stays empty: no C++ compiler before the first token)."""
    import mlx.core as mx

    proc = subprocess.run(
        [sys.executable, "-c", CHECK],
        env=dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path)),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    if mx.default_device() == mx.cpu:
        assert list(tmp_path.rglob("*.so")) == []


def test_switch_glu_matches_per_expert_linears():
    """Independent oracle: each (token, expert) pair through plain matmuls of that expert's weights,
    for the token-order path (few pairs) and the expert-sorted one (>= SORT_MIN_PAIRS)."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from hebrus_mlx.models.switch_layers import SORT_MIN_PAIRS, SwitchGLU

    glu = SwitchGLU(8, 12, 6)
    for tokens in (2, SORT_MIN_PAIRS):
        x = mx.random.normal((1, tokens, 8), key=mx.random.key(tokens))
        idx = mx.random.randint(0, 6, (1, tokens, 3), key=mx.random.key(tokens + 1))
        got = np.array(glu(x, idx))
        g, u, d = (np.array(m.weight) for m in (glu.gate_proj, glu.up_proj, glu.down_proj))
        xs, ids = np.array(x)[0], np.array(idx)[0]
        for t in range(tokens):
            for j, e in enumerate(ids[t]):
                gate, up = g[e] @ xs[t], u[e] @ xs[t]
                ref = d[e] @ (np.array(nn.silu(mx.array(gate))) * up)
                np.testing.assert_allclose(got[0, t, j], ref, rtol=1e-4, atol=1e-5)


def test_a_run_that_will_jit_compile_says_so_once_on_stderr(tmp_path, monkeypatch, capsys):
    """Compiled regions on the CPU backend with an empty MLX kernel cache: load() prints one line
    naming the cache; with kernels already there, or compile off (the CPU default), nothing."""
    import mlx.core as mx
    import pytest

    from hebrus_mlx.loader import load
    from hebrus_mlx.models.options import GraphOptions, jit_cache_dir

    if mx.default_device() != mx.cpu:
        pytest.skip("the C++ JIT is the CPU backend's")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    load("demo", options=GraphOptions(compile=True))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(jit_cache_dir()) in lines[0] and str(tmp_path) in lines[0]
    load("demo", options=GraphOptions(compile=False))
    load("demo")  # the CPU default: compile off
    assert capsys.readouterr().err == ""
    jit_cache_dir().mkdir(parents=True)
    (jit_cache_dir() / "libkernel.so").write_bytes(b"")
    load("demo", options=GraphOptions(compile=True))
    assert capsys.readouterr().err == ""
