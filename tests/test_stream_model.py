"""Tests for the streamed model path: ``load(..., expert_cache_gb)`` / the
resident-vs-streamed plan in hebrus_mlx/loading/build_model.py, wired to
hebrus_mlx/stream (engine, StreamedExperts, StreamedSwitchGLU).

Provenance: the reference for every streamed run is the same artifact loaded
resident by the artifact loader (experts read by ExpertMajorReader: Python
pread + hashlib, not the engine) - an independent cross-check of the
engine's read, fp32 widening and arena gather path. Models: the shipped demo
artifact (affine4-g64 experts, 8 layers x 64 experts) and the tiny reference
checkpoint (transformers capture) converted here with the affine4-g64
profile. Cache sizes are contract controls (5% of the records).
"""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from support.chunked_greedy import chunked_greedy
from support.fault_injection import FaultyEngine
from support.stream_store import cache_gb

from hebrus_mlx.artifact import constants as C
from hebrus_mlx.artifact import expert_major as em
from hebrus_mlx.loader import DEMO_DIR, load_model
from hebrus_mlx.loading import build_model as artifact_loading
from hebrus_mlx.loading import plan
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream import errors
from hebrus_mlx.stream import experts as SE
from hebrus_mlx.stream.streaming import Streaming
from hebrus_mlx.stream.switch import StreamedSwitchGLU, attach

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


def _experts_store(art):
    with open(os.path.join(art, C.MANIFEST_NAME)) as f:
        m = json.load(f)
    s = next(s for s in m["stores"] if s["role"] == "experts")
    return os.path.join(art, s["path"]), C.family(m["family"]), s["codec"]


def _cache_gb(art, fraction=0.05):
    return cache_gb(art, fraction)


def _decode(model, prompt, steps, chunk):
    """Chunked prefill then greedy decode; every forward's logits ([1, L, V])."""
    tokens, logits = chunked_greedy(model, prompt, steps, chunk)
    return tokens, [out[None] for out in logits]


def _assert_same(got, want):
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1])
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def tiny_affine4(tmp_path_factory):
    from support.artifact_fixture import tiny_artifact

    _, art = tiny_artifact(str(tmp_path_factory.mktemp("tiny4")), dtype=None, q_bits=4)
    assert _experts_store(art)[2] == "affine4-g64"
    return art


@pytest.mark.parametrize("stream_ple", [False, True], ids=["experts", "experts+ple"])
@pytest.mark.parametrize("which", ["demo", "tiny_affine4"])
def test_streamed_5pct_cache_bit_identical_to_resident(which, stream_ple, request):
    """AFN-019 (issue 6 evidence): with a cache of 5% of the expert records,
    a prompt + 20 greedy tokens give the same tokens and bitwise-equal logits
    as the resident run, on quantized (affine4-g64) experts: the arena holds
    fp32 scales/biases like the resident loader. Prefill runs in chunks of
    rows // top_k tokens (every expert a chunk routes to is pinned at once)."""
    art = str(DEMO_DIR) if which == "demo" else request.getfixturevalue("tiny_affine4")
    gb, rows = _cache_gb(art)
    resident = load_model(art)
    # With stream_ple the PLE rows also come through the engine, from a 256 KiB page cache.
    streamed = load_model(art, expert_cache_gb=gb, ple_cache_gb=(4 * 65536 / 2**30) if stream_ple else None)
    assert resident.streaming is None
    experts = streamed.streaming.experts
    assert experts.rows == rows and isinstance(streamed.model.layers[0].mlp.switch_mlp, StreamedSwitchGLU)
    assert experts.weights["gate"]["scales"].dtype == mx.float32
    tables = [layer.ple.ple_embedding.ngram_embedding for layer in streamed.model.layers if layer.has_ple]
    assert tables and all((type(t).__name__ == "StreamedNGramTable") == stream_ple for t in tables)
    vocab = resident.args.vocab_size
    prompt = np.random.default_rng(1).integers(2, vocab, 9).tolist()
    chunk = experts.max_chunk_tokens
    want = _decode(resident, prompt, 20, chunk)
    got = _decode(streamed, prompt, 20, chunk)
    _assert_same(got, want)
    c, mem = experts.engine.counters(), experts.engine.memory()
    assert c["misses"] > 0 and c["evictions"] > 0 and c["errors"] == 0
    assert mem["pinned_slots"] == 0 and mem["arena_rows"] <= rows


