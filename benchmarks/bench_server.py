"""Time to first token of a chat's second turn with and without the server's prefix cache.

Starts two `hebrus-mlx server` processes on 127.0.0.1 (ephemeral ports) with the same model: A
with the prefix cache, B with `--prompt-cache-bytes 0`. Each round runs a fresh two-turn
conversation (a long first user message, a short second one; the reply is sent back as the
client got it) on A and on B, alternating which goes first (A/B, B/A). TTFT is measured by the
client from sending the request to the first streamed content delta. Prints medians and the
ratios turn-2(A) / turn-1(A) and turn-2(A) / turn-2(B).

    python benchmarks/bench_server.py [--model demo] [--rounds 6] [--words 1200]
"""

import argparse
import http.client
import json
import random
import statistics
import subprocess
import time

from hebrus_mlx.testing.processes import ROOT, child_env, server_argv


def start(model, extra):
    proc = subprocess.Popen(
        server_argv(*extra, model=model),
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


def ask(port, messages, max_tokens):
    """(ttft seconds, reply text, usage) over a streamed chat completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps(
        {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    tic = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    ttft, text, usage = None, "", None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise SystemExit(chunk["error"]["message"])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk["choices"]:
            piece = c["delta"].get("content")
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - tic
                text += piece
    conn.close()
    return ttft, text, usage


def first_turn(rng, words):
    """A conversation's long first user message: `words` code-like words drawn by `rng`."""
    vocab = ["def", "return", "value", "list", "import", "class", "self", "file", "open", "read", "print", "data"]
    return [{"role": "user", "content": "Explain this code:\n" + " ".join(rng.choice(vocab) for _ in range(words))}]


def parse_args(rounds):
    """The flags of the two-turn server benchmarks (this one and bench_prompt_cache.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--words", type=int, default=1200)
    ap.add_argument("--max-tokens", type=int, default=16)
    return ap.parse_args()


def conversation(port, rng, words, max_tokens):
    msgs = first_turn(rng, words)
    t1, reply, u1 = ask(port, msgs, max_tokens)
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter, please."}]
    t2, _, u2 = ask(port, msgs, max_tokens)
    return t1, t2, u1, u2


def main():
    args = parse_args(rounds=6)
    a, pa = start(args.model, [])
    b, pb = start(args.model, ["--prompt-cache-bytes", "0"])
    try:
        conversation(pa, random.Random(-1), 50, 4)  # warm both (imports, first graph build)
        conversation(pb, random.Random(-1), 50, 4)
        res = {"a1": [], "a2": [], "b1": [], "b2": []}
        for r in range(args.rounds):
            order = [("a", pa), ("b", pb)] if r % 2 == 0 else [("b", pb), ("a", pa)]
            usage = {}
            for name, port in order:
                t1, t2, u1, usage[name] = conversation(port, random.Random(r), args.words, args.max_tokens)
                res[name + "1"].append(t1)
                res[name + "2"].append(t2)
            ua = usage["a"]
            print(
                f"round {r}: prompt {u1['prompt_tokens']} -> {ua['prompt_tokens']} tokens; A turn 2 restored "
                f"{ua['prompt_tokens_details']['cached_tokens']}; "
                f"A {res['a1'][-1] * 1e3:.0f}/{res['a2'][-1] * 1e3:.0f} ms, "
                f"B {res['b1'][-1] * 1e3:.0f}/{res['b2'][-1] * 1e3:.0f} ms",
                flush=True,
            )
        med = {k: statistics.median(v) for k, v in res.items()}
        print(
            f"median TTFT ms: A turn1 {med['a1'] * 1e3:.0f}, A turn2 {med['a2'] * 1e3:.0f}, "
            f"B turn1 {med['b1'] * 1e3:.0f}, B turn2 {med['b2'] * 1e3:.0f}"
        )
        pairs = [x / y for x, y in zip(res["a2"], res["b2"])]
        print(f"turn-2 TTFT, prefix cache / no cache: {statistics.median(pairs):.3f}x (median of per-round pairs)")
        print(
            f"turn-2 / turn-1 TTFT with the prefix cache: {med['a2'] / med['a1']:.3f}x; without: "
            f"{med['b2'] / med['b1']:.3f}x"
        )
    finally:
        for p in (a, b):
            p.terminate()
            p.wait(10)


if __name__ == "__main__":
    main()
