"""Issue 24 §2: mlx-lm's request fields honoured or refused, never ignored.

A real worker on the demo model behind the real App on uvicorn (127.0.0.1, ephemeral port), driven
by the real `openai` client and raw HTTP. Expected values come from in-process `stream_generate`
over the full prompt with `make_logits_processors` (no HTTP, no worker, no prefix cache)."""

import http.client
import json
import math
import socket
import threading
import time

import pytest

from hebrus_mlx.serve.app import developer_as_system
from hebrus_mlx.serve.output import ThinkSplitter

CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list in place."}]


def _serve(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app.app, log_level="warning", lifespan="off"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.02)

    def stop():
        srv.should_exit = True
        th.join(10)

    return sock.getsockname()[1], stop


@pytest.fixture(scope="module")
def served():
    import openai

    from hebrus_mlx import load
    from hebrus_mlx.serve.app import App
    from hebrus_mlx.serve.worker import ServerDefaults, Worker

    worker = Worker(lambda: load("demo"), 1 << 30, ServerDefaults())
    app = App(worker, "demo", allowed_origins=["http://ui.example:3000"])
    port, stop = _serve(app)
    model, tok = load("demo")  # the independent in-process path
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120, max_retries=0)
    try:
        yield {"port": port, "client": client, "model": model, "tok": tok, "worker": worker}
    finally:
        stop()
        worker.stop()


def _reference(served, ids, max_tokens, **processors):
    from hebrus_mlx import stream_generate
    from hebrus_mlx.sample_utils import make_logits_processors

    procs = make_logits_processors(**processors, vocab_size=served["tok"].effective_vocab_size) if processors else None
    return list(stream_generate(served["model"], served["tok"], ids, max_tokens=max_tokens, logits_processors=procs))


def _text(rs):
    return "".join(r.text for r in rs)


def _raw(served, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", served["port"], timeout=60)
    h = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=h)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    try:
        body = json.loads(data) if data else None
    except ValueError:
        body = data
    return r.status, {k.lower(): v for k, v in r.getheaders()}, body


def test_greedy_with_every_processor_off_is_unchanged(served):
    """Sending each processor field at its off value gives today's plain greedy text."""
    tok, c = served["tok"], served["client"]
    want = _text(_reference(served, tok.apply_chat_template(CHAT), 16))
    off = dict(frequency_penalty=0, presence_penalty=0, logit_bias={})  # the OpenAI processor fields
    off_extra = {"repetition_penalty": 0, "repetition_context_size": 20}  # mlx-lm's
    r = c.chat.completions.create(
        model="demo", messages=CHAT, max_tokens=16, temperature=0, **off, extra_body=off_extra
    )
    assert r.choices[0].message.content == want


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 1.5, "repetition_context_size": 8},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.2},
    ],
)
def test_penalties_match_in_process_processors(served, fields):
    """Each penalty changes the greedy text, exactly as the in-process processors over the full
    prompt do, on a first request and on a second one whose prefix comes from the prefix cache
    (the processors still see the whole prompt)."""
    tok, c = served["tok"], served["client"]
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
    ids = tok.encode(prompt)
    plain = _text(_reference(served, ids, 24))
    kwargs = {k: v for k, v in fields.items() if "context" not in k}
    mapped = {"repetition_context_size": fields.get("repetition_context_size", 20), **kwargs}
    want = _text(_reference(served, ids, 24, **mapped))
    assert want != plain  # the field matters on this prompt
    r = c.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0, extra_body=fields)
    assert r.choices[0].text == want
    longer = prompt + " fib"
    r2 = c.completions.create(model="demo", prompt=longer, max_tokens=24, temperature=0, extra_body=fields)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    assert r2.choices[0].text == _text(_reference(served, tok.encode(longer), 24, **mapped))


def test_logit_bias_forces_a_token(served):
    tok, c = served["tok"], served["client"]
    x = tok.encode("x")
    assert len(x) == 1
    r = c.completions.create(model="demo", prompt="import os", max_tokens=5, temperature=0, logit_bias={str(x[0]): 100})
    assert r.choices[0].text == "xxxxx"
    want = _text(_reference(served, tok.encode("import os"), 5, logit_bias={x[0]: -100.0}))
    r = c.completions.create(
        model="demo", prompt="import os", max_tokens=5, temperature=0, logit_bias={str(x[0]): -100}
    )
    assert r.choices[0].text == want and "x" not in want