def test_streamed_load_reads_no_expert_bytes(monkeypatch):
    """AFN-019: the streamed load never reads the expert store into memory
    (the resident reader path is refused) and the auto plan streams when the
    store does not fit available memory minus the reserve; HF dirs refuse
    an expert cache (they stay resident)."""

    def refuse(*a, **k):
        raise AssertionError("expert store read while streaming")

    monkeypatch.setattr(artifact_loading, "_experts", refuse)
    monkeypatch.setattr(em.ExpertMajorReader, "read_expert", refuse)
    with open(DEMO_DIR / C.MANIFEST_NAME) as f:
        other = sum(os.path.getsize(DEMO_DIR / s["path"]) for s in json.load(f)["stores"] if s["role"] != "experts")
    monkeypatch.setattr(plan, "available_memory", lambda: plan.RESERVE_BYTES + other + (1 << 20))
    model = load_model(DEMO_DIR)  # 1 MiB spare < 7.9 MB of fp32-scaled experts
    assert model.streaming is not None and model.streaming.experts.rows == 68
    out = model(mx.array([[5, 6]]), model.make_cache())
    mx.eval(out)
    monkeypatch.setattr(plan, "available_memory", lambda: 64 * plan.GIB)
    with pytest.raises(AssertionError, match="expert store read"):
        load_model(DEMO_DIR)  # fits: resident, which reads the store
    with pytest.raises(ValueError, match="expert_cache_gb"):
        load_model(
            os.path.join(os.path.dirname(__file__), "support", "fixtures", "parity", "tiny_a"), expert_cache_gb=1.0
        )


def _testing_experts(model, rows):
    """Swap in a StreamedExperts over an engine with fault hooks; no P1
    prefetch, so an injected fault lands on an exact read."""
    path, fam, codec = _experts_store(str(DEMO_DIR))
    with em.ExpertMajorReader(path, fam, codec) as reader:
        eng = FaultyEngine(cache_bytes=1 << 16, threads=2)
        experts = SE.StreamedExperts(eng, reader, rows, prefetch_previous=False)
    switches = attach([layer.mlp for layer in model.model.layers], experts)
    model.streaming = Streaming(eng, experts, switches)
    return experts


FAULTS = [
    ("eio", "I/O error", errors.StreamIOError),
    ("short_read", "short read", errors.ShortReadError),
    ("digest", "SHA-256 mismatch", errors.DigestMismatchError),
]


