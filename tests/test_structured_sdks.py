"""Structured output and strict tools through the SDKs agents use, against the demo model served
in-process: the openai client's `parse` helpers, the openai-agents Agent (strict function tool,
tool_choice required) on the Chat Completions and Responses models, LangChain's
`with_structured_output` (json_schema and function_calling) and LiteLLM's json_object. Small
max_tokens everywhere: the schemas are enums and booleans, so a constrained reply ends early."""

import os
from typing import Literal

import pytest
from pydantic import BaseModel

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


@pytest.fixture(scope="module")
def served():
    from support.scripted_server import serving

    from hebrus_mlx import load
    from hebrus_mlx.serve.worker import ServerDefaults, Worker

    worker = Worker(lambda: load("demo"), 1 << 28, ServerDefaults())
    with serving(worker, "demo") as port:
        yield {"url": f"http://127.0.0.1:{port}/v1", "worker": worker}


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=served["url"], api_key="x", timeout=120, max_retries=0)


MSG = [{"role": "user", "content": "Is water wet?"}]


def test_openai_chat_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model="demo", messages=MSG, response_format=Verdict, max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Verdict)


def test_openai_responses_parse_with_text_format(client):
    r = client.responses.parse(model="demo", input="Is water wet?", text_format=Verdict, max_output_tokens=24)
    assert isinstance(r.output_parsed, Verdict) and r.status == "completed"
    assert r.text.format.type == "json_schema"


def test_strict_tool_required_and_one_call(client):
    """tool_choice required with a strict tool and parallel_tool_calls false: exactly one call,
    its arguments valid for the tool's schema."""
    import json

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "strict": True,
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    r = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=32,
        temperature=0,
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")


def test_no_op_fields_and_reasoning_effort(client, served):
    """store, metadata and service_tier are accepted (documented no-ops); reasoning_effort none
    renders the prompt with thinking off, as chat_template_kwargs.enable_thinking false does."""
    tok = served["worker"].tokenizer
    seen = []
    real = tok.apply_chat_template

    def spy(*a, **k):
        seen.append(k.get("enable_thinking"))
        return real(*a, **k)

    tok.apply_chat_template = spy
    try:
        for effort in ("none", "minimal", "high"):
            r = client.chat.completions.create(
                model="demo",
                messages=MSG,
                max_tokens=2,
                store=True,
                metadata={"k": "v"},
                service_tier="auto",
                reasoning_effort=effort,
            )
            assert r.choices[0].message is not None
    finally:
        del tok.apply_chat_template
    assert seen == [False, False, True]


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_strict_function_tool_round_trip(served, api):
    """openai-agents: a default (strict) @function_tool with tool_choice required; the agent calls
    it with valid arguments, sends its result back and finishes on the next turn (tool_choice
    resets to auto) with its structured output type."""
    import agents
    import openai

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    aclient = openai.AsyncOpenAI(base_url=served["url"], api_key="x", timeout=120, max_retries=0)
    model = (
        agents.OpenAIChatCompletionsModel(model="demo", openai_client=aclient)
        if api == "chat"
        else agents.OpenAIResponsesModel(model="demo", openai_client=aclient)
    )
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the tool.",
        tools=[get_weather],
        model=model,
        output_type=Verdict,
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=48, temperature=0),
    )
    result = agents.Runner.run_sync(agent, "Is it sunny in Oslo?", max_turns=4)
    assert calls and set(calls) <= {"Paris", "Oslo"}
    assert isinstance(result.final_output, Verdict)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(served, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="demo", base_url=served["url"], api_key="x", max_tokens=32, temperature=0, max_retries=0)
    out = llm.with_structured_output(Verdict, method=method, strict=True).invoke("Is water wet?")
    assert isinstance(out, Verdict)


def test_litellm_json_object(served):
    import json

    import litellm

    r = litellm.completion(
        model="openai/demo",
        api_base=served["url"],
        api_key="x",
        messages=MSG,
        response_format={"type": "json_object"},
        max_tokens=12,
        temperature=0,
    )
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_forced_call_of_a_non_strict_tool_follows_its_schema_where_it_compiles(client):
    """A non-strict tool under tool_choice required: its parameters guide the call when the engine
    compiles them; a schema it refuses falls back to any JSON object (the call is still forced)
    instead of a 400."""
    import json

    def pick(params):
        return client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Pick one."}],
            tools=[{"type": "function", "function": {"name": "pick", "parameters": params}}],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=32,
            temperature=0,
        ).choices[0]

    enum = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"], "additionalProperties": False}
    (call,) = pick(enum).message.tool_calls
    assert json.loads(call.function.arguments) in ({"n": 1}, {"n": 2})
    c = pick({"type": "nope"})
    if c.message.tool_calls:
        assert isinstance(json.loads(c.message.tool_calls[0].function.arguments), dict)
    else:  # the demo's free-form object outran max_tokens: still the forced call's shape
        assert c.finish_reason == "length" and c.message.content.startswith(
            '<tool_call>\n{"name": "pick", "arguments": {'
        )
