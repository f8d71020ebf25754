"""Prefix reuse across requests (AFN-010): a cache hit must give what a fresh prefill gives.

Controls are computed on fresh caches with plain model calls (no PromptCache): bitwise when the
control feeds the same token partition as the cache-hit path, and greedy tokens identical (logits
within the chunk-partition tolerance of the state tests) against one plain prefill."""

import mlx.core as mx
import numpy as np
import pytest

from hebrus_mlx.prompt_cache import PromptCache, Usage, stream_with_cache
from hebrus_mlx.sample_utils import apply_vocab_mask


def _feed(model, cache, parts):
    """Feed each part as one forward call; the last call's last-row logits."""
    out = None
    for p in parts:
        out = model(mx.array([p], dtype=mx.int32), cache=cache)
    out = out[0, -1]
    mx.eval(out)
    return np.array(out)


def _two_request_control(model, tok, a, a_tokens, b):
    """Log-probabilities of `b`'s first generated token on a fresh cache fed in the forward calls the
    two requests (`a` then its answer `a_tokens`, then `b`) made, without any PromptCache."""
    cache = model.make_cache()
    _feed(model, cache, [a[:-1], a[-1:]] + [[t] for t in a_tokens[:-1]] + [a_tokens[-1:]])
    control = apply_vocab_mask(
        mx.array(_feed(model, cache, [b[len(a) + len(a_tokens) : -1], b[-1:]]))[None], tok.effective_vocab_size
    )
    return np.array((control - mx.logsumexp(control, axis=-1, keepdims=True))[0])


def _greedy(model, tok, ids, pc, n, usage=None):
    rs = list(stream_with_cache(model, tok, ids, pc, n, usage=usage))
    return [r.token for r in rs], [np.array(r.logprobs) for r in rs]


class Counting:
    """The model, counting the tokens fed through it."""

    def __init__(self, model):
        self.model, self.fed = model, 0

    def __call__(self, inputs, cache=None):
        self.fed += inputs.shape[1]
        return self.model(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_hit_is_bitwise_a_fresh_run_with_the_same_partition(demo):
    model, tok = demo
    pc = PromptCache(1 << 30)
    a = tok.apply_chat_template([{"role": "user", "content": "Open a file."}])
    a_tokens, _ = _greedy(model, tok, a, pc, 6)
    # b continues a + its reply; the hit restores a[:-1], then a + reply.
    b = a + a_tokens + tok.encode("\n# and then close it\n")
    u = Usage(0, 0)
    b_tokens, b_logprobs = _greedy(model, tok, b, pc, 6, u)
    assert u.cached_tokens == len(a) + len(a_tokens)
    # Control: fresh cache, same forward calls as the two requests made, no PromptCache.
    control = _two_request_control(model, tok, a, a_tokens, b)
    assert np.array_equal(b_logprobs[0], control)
    # Against one plain prefill: the same greedy tokens, logits within fp32 partition rounding.
    fresh_tokens, fresh_logprobs = _greedy(model, tok, b, None, 6)
    assert b_tokens == fresh_tokens
    v = tok.effective_vocab_size
    assert max(np.abs(x[:v] - y[:v]).max() for x, y in zip(b_logprobs, fresh_logprobs)) < 1e-4


def test_two_continuations_of_one_prefix_do_not_write_into_each_other(demo):
    """Attention buffers grow in place; a restored prefix must not share them with another
    sequence (detach). Fails if the cache stores plain `snapshot()`s."""
    model, tok = demo
    pc = PromptCache(1 << 30)
    p = tok.encode("import os\nimport sys\n\ndef main():\n")
    t1, _ = _greedy(model, tok, p, pc, 5)  # stores p[:-1] and p + t1
    other = p[:-1] + tok.encode(" # something else entirely, long enough to overwrite rows")
    _greedy(model, tok, other, pc, 5)  # continues from p[:-1] into the same rows
    again = p + t1 + tok.encode(" return 0\n")
    u = Usage(0, 0)
    hit_tokens, hit_logprobs = _greedy(model, tok, again, pc, 5, u)
    assert u.cached_tokens == len(p) + len(t1)
    fresh_tokens, fresh_logprobs = _greedy(model, tok, again, None, 5)
    v = tok.effective_vocab_size
    assert hit_tokens == fresh_tokens
    assert max(np.abs(x[:v] - y[:v]).max() for x, y in zip(hit_logprobs, fresh_logprobs)) < 1e-4


def test_second_turn_does_not_prefill_the_first(demo):
    model, tok = demo
    counting = Counting(model)
    pc = PromptCache(1 << 30)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List three modules."}]
    ids1 = tok.apply_chat_template(msgs)
    rs = list(stream_with_cache(counting, tok, ids1, pc, 8))
    assert counting.fed == len(ids1) + len(rs)  # prompt + every token handed out
    reply = "".join(r.text for r in rs)
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "One more."}]
    ids2 = tok.apply_chat_template(msgs)
    u, counting.fed = Usage(0, 0), 0
    list(stream_with_cache(counting, tok, ids2, pc, 3, usage=u))
    assert u.cached_tokens >= len(ids1) - 1
    assert counting.fed == len(ids2) - u.cached_tokens + 3


def test_lru_by_bytes(demo):
    model, tok = demo
    probe = PromptCache(1 << 30)
    _greedy(model, tok, tok.encode("x = 1\n"), probe, 1)
    per_entry = max(e.nbytes for e in probe._entries.values())
    pc = PromptCache(int(per_entry * 2.5))
    for text in ["a = 1\n", "b = 2\n", "c = 3\n"]:
        _greedy(model, tok, tok.encode(text), pc, 1)
    assert pc.nbytes <= pc.max_bytes and len(pc) == 2
    keys = list(pc._entries)
    # The newest request's entries survive; the oldest were evicted first.
    assert all(k[: len(tok.encode("c = 3\n")) - 1] == tuple(tok.encode("c = 3\n"))[:-1] for k in keys)
    assert PromptCache(0).insert([1], model.make_cache()) is False
    with pytest.raises(ValueError, match="prompt_cache_bytes"):
        PromptCache(-1)


def test_context_limit_is_checked_with_the_cached_prefix(demo):
    model, tok = demo
    from hebrus_mlx.generate import GenerationError

    ids = tok.encode("x")
    with pytest.raises(GenerationError, match="exceeds the model context"):
        list(stream_with_cache(model, tok, ids, PromptCache(1 << 20), model.args.max_position_embeddings))