@pytest.mark.parametrize("fault,message,typed", FAULTS, ids=[f[0] for f in FAULTS])
def test_decode_fault_is_clean_and_retry_succeeds(fault, message, typed):
    """AFN-010/AFN-019: an EIO, a short read or a digest mismatch during a
    model decode step fails that evaluation with a clear error naming the
    store read (typed by errors.translate, message kept, tag dropped),
    publishes nothing, leaves no slot pinned and no ticket open, and the
    next sequence gives the resident tokens and logits. (The failed
    sequence is discarded: its cache already holds that step's partial,
    possibly in-place, updates.)"""
    gb, rows = _cache_gb(str(DEMO_DIR))
    resident = load_model(DEMO_DIR)
    model = load_model(DEMO_DIR, expert_cache_gb=gb)
    eng = _testing_experts(model, rows).engine
    prompt = [7, 40, 99, 3]
    want_tokens, want_logits = _decode(resident, prompt, 3, 1)
    cache = model.make_cache()
    for t in prompt[:-1]:
        mx.eval(model(mx.array([[t]]), cache))
    n_errors = eng.counters()["errors"]
    eng.inject_fault(fault, 1)
    out = model(mx.array([prompt[-1:]]), cache)
    with pytest.raises(RuntimeError, match=message) as info:
        mx.eval(out)
    err = errors.translate(info.value)
    assert type(err) is typed and str(err).startswith(message) and "[stream:" not in str(err)
    mem = eng.memory()
    assert eng.counters()["errors"] == n_errors + 1
    assert mem["pinned_slots"] == 0 and mem["tickets"] == 0 and mem["arena_rows"] < rows + 1
    _assert_same(_decode(model, prompt, 3, 1), (want_tokens, want_logits))
    assert eng.memory()["pinned_slots"] == 0


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_streamed_decode_memory_is_flat():
    """AFN-019 (bounded cache): 300 streamed decode tokens through a 5%
    cache; after a 50-token warm-up, process RSS and MLX active memory grow
    by far less than the bytes the engine read (a per-read leak would grow
    by about that much), and the arena never exceeds its rows. The
    2,000-token run is benchmarks/bench_stream_decode.py."""
    gb, rows = _cache_gb(str(DEMO_DIR))
    model = load_model(DEMO_DIR, expert_cache_gb=gb)
    eng = model.streaming.engine
    cache, y = model.make_cache(), mx.array([[5]])
    rss = active = read0 = None
    for step in range(300):
        y = model(y, cache)[:, -1:].argmax(-1)
        mx.eval(y)
        if step == 50:
            rss, active = _rss(), mx.get_active_memory()
            c = eng.counters()
            read0 = c["exact_bytes"] + c["predicted_bytes"]
    c = eng.counters()
    read = c["exact_bytes"] + c["predicted_bytes"] - read0
    assert read > 20 * (1 << 20)
    assert _rss() - rss < read / 8
    assert mx.get_active_memory() - active < read / 8
    assert eng.memory()["arena_rows"] <= rows and eng.memory()["pinned_slots"] == 0


def test_failed_generation_step_rolls_the_sequence_back():
    """AFN-010: generate_step restores the sequence state when a step's evaluation fails (and
    raises the typed StreamIOError), so the same sequence (not only a fresh one) continues
    exactly like a run that never failed."""
    from hebrus_mlx.generate import generate_step

    gb, rows = _cache_gb(str(DEMO_DIR))
    resident = load_model(DEMO_DIR)
    model = load_model(DEMO_DIR, expert_cache_gb=gb)
    eng = _testing_experts(model, rows).engine
    prompt = mx.array([7, 40, 99, 3, 12])
    vocab = resident.args.vocab_size
    want = [t for t, _ in generate_step(prompt, resident, effective_vocab_size=vocab, max_tokens=6)]

    cache = model.make_cache()
    got = []
    steps = generate_step(prompt, model, effective_vocab_size=vocab, max_tokens=6, prompt_cache=cache)
    got.append(next(steps)[0])
    got.append(next(steps)[0])
    eng.inject_fault("eio", 1)
    with pytest.raises(errors.StreamIOError, match="I/O error"):
        for token, _ in steps:
            got.append(token)
    # Rolled back to a state no failure touched: the prompt and every handed-out token but the
    # last are consumed; the last one is fed again to continue the same sequence.
    assert cache.offset == prompt.size + len(got) - 1
    resume_from = got[-1]
    continued = [
        t
        for t, _ in generate_step(
            mx.array([resume_from]), model, effective_vocab_size=vocab, max_tokens=6 - len(got), prompt_cache=cache
        )
    ]
    assert got + continued == want
    assert eng.memory()["pinned_slots"] == 0


