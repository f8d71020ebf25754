"""A request's sampling: the fields of a body that api_fields' validators checked (type and range,
one set of checks for every route) as the worker's `Sampling`, the sampler's cross-field rules,
each token's reported log-probability, and the grammar processor of a structured-output request."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import constrain
from ..sample_utils import SamplingError, check_sampling_args, make_logits_processors, make_sampler
from .api_fields import RequestError, check_sampling_fields, is_int


@dataclass
class Sampling:
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    # Issue 24: the logits processors (make_logits_processors' arguments) and what to report.
    logit_bias: dict | None = None  # token ID -> bias
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    presence_context_size: int = 20
    frequency_penalty: float | None = None
    frequency_context_size: int = 20
    logprobs: bool = False  # report each token's log-probability
    top_logprobs: int = 0  # and this many alternatives

    def sampler(self):
        """The sampler of these settings (sample_utils.make_sampler)."""
        return make_sampler(temp=self.temperature, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)

    def logits_processors(self, vocab_size: int) -> list:
        return make_logits_processors(
            self.logit_bias,
            self.repetition_penalty,
            self.repetition_context_size,
            self.presence_penalty,
            self.presence_context_size,
            self.frequency_penalty,
            self.frequency_context_size,
            vocab_size=vocab_size,
        )


def parse_sampling(body: dict, defaults) -> Sampling:
    """The Sampling of a request body (`defaults`: the worker's ServerDefaults for what it leaves
    out). Each field is checked by api_fields' validator of its name (check_fields ran them all;
    they run here again for a body that did not come through it), so this adds only the rules
    between fields."""
    check_sampling_fields(body)

    def given(name, default):
        v = body.get(name)
        return default if v is None else v

    max_tokens, max_completion = body.get("max_tokens"), body.get("max_completion_tokens")
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise RequestError("max_tokens and max_completion_tokens disagree", "max_tokens")
    s = Sampling(
        max_tokens=max_tokens if max_tokens is not None else max_completion,
        temperature=float(given("temperature", defaults.temp)),
        top_p=float(given("top_p", defaults.top_p)),
        top_k=given("top_k", defaults.top_k),
        min_p=float(given("min_p", defaults.min_p)),
        seed=body.get("seed"),
        stop=[],
        stream=given("stream", False),
        include_usage=(body.get("stream_options") or {}).get("include_usage", False),
    )
    try:
        check_sampling_args(s.temperature, s.top_p, s.min_p, s.top_k)
    except SamplingError as e:
        name = "temperature" if e.field == "temp" else e.field
        raise RequestError(f"{name} {e.message}", name) from None
    stop = body.get("stop")
    if stop is not None:
        s.stop = [stop] if isinstance(stop, str) else list(stop)
    if body.get("logit_bias"):
        s.logit_bias = {int(k): float(v) for k, v in body["logit_bias"].items()}
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            setattr(s, name, float(body[name]))
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        if body.get(name) is not None:
            setattr(s, name, body[name])
    logprobs = body.get("logprobs")
    if is_int(logprobs):  # /v1/completions: the number of alternatives
        s.logprobs, s.top_logprobs = True, logprobs
    else:
        s.logprobs, s.top_logprobs = logprobs is True, body.get("top_logprobs") or 0
    return s


def token_logprob(tokenizer, logprobs, token: int, top: int) -> dict:
    """One generated token's report: its log-probability under the distribution it was drawn from
    (the log-softmax of the processed logits, as mlx-lm reports) and the `top` most likely tokens."""
    import mlx.core as mx

    def finite(v):  # JSON has no -inf; OpenAI reports -9999.0 for an impossible token
        return v if math.isfinite(v) else -9999.0

    entry = {"id": token, "token": tokenizer.decode([token]), "logprob": finite(logprobs[token].item()), "top": []}
    if top:
        best = mx.argpartition(-logprobs, kth=top - 1)[:top]
        values = logprobs[best]
        order = mx.argsort(-values)  # most likely first
        for i, v in zip(best[order].tolist(), values[order].tolist()):
            entry["top"].append({"id": i, "token": tokenizer.decode([i]), "logprob": finite(v)})
    return entry


def compile_constraint(tok, c: dict, think: bool | None):
    """The grammar processor (constrain.GrammarProcessor) of a request's checked constraint
    (api_fields.constraint); a schema the engine refuses is a RequestError naming its field.
    `think`: the reply's think state (output.parts)."""
    try:
        schema = None
        if c["schema"] is not None:
            schema, field = c["schema"]
            constrain.check_schema(tok, schema, field)
        tools = None
        if c["tools"] is not None:
            tools = []
            for name, params, strict, where in c["tools"]:
                if strict:
                    params = params or {"type": "object", "properties": {}, "additionalProperties": False}
                    constrain.check_schema(tok, params, where)
                elif params is not None:
                    # Not strict: its schema guides the call where the engine takes it (as vLLM
                    # does for forced calls), else any object; never a refusal.
                    try:
                        constrain.check_schema(tok, params, where)
                    except constrain.GrammarError:
                        params = None
                tools.append(constrain.Tool(name, params))
        spec = constrain.Spec(schema, tools, c["calls"], c["parallel"], think)
        return constrain.compile_spec(tok, spec, "tools" if c["calls"] else c["schema"][1])
    except constrain.GrammarError as e:
        raise RequestError(f"{e.field}: {e.message}", e.field) from None
