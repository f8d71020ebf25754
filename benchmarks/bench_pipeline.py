"""Pipeline parallelism: decode tok/s of 1 process vs 2 local ranks (ring backend over loopback),
rounds interleaved A/B/B/A, the bytes and time crossing the link per token, and a projection of
two 64 GB Macs on Thunderbolt for Qwen3.8-Flash-Next's geometry.

    python benchmarks/bench_pipeline.py [--model demo] [--tokens 64] [--rounds 2]

The 2-rank run here measures this machine's loopback ring and 2 shared cores, not a Mac pair;
the projection below is arithmetic on stated assumptions, not a measurement.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):\n    "


def _rank_main(model, tokens, out):
    import mlx.core as mx

    from hebrus_mlx.generate import generate_step
    from hebrus_mlx.loader import load_model, resolve_model_path
    from hebrus_mlx.pipeline import gather_stats, load_pipeline
    from hebrus_mlx.text.tokenizer import load_tokenizer

    path = resolve_model_path(model)
    if os.environ.get("MLX_RANK") is None:
        m, pipe = load_model(path), None
    else:
        pipe = load_pipeline(path)
        if pipe.rank != 0:
            st = pipe.serve()
            gather_stats(pipe.group, st["forwards"], st["comm_seconds"], st["comm_bytes"])
            return
        m = pipe.model
    tok = load_tokenizer(path, physical_vocab_size=m.args.vocab_size)
    ids = mx.array(tok.encode(PROMPT), dtype=mx.int32)
    steps = generate_step(ids, m, effective_vocab_size=tok.effective_vocab_size, max_tokens=tokens)
    got = [next(steps)[0]]  # prefill + first token
    forwards0 = m.forwards if pipe else 0
    comm0, bytes0 = (m.comm_seconds, m.comm_bytes) if pipe else (0.0, 0)
    tic = time.perf_counter()
    for t, _ in steps:
        got.append(t)
    dt = time.perf_counter() - tic
    res = {"tokens": got, "decode_tps": (len(got) - 1) / dt}
    if pipe:
        n = m.forwards - forwards0
        res["link_ms_per_token"] = (m.comm_seconds - comm0) / n * 1e3
        res["link_bytes_per_token"] = (m.comm_bytes - bytes0) / n
        m.stop()
        res["ranks"] = gather_stats(pipe.group, m.forwards, m.comm_seconds, m.comm_bytes)
    Path(out).write_text(json.dumps(res))


def _run(model, tokens, ranks, tmp):
    out = Path(tmp) / f"r{ranks}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, __file__, "--rank-main", "--model", model, "--tokens", str(tokens), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if ranks == 1:
        subprocess.run(cmd, env=env, check=True)
    else:
        from hebrus_mlx.pipeline import local_hostfile

        hostfile = local_hostfile(Path(tmp) / "hosts.json", ranks)
        procs = [
            subprocess.Popen(cmd, env=dict(env, MLX_HOSTFILE=str(hostfile), MLX_RANK=str(r))) for r in range(ranks)
        ]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise SystemExit(f"rank exited with {p.returncode}")
    return json.loads(out.read_text())


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def projection():
    """Two 64 GB Macs, Qwen3.8-Flash-Next affine4 resident across them. Assumptions (stated, not
    measured): Thunderbolt 5 link at 5 GB/s effective and 0.1 ms per message; the model's
    per-token compute equals one Mac holding it all (pipeline ranks run one after another for a
    single sequence, so splitting adds only the link)."""
    hc, hidden, vocab = 4, 2560, 248_320
    payload = (hc * hidden + 1) * 4  # fp32 streams + the token id column
    logits = vocab * 4
    header = 8 * 4
    messages = 3  # header + payload to rank 1, logits back to rank 0
    bw, lat = 5e9, 1e-4
    link_ms = (messages * lat + (payload + logits + header) / bw) * 1e3
    print("\nProjection (arithmetic, not a measurement): two 64 GB Macs over Thunderbolt 5, Qwen3.8-Flash-Next")
    print(
        f"  per decode token across the link: {payload / 1024:.1f} KiB hidden state + {logits / 1024:.0f} KiB "
        f"logits + headers = {(payload + logits + header) / 1024:.0f} KiB in {messages} messages"
    )
    print(f"  at 5 GB/s and 0.1 ms per message: {link_ms:.2f} ms per token")
    for tps in (12.0, 17.5, 25.0):
        print(
            f"  a token that takes {1e3 / tps:.0f} ms of compute ({tps:g} tok/s on one machine) -> "
            f"{1e3 / (1e3 / tps + link_ms):.1f} tok/s pipelined ({link_ms / (1e3 / tps) * 100:.1f}% link)"
        )
    # Speculative verify: a block of k drafts + 1 sends k+1 rows of hidden state and gets k+1 rows
    # of logits back; drafting with the MTP head also gets the k+1 final pre-mixer rows back.
    k = 3
    hidden_rows = hc * hidden * 4
    for name, extra in (("ngram / draft model", 0), ("mtp", hidden_rows)):
        step = (k + 1) * (payload + logits + extra) + header
        ms = ((messages + (1 if extra else 0)) * lat + step / bw) * 1e3
        print(
            f"  a verify of {k} drafts ({name}): {step / 1024:.0f} KiB ({(k + 1) * extra / 1024:.0f} KiB of it "
            f"final states) -> {ms:.2f} ms on the link per verify step"
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return _rank_main(args.model, args.tokens, args.out)
    one, two, links, nbytes = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        base = None
        for r in range(args.rounds):
            for ranks in (1, 2) if r % 2 == 0 else (2, 1):
                res = _run(args.model, args.tokens, ranks, tmp)
                base = base or res["tokens"]
                if res["tokens"] != base:
                    raise SystemExit("tokens differ between runs: not comparable")
                (one if ranks == 1 else two).append(res["decode_tps"])
                if ranks == 2:
                    links.append(res["link_ms_per_token"])
                    nbytes.append(res["link_bytes_per_token"])
    print(f"model {args.model}, {args.tokens} tokens, {args.rounds} rounds A/B/B/A, tokens identical across runs")
    print(
        f"1 process: {_median(one):.1f} tok/s; 2 ranks: {_median(two):.1f} tok/s "
        f"(ratio {_median(two) / _median(one):.2f}x)"
    )
    print(
        f"2 ranks: rank 0 waits {_median(links):.2f} ms per token on the link (incl. rank 1's compute), "
        f"{_median(nbytes) / 1024:.1f} KiB per token cross it"
    )
    projection()


if __name__ == "__main__":
    main()
