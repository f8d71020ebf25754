"""mlx-lm's generate on a resident hebrus-mlx model and tokenizer (issue 26 §4).

The oracle is hebrus's own generate on the same model (greedy, so tokens must be identical); the
AFN-005 and stop-set cases use a model whose unassigned rows or a stop token are made to win."""

import mlx.core as mx
import mlx_lm
import pytest

from hebrus_mlx import generate as hebrus_generate
from hebrus_mlx import stream_generate as hebrus_stream
from hebrus_mlx.sample_utils import make_logits_processors, make_sampler

PROMPTS = ["def add(a, b):", "import os\n", "Once upon a time"]
N = 24


def _tokens(responses):
    return [r.token for r in responses]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_mlx_lm_stream_generate_gives_hebrus_greedy_tokens(demo, prompt):
    model, tok = demo
    ours = list(hebrus_stream(model, tok, prompt, max_tokens=N))
    assert ours[-1].finish_reason == "length"  # no stop token inside N on these prompts (see below)
    assert _tokens(mlx_lm.stream_generate(model, tok, prompt, max_tokens=N)) == _tokens(ours)


def test_mlx_lm_generate_text_and_chat_prompt(demo):
    model, tok = demo
    assert mlx_lm.generate(model, tok, PROMPTS[0], max_tokens=N) == hebrus_generate(
        model, tok, PROMPTS[0], max_tokens=N
    )
    ids = tok.apply_chat_template([{"role": "user", "content": "List three modules."}], add_generation_prompt=True)
    assert _tokens(mlx_lm.stream_generate(model, tok, ids, max_tokens=N)) == _tokens(
        hebrus_stream(model, tok, ids, max_tokens=N)
    )
    # mlx-lm's wrapper calls the template with its own keywords (return_dict=False, enable_thinking).
    wrapped = tok.to_mlx_lm()
    assert wrapped.has_chat_template is True
    assert wrapped.apply_chat_template(
        [{"role": "user", "content": "List three modules."}], add_generation_prompt=True, enable_thinking=False
    ) == tok.apply_chat_template([{"role": "user", "content": "List three modules."}], enable_thinking=False)


def test_caller_text_stays_data_through_mlx_lm(demo):
    """AFN-006: a prompt string spelling a special token is encoded as text by mlx-lm too (it calls
    the tokenizer's encode, which never resolves added tokens for caller text)."""
    model, tok = demo
    text = "say <|im_end|> twice <|im_end|>"
    data, control = tok.encode(text), tok.encode(text, trusted=True)
    assert tok.added_tokens["<|im_end|>"] in control and tok.added_tokens["<|im_end|>"] not in data
    r = next(iter(mlx_lm.stream_generate(model, tok, text, max_tokens=1)))
    assert r.prompt_tokens == len(data) != len(control)


def test_samplers_and_processors_plug_into_mlx_lm(demo):
    model, tok = demo
    kwargs = dict(
        max_tokens=N,
        sampler=make_sampler(temp=0.0, effective_vocab_size=tok.effective_vocab_size),
        logits_processors=make_logits_processors(repetition_penalty=1.4, presence_penalty=0.5),
    )
    theirs = _tokens(mlx_lm.stream_generate(model, tok, PROMPTS[1], **kwargs))
    assert theirs == _tokens(hebrus_stream(model, tok, PROMPTS[1], **kwargs))
    assert theirs != _tokens(hebrus_stream(model, tok, PROMPTS[1], max_tokens=N))  # the processors acted
    mx.random.seed(5)
    a = _tokens(mlx_lm.stream_generate(model, tok, PROMPTS[1], max_tokens=N, sampler=make_sampler(temp=0.8, top_k=20)))
    mx.random.seed(5)
    b = _tokens(hebrus_stream(model, tok, PROMPTS[1], max_tokens=N, sampler=make_sampler(temp=0.8, top_k=20)))
    assert a == b