def test_chat_logprobs_stream_and_nonstream(served):
    tok, c = served["tok"], served["client"]
    ref = _reference(served, tok.apply_chat_template(CHAT), 8)
    r = c.chat.completions.create(
        model="demo", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.decode([x.token]) for x in ref if x.finish_reason != "stop"]
    for e, x in zip(content, ref):
        assert math.isclose(e.logprob, x.logprobs[x.token].item(), abs_tol=1e-5)
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the best one
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.bytes == list(e.token.encode())
    chunks = list(
        c.chat.completions.create(
            model="demo", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
    )
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # Without the field: no logprobs.
    assert c.chat.completions.create(model="demo", messages=CHAT, max_tokens=2).choices[0].logprobs is None


def test_completions_logprobs_legacy_shape(served):
    tok, c = served["tok"], served["client"]
    ref = _reference(served, tok.encode("class Stack:"), 6)
    r = c.completions.create(model="demo", prompt="class Stack:", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([x.token]) for x in ref]
    assert all(math.isclose(a, x.logprobs[x.token].item(), abs_tol=1e-5) for a, x in zip(lp.token_logprobs, ref))
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(
        c.completions.create(model="demo", prompt="class Stack:", max_tokens=6, temperature=0, logprobs=2, stream=True)
    )
    got = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    offsets = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.text_offset]
    assert got == lp.token_logprobs and offsets == lp.text_offset
    # A stop sequence: the tokens up to the one it starts in are reported, none after.
    text = r.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text[: text.index(stop)]
    r = c.completions.create(model="demo", prompt="class Stack:", max_tokens=6, temperature=0, logprobs=0, stop=[stop])
    joined = "".join(r.choices[0].logprobs.tokens)
    assert r.choices[0].text == cut and joined.startswith(cut) and text.startswith(joined) and len(joined) > len(cut)


BAD = [
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": "high"}, "repetition_penalty"),
    ({"repetition_context_size": 0}, "repetition_context_size"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"frequency_context_size": 1.5}, "frequency_context_size"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs.foo"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"xtc_probability": 0.5}, "xtc_probability"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_malformed_fields_are_400_naming_the_field(served, extra, param):
    status, _, err = _raw(
        served,
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **extra},
    )
    assert (status, err["error"]["param"]) == (400, param), err


def test_completions_logprobs_range(served):
    status, _, err = _raw(served, "POST", "/v1/completions", {"prompt": "x", "logprobs": 21})
    assert (status, err["error"]["param"]) == (400, "logprobs")


def test_developer_role_is_system(served):
    c = served["client"]
    as_dev = [{"role": "developer", "content": CHAT[0]["content"]}, CHAT[1]]
    assert developer_as_system(as_dev) == CHAT
    a = c.chat.completions.create(model="demo", messages=as_dev, max_tokens=6, temperature=0)
    b = c.chat.completions.create(model="demo", messages=CHAT, max_tokens=6, temperature=0)
    assert (a.usage.prompt_tokens, a.choices[0].message.content) == (
        b.usage.prompt_tokens,
        b.choices[0].message.content,
    )


