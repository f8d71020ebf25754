"""Constrained decoding (hebrus_mlx/constrain.py) on the demo model: the grammar mask keeps every
token it allows at its logit (AFN-005: it is one more -inf mask before the log-softmax), so
greedy decoding picks the plain greedy token wherever the grammar allows it; each row of a batch
has its own grammar state; a rolled-back step rolls the matcher back; a constrained request on a
server with a drafter decodes without drafting."""

import asyncio
import json

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx import constrain

SCHEMA_A = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
SCHEMA_B = {
    "type": "object",
    "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo():
    from hebrus_mlx import load

    return load("demo")


def _prompt(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def _greedy(model, tok, ids, n, processors=None):
    from hebrus_mlx import stream_generate

    return [r.token for r in stream_generate(model, tok, ids, max_tokens=n, logits_processors=processors)]


def _allowed(tok, proc, prefix):
    """The grammar's allowed columns after `prefix`, from a fresh processor over zero logits."""
    zeros = mx.zeros((1, tok.physical_vocab_size))
    proc(mx.array([0], dtype=mx.int32), zeros)
    return np.isfinite(np.array(proc(mx.array([0] + list(prefix), dtype=mx.int32), zeros)[0]))


def test_constrained_greedy_is_plain_greedy_wherever_the_grammar_allows_it(demo):
    """Step by step: the constrained greedy token is the plain greedy token of the same prefix
    (an independent plain run, no processors) whenever the grammar allows that token, and an
    allowed token otherwise; the output is JSON of the schema. The prompt makes the plain model
    write something else at some step (the grammar acts) and agree at others."""
    model, tok = demo
    ids = _prompt(tok, "Is water wet? Answer in JSON.")
    spec = constrain.Spec(schema=SCHEMA_A)
    out = _greedy(model, tok, ids, 24, [constrain.compile_spec(tok, spec, "s")])
    stops = tok.stop_token_ids
    assert out[-1] in stops, tok.decode(out)
    assert set(json.loads(tok.decode(out[:-1]))) == {"answer", "sure"}
    agreed = overruled = 0
    for i, token in enumerate(out):
        plain = _greedy(model, tok, ids + out[:i], 1)[0]
        allowed = _allowed(tok, constrain.compile_spec(tok, spec, "s"), out[:i])
        assert allowed[token], (i, tok.decode(out[: i + 1]))
        if allowed[plain]:
            assert token == plain, (i, tok.decode(out[:i]))
            agreed += 1
        else:
            overruled += 1
    assert agreed and overruled


def test_permissive_grammar_leaves_greedy_output_unchanged(demo):
    """A grammar allowing any text (no special token but the stop tokens) changes nothing where
    the plain output has no special token: the same tokens."""
    model, tok = demo
    ids = tok.encode("def fibonacci(n):\n    ")
    plain = _greedy(model, tok, ids, 24)
    special = set(tok.added_tokens.values()) - set(tok.stop_token_ids)
    assert not special & set(plain)
    proc = constrain.compile_lark(tok, "start: /(?s:.*)/", "g")
    assert _greedy(model, tok, ids, 24, [proc]) == plain


def test_two_schemas_in_one_batch_each_row_its_own_grammar(demo):
    """Continuous batching: two requests with different schemas share decode steps; each row's
    tokens are its solo constrained run's and follow its own schema."""
    from hebrus_mlx.batch_generate import BatchGenerator

    model, tok = demo
    prompts = [_prompt(tok, "Is water wet?"), _prompt(tok, "How many legs has a cat?")]
    specs = [constrain.Spec(schema=SCHEMA_A), constrain.Spec(schema=SCHEMA_B)]
    solo = [_greedy(model, tok, p, 20, [constrain.compile_spec(tok, s, "s")]) for p, s in zip(prompts, specs)]
    g = BatchGenerator(model, effective_vocab_size=tok.effective_vocab_size, stop_tokens=tok.stop_token_ids)
    uids = g.insert(
        prompts, max_tokens=[20, 20], logits_processors=[[constrain.compile_spec(tok, s, "s")] for s in specs]
    )
    tokens = {u: [] for u in uids}
    steps_shared = 0
    while len(g):
        rs = g.next()
        steps_shared += len(rs) == 2
        for r in rs:
            tokens[r.uid].append(r.token)
    assert [tokens[u] for u in uids] == solo
    assert steps_shared > 1
    a, b = (json.loads(tok.decode(t[:-1])) for t in solo)
    assert set(a) == {"answer", "sure"} and set(b) == {"count"} and 0 <= b["count"] <= 9


def test_rolled_back_history_rolls_the_matcher_back(demo):
    """A batched step that fails restores its rows' history (AFN-010); the processor then sees a
    shorter history and its mask is the mask of that prefix again."""
    _, tok = demo
    text = tok.encode('{"answer": "no", "sure": true}', add_special_tokens=False)
    proc = constrain.compile_spec(tok, constrain.Spec(schema=SCHEMA_A), "s")
    logits = mx.zeros((1, tok.physical_vocab_size))
    prompt = [5, 6, 7]
    proc(mx.array(prompt, dtype=mx.int32), logits)
    proc(mx.array(prompt + text[:6], dtype=mx.int32), logits)
    back = proc(mx.array(prompt + text[:3], dtype=mx.int32), logits)
    fresh = constrain.compile_spec(tok, constrain.Spec(schema=SCHEMA_A), "s")
    fresh(mx.array(prompt, dtype=mx.int32), logits)
    want = fresh(mx.array(prompt + text[:3], dtype=mx.int32), logits)
    assert np.array_equal(np.array(back), np.array(want))
    assert np.isinf(np.array(want)).any()


def test_lazy_tool_grammar_masks_nothing_until_the_call_opens(demo):
    """tool_choice auto with a strict tool: free text is untouched; from <tool_call> on the call
    follows the tool's schema, then only another call or a stop token."""
    _, tok = demo
    tool = constrain.Tool("get_weather", {"type": "object", "properties": {"city": {"enum": ["Oslo"]}}})
    proc = constrain.compile_spec(tok, constrain.Spec(tools=[tool], calls="auto"), "tools")
    logits = mx.random.normal((1, tok.physical_vocab_size))
    prompt = [1, 2]
    proc(mx.array(prompt, dtype=mx.int32), logits)
    text = tok.encode("Let me look.", add_special_tokens=False)
    assert np.array_equal(np.array(proc(mx.array(prompt + text, dtype=mx.int32), logits)), np.array(logits))
    opener = tok.added_tokens["<tool_call>"]
    out = np.array(proc(mx.array(prompt + text + [opener], dtype=mx.int32), logits))
    allowed = np.isfinite(out[0])
    assert allowed.sum() == 1 and tok.decode([int(np.argmax(allowed))]) == "\n"
    call = tok.encode('\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n', add_special_tokens=False)
    closer = tok.added_tokens["</tool_call>"]
    out = np.array(proc(mx.array(prompt + text + [opener] + call + [closer], dtype=mx.int32), logits))
    allowed = set(np.nonzero(np.isfinite(out[0]))[0].tolist())
    assert set(tok.stop_token_ids) <= allowed and opener in allowed
    assert allowed <= set(tok.stop_token_ids) | {opener} | set(tok.encode("\n", add_special_tokens=False))


def test_bad_schema_names_the_field(demo):
    _, tok = demo
    with pytest.raises(constrain.GrammarError) as e:
        constrain.check_schema(tok, {"type": "nope"}, "response_format.json_schema.schema")
    assert e.value.field == "response_format.json_schema.schema" and "nope" in e.value.message


def test_constrained_request_on_a_drafting_server_decodes_plainly(demo, monkeypatch):
    """--draft-model: drafted tokens are not checked against a grammar, so a constrained request
    runs without the drafter (none is made) and its tokens are the plain constrained run's."""
    from support.scripted_server import job_text, run_job

    import hebrus_mlx.speculative as spec
    from hebrus_mlx import load
    from hebrus_mlx.serve.sampling import Sampling
    from hebrus_mlx.serve.worker import Job, ServerDefaults, Worker

    model, tok = demo
    made, real = [], spec.make_drafter
    monkeypatch.setattr(spec, "make_drafter", lambda *a, **k: made.append(a[0]) or real(*a, **k))
    ids = _prompt(tok, "Is water wet?")
    out = _greedy(model, tok, ids, 20, [constrain.compile_spec(tok, constrain.Spec(schema=SCHEMA_A), "s")])
    want = tok.decode([t for t in out if t not in tok.stop_token_ids])
    worker = Worker(lambda: load("demo"), 1 << 28, ServerDefaults(draft_model="ngram", num_draft_tokens=3))
    sampling = Sampling(None, 0.0, 1.0, 0, 0.0, None, [], True, False)

    async def scenario():
        job = Job(ids, sampling, 20, asyncio.get_running_loop(), asyncio.Queue())
        job.grammar = constrain.compile_spec(tok, constrain.Spec(schema=SCHEMA_A), "s")
        worker.jobs.put(job)
        return await job_text(job)

    try:
        got = asyncio.run(scenario())
        plain, _ = asyncio.run(run_job(worker, ids, sampling, 4))
    finally:
        worker.stop()
    assert made == ["ngram"]  # only the unconstrained request drafted
    assert got == want and json.loads(got)


def test_a_reply_inside_thinking_closes_it_before_the_structured_part(demo):
    """A prompt that leaves the reply inside <think>: free text (no special token) up to </think>,
    then the schema's JSON, then only a stop token."""
    _, tok = demo
    proc = constrain.compile_spec(tok, constrain.Spec(schema=SCHEMA_B, think=True), "s")
    close = tok.added_tokens["</think>"]
    zeros = mx.zeros((1, tok.physical_vocab_size))
    thought = tok.encode("Cats have four legs.", add_special_tokens=False)
    history = [1, 2]
    proc(mx.array(history, dtype=mx.int32), zeros)
    allowed = np.isfinite(np.array(proc(mx.array(history + thought, dtype=mx.int32), zeros)[0]))
    assert allowed[close] and not allowed[tok.added_tokens["<tool_call>"]]
    reply = tok.encode('\n\n{"count": 4}', add_special_tokens=False)
    allowed = np.isfinite(np.array(proc(mx.array(history + thought + [close] + reply, dtype=mx.int32), zeros)[0]))
    assert set(np.nonzero(allowed)[0].tolist()) == set(tok.stop_token_ids)


def test_server_batch_two_schemas_each_request_its_own_grammar(demo):
    """--decode-concurrency 2: two constrained requests with different schemas decode together in
    the worker; each reply is its solo constrained run's and follows its own schema."""
    from support.scripted_server import job_text

    from hebrus_mlx import load
    from hebrus_mlx.serve.sampling import Sampling
    from hebrus_mlx.serve.worker import Job, ServerDefaults, Worker

    model, tok = demo
    prompts = [_prompt(tok, "Is water wet?"), _prompt(tok, "How many legs has a cat?")]
    specs = [constrain.Spec(schema=SCHEMA_A), constrain.Spec(schema=SCHEMA_B)]
    want = []
    for p, s in zip(prompts, specs):
        out = _greedy(model, tok, p, 20, [constrain.compile_spec(tok, s, "s")])
        want.append(tok.decode([t for t in out if t not in tok.stop_token_ids]))
    worker = Worker(lambda: load("demo"), 1 << 28, ServerDefaults(decode_concurrency=2, prompt_concurrency=2))
    sampling = Sampling(None, 0.0, 1.0, 0, 0.0, None, [], True, False)

    async def scenario():
        jobs = []
        for p, s in zip(prompts, specs):
            job = Job(p, sampling, 20, asyncio.get_running_loop(), asyncio.Queue())
            job.grammar = constrain.compile_spec(tok, s, "s")
            jobs.append(job)
        for job in jobs:  # both queued before the worker takes either
            worker.jobs.put(job)
        return await asyncio.gather(*(job_text(j) for j in jobs)), [j.usage.completion_tokens for j in jobs]

    try:
        got, generated = asyncio.run(scenario())
        steps = worker.batch.steps
    finally:
        worker.stop()
    assert got == want
    assert steps < sum(generated)  # the rows shared steps
    assert set(json.loads(got[0])) == {"answer", "sure"} and set(json.loads(got[1])) == {"count"}


def test_a_tokenizer_the_engine_cannot_read_is_a_typed_error(monkeypatch):
    """A tokenizer llguidance refuses: GrammarError naming `tokenizer` (the server logs it at start
    and answers structured requests 400), never a traceback."""
    import llguidance

    from hebrus_mlx import load

    _, tok = load("demo")  # a new tokenizer object: not in the bridge's cache

    def refuse(*a, **k):
        raise ValueError("unsupported pre-tokenizer")

    monkeypatch.setattr(llguidance, "LLTokenizer", refuse)
    with pytest.raises(constrain.GrammarError) as e:
        constrain.check_schema(tok, {"type": "object"}, "response_format.json_schema.schema")
    assert e.value.field == "tokenizer" and "unsupported pre-tokenizer" in e.value.message