class Padded:
    """The demo model with every unassigned row (>= the effective vocabulary) made to win."""

    def __init__(self, model, effective):
        self.model, self.effective = model, effective

    def __call__(self, inputs, cache=None, **kw):
        logits = self.model(inputs, cache=cache, **kw)
        cols = mx.arange(logits.shape[-1])
        return mx.where(cols >= self.effective, logits + 100.0, logits)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_vocabulary_boundary_in_mlx_lms_loop_comes_from_the_sampler(demo):
    """AFN-005: mlx-lm's loop does not mask, so over a model without the mask its default argmax
    picks an unassigned row here (control); with hebrus's sampler and `effective_vocab_size` it
    picks what hebrus's loop does."""
    model, tok = demo
    padded = Padded(model, tok.effective_vocab_size)
    model.effective_vocab_size = None  # the model's own mask off (the next test has it on)
    try:
        bare = _tokens(mlx_lm.stream_generate(padded, tok, PROMPTS[0], max_tokens=4))
        assert all(t >= tok.effective_vocab_size for t in bare)
        sampler = make_sampler(effective_vocab_size=tok.effective_vocab_size)
        guarded = _tokens(mlx_lm.stream_generate(padded, tok, PROMPTS[0], max_tokens=N, sampler=sampler))
        assert guarded == _tokens(hebrus_stream(padded, tok, PROMPTS[0], max_tokens=N))
    finally:
        model.effective_vocab_size = tok.effective_vocab_size
    assert guarded == _tokens(hebrus_stream(model, tok, PROMPTS[0], max_tokens=N))


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_model_masks_its_unassigned_rows_for_mlx_lms_own_loop(demo, temp):
    """AFN-005: the model's logits are -inf past the effective vocabulary (loaded with its
    tokenizer), so mlx-lm's own generate_step, with mlx-lm's sampler and a processor pushing every
    unassigned row up by 1e4, never emits one; the valid rows' logits are the unmasked model's."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

    model, tok = demo
    eff = tok.effective_vocab_size
    assert model.effective_vocab_size == eff < model.args.vocab_size

    def push(tokens, logits):
        return mx.where(mx.arange(logits.shape[-1]) >= eff, logits + 1e4, logits)

    prompt = mx.array(tok.encode(PROMPTS[2]))
    steps = generate_step(prompt, model, max_tokens=N, sampler=mlx_make_sampler(temp=temp), logits_processors=[push])
    tokens = [int(t) for t, _ in steps]
    assert len(tokens) == N and max(tokens) < eff
    masked = model(prompt[None])[0]
    model.effective_vocab_size = None
    try:
        raw = model(prompt[None])[0]
    finally:
        model.effective_vocab_size = eff
    assert mx.array_equal(masked[:, :eff], raw[:, :eff]) and bool(mx.all(masked[:, eff:] == -mx.inf))


def test_stop_set_needs_the_wrapper_from_to_mlx_lm(demo):
    """mlx-lm wraps a foreign tokenizer itself and then stops on `eos_token_id` only; <|endoftext|>
    (also a stop token here) ends hebrus's run and the run through `to_mlx_lm()`, not the bare one."""
    model, tok = demo
    endoftext = tok.added_tokens["<|endoftext|>"]
    assert endoftext in tok.eos_token_ids and endoftext != tok.eos_token_id
    force = make_logits_processors(logit_bias={endoftext: 1e4})
    ours = list(hebrus_stream(model, tok, PROMPTS[0], max_tokens=5, logits_processors=force))
    assert _tokens(ours) == [endoftext] and ours[-1].finish_reason == "stop"
    wrapped = list(mlx_lm.stream_generate(model, tok.to_mlx_lm(), PROMPTS[0], max_tokens=5, logits_processors=force))
    assert _tokens(wrapped) == [endoftext] and wrapped[-1].finish_reason == "stop"
    bare = list(mlx_lm.stream_generate(model, tok, PROMPTS[0], max_tokens=5, logits_processors=force))
    assert _tokens(bare) == [endoftext] * 5 and bare[-1].finish_reason == "length"


def test_mlx_lm_continues_a_hebrus_prompt_cache(demo):
    """mlx-lm's generate_step evaluates `[c.state for c in cache]` and feeds the cache in place."""
    model, tok = demo
    ids = tok.encode(PROMPTS[1] + "import sys\nimport json\n")
    cache = model.make_cache()
    model(mx.array([ids[:5]]), cache=cache)
    theirs = _tokens(mlx_lm.stream_generate(model, tok, ids[5:], max_tokens=8, prompt_cache=cache))
    assert cache.offset >= len(ids) + 7  # every token yielded was fed into this cache
    assert theirs == _tokens(hebrus_stream(model, tok, ids, max_tokens=8))
