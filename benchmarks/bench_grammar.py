"""The grammar mask's cost per token beside the decode step it rides on, side by side in one run.

For the demo model, greedy, the same prompt:
- plain: decode seconds per token (first token to last, `stream_generate`, no processors);
- constrained: the same under a JSON schema (an array of strings, so the reply runs max_tokens);
- mask: the grammar processor alone replaying the constrained tokens (llguidance's matcher
  consuming each token, its bitmask, the -inf columns on the [1, V] logits, evaluated): the
  per-token cost constrained decoding adds to a step, with no model in the loop.
Prints each per token, mask / plain step (target <= 5%) and constrained / plain step (that also
pays the host sync the mask needs: the processor reads the previous token before building the
next step, so the host no longer builds while the device computes).

--qwen-tokenizer DIR also times the mask alone over the 248k Qwen vocabulary (tokenizer.json in
DIR, e.g. built by tools/build_qwen_tokenizer.py), where the bitmask is 60x the demo's.

    python benchmarks/bench_grammar.py [--model demo] [--tokens 64] [--repeats 3] [--qwen-tokenizer DIR]
"""

import argparse
import statistics
import time

import mlx.core as mx

from hebrus_mlx import constrain, load, stream_generate

SCHEMA = {
    "type": "object",
    "properties": {"steps": {"type": "array", "items": {"type": "string"}}},
    "required": ["steps"],
    "additionalProperties": False,
}


def decode_per_token(model, tok, ids, n, processors=None):
    """Seconds per decode step (first token to last) and the tokens."""
    times, tokens = [], []
    for r in stream_generate(model, tok, ids, max_tokens=n, logits_processors=processors):
        times.append(time.perf_counter())
        tokens.append(r.token)
    return (times[-1] - times[0]) / max(1, len(times) - 1), tokens


def mask_per_token(tok, tokens, vocab=None):
    """Seconds per token of the processor alone, replaying `tokens` (prompt: one token)."""
    proc = constrain.compile_spec(tok, constrain.Spec(schema=SCHEMA), "bench")
    logits = mx.zeros((1, vocab or tok.physical_vocab_size))
    history = [0]
    mx.eval(proc(mx.array(history, dtype=mx.int32), logits))
    tic = time.perf_counter()
    for t in tokens:
        history.append(t)
        mx.eval(proc(mx.array(history, dtype=mx.int32), logits))
    return (time.perf_counter() - tic) / max(1, len(tokens))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--qwen-tokenizer", default=None)
    args = p.parse_args(argv)

    model, tok = load(args.model)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "List the steps to sort a list in Python, in JSON."}], add_generation_prompt=True
    )
    decode_per_token(model, tok, ids, 8)  # warm up
    plain, constrained, masks = [], [], []
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
        s, _ = decode_per_token(model, tok, ids, args.tokens)
        plain.append(s)
        s, toks = decode_per_token(
            model, tok, ids, args.tokens, [constrain.compile_spec(tok, constrain.Spec(schema=SCHEMA), "bench")]
        )
        constrained.append(s)
        masks.append(mask_per_token(tok, toks))
    p_s, c_s, m_s = (statistics.median(x) for x in (plain, constrained, masks))
    print(f"model {args.model}, vocab {tok.physical_vocab_size}, {args.tokens} tokens, median of {args.repeats}")
    print(f"plain decode step        {p_s * 1e3:8.3f} ms/token")
    print(f"constrained decode step  {c_s * 1e3:8.3f} ms/token  ({c_s / p_s:.3f}x plain)")
    print(
        f"grammar mask alone       {m_s * 1e6:8.1f} us/token  ({100 * m_s / p_s:.2f}% of the plain step; target <= 5%)"
    )
    if args.qwen_tokenizer:
        from hebrus_mlx.text.tokenizer import load_tokenizer

        from_dir = load_tokenizer(args.qwen_tokenizer, 248320)
        text = '{"steps": ["Call sorted() on the list", "or use list.sort() to sort it in place", "pass key="]}'
        qtoks = from_dir.encode(text, add_special_tokens=False)
        q = statistics.median(mask_per_token(from_dir, qtoks) for _ in range(args.repeats))
        print(f"grammar mask, 248k vocab {q * 1e6:8.1f} us/token  (tokenizer {args.qwen_tokenizer})")


if __name__ == "__main__":
    main()