def test_model_by_id_and_cors(served):
    import openai

    assert served["client"].models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        served["client"].models.retrieve("other")
    status, _, err = _raw(served, "GET", "/v1/models/other")
    assert (status, err["error"]["param"]) == (404, "model")
    pre = {
        "Origin": "http://ui.example:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    status, h, _ = _raw(served, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 200 and h["access-control-allow-origin"] == "http://ui.example:3000"
    status, h, _ = _raw(served, "OPTIONS", "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
    assert status == 400 and "access-control-allow-origin" not in h
    status, h, _ = _raw(served, "GET", "/v1/models", headers={"Origin": "http://ui.example:3000"})
    assert status == 200 and h["access-control-allow-origin"] == "http://ui.example:3000"


def test_think_splitter_split_tags():
    s = ThinkSplitter(False)
    parts = []
    for piece in ["<thi", "nk>\nplan a", "nd b</th", "ink>\n\nAnswer", " here"]:
        parts += s.feed(piece)
    parts += s.feed("", final=True)
    reasoning = "".join(t for k, t in parts if k == "reasoning")
    content = "".join(t for k, t in parts if k == "content")
    assert (reasoning, content) == ("plan and b", "Answer here")
    s = ThinkSplitter(True)  # the prompt opened the block
    assert s.feed("x</think>y", final=True) == [("reasoning", "x"), ("content", "y")]


def test_enable_thinking_reaches_the_template(served):
    tok, c = served["tok"], served["client"]
    msgs = [{"role": "user", "content": "hi"}]
    off = tok.apply_chat_template(msgs, enable_thinking=False)
    assert len(off) > len(tok.apply_chat_template(msgs))
    r = c.chat.completions.create(
        model="demo", messages=msgs, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert r.usage.prompt_tokens == len(off)


def ScriptWorker(tok, script):
    """The worker boundary scripted: each job gets `script`'s text pieces (the demo never thinks
    or calls tools on its own); everything from the HTTP request to the response is real."""
    from support.scripted_server import scripted_worker

    def emit(job):
        job.usage.prompt_tokens = len(job.ids)
        pieces = script(job) if callable(script) else script
        for piece in pieces:
            job.emit(("text", piece))
        job.usage.completion_tokens = len(pieces)
        job.emit(("done", "stop"))

    worker = scripted_worker(tok, emit)
    worker.stop = lambda: worker.jobs.put(None)
    return worker


def test_reasoning_field_from_think_blocks(served):
    import openai

    from hebrus_mlx.serve.app import App

    worker = ScriptWorker(served["tok"], ["<think>", "\nweigh the", " options\n", "</think>", "\n\nUse sort", "()."])
    port, stop = _serve(App(worker, "scripted"))
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "How?"}]
        m = c.chat.completions.create(model="scripted", messages=msgs).choices[0].message
        assert (m.content, m.model_extra["reasoning"]) == ("Use sort().", "weigh the options")
        chunks = list(c.chat.completions.create(model="scripted", messages=msgs, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join(d.content or "" for d in deltas) == "Use sort()."
        assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == "weigh the options\n"
    finally:
        stop()
        worker.stop()


def test_batched_worker_honours_processors_and_logprobs(served):
    """--decode-concurrency 2: two requests sharing decode steps, each with its own processors
    (one from a cached prefix) and logprobs, give the in-process results."""
    import openai

    from hebrus_mlx import load
    from hebrus_mlx.serve.app import App
    from hebrus_mlx.serve.worker import ServerDefaults, Worker

    tok = served["tok"]
    worker = Worker(lambda: load("demo"), 1 << 30, ServerDefaults(decode_concurrency=2, prompt_concurrency=2))
    port, stop = _serve(App(worker, "demo"))
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120, max_retries=0)
        c.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0)  # caches the prefix
        jobs = [(prompt + " x", {"frequency_penalty": 1.2}), ("class Stack:", {"presence_penalty": 1.5})]
        got = [None, None]

        def go(i):
            p, fields = jobs[i]
            got[i] = c.completions.create(
                model="demo", prompt=p, max_tokens=16, temperature=0, logprobs=1, extra_body=fields
            )

        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got[0].usage.prompt_tokens_details.cached_tokens > 0
        for (p, fields), r in zip(jobs, got):
            ref = _reference(served, tok.encode(p), 16, **fields)
            assert r.choices[0].text == _text(ref) != _text(_reference(served, tok.encode(p), 16))
            assert all(
                math.isclose(a, x.logprobs[x.token].item(), abs_tol=1e-4)
                for a, x in zip(r.choices[0].logprobs.token_logprobs, ref)
            )
            assert len(r.choices[0].logprobs.token_logprobs) == len([x for x in ref if x.finish_reason != "stop"])
    finally:
        stop()
        worker.stop()


@pytest.mark.parametrize("concurrency", [1, 2])
def test_unseeded_requests_do_not_follow_a_seeded_one(served, concurrency):
    """A `seed: 5` request draws from its own key, one at a time or batched: its text repeats, and
    an unseeded `temperature: 1` request after it draws fresh text each time (the worker used to
    reseed MLX's global generator per seeded request, so the unseeded one after it was always the
    same text)."""
    from hebrus_mlx import load
    from hebrus_mlx.serve.app import App
    from hebrus_mlx.serve.worker import ServerDefaults, Worker

    if concurrency == 1:
        c = served["client"]
        stop = worker = None
    else:
        import openai

        worker = Worker(lambda: load("demo"), 1 << 30, ServerDefaults(decode_concurrency=2, prompt_concurrency=2))
        port, stop = _serve(App(worker, "demo"))
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120, max_retries=0)
    try:

        def complete(**fields):
            return c.completions.create(model="demo", prompt="Once upon a time", max_tokens=12, **fields).choices[0]

        seeded, unseeded = set(), set()
        for _ in range(3):
            seeded.add(complete(temperature=1.0, seed=5).text)
            unseeded.add(complete(temperature=1.0).text)
        assert len(seeded) == 1 and len(unseeded) == 3
    finally:
        if stop is not None:
            stop()
            worker.stop()
