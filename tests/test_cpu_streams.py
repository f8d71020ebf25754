"""The second CPU stream (models/cpu_streams.py) keeps the resident graph's outputs bit-identical:
half of the routed experts, part of a prefill's projections and half of its positions' logits run on
another stream, and every output element is the same dot product as on one stream."""

import os
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx.models import cpu_streams, optimize
from hebrus_mlx.models import options as graph_options
from hebrus_mlx.models import qwen4exp as q
from hebrus_mlx.models.options import GraphOptions
from hebrus_mlx.testing.processes import cli_argv
from hebrus_mlx.testing.tiny_configs import TINY_QWEN4EXP

ROOT = Path(__file__).resolve().parent.parent


def _model():
    # Sparse QSA from a few tokens, PLE, joinable projections: every split site of the graph.
    # The shared tiny config with a second KV head, 16 experts of 32 (4 active) and a longer context.
    args = q.ModelArgs.from_dict(
        dict(
            TINY_QWEN4EXP,
            num_key_value_heads=2,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            vocab_size=300,
            max_position_embeddings=512,
            ngram_vocab_size_base=128,
            heads_per_ngram=4,
            eos_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )
    )
    model = q.Model(args)
    mx.random.seed(3)
    import mlx.nn as nn

    flat = nn.utils.tree_flatten(model.parameters())
    model.update(nn.utils.tree_unflatten([(k, mx.random.normal(v.shape) * 0.2) for k, v in flat]))
    optimize.apply(model, GraphOptions(cpu_streams=2))
    mx.eval(model.parameters())
    return model


def _run(model, streams, ids, steps=5):
    model.options = model.options.replace(cpu_streams=streams)  # read while each graph is built
    cache = model.make_cache()
    out = [model(ids, cache=cache)]
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1][:, -1:], axis=-1).astype(mx.int32), cache=cache))
    mx.eval(out)
    return out


@pytest.fixture
def sides(monkeypatch):
    """Every split site taken (no size floor), and the number of times the graph asked for the side
    stream while building (so a graph that silently stays on one stream fails)."""
    monkeypatch.setattr(optimize, "SIDE_MIN_MACS", 0)
    calls = []
    real = cpu_streams.side_stream

    def counted():
        s = real()
        if s is not None:
            calls.append(s)
        return s

    monkeypatch.setattr(cpu_streams, "side_stream", counted)
    return calls


def test_two_cpu_streams_are_bit_identical_to_one(sides):
    model = _model()
    ids = mx.array(np.random.default_rng(0).integers(1, 300, size=(1, 21)), dtype=mx.int32)
    one = _run(model, 1, ids)
    assert not sides
    two = _run(model, 2, ids)
    assert sides  # the graph did use the second stream
    for a, b in zip(one, two):
        assert mx.array_equal(a, b).item()


def test_each_split_site_matches_its_single_stream_op(sides):
    model = _model()
    x = mx.random.normal((1, 1, 64), key=mx.random.key(5))
    moe, layer = model.layers[0].mlp, model.layers[0]
    gdn = layer.linear_attn
    joined = [gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a]
    wide = mx.random.normal((1, 20, 64), key=mx.random.key(6))  # prefill: the per-Linear split
    for streams in (1, 2):
        with graph_options.use(model.options.replace(cpu_streams=streams)):
            got = {
                "moe": moe(x),
                "project": q._project(gdn, joined, x) + q._project(gdn, joined, wide),
                "logits": model.head_logits(wide),
            }
        mx.eval(got)
        if streams == 1:
            ref = got
    assert mx.array_equal(got["moe"], ref["moe"]).item()
    assert mx.array_equal(got["logits"], ref["logits"]).item()
    assert mx.array_equal(got["logits"], model.lm_head(wide)).item()
    for a, b in zip(got["project"], ref["project"]):
        assert mx.array_equal(a, b).item()


def test_bad_cpu_streams_value_is_a_typed_error_naming_the_field():
    from hebrus_mlx.errors import UsageError

    with pytest.raises(UsageError, match="cpu_streams"):
        GraphOptions(cpu_streams=4)


def test_cli_refuses_a_bad_graph_option_in_one_line():
    proc = subprocess.run(
        cli_argv(
            "generate",
            "--model",
            "demo",
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
            "--graph",
            "cpu_streams=many",
        ),
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "hebrus-mlx generate: error: --graph cpu_streams: expected an integer, got 'many'"
    ]
