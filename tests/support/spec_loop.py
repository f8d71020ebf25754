"""A minimal exact greedy verify loop for drafter tests (the real protocol lives in
hebrus_mlx.speculative once merged): draft n, run the target once over [last token, drafts],
accept the longest prefix equal to the target's greedy tokens plus one bonus token, roll the
target cache back past rejected drafts, commit to the drafter with the newly known states."""

import mlx.core as mx

from hebrus_mlx.generate import generate_step
from hebrus_mlx.models.qwen4exp import Capture


def _greedy(logits, vocab):
    return mx.argmax(logits[..., :vocab], axis=-1)


def speculative_greedy(model, drafter, prompt, max_tokens, n_draft, vocab):
    """(tokens, drafted, accepted) for greedy decoding of max_tokens tokens."""
    cache = model.make_cache()
    cap = Capture()
    logits = model(mx.array([prompt]), cache=cache, capture=cap)
    drafter.begin(list(prompt), cap.hidden[-1][0])
    out = [_greedy(logits[0, -1], vocab).item()]
    drafter.commit(out[:], None)
    drafted = accepted = 0
    while len(out) < max_tokens:
        proposal = drafter.propose(min(n_draft, max_tokens - len(out)))
        drafts = proposal.tokens
        snap = cache.snapshot()
        cap = Capture()
        feed = [out[-1]] + drafts
        greedy = _greedy(model(mx.array([feed]), cache=cache, capture=cap)[0], vocab).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == greedy[a]:
            a += 1
        states = cap.hidden[-1][0, : a + 1]
        if a < len(drafts):  # the target consumed rejected drafts: rewind and re-consume the kept ones
            cache.restore(snap)
            model(mx.array([feed[: a + 1]]), cache=cache)
        new = drafts[:a] + [greedy[a]]
        drafter.commit(new, states)
        out += new
        drafted += len(drafts)
        accepted += a
    return out[:max_tokens], drafted, accepted


def plain_greedy(model, prompt, max_tokens, vocab):
    gen = generate_step(mx.array(prompt), model, effective_vocab_size=vocab, max_tokens=max_tokens)
    return [int(t) for t, _ in gen]
