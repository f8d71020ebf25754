"""Route-trace report on the demo model (issue 11): capture, replay parity, export, controls,
cache simulator and the worked trainer, on held-out CPython stdlib text.

    python benchmarks/traces_report.py [--work /tmp/hebrus-traces] [--stage all|capture|analyze]

Capture (stage `capture`): the demo's held-out files (tools/train_demo.py's split: seed 0, 10% of
the stdlib's top-level *.py files) are tokenized; from each file up to --windows windows of
--prompt-tokens tokens are fed through `stream_generate(..., trace_out=...)` as the prompt
(teacher-forced: its chunked prefill records the observations) followed by --decode-tokens greedy
decoded tokens (real decode observations). A second set is pure decode: short prompts from the
same files, --decode-only-tokens decoded tokens each (greedy, and sampled at temp 0.8 seed 7).
Owners are the file names, so the export's owner split keeps each file in one split.

Stage `analyze` runs the `hebrus-mlx traces` commands as subprocesses and writes
benchmarks/out/traces_report.{md,json,png} with the exact commands and their output.
"""

import argparse
import os
import random
import subprocess
import sys
import sysconfig
import time
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"


def heldout_files():
    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.is_file())
    order = sorted(files, key=lambda p: p.name)
    random.Random(0).shuffle(order)  # tools/train_demo.py split_files(files, 0.1, seed=0)
    n_held = max(1, round(len(order) * 0.1))
    return sorted(order[:n_held], key=lambda p: p.name)


def capture(args):
    from hebrus_mlx import load
    from hebrus_mlx.generate import stream_generate
    from hebrus_mlx.sample_utils import make_sampler

    model, tok = load("demo")
    held = heldout_files()
    print("held-out files:", ", ".join(p.name for p in held))
    work = Path(args.work)
    t0, n_tok = time.time(), 0
    for f in held:
        ids = tok.encode(unicodedata.normalize("NFC", f.read_text(encoding="utf-8", errors="replace")))
        for w in range(args.windows):
            chunk = ids[w * args.prompt_tokens : (w + 1) * args.prompt_tokens]
            if len(chunk) < args.prompt_tokens // 2:
                break
            for _ in stream_generate(
                model,
                tok,
                chunk,
                max_tokens=args.decode_tokens,
                prefill_step_size=args.prefill_step_size,
                trace_out=work / "heldout",
                trace_owner=f.name,
                trace_features=1,
            ):
                pass
            n_tok += len(chunk) + args.decode_tokens - 1
        print(f"  {f.name}: {n_tok} tokens so far, {time.time() - t0:.0f} s", flush=True)
    for f in held[: args.decode_prompts]:
        ids = tok.encode(f.read_text(encoding="utf-8", errors="replace"))[:24]
        for temp, seed in ((0.0, None), (0.8, 7)):
            kw = {}
            if temp:
                import mlx.core as mx

                mx.random.seed(seed)
                kw["sampler"] = make_sampler(temp=temp)
            for _ in stream_generate(
                model,
                tok,
                ids,
                max_tokens=args.decode_only_tokens,
                trace_out=work / "decode",
                trace_owner=f.name,
                trace_sampling={"temp": temp, "seed": seed},
                **kw,
            ):
                pass
    print(f"capture done: {time.time() - t0:.0f} s")


def run(cmd, log):
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.cli", *cmd],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    dt = time.time() - t0
    shown = "hebrus-mlx " + " ".join(cmd)
    log.append((shown, p.returncode, p.stdout + p.stderr, dt))
    print(f"$ {shown}  (exit {p.returncode}, {dt:.0f} s)\n{p.stdout}{p.stderr}", flush=True)
    return p


def analyze(args):
    work = Path(args.work)
    log = []
    run(["traces", "replay", str(work / "decode"), "--prefill-step-size", "64"], log)
    run(["traces", "replay", str(work / "heldout"), "--prefill-step-size", "256"], log)
    run(
        [
            "traces",
            "export",
            str(work / "heldout"),
            "--out",
            str(work / "export"),
            "--split-by",
            "owner",
            "--fractions",
            "0.5,0.2,0.3",
        ],
        log,
    )
    run(
        [
            "traces",
            "eval",
            str(work / "heldout"),
            "--model",
            "demo",
            "--cache-sim",
            "--json",
            "benchmarks/out/traces_eval_all.json",
            "--plot",
            "benchmarks/out/traces_report.png",
        ],
        log,
    )
    run(
        [
            "traces",
            "eval",
            str(work / "export"),
            "--split",
            "test",
            "--model",
            "demo",
            "--json",
            str(work / "eval_test.json"),
        ],
        log,
    )
    t0 = time.time()
    cmd = [
        sys.executable,
        "tools/train_route_predictor.py",
        str(work / "export"),
        "--controls",
        str(work / "eval_test.json"),
        "--json",
        "benchmarks/out/traces_predictor.json",
    ]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log.append(("python " + " ".join(cmd[1:]), p.returncode, p.stdout + p.stderr, time.time() - t0))
    print(p.stdout, p.stderr)
    md = [
        "# Route traces on the demo model (issue 11)",
        "",
        "Produced by `python benchmarks/traces_report.py` (capture, then these commands, run in order; "
        f"trace work dir `{args.work}`, not committed: traces hold token IDs). Machine: 2 shared cores, CPU MLX.",
        "",
        f"Capture: {args.windows} windows x {args.prompt_tokens} prompt tokens per held-out file, teacher-forced "
        f"(chunked prefill, step {args.prefill_step_size}), each followed by {args.decode_tokens} greedy decoded tokens; "
        f"pure decode: {args.decode_prompts} prompts x {args.decode_only_tokens} tokens, greedy and temp 0.8.",
        "",
    ]
    for shown, rc, out, dt in log:
        md += [f"## `{shown}`", "", f"exit {rc}, {dt:.0f} s", "", "```", out.rstrip(), "```", ""]
    md += ["![controls and cache simulator](traces_report.png)", ""]
    (OUT / "traces_report.md").write_text("\n".join(md))
    print("wrote", OUT / "traces_report.md")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/hebrus-traces")
    p.add_argument("--stage", choices=("all", "capture", "analyze"), default="all")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--decode-tokens", type=int, default=24)
    p.add_argument("--prefill-step-size", type=int, default=256)
    p.add_argument("--decode-prompts", type=int, default=4)
    p.add_argument("--decode-only-tokens", type=int, default=160)
    args = p.parse_args()
    if args.stage in ("all", "capture"):
        if Path(args.work).exists() and any(Path(args.work).iterdir()):
            sys.exit(f"--work {args.work} is not empty; remove it first")
        capture(args)
    if args.stage in ("all", "analyze"):
        analyze(args)


if __name__ == "__main__":
    main()
