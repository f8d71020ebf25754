"""Issue 24 §3: POST /v1/responses through the real `openai` client (responses.create,
responses.stream, retrieve), a real worker on the demo model behind the real App; the tool round
trip scripts the worker boundary (the demo never calls tools) and checks what the template got."""

import json

import pytest
from test_server_fields import ScriptWorker, _raw, _reference, _serve, _text

from hebrus_mlx.serve.responses_api import ResponseStore, to_messages

INSTR = "You write Python."


@pytest.fixture(scope="module")
def served():
    import openai

    from hebrus_mlx import load
    from hebrus_mlx.serve.app import App
    from hebrus_mlx.serve.worker import ServerDefaults, Worker

    worker = Worker(lambda: load("demo"), 1 << 30, ServerDefaults())
    port, stop = _serve(App(worker, "demo"))
    model, tok = load("demo")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=120, max_retries=0)
    try:
        yield {"port": port, "client": client, "model": model, "tok": tok}
    finally:
        stop()
        worker.stop()


def test_create_previous_response_and_store_false(served):
    tok, c = served["tok"], served["client"]
    msgs = [{"role": "system", "content": INSTR}, {"role": "user", "content": "Sort a list in place."}]
    want = _text(_reference(served, tok.apply_chat_template(msgs), 12))
    r = c.responses.create(
        model="demo", instructions=INSTR, input="Sort a list in place.", max_output_tokens=12, temperature=0
    )
    assert r.output_text == want and r.usage.input_tokens == len(tok.apply_chat_template(msgs))
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # 12 tokens, no EOS
    assert [o.type for o in r.output] == ["message"] and r.id.startswith("resp_")
    # The next turn renders the stored conversation first: the prefix cache restores it.
    r2 = c.responses.create(
        model="demo",
        instructions=INSTR,
        previous_response_id=r.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Now test it."}]}],
        max_output_tokens=4,
        temperature=0,
    )
    full = msgs + [{"role": "assistant", "content": want}, {"role": "user", "content": "Now test it."}]
    assert r2.usage.input_tokens == len(tok.apply_chat_template(full))
    assert r2.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 1
    assert r2.output_text == _text(_reference(served, tok.apply_chat_template(full), 4))
    assert c.responses.retrieve(r.id).output_text == want
    # store: false: nothing to continue from.
    r3 = c.responses.create(model="demo", input="hi", max_output_tokens=2, store=False)
    status, _, err = _raw(
        served, "POST", "/v1/responses", {"input": "again", "previous_response_id": r3.id, "max_output_tokens": 2}
    )
    assert (status, err["error"]["param"]) == (400, "previous_response_id")
    status, _, err = _raw(served, "GET", f"/v1/responses/{r3.id}")
    assert status == 404


