"""Turn-2 time to first token after a server restart with `--prompt-cache-dir` vs a cold server.

Per round: a fresh two-turn conversation (a long first user message, a short second one; the reply
is sent back as the client got it). Turn 1 runs on a server with `--prompt-cache-dir DIR`, which
is then stopped. Turn 2 runs on (R) a new server over the same DIR (the restart) and on (C) a new
server without it (cold), alternating which goes first. TTFT is measured by the client from
sending the request to the first streamed content delta. Prints medians, the per-round ratio
R / C, and checks both replies are the same text.

    python benchmarks/bench_prompt_cache.py [--model demo] [--rounds 3] [--words 1200]
"""

import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import ask, first_turn, parse_args, start  # noqa: E402


def stop(proc):
    proc.terminate()
    proc.wait(30)


def main():
    args = parse_args(rounds=3)
    res = {"r": [], "c": []}
    with tempfile.TemporaryDirectory(prefix="hebrus-prompt-cache-") as d:
        for r in range(args.rounds):
            msgs = first_turn(random.Random(r), args.words)
            first, p1 = start(args.model, ["--prompt-cache-dir", d])
            try:
                ask(p1, [{"role": "user", "content": "warm up"}], 2)
                _, reply, u1 = ask(p1, msgs, args.max_tokens)
            finally:
                stop(first)
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter, please."}]
            restarted, pr = start(args.model, ["--prompt-cache-dir", d])
            cold, pc = start(args.model, [])
            try:
                for port in (pr, pc):  # imports and the first graph build, outside the measurement
                    ask(port, [{"role": "user", "content": "warm up"}], 2)
                order = [("r", pr), ("c", pc)] if r % 2 == 0 else [("c", pc), ("r", pr)]
                out = {}
                for name, port in order:
                    ttft, text, usage = ask(port, msgs, args.max_tokens)
                    res[name].append(ttft)
                    out[name] = (text, usage)
            finally:
                stop(restarted)
                stop(cold)
            same = out["r"][0] == out["c"][0]
            ur = out["r"][1]
            print(
                f"round {r}: turn 1 {u1['prompt_tokens']} tokens, turn 2 {ur['prompt_tokens']} tokens "
                f"({ur['prompt_tokens_details']['cached_tokens']} restored from disk after the restart); "
                f"TTFT restarted {res['r'][-1] * 1e3:.0f} ms, cold {res['c'][-1] * 1e3:.0f} ms; same text: {same}",
                flush=True,
            )
            if not same:
                raise SystemExit("the restarted server's reply differs from the cold server's")
    ratios = [x / y for x, y in zip(res["r"], res["c"])]
    print(
        f"median turn-2 TTFT ms: restarted {statistics.median(res['r']) * 1e3:.0f}, "
        f"cold {statistics.median(res['c']) * 1e3:.0f}"
    )
    print(
        f"turn-2 TTFT, restarted with --prompt-cache-dir / cold: {statistics.median(ratios):.3f}x "
        "(median of per-round pairs)"
    )


if __name__ == "__main__":
    main()