def test_cancelled_ticket_mid_step_is_typed_and_clean():
    """AFN-010/AFN-019: a ticket cancelled while a decode step's resolve waits
    on it (workers held, so the read cannot finish first) fails generate with
    TicketCancelledError naming the ticket; nothing stays pinned or open and
    the same sequence then continues like the resident run."""
    import threading

    from hebrus_mlx.generate import generate_step

    gb, rows = _cache_gb(str(DEMO_DIR))
    resident = load_model(DEMO_DIR)
    model = load_model(DEMO_DIR, expert_cache_gb=gb)
    eng = _testing_experts(model, rows).engine
    prompt, vocab = mx.array([7, 40, 99, 3]), resident.args.vocab_size
    want = [t for t, _ in generate_step(prompt, resident, effective_vocab_size=vocab, max_tokens=4)]
    cache = model.make_cache()
    steps = generate_step(prompt, model, effective_vocab_size=vocab, max_tokens=4, prompt_cache=cache)
    got = [next(steps)[0]]
    # Ids are sequential: every ticket of the next step is above this one.
    probe = eng.request(eng.add_store(_experts_store(str(DEMO_DIR))[0]), 0, 4096)
    eng.wait(probe)
    eng.release(probe)

    def pending(t):
        try:
            return eng.ticket_info(t)["state"] == "pending"
        except errors.TicketCancelledError:  # released or never issued
            return False

    cancelled, done = [], threading.Event()

    def canceller():  # engine calls only: MLX streams belong to the main thread
        while not done.is_set() and not cancelled:
            cancelled.extend(t for t in range(probe + 1, probe + 4096) if pending(t) and eng.cancel(t))

    worker = threading.Thread(target=canceller)
    eng.hold(True)  # the first miss of a queued step blocks its resolve
    worker.start()
    caught = []
    try:
        for token, _ in steps:
            got.append(token)
    except errors.StreamError as e:
        caught.append(e)
    finally:
        done.set()
        worker.join()
        eng.hold(False)
    assert cancelled and len(caught) == 1, (got, caught)
    assert type(caught[0]) is errors.TicketCancelledError and "cancelled" in str(caught[0])
    assert eng.memory()["pinned_slots"] == 0 and eng.memory()["tickets"] == 0
    assert cache.offset == prompt.size + len(got) - 1
    rest = generate_step(
        mx.array([got[-1]]), model, effective_vocab_size=vocab, max_tokens=4 - len(got), prompt_cache=cache
    )
    assert got + [t for t, _ in rest] == want


def test_cli_stream_failure_is_one_line(monkeypatch, capsys):
    """AFN-010: a read failure during `hebrus-mlx generate` prints one line
    naming the typed error and the store read, no traceback, and exits 2."""

    from hebrus_mlx.loader import load

    gb, rows = _cache_gb(str(DEMO_DIR))
    model, tok = load("demo", expert_cache_gb=gb)
    eng = _testing_experts(model, rows).engine
    from support.verb_loading import patch_load_from_args

    patch_load_from_args(monkeypatch, lambda *a, **k: (model, tok))
    eng.inject_fault("short_read", 1)
    from hebrus_mlx.cli import main

    assert main(["generate", "-p", "hello", "--max-tokens", "3", "--verbose", "false"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ShortReadError: short read of store" in err
    assert "Traceback" not in err and "[stream:" not in err


def test_expert_and_ple_io_are_counted_apart():
    """Expert records and PLE pages share one engine; its per-store counters report each apart
    (bytes, reads, exposed wait), and together they are everything the engine read."""
    from hebrus_mlx.stream.engine import io_by_kind, io_split_summary

    gb, _ = _cache_gb(str(DEMO_DIR))
    streamed = load_model(str(DEMO_DIR), expert_cache_gb=gb, ple_cache_gb=4 * 65536 / 2**30)
    engine = streamed.streaming.engine
    prompt = np.random.default_rng(2).integers(2, streamed.args.vocab_size, 6).tolist()
    _decode(streamed, prompt, 4, streamed.streaming.experts.max_chunk_tokens)
    c = engine.counters()
    split = io_by_kind(c, engine.store_kinds)
    assert set(split) == {"experts", "ple"}
    assert split["experts"]["reads"] > 0 and split["ple"]["reads"] > 0
    assert split["experts"]["bytes"] + split["ple"]["bytes"] == c["exact_bytes"] + c["predicted_bytes"]
    assert sum(v["exposed_wait_ns"] for v in split.values()) == c["exposed_wait_ns"]
    line = io_split_summary(c, engine.store_kinds)
    assert line.startswith("I/O by store: experts ") and "; ple " in line
    assert any(x.startswith("I/O by store:") for x in streamed.streaming.summary())
