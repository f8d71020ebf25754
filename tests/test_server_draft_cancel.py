"""Issue 26 §3: a request decoding speculatively (`--draft-model`) is cancelled like any other.

The server runs each request in one ticket scope of `Model.streaming`; the speculative protocol
retires generations inside that scope instead of carrying an owner of its own, so a client
disconnect fails the pending expert reads of a speculative request at once (before the fix the
cancel advanced the server's owner while the reads carried the protocol's, and a step blocked on
the SSD finished its reads first). References are in-process plain `stream_generate` runs.
"""

import asyncio

import mlx.core as mx
import pytest

from hebrus_mlx.stream import engine as se

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


@pytest.fixture(scope="module")
def demo():
    from hebrus_mlx import load

    return load("demo")


def _streamed():
    from hebrus_mlx import load
    from test_stream_model import _testing_experts

    model, tok = load("demo")
    _testing_experts(model, 26)  # 26 of 512 records: every step misses
    return model, tok


def test_cancel_fails_pending_speculative_reads(demo):
    from hebrus_mlx import stream_generate
    from hebrus_mlx.server import Job, Sampling, ServerDefaults, Worker

    ref_model, tok = demo
    worker = Worker(_streamed, 1 << 30, ServerDefaults(draft_model="ngram", num_draft_tokens=2))
    eng = worker.model.streaming.engine
    sampling = Sampling(None, 0.0, 1.0, 0, 0.0, None, [], True, False)
    ids = tok.encode("def main():\n")

    async def scenario():
        loop = asyncio.get_running_loop()
        job = Job(ids, sampling, 500, loop, asyncio.Queue())
        worker.jobs.put(job)
        assert (await asyncio.wait_for(job.events.get(), 60))[0] == "text"
        eng.hold(True)  # the next miss blocks its step
        await asyncio.sleep(0.3)
        before = eng.counters()["stale_tickets"]
        worker.cancel(job)
        stale = eng.counters()["stale_tickets"] - before
        eng.hold(False)
        for _ in range(600):
            if not worker.busy:
                break
            await asyncio.sleep(0.05)
        nxt = Job(ids, sampling, 8, loop, asyncio.Queue())
        worker.jobs.put(nxt)
        text = ""
        while True:
            kind, value = await asyncio.wait_for(nxt.events.get(), 60)
            if kind != "text":
                return stale, (kind, value, text)
            text += value

    try:
        stale, after = asyncio.run(scenario())
    finally:
        worker.stop()
    assert stale > 0  # the blocked step's reads failed at the cancel, not after the SSD
    assert eng.memory()["pinned_slots"] == 0 and eng.memory()["tickets"] == 0
    want = "".join(r.text for r in stream_generate(ref_model, tok, ids, max_tokens=8))
    assert after[:2] == ("done", "length") and after[2] == want
    eng.close()


def test_ticket_scope_retire_cancel_and_nesting():
    """The scope semantics the server and the protocol rely on, against the engine's own view."""
    model, _ = _streamed()
    st = model.streaming
    sw = model.layers[0].mlp.switch_mlp
    try:
        assert (sw.owner, sw.generation) == (0, 0)
        with st.request() as outer:
            assert (sw.owner, sw.generation) == (outer.owner, outer.generation)
            with st.request() as inner:  # speculation inside a request shares its scope
                assert inner is outer
                first = outer.generation
                inner.retire()
            assert outer.generation == first + 1 and sw.generation == first + 1
            # The retired generation is refused by the engine.
            with pytest.raises(Exception, match="stale"):
                rows, _ = st.experts.resolve(0, mx.array([[1, 2, 3, 4]]), outer.owner, first)
                mx.eval(rows)
            outer.cancel()
            outer.retire()  # after a cancel: no fresh generation, later reads keep failing
            assert outer.generation == first + 1
            with pytest.raises(Exception, match="stale"):
                rows, _ = st.experts.resolve(0, mx.array([[1, 2, 3, 4]]), outer.owner, outer.generation)
                mx.eval(rows)
        assert (sw.owner, sw.generation) == (0, 0)
        with st.request() as nxt:  # a new request starts past the cancelled one
            assert nxt.generation > first + 1
            outer.cancel()  # a late cancel of a finished request does not touch it
            rows, lease = st.experts.resolve(0, mx.array([[1, 2, 3, 4]]), nxt.owner, nxt.generation)
            mx.eval(st.engine.release_after(rows, lease))
    finally:
        st.engine.close()
