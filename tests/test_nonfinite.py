"""AFN-010: a step whose logits go non-finite is rolled back and fails typed (NonFiniteError naming
``logits``); it never hands out a token drawn from NaN logits, and the state it fed is not
published (the sequence, the prompt cache and the next request continue as if it never ran).

The NaN comes from fault injection after a graph stage (tests/support/fault_injection.py `Poison`: a
decoder layer's output or the vocabulary projection); the expected tokens from the same model's
clean greedy run. Model: the shipped demo, resident."""

import mlx.core as mx
import pytest
from support.fault_injection import Poison

from hebrus_mlx.batch_generate import BatchGenerator, BatchStepError
from hebrus_mlx.errors import NonFiniteError
from hebrus_mlx.generate import generate_step, prefill
from hebrus_mlx.loader import DEMO_DIR, load_model

VOCAB = 4105  # the demo tokenizer's effective vocabulary
PROMPT = [7, 40, 99, 3, 12, 55]
N = 6


@pytest.fixture(scope="module")
def model():
    return load_model(DEMO_DIR)


def _greedy(model, prompt, n, cache=None):
    steps = generate_step(mx.array(prompt), model, effective_vocab_size=VOCAB, max_tokens=n, prompt_cache=cache)
    return [t for t, _ in steps]


@pytest.mark.parametrize("stage,after", [("layer:3", 0), ("layer:3", 3), ("logits", 2)])
def test_poisoned_step_fails_typed_and_the_sequence_continues_exactly(model, monkeypatch, stage, after):
    """The poisoned decode step raises NonFiniteError("logits") with only the clean steps' tokens
    handed out; the cache is back to before that step, so decoding on from it gives the clean run."""
    want = _greedy(model, PROMPT, N)
    cache = model.make_cache()
    prefill(model, mx.array(PROMPT[:-1]), cache)
    poison = Poison(monkeypatch, model, stage, after=after)
    got = []
    with pytest.raises(NonFiniteError) as e:
        for token, _ in generate_step(
            mx.array(PROMPT[-1:]), model, effective_vocab_size=VOCAB, max_tokens=N, prompt_cache=cache
        ):
            got.append(token)
    assert e.value.field == "logits" and got == want[:after]
    assert cache.offset == len(PROMPT) - 1 + after  # the failed step (and the one queued on it) undone
    poison.armed = False
    rest = _greedy(model, (PROMPT + got)[-1:], N - after, cache)
    assert got + rest == want


def test_last_step_nobody_reads_is_not_published(model, monkeypatch):
    """The step queued on the last token is only settled: non-finite, the cache goes back to before
    it (every token was finite and handed out; the poisoned state is not kept)."""
    want = _greedy(model, PROMPT, 3)
    cache = model.make_cache()
    Poison(monkeypatch, model, "logits", after=4)  # prefill's one forward and the three read steps are clean
    assert _greedy(model, PROMPT, 3, cache) == want
    assert cache.offset == len(PROMPT) - 1 + 3


def test_batched_step_fails_typed_and_continues_exactly(model, monkeypatch):
    """Batched: the non-finite step raises BatchStepError with a NonFiniteError cause naming the
    rows that went non-finite, every row back to before it; next() then continues them exactly."""
    prompts = [PROMPT, [5, 9], [100, 200, 300]]
    want = [_greedy(model, p, N) for p in prompts]
    g = BatchGenerator(model, effective_vocab_size=VOCAB, prompt_concurrency=3)
    uids = g.insert(prompts, max_tokens=[N] * 3)
    got = {u: [] for u in uids}
    for _ in range(3):
        for r in g.next():
            got[r.uid].append(r.token)
    poison = Poison(monkeypatch, model, "logits")
    with pytest.raises(BatchStepError) as e:
        for _ in range(2):
            for r in g.next():
                got[r.uid].append(r.token)
    assert isinstance(e.value.cause, NonFiniteError) and e.value.cause.field == "logits"
    assert sorted(e.value.uids) == uids
    poison.armed = False
    while len(g):
        for r in g.next():
            got[r.uid].append(r.token)
    assert [got[u] for u in uids] == want


def test_server_fails_the_request_typed_and_serves_the_next(monkeypatch):
    """Through the server: the poisoned request is an error naming the logits (no text streamed,
    nothing stored in the prefix cache); the same request afterwards gets the clean text."""
    import openai
    from support.scripted_server import serving

    from hebrus_mlx import load, stream_generate
    from hebrus_mlx.serve.worker import ServerDefaults, Worker

    ref_model, tok = load("demo")
    prompt = "def fibonacci(n):\n    if n < 2:"
    want = "".join(r.text for r in stream_generate(ref_model, tok, tok.encode(prompt), max_tokens=8))
    worker = Worker(lambda: load("demo"), 1 << 30, ServerDefaults())
    with serving(worker, "demo") as port:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120, max_retries=0)

        def complete(**kw):
            return c.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0, **kw)

        poison = Poison(monkeypatch, ref_model, "layer:5")
        with pytest.raises(openai.APIError, match="NonFiniteError.*logits"):
            complete()
        chunks = []
        with pytest.raises(openai.APIError, match="NonFiniteError.*logits"):
            for ch in complete(stream=True):
                chunks += [x.text for x in ch.choices]
        assert "".join(chunks) == ""
        poison.armed = False
        assert complete().choices[0].text == want
        assert complete().choices[0].text == want  # from the prefix cache the clean run stored