def test_stream_events_in_the_clients_order(served):
    c = served["client"]
    r = c.responses.create(model="demo", input="def main():", max_output_tokens=8, temperature=0)
    with c.responses.stream(model="demo", input="def main():", max_output_tokens=8, temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == r.output_text


def _tool_script(tok):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'

    def script(job):
        prompt = tok.decode(job.ids)
        if "<tool_response>" in prompt:
            return ["It is ", prompt.split("<tool_response>\n")[-1].split("\n</tool_response>")[0], "."]
        return (
            [
                "Checking.",
                "\n\n<tool",
                '_call>\n{"name": "get_',
                'weather", "arguments": {"city": ',
                '"Oslo"}}\n</tool_call>',
            ]
            if "get_weather" in prompt
            else ["<think>", "hm", "</think>", "Hi."]
        )

    return call, script


def test_tool_round_trip_and_stream(served):
    import openai

    from hebrus_mlx.serve.app import App

    tok = served["tok"]
    call_text, script = _tool_script(tok)
    worker = ScriptWorker(tok, script)
    port, stop = _serve(App(worker, "scripted"))
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r1 = c.responses.create(model="scripted", input="Weather in Oslo?", tools=tools)
        assert [o.type for o in r1.output] == ["message", "function_call"] and r1.status == "completed"
        fc = r1.output[1]
        assert (fc.name, json.loads(fc.arguments)) == ("get_weather", {"city": "Oslo"})
        assert r1.output_text == "Checking.\n\n"
        r2 = c.responses.create(
            model="scripted",
            previous_response_id=r1.id,
            tools=tools,
            input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}],
        )
        assert r2.output_text == "It is sunny."
        # The template rendered the whole exchange: the call the model made, then its output.
        want = tok.apply_chat_template(
            [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": "Checking.\n\n",
                    "tool_calls": [
                        {
                            "id": fc.call_id,
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": fc.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": fc.call_id, "content": "sunny"},
            ],
            tools=[
                {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                for t in tools
            ],
        )
        assert worker.seen[-1] == want and call_text in tok.decode(want)
        # The same call through the stream helper: a completed response with the call.
        with c.responses.stream(model="scripted", input="Weather in Oslo?", tools=tools) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        assert [o.type for o in final.output] == ["message", "function_call"]
        assert json.loads(final.output[1].arguments) == {"city": "Oslo"}
        # Thinking comes back as a reasoning item.
        r = c.responses.create(model="scripted", input="hello")
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Hi."
        assert r.output[0].content[0].text == "hm"
    finally:
        stop()
        worker.stop()


BAD = [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict"),
    (
        {"input": "x", "tools": [{"type": "function", "name": "f", "strict": True, "parameters": {"type": "nope"}}]},
        "tools[0].parameters",
    ),
    ({"input": "x", "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    (
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": 5}}}},
        "text.format.schema",
    ),
    ({"input": "x", "text": {"format": {"type": "json_object", "name": "a"}}}, "text.format"),
    ({"input": "x", "text": {"foo": 1}}, "text.foo"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "store": "no"}, "store"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_responses_requests_name_the_field(served, body, param):
    status, _, err = _raw(served, "POST", "/v1/responses", body)
    assert (status, err["error"]["param"]) == (400, param), err


def test_input_items_to_messages():
    msgs = to_messages(
        [
            {"role": "developer", "content": "be brief"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "think"}],
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ]
    )
    assert msgs == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {
            "role": "assistant",
            "content": "b",
            "reasoning_content": "think",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]


def test_response_store_bounds_and_expiry():
    now = [0.0]
    s = ResponseStore(max_entries=2, max_bytes=400, ttl=10, clock=lambda: now[0])
    for i in range(3):
        assert s.put(f"r{i}", [{"role": "user", "content": "x"}], {"id": f"r{i}"})
    assert s.get("r0") is None and s.get("r1") and s.get("r2") and len(s) == 2  # by number
    assert not s.put("big", [{"role": "user", "content": "x" * 500}], {})  # larger than the whole store
    s.put("r3", [{"role": "user", "content": "y" * 340}], {"id": "r3"})
    assert s.get("r1") is None and s.get("r2") is None and s.get("r3") and s.nbytes <= 400  # by bytes
    now[0] = 10.5
    assert s.get("r3") is None and len(s) == 0 and s.nbytes == 0  # expired


def test_input_items_input_tokens_and_delete(served):
    """GET /v1/responses/{id}/input_items lists the request's input (newest first by default, paged
    by the client's cursor), POST /v1/responses/input_tokens counts what create prefills (the stored
    conversation included), DELETE forgets the response."""
    import openai

    tok, c = served["tok"], served["client"]
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Sort a list."}]},
    ]
    r = c.responses.create(model="demo", instructions=INSTR, input=items, max_output_tokens=2)
    listed = list(c.responses.input_items.list(r.id))
    assert [(i.type, i.role, i.content[0].text) for i in listed] == [
        ("message", "user", "Sort a list."),
        ("message", "developer", "be brief"),
    ]
    page = c.responses.input_items.list(r.id, order="asc", limit=1)
    assert len(page.data) == 1 and page.has_more
    assert [i.id for i in page] == [i.id for i in reversed(listed)]  # the client fetches page 2 by `after`
    assert len({i.id for i in listed}) == 2
    n = c.responses.input_tokens.count(model="demo", instructions=INSTR, input=items)
    msgs = [{"role": "system", "content": INSTR + "\n\nbe brief"}, {"role": "user", "content": "Sort a list."}]
    assert n.object == "response.input_tokens" and n.input_tokens == r.usage.input_tokens
    assert n.input_tokens == len(tok.apply_chat_template(msgs))
    n2 = c.responses.input_tokens.count(model="demo", previous_response_id=r.id, input="more")
    r2 = c.responses.create(model="demo", previous_response_id=r.id, input="more", max_output_tokens=1)
    assert n2.input_tokens == r2.usage.input_tokens > n.input_tokens
    assert [i.content[0].text for i in c.responses.input_items.list(r2.id)] == ["more"]  # this request's own
    for query, param in [("limit=0", "limit"), ("order=up", "order"), ("after=nope", "after"), ("frob=1", "frob")]:
        status, _, err = _raw(served, "GET", f"/v1/responses/{r.id}/input_items?{query}")
        assert (status, err["error"]["param"]) == (400, param), err
    status, _, err = _raw(served, "POST", "/v1/responses/input_tokens", {"input": "x", "max_output_tokens": 3})
    assert (status, err["error"]["param"]) == (400, "max_output_tokens")
    assert c.responses.delete(r.id) is None
    for call in (c.responses.retrieve, c.responses.delete, c.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            call(r.id)
    status, _, err = _raw(served, "POST", "/v1/responses", {"input": "x", "previous_response_id": r.id})
    assert (status, err["error"]["param"]) == (400, "previous_response_id")
    assert c.responses.retrieve(r2.id).id == r2.id  # the others stay


def test_default_cap_lets_a_long_reply_complete(served):
    """Without max_output_tokens a Responses reply may use the context left (OpenAI's default), so a
    reply longer than the chat routes' default cap (512) completes and `responses.stream(...)
    .get_final_response()` gets a completed response; --max-tokens, when the operator gives it,
    still bounds every route's default."""
    import openai
    from support.scripted_server import scripted_worker, serving

    caps = []

    def emit(job):  # a 600-token reply, cut at the job's cap as the real worker cuts it
        caps.append(job.max_tokens)
        n = min(600, job.max_tokens)
        job.usage.prompt_tokens, job.usage.completion_tokens = len(job.ids), n
        job.emit(("text", "word " * n))
        job.emit(("done", "stop" if n == 600 else "length"))

    worker = scripted_worker(served["tok"], emit)
    with serving(worker) as port:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        with c.responses.stream(model="scripted", input="Write at length.") as stream:
            final = stream.get_final_response()
        assert (final.status, final.usage.output_tokens) == ("completed", 600)
        assert caps[-1] == worker.context - final.usage.input_tokens
        r = c.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "Write at length."}])
        assert (caps[-1], r.choices[0].finish_reason) == (512, "length")  # mlx_lm.server's default
        worker.defaults.max_tokens = 100  # `--max-tokens 100`
        r = c.responses.create(model="scripted", input="Write at length.")
        assert (caps[-1], r.status) == (100, "incomplete")
        assert c.responses.create(model="scripted", input="x", max_output_tokens=700).status == "completed"
