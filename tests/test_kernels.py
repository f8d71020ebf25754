"""Metal kernels: the same sources through the MSL emulator (runs everywhere) against float64
oracles and the graph's ops paths; kernel vs ops on a real Metal device (skipped without Metal).

The emulator checks indexing, reductions, barriers and masking — not Apple's compiler
(see hebrus_mlx/testing/msl_emulator.py)."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from support.parity_fixtures import capture, model

from hebrus_mlx import kernels
from hebrus_mlx.kernels import hc_mix, ple_gather, qsa_attention
from hebrus_mlx.models.qwen4exp import Capture, QSAAttention
from hebrus_mlx.testing import kernel_emulation as emu
from hebrus_mlx.testing import msl_emulator

needs_cxx = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")), reason="no C++ compiler")


def needs_metal(fn):
    """Runs only on a Metal device; marked `metal` (the self-hosted Apple-silicon CI job's -m metal)."""
    return pytest.mark.metal(
        pytest.mark.skipif(not kernels.metal_available(), reason="no Metal device (not verifiable here)")(fn)
    )


# ---- harness -------------------------------------------------------------------------------------

REDUCE = """
    uint i = thread_position_in_grid.x;
    float v = x[i];
    // butterfly within the SIMD group, then the groups through threadgroup memory
    for (ushort o = 16; o > 0; o >>= 1) v += simd_shuffle_xor(v, o);
    threadgroup float part[NSG];
    if (thread_index_in_simdgroup == 0) part[simdgroup_index_in_threadgroup] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (thread_index_in_threadgroup == 0) {
        float t = 0.0f;
        for (int g = 0; g < NSG; ++g) t += part[g];
        out[threadgroup_position_in_grid.x] = t;
    }
    float m = simd_max(x[i]);
    if (thread_index_in_simdgroup == 0) mx_out[i / 32] = m;
"""


def _run_reduce(name, source, x):
    """Run a REDUCE-shaped kernel over x: one threadgroup of 128 threads (4 SIMD groups) per 128
    values; returns (per-group sums, per-SIMD-group maxima)."""
    groups = x.size // 128
    return msl_emulator.run(
        name,
        source,
        {"x": x},
        {"out": ((groups,), np.float32), "mx_out": ((4 * groups,), np.float32)},
        grid=(x.size, 1, 1),
        threadgroup=(128, 1, 1),
        template=[("NSG", 4)],
    )


@needs_cxx
def test_harness_reductions_barriers_and_threadgroups():
    x = np.random.default_rng(0).standard_normal(3 * 128).astype(np.float32)
    out, mx_out = _run_reduce("reduce", REDUCE, x)
    np.testing.assert_allclose(out, x.astype(np.float64).reshape(3, 128).sum(-1), atol=1e-5)
    np.testing.assert_array_equal(mx_out, x.reshape(12, 32).max(-1))


@needs_cxx
def test_harness_catches_a_missing_group_in_the_merge():
    """The oracle comparison can fail: a kernel that merges only SIMD group 0 is caught."""
    x = np.random.default_rng(1).standard_normal(128).astype(np.float32)
    broken = REDUCE.replace("for (int g = 0; g < NSG; ++g) t += part[g];", "t = part[0];")
    out, _ = _run_reduce("reduce_broken", broken, x)
    assert abs(out[0] - x.astype(np.float64).sum()) > 1e-3


def test_grid_must_be_a_multiple_of_the_threadgroup():
    with pytest.raises(ValueError, match="multiple"):
        msl_emulator.run("x", "", {}, {"o": ((1,), np.float32)}, grid=(33, 1, 1), threadgroup=(32, 1, 1))


# ---- hyper-connection mix ------------------------------------------------------------------------


def _hc_inputs(rows=5, hc=4, hidden=64, seed=0):
    r = np.random.default_rng(seed)
    return (
        r.standard_normal((1, rows, hc * hidden)).astype(np.float32) * 3,
        r.standard_normal((1, rows, hc * hidden)).astype(np.float32),
    )


@needs_cxx
@pytest.mark.parametrize("hc,hidden", [(4, 64), (3, 48)])
def test_hc_mix_emulated_matches_float64_and_ops(hc, hidden):
    up, normed = _hc_inputs(hc=hc, hidden=hidden)
    got = emu.hc_mix(up, normed, hc, hidden)
    u, n = up.astype(np.float64), normed.astype(np.float64)
    oracle = ((1 / (1 + np.exp(-u))).reshape(1, 5, hc, hidden) * n.reshape(1, 5, hc, hidden)).mean(-2)
    np.testing.assert_allclose(got, oracle, atol=1e-6)
    np.testing.assert_allclose(got, np.array(hc_mix.ops(mx.array(up), mx.array(normed), hc, hidden)), atol=1e-6)


# ---- PLE hash + gather ---------------------------------------------------------------------------


def _ple_case(name):
    m = model(name)
    layer = next(lay for lay in m.layers if lay.has_ple)
    emb = layer.ple.ple_embedding
    eos = m.args.eos_id
    ids = capture(name)["input_ids"][0].astype(np.int64)
    # carried context of EOS (sequence start), then the prompt with its adjacent/later EOS
    history = np.concatenate([np.full(emb.ngram_size - 1, eos), ids[:20]])
    return emb, history, eos


@needs_cxx
@pytest.mark.parametrize("name", ["tiny_a", "tiny_b", "tiny_c"])
def test_ple_gather_emulated_matches_ops(name):
    emb, history, eos = _ple_case(name)
    n_new = len(history) - (emb.ngram_size - 1)
    rows, got = emu.ple_gather(
        history,
        np.array(emb._multipliers),
        np.array(emb._head_sizes),
        np.array(emb._head_offsets),
        np.array(emb.ngram_embedding.weight),
        n_new,
        emb.heads_per_ngram,
        eos,
    )
    ref_rows, ref_emb = ple_gather.ops(emb, mx.array(history[None]), n_new)
    np.testing.assert_array_equal(rows, np.array(ref_rows)[0])
    np.testing.assert_array_equal(got, np.array(ref_emb)[0])
    assert (history[emb.ngram_size - 1 :] == eos).any()  # the segment rule was exercised


# ---- QSA attention over the selected keys --------------------------------------------------------


def _sparse_calls(name, decode_steps=1):
    """(queries, keys, values, idx, ok, out) of every sparse attention call: a prefill past the
    window, then decode steps."""
    m = model(name)
    calls = []
    orig = QSAAttention.sparse_attention

    def record(self, q, k, v, idx, ok, *a, **kw):
        out = orig(self, q, k, v, idx, ok, *a, **kw)
        calls.append((self.scale, *(np.array(t) for t in (q, k, v, idx, ok, out))))
        return out

    QSAAttention.sparse_attention = record
    try:
        ids = mx.array(capture(name)["input_ids"])
        cache = m.make_cache()
        logits = m(ids, cache=cache, capture=Capture())
        for _ in range(decode_steps):
            logits = m(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
            mx.eval(logits)
    finally:
        QSAAttention.sparse_attention = orig
    assert calls, "no sparse call: the prompt must pass the QSA window"
    return calls


def _attention_oracle(q, k, v, idx, ok, scale):
    hq, L, D = q.shape
    rep = hq // k.shape[0]
    out = np.zeros((L, hq * D))
    for h in range(hq):
        for i in range(L):
            sel = idx[i][ok[i]]
            s = (k[h // rep, sel].astype(np.float64) @ q[h, i].astype(np.float64)) * scale
            p = np.exp(s - s.max())
            out[i, h * D : (h + 1) * D] = (p / p.sum()) @ v[h // rep, sel].astype(np.float64)
    return out


@needs_cxx
@pytest.mark.parametrize("name", ["tiny_a", "tiny_c"])
def test_qsa_attention_emulated_prefill_and_decode(name):
    calls = _sparse_calls(name)
    kinds, tails = set(), set()
    for scale, q, k, v, idx, ok, ops_out in calls:
        L = q.shape[2]
        kinds.add("prefill" if L > 1 else "decode")
        got = emu.qsa_attention(q[0], k[0], v[0], idx[0], ok[0], scale)
        oracle = _attention_oracle(q[0], k[0], v[0], idx[0], ok[0], scale)
        np.testing.assert_allclose(got, oracle, atol=2e-6)
        np.testing.assert_allclose(got, ops_out[0], atol=2e-6)
        # the tail (the query's incomplete block) is part of the selection (AFN-017)
        r = model(name).args.indexer_compress_ratio
        for i in range(L):
            pos = k.shape[2] - L + i
            tail = np.arange((pos + 1) // r * r, pos + 1)
            assert np.isin(tail, idx[0][i][ok[0][i]]).all()
            tails.add(len(tail) > 0)
        # and selected groups come in chronological order
        assert all((np.diff(idx[0][i][ok[0][i]]) > 0).all() for i in range(L))
    assert kinds == {"prefill", "decode"} and True in tails


# ---- switches ------------------------------------------------------------------------------------


def test_kernels_switch_on_only_when_the_profile_passed_them_on_metal(monkeypatch):
    from hebrus_mlx import machine_profile as prof

    here = dict(prof.this_machine(), metal=True)  # a profile written on this machine, seen as a Mac
    monkeypatch.setattr(prof, "this_machine", lambda: dict(here))
    profile = {
        "machine": here,
        "kernels": {
            "hc_mix": {"status": "passed", "device": "metal"},
            "ple_gather": {"status": "passed", "device": "emulator"},
            "qsa_attention": {"status": "failed", "device": "metal"},
        },
    }
    assert kernels.configure(profile) == {"hc_mix"}
    assert kernels.enabled("hc_mix") == kernels.metal_available()
    # The load-time pass swaps a qualified kernel in, unless the options switch Metal kernels off.
    from support.parity_fixtures import PARITY

    from hebrus_mlx.models import optimize
    from hebrus_mlx.models.options import GraphOptions
    from hebrus_mlx.models.qwen4exp import HyperConnection, ModelArgs

    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    args = ModelArgs.from_dict(json.loads((PARITY / "tiny_a" / "config.json").read_text()))
    for allowed, cls in ((True, optimize.MetalHyperConnection), (False, optimize.OneGraphHyperConnection)):
        hc = HyperConnection(args)
        optimize.apply(hc, GraphOptions(metal_kernels=allowed, cpu_streams=1))
        assert type(hc) is cls
    kernels.configure(None)
    assert not any(kernels.enabled(k) for k in kernels.KERNELS)


def test_no_kernel_object_without_metal():
    if kernels.metal_available():
        pytest.skip("Metal present")
    assert hc_mix.kernel_object() is None and ple_gather.kernel_object() is None
    assert qsa_attention.kernel_object() is None


# ---- on a Metal device (skipped here) -----------------------------------------------------------


@needs_metal
def test_hc_mix_metal_matches_ops():
    up, normed = (mx.array(a) for a in _hc_inputs())
    np.testing.assert_allclose(
        np.array(hc_mix.metal(up, normed, 4, 64)), np.array(hc_mix.ops(up, normed, 4, 64)), atol=1e-5
    )


@needs_metal
def test_ple_gather_metal_matches_ops():
    emb, history, _ = _ple_case("tiny_a")
    n_new = len(history) - (emb.ngram_size - 1)
    rows, got = ple_gather.metal(emb, mx.array(history[None]), n_new)
    ref_rows, ref = ple_gather.ops(emb, mx.array(history[None]), n_new)
    np.testing.assert_array_equal(np.array(rows), np.array(ref_rows))
    np.testing.assert_array_equal(np.array(got), np.array(ref))


@needs_metal
def test_qsa_attention_metal_matches_ops():
    for scale, q, k, v, idx, ok, ops_out in _sparse_calls("tiny_a"):
        got = qsa_attention.metal(*(mx.array(t) for t in (q, k, v, idx, ok)), scale)
        np.testing.assert_allclose(np.array(got), ops_out, atol=1e-5)


# ---- run-time lengths and strides (one compiled kernel for every decode step) ---------------------


def _qsa_case(rng, hq, hkv, cap, S, L, W, D=8):
    """A QSA call whose K/V are views over [Hkv, cap, D] buffers cut to S rows (as the cache's are)."""
    q = rng.standard_normal((hq, L, D)).astype(np.float32)
    k_buf, v_buf = (rng.standard_normal((hkv, cap, D)).astype(np.float32) for _ in range(2))
    idx = np.stack([np.sort(rng.choice(S, W, replace=False)) for _ in range(L)]).astype(np.int32)
    ok = rng.random((L, W)) < 0.8
    ok[:, 0] = True
    return q, k_buf[:, :S], v_buf[:, :S], idx, ok


@needs_cxx
def test_qsa_attention_compiles_one_kernel_for_every_context_length(monkeypatch):
    """The context length S (and L, W) are read at run time: calls at different lengths build the
    same source, so MLX compiles one Metal library, not one per decode token. K/V are strided
    views over larger buffers (the cache's spare capacity) and are read through their strides."""
    assert {name for name, _ in qsa_attention.launch(1, 4, 2, 8, mx.float32)["template"]} == {
        "T",
        "HQ",
        "HKV",
        "D",
        "NSG",
    }
    sources = set()
    build = msl_emulator.build_source
    monkeypatch.setattr(msl_emulator, "build_source", lambda *a, **k: sources.add(build(*a, **k)) or build(*a, **k))
    rng = np.random.default_rng(5)
    for cap, S, L, W in ((64, 9, 1, 9), (64, 40, 1, 11), (128, 97, 3, 11), (128, 128, 2, 20)):
        q, k, v, idx, ok = _qsa_case(rng, 4, 2, cap, S, L, W)
        assert not k.flags.c_contiguous or S == cap
        got = emu.qsa_attention(q, k, v, idx, ok, 0.35)
        np.testing.assert_allclose(got, _attention_oracle(q, k, v, idx, ok, 0.35), atol=2e-6)
    assert len(sources) == 1


def test_qsa_metal_call_keeps_one_template_and_passes_the_cache_views(monkeypatch):
    """On a Mac (faked here: the kernel object is a recorder) the call's template is the same at
    every context length, K/V go in as the views they are, and the kernel is made without
    ensure_row_contiguous (MLX would copy each K/V view per layer per step). Not verified on Metal."""
    calls = []

    def fake(inputs, output_shapes, output_dtypes, **launch):
        calls.append((inputs, launch))
        return [mx.zeros(output_shapes[0], dtype=output_dtypes[0])]

    monkeypatch.setattr(qsa_attention, "kernel_object", lambda: fake)
    buf = mx.random.normal((1, 2, 64, 8))
    for S in (10, 33):
        q = mx.random.normal((1, 4, 1, 8))
        idx = mx.broadcast_to(mx.arange(min(S, 6)), (1, 1, min(S, 6)))
        qsa_attention.metal(q, buf[:, :, :S], buf[:, :, :S], idx, mx.ones(idx.shape, dtype=mx.bool_), 0.3)
    (first, a), (second, b) = calls
    assert a == b
    assert first[1].shape == (2, 10, 8) and second[1].shape == (2, 33, 8)


def test_qsa_kernel_is_made_without_row_contiguous_copies(monkeypatch):
    """mx.fast.metal_kernel gets ensure_row_contiguous=False for QSA (it reads K/V through their
    strides); the other kernels keep MLX's copy. Faked Metal; not verified on a device."""
    made = {}
    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    monkeypatch.setattr(mx.fast, "metal_kernel", lambda **kw: made.setdefault(kw["name"], kw))
    for module in (qsa_attention, hc_mix):
        module.kernel_object.cache_clear()
        try:
            module.kernel_object()
        finally:
            module.kernel_object.cache_clear()
    assert made["hebrus_qsa_attention"]["ensure_row_contiguous"] is False
    assert made["hebrus_hc_mix"]["ensure_row_contiguous"] is True
