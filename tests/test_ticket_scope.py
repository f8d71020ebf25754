"""Issue 26 §3: the ticket scope of `Model.streaming.request()` that the server opens per request and
the speculative protocol retires generations in (so a client disconnect fails a speculative
request's pending reads too: tests/test_server.py::test_cancel_fails_pending_expert_tickets[ngram]).
Checked against the engine's own view of stale generations."""

import mlx.core as mx
import pytest

from hebrus_mlx.stream import engine as se

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


def _streamed():
    from test_stream_model import _testing_experts

    from hebrus_mlx import load

    model, tok = load("demo")
    _testing_experts(model, 26)  # 26 of 512 records: every step misses
    return model, tok


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
