"""Tests for the prefill sweep (issue 13): hebrus_mlx/stream/sweep.py, metal_ext/sweep.cpp, its
hooks in Streaming / StreamedSwitchGLU and the `--prefill-sweep` flag.

Provenance: the reference for every swept run is the same artifact run through the slot path
(records resolved one by one into the arena) and loaded resident (ExpertMajorReader, not the
engine): the shipped demo artifact and a tiny checkpoint written by transformers' save_pretrained
and converted here (artifact_fixture.tiny_artifact, bf16 affine4: the ring widens bf16 parts).
Corruption is one byte flipped in the expert store on disk after admission.
"""

import argparse
import os
import shutil

import mlx.core as mx
import numpy as np
import pytest
from support.chunked_greedy import chunked_greedy
from support.stream_store import cache_gb

from hebrus_mlx import cli
from hebrus_mlx.commands import cli_args
from hebrus_mlx.errors import UsageError
from hebrus_mlx.loader import DEMO_DIR, load_model
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream import sweep as S
from hebrus_mlx.stream.errors import DigestMismatchError

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


def test_modes_flag_and_typed_errors(capsys):
    assert S.parse_mode(None) == S.DEFAULT == "auto"
    with pytest.raises(UsageError) as e:
        S.parse_mode("always")
    assert e.value.field == "prefill_sweep"
    p = argparse.ArgumentParser()
    cli_args.add_sweep_argument(p)
    assert cli_args.sweep_from_args(p.parse_args([])) is None
    assert cli_args.sweep_from_args(p.parse_args(["--prefill-sweep", "off"])) == "off"
    assert cli.main(["generate", "--prefill-sweep", "sometimes", "-m", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prefill-sweep" in err[0]


def test_expected_unique_fraction():
    # 1 token of top-10 over 512 touches 10/512; many tokens approach all of them.
    assert S.expected_unique_fraction(1, 10, 512) == pytest.approx(10 / 512)
    assert S.expected_unique_fraction(512, 10, 512) == pytest.approx(1 - (502 / 512) ** 512)
    assert S.expected_unique_fraction(8192, 10, 512) > 0.999


def _cache_gb(d, fraction):
    return cache_gb(d, fraction)[0]


def _run(model, prompt, steps, chunk):
    """Chunked prefill then greedy decode; every position's prefill logits and each step's."""
    sweep = None if model.streaming is None else model.streaming.sweep
    after = []
    tokens, logits = chunked_greedy(
        model, prompt, steps, chunk, lambda: after.append(None if sweep is None else sweep.counters()["sweeps"])
    )
    return tokens, logits, after[0]


def _assert_same(a, b):
    assert a[0] == b[0]
    assert len(a[1]) == len(b[1])
    for x, y in zip(a[1], b[1]):
        np.testing.assert_array_equal(x, y)


def _check_swept_equals_slot_and_resident(d, fraction, prompt_len, seed, steps=8):
    resident = load_model(d)
    prompt = np.random.default_rng(seed).integers(2, resident.args.vocab_size, prompt_len).tolist()
    slot = load_model(d, expert_cache_gb=_cache_gb(d, fraction), prefill_sweep="off")
    chunk = slot.streaming.max_chunk_tokens
    assert chunk >= 2 and slot.streaming.sweep is None
    want = _run(slot, prompt, steps, chunk)
    _assert_same(want, _run(resident, prompt, steps, chunk))
    swept = load_model(d, expert_cache_gb=_cache_gb(d, fraction), prefill_sweep="on")
    st = swept.streaming
    got = _run(swept, prompt, steps, chunk)
    _assert_same(got, want)
    c = st.sweep.counters()
    # The sweep ran for every prefill chunk's layers and never for a one-token decode step.
    assert got[2] > 0 and c["sweeps"] == got[2]
    assert c["read_bytes"] >= got[2] * swept.args.num_experts * sum(st.experts.part_bytes)
    assert st.engine.memory()["pinned_slots"] == 0
    return swept


def test_demo_streamed_small_cache_sweep_is_bit_identical():
    """Demo at 5% of its records: prefill logits, then greedy tokens and logits (the cache state
    the prefill left) equal the slot path's and the resident run's."""
    model = _check_swept_equals_slot_and_resident(DEMO_DIR, 0.05, 23, 5)
    assert "Prefill sweep on:" in model.streaming.sweep_summary()


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    from support.artifact_fixture import tiny_artifact

    return tiny_artifact(str(tmp_path_factory.mktemp("sweep")), dtype="bfloat16", q_bits=4)[1]


def test_tiny_converted_checkpoint_sweep_is_bit_identical(tiny_bf16):
    _check_swept_equals_slot_and_resident(tiny_bf16, 0.25, 13, 7)


def test_auto_switches_at_the_crossover(tmp_path, monkeypatch):
    monkeypatch.setenv("HEBRUS_PROFILE", str(tmp_path / "none.json"))  # no measured crossover: the built-in one
    model = load_model(DEMO_DIR, expert_cache_gb=_cache_gb(DEMO_DIR, 0.2))
    st = model.streaming
    assert st.sweep is not None and st.sweep.mode == "auto"  # the default
    assert st.sweep.crossover == S.CROSSOVER
    top_k, n, cap = model.args.num_experts_per_tok, model.args.num_experts, st.max_chunk_tokens
    st.set_prefill_sweep("auto", crossover=0.3)
    need = next(t for t in range(1, 10_000) if S.expected_unique_fraction(t, top_k, n) >= 0.3)
    assert 2 < need < cap
    assert not st.sweep.active(need - 1) and st.sweep.active(need)
    st.set_prefill_sweep("auto", crossover=1.0)
    # Below the crossover, chunks the arena takes stay on the slot path, larger ones are swept.
    assert not st.sweep.active(cap) and st.sweep.active(cap + 1)
    for mode in ("auto", "on"):
        st.set_prefill_sweep(mode)
        assert not st.sweep.active(1)  # never for decode
    st.set_prefill_sweep("off")
    assert st.sweep is None and not st.switches[0].sweeping(10_000) and st.prefill_chunk_cap == cap


def test_generate_with_a_ring_prefills_in_resident_chunks():
    """With a ring generate stops capping prefill chunks at the arena: the streamed prompt is
    prefilled in prefill_step_size chunks (those past the arena swept, the others as auto decides)
    and its tokens and logprobs equal the resident run's at the same prefill_step_size; without one
    (off) the chunks stay capped at the arena."""
    from hebrus_mlx.generate import generate_step

    gb = _cache_gb(DEMO_DIR, 0.05)
    auto, off = load_model(DEMO_DIR, expert_cache_gb=gb), load_model(DEMO_DIR, expert_cache_gb=gb, prefill_sweep="off")
    assert auto.streaming.prefill_chunk_cap is None and auto.streaming.sweep.mode == "auto"
    assert off.streaming.prefill_chunk_cap == off.streaming.max_chunk_tokens < 16
    resident = load_model(DEMO_DIR)
    prompt = mx.array(np.random.default_rng(2).integers(2, resident.args.vocab_size, 40).tolist())
    kw = dict(effective_vocab_size=resident.args.vocab_size, max_tokens=6, prefill_step_size=16)
    got = list(generate_step(prompt, auto, **kw))
    want = list(generate_step(prompt, resident, **kw))
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    # 39 prompt tokens before the last: chunks of 16, 16 and 7 (all past the arena's 6), each swept
    # layer by layer; decode steps never sweep.
    assert auto.streaming.sweep.counters()["sweeps"] == 3 * auto.args.num_hidden_layers


def test_ring_over_budget_is_refused_or_left_off():
    model = load_model(DEMO_DIR, expert_cache_gb=_cache_gb(DEMO_DIR, 0.2))
    st = model.streaming
    need = S.ring_bytes(st.experts)
    assert need == 2 * model.args.num_experts * sum(
        2 * n if w else n for n, w in zip(st.experts.part_bytes, st.experts.expand)
    )
    with pytest.raises(S.SweepBudgetError) as e:
        st.set_prefill_sweep("on", budget=need - 1)
    assert e.value.field == "prefill_sweep" and "GiB" in e.value.message
    st.set_prefill_sweep("auto", budget=need - 1)
    assert st.sweep is None and "prefill sweep off" in st.sweep_note
    st.set_prefill_sweep("on", budget=need)
    assert st.sweep is not None and st.sweep.bytes == need
    with pytest.raises(UsageError) as e:
        load_model(DEMO_DIR, prefill_sweep="on")  # resident experts: nothing to sweep
    assert e.value.field == "prefill_sweep"


def test_corrupt_record_fails_typed_and_the_step_rolls_back(tmp_path):
    """A record whose bytes no longer match its digest fails the swept chunk with the typed
    DigestMismatchError (never used); once the bytes are restored the same prefill is identical."""
    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact.expert_major import ExpertMajorReader
    from hebrus_mlx.generate import generate_step

    d = shutil.copytree(DEMO_DIR, tmp_path / "demo")
    model = load_model(d, expert_cache_gb=_cache_gb(d, 0.05), prefill_sweep="on")
    m = admit(str(d))
    with ExpertMajorReader(m.file(m.experts), m.family, m.experts.codec) as r:
        victim = r.geometry.record_offset(3 * m.family.num_experts + 5) + 17  # layer 3, expert 5
    path = os.path.join(d, "experts.hbem")
    with open(path, "r+b") as f:
        f.seek(victim)
        good = f.read(1)
        f.seek(victim)
        f.write(bytes([good[0] ^ 0xFF]))
    prompt = mx.array(np.random.default_rng(1).integers(2, 4000, 12).tolist())
    kw = dict(effective_vocab_size=model.args.vocab_size, max_tokens=2, prefill_step_size=6)
    with pytest.raises(DigestMismatchError, match="XXH3-128 mismatch .* in a prefill sweep"):
        list(generate_step(prompt, model, **kw))
    with open(path, "r+b") as f:
        f.seek(victim)
        f.write(good)
    got = [t for t, _ in generate_step(prompt, model, **kw)]
    ref = load_model(DEMO_DIR, expert_cache_gb=_cache_gb(DEMO_DIR, 0.05), prefill_sweep="off")
    assert got == [t for t, _ in generate_step(prompt, ref, **kw)]


def test_auto_planned_arena_leaves_the_ring_its_room(monkeypatch):
    """An arena sized from free memory used to take every byte, so `auto` found no room for the
    ring and stayed off on exactly the models that stream by themselves. The loader now gives the
    ring its two layers of records out of such an arena when that costs at most RING_SHARE of it;
    a forced cache size (the user's budget) and `off` keep the arena as planned."""
    import json

    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact import constants as C
    from hebrus_mlx.loading import build_model as A
    from hebrus_mlx.loading import plan

    m = admit(str(DEMO_DIR))
    E = m.family.num_experts
    assert A._make_room_for_ring(m, mx.float32, 100 * E, None, "auto") == 98 * E
    assert A._make_room_for_ring(m, mx.float32, 8 * E, None, "auto") == 6 * E  # exactly the share
    assert A._make_room_for_ring(m, mx.float32, 8 * E - 1, None, "auto") == 8 * E - 1
    assert A._make_room_for_ring(m, mx.float32, 100 * E, 1.0, "auto") == 100 * E
    assert A._make_room_for_ring(m, mx.float32, 100 * E, None, "off") == 100 * E
    assert A._make_room_for_ring(m, mx.float32, None, None, "auto") is None

    # End to end on the demo (8 layers: two layers are a quarter of the whole store, so let the
    # ring take up to all of an arena planned from a small free-memory figure).
    with open(DEMO_DIR / C.MANIFEST_NAME) as f:
        other = sum(os.path.getsize(DEMO_DIR / s["path"]) for s in json.load(f)["stores"] if s["role"] != "experts")
    st0 = load_model(DEMO_DIR, expert_cache_gb=_cache_gb(DEMO_DIR, 0.2)).streaming
    record = S.ring_bytes(st0.experts) // (2 * E)
    monkeypatch.setattr(plan, "available_memory", lambda: plan.RESERVE_BYTES + other + 5 * E * record)
    monkeypatch.setattr(A, "RING_SHARE", 1.0)
    off = load_model(DEMO_DIR, prefill_sweep="off").streaming
    auto = load_model(DEMO_DIR).streaming
    assert off.experts.rows == 5 * E and off.sweep is None
    assert auto.experts.rows == 3 * E and auto.sweep is not None, auto.sweep_note
