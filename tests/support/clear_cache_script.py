"""Run by tests/test_clear_cache_in_flight.py in a child process (a deadlock there must time out
the child, not the test run). Each stage calls an MLX function that synchronizes every CPU stream
while holding the GIL (mx.clear_cache, mx.set_cache_limit) with streamed work still in flight, and
prints "stage NAME" before and "done NAME" after, so a hang names its stage.

argv: STAGE... among
  engine    engine gather op, its read held 300 ms by the test hook: async_eval, then clear_cache
            and set_cache_limit (deterministic: the op's CPU task is still running)
  forward   the demo streamed (expert_cache_gb=0.004): forward, async_eval, clear_cache; logits equal
            the resident model's
  sweep     the same with prefill_sweep="on" on a 12-token chunk (the ring's ops)
  mlx_lm    mlx_lm.stream_generate on the streamed demo, 20 tokens: equal to hebrus's resident run
  loop      hebrus's stream_generate, CLEAR_CACHE_EVERY=1 (clear_cache with the next step queued at
            every token), 20 tokens: equal to the resident run
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: `support`

import mlx.core as mx
import numpy as np

PROMPT = "def add(a, b):"
N = 20

calls = [0]
_clear = mx.clear_cache


def counted_clear_cache():
    calls[0] += 1
    _clear()


mx.clear_cache = counted_clear_cache  # the real call, counted (mlx_lm and hebrus look it up on mx)


def warm_buffer_cache():
    """MLX's clear_cache returns early on an empty buffer cache: leave a freed buffer in it."""
    mx.eval(mx.ones(1 << 16))
    assert mx.get_cache_memory() > 0


def engine_stage():
    from support.fault_injection import FaultyEngine

    rec = 4096
    path = os.path.join(tempfile.mkdtemp(), "store.bin")
    data = np.random.default_rng(0).integers(0, 256, size=4 * rec, dtype=np.uint8)
    data.tofile(path)
    eng = FaultyEngine(cache_bytes=8 * rec, threads=2)
    table = eng.register_table(eng.add_store(path), [i * rec for i in range(4)], [rec] * 4)
    want = int(data[rec : 3 * rec].astype(np.int64).sum())
    for sync in (mx.clear_cache, lambda: mx.set_cache_limit(mx.set_cache_limit(0))):
        warm_buffer_cache()
        eng.set_read_delay_us(300_000)
        y = eng.gather(table, mx.array([1, 2])).astype(mx.int32).sum()
        mx.async_eval(y)
        sync()
        eng.set_read_delay_us(0)
        assert y.item() == want


def demo(**kw):
    from hebrus_mlx import load

    model, tok = load("demo", **kw)
    return model, tok


def forward_stage(sweep):
    streamed, tok = demo(expert_cache_gb=0.004, prefill_sweep="on" if sweep else None)
    resident, _ = demo()
    assert streamed.streaming is not None and resident.streaming is None
    if sweep:
        assert streamed.streaming.sweep is not None
    ids = tok.encode(PROMPT + " return a + b\n\n")[:12] if sweep else [1, 2, 3]
    want = resident(mx.array([ids]), cache=resident.make_cache())
    mx.eval(want)
    for _ in range(10):  # the race is per step: ten steps hung 4 runs of 4 before the fix
        warm_buffer_cache()
        out = streamed(mx.array([ids]), cache=streamed.make_cache())
        mx.async_eval(out)
        mx.clear_cache()
        np.testing.assert_array_equal(np.array(out), np.array(want))
    if sweep:
        assert streamed.streaming.sweep.counters()["sweeps"] > 0


def resident_tokens(n):
    from hebrus_mlx import stream_generate

    resident, tok = demo()
    return [r.token for r in stream_generate(resident, tok, PROMPT, max_tokens=n)]


def mlx_lm_stage():
    import mlx_lm

    streamed, tok = demo(expert_cache_gb=0.004)
    before = calls[0]
    got = [r.token for r in mlx_lm.stream_generate(streamed, tok.to_mlx_lm(), PROMPT, max_tokens=N)]
    assert calls[0] > before
    assert got == resident_tokens(N)


def loop_stage():
    import importlib

    from hebrus_mlx import stream_generate

    G = importlib.import_module("hebrus_mlx.generate")  # the module: the package's `generate` is the function

    want = resident_tokens(N)
    streamed, tok = demo(expert_cache_gb=0.004)
    G.CLEAR_CACHE_EVERY = 1
    before = calls[0]
    got = [r.token for r in stream_generate(streamed, tok, PROMPT, max_tokens=N)]
    assert calls[0] - before >= N - 1
    assert got == want


STAGES = {
    "engine": engine_stage,
    "forward": lambda: forward_stage(False),
    "sweep": lambda: forward_stage(True),
    "mlx_lm": mlx_lm_stage,
    "loop": loop_stage,
}

for name in sys.argv[1:]:
    print("stage", name, flush=True)
    STAGES[name]()
    print("done", name, flush=True)
