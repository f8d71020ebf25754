"""Speculative decoding on the demo model with code prompts, side by side with plain decode.

For each drafter (prompt lookup `ngram`; `mtp` when the build and the artifact have the MTP head;
the `oracle` replaying plain decoding's own output: the acceptance upper bound) and block size 1..4 plus the governor (limit 4), resident and with routed
experts streamed through a 5% cache, prints:

- tokens per step (acceptance length: committed tokens per verify or plain step, incl. the bonus)
  and the acceptance rate of drafted tokens;
- decode tokens/s (from the first token on; the prompt's prefill is the same for every variant)
  relative to plain decode, median of per-round ratios with the runs interleaved A/B/B/A (plain,
  variants, variants reversed, plain) because this machine is shared and noisy;
- routed expert bytes per committed token (accepted drafts, bonus and plain tokens): unique
  experts per layer of every forward (verify, re-run of an accepted prefix, plain step) x the
  record size, counted in a separate untimed pass; with a streamed model also the bytes the
  engine actually read per token (cache misses);
- for the governor: how many steps it ran at each block size (B=0: plain, pipelined steps).

Every variant's tokens are checked against plain decode (greedy); a mismatch aborts.

    python benchmarks/bench_speculative.py [--tokens 48] [--rounds 2] [--no-streamed]
"""

import argparse
import json
import math
import os
import statistics
import time

import mlx.core as mx

from hebrus_mlx.artifact import constants as C
from hebrus_mlx.artifact import expert_major as em
from hebrus_mlx.generate import generate_step, speculative_generate_step
from hebrus_mlx.loader import DEMO_DIR, load
from hebrus_mlx.models import qwen4exp
from hebrus_mlx.speculative import DrafterError, Governor, SpeculativeStats, make_drafter
from hebrus_mlx.speculative.governor import FixedSchedule
from hebrus_mlx.testing.drafters import OracleDrafter

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
    "        self.items = {}\n\n    def get(self, key, default=None):\n        return self.items.get(key, default)\n\n"
    "    def set(self, key, value):\n",
]


def record_bytes():
    with open(os.path.join(DEMO_DIR, C.MANIFEST_NAME)) as f:
        m = json.load(f)
    s = next(s for s in m["stores"] if s["role"] == "experts")
    fam = C.family(m["family"])
    return sum(n for *_, n in em.record_layout(fam, s["codec"])), fam


class LoggedGovernor(Governor):
    """The governor, recording the block size it chose at every step."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.log = []

    def block_size(self):
        self.log.append(super().block_size())
        return self.log[-1]


def run(model, tok, ids, variant, n_tokens, stats=None, on_first=None, schedule=None, logs=None):
    """Tokens of one generation; on_first() runs once the prompt is consumed (first token out).
    A governed variant replays `schedule` when given, else appends its choices to `logs`."""
    V = tok.effective_vocab_size
    if variant is None:
        steps = ((t, None) for t, _ in generate_step(mx.array(ids), model, effective_vocab_size=V, max_tokens=n_tokens))
    else:
        drafter, block, governed = variant()
        gov = None
        if governed:
            gov = FixedSchedule(schedule) if schedule is not None else LoggedGovernor(block)
            if logs is not None and schedule is None:
                logs.append(gov.log)
        steps = speculative_generate_step(
            mx.array(ids),
            model,
            drafter,
            effective_vocab_size=V,
            max_tokens=n_tokens,
            num_draft_tokens=block,
            governor=gov,
            stats=stats,
        )
    out = []
    for t, *_ in steps:
        if not out and on_first is not None:
            on_first()
        out.append(t)
    return out


def decode_seconds(model, tok, ids, variant, n_tokens, stats, logs, want):
    """Wall time from the first token to the last (decode only); the tokens must be `want`."""
    first = []
    out = run(model, tok, ids, variant, n_tokens, stats, lambda: first.append(time.perf_counter()), logs=logs)
    t = time.perf_counter() - first[0]
    if out != want:
        raise SystemExit("tokens differ from plain decode")
    return t


class UniqueExperts:
    """Untimed pass: sum over forwards and layers of the unique routed experts (a sync per layer)."""

    def __init__(self):
        self.total = 0
        self.orig = qwen4exp.SparseMoE.route

    def __enter__(self):
        outer = self

        def route(moe, x):
            inds, scores = outer.orig(moe, x)
            outer.total += len(set(inds.reshape(-1).tolist()))
            return inds, scores

        qwen4exp.SparseMoE.route = route
        return self

    def __exit__(self, *exc):
        qwen4exp.SparseMoE.route = self.orig


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-streamed", action="store_true")
    args = ap.parse_args()
    rec, fam = record_bytes()
    rows = max(math.ceil(0.05 * fam.num_hidden_layers * fam.num_experts), fam.num_experts_per_tok)
    gb = (rows * rec + rec // 2) / 2**30
    setups = [("resident", {})] + ([] if args.no_streamed else [("streamed 5%", {"expert_cache_gb": gb})])
    for setup, kw in setups:
        model, tok = load("demo", **kw)
        engine = model.streaming.engine if model.streaming is not None else None
        prompts = [tok.encode(p) for p in PROMPTS]
        futures = [run(model, tok, ids, None, args.tokens) for ids in prompts]
        variants = {}
        names = ["ngram", "oracle"]
        try:
            make_drafter("mtp", model, tok)
            names.insert(1, "mtp")
        except DrafterError as e:
            print(f"({setup}: no mtp variant: {e})")
        for name in names:
            for b in (1, 2, 3, 4):
                variants[f"{name} B={b}"] = (name, b, False)
            variants[f"{name} governor"] = (name, 4, True)

        def make(name, b, governed, i):
            def build():
                if name == "oracle":
                    return OracleDrafter(futures[i]), b, governed
                return make_drafter(name, model, tok), b, governed

            return build

        labels = ["plain"] + list(variants)

        def variant_of(label, i):
            return None if label == "plain" else make(*variants[label], i)

        # Timed, interleaved rounds (exactness checked, stats and the governor's choices kept).
        times = {label: [] for label in labels}
        stats = {label: [] for label in labels}
        logs = {label: [] for label in labels}  # per run and prompt: the governor's block sizes
        for _ in range(args.rounds):
            for label in labels + labels[::-1]:
                total = 0.0
                for i, ids in enumerate(prompts):
                    st = SpeculativeStats()
                    total += decode_seconds(
                        model, tok, ids, variant_of(label, i), args.tokens, st, logs[label], futures[i]
                    )
                    stats[label].append(st)
                times[label].append(total)
        # Untimed pass: routed bytes (a sync per layer), the governor replaying its last timed choices.
        info = {}
        n = (args.tokens - 1) * len(prompts)  # tokens after the first (which the prefill yields)
        for label in labels:
            tot, eng = 0, 0
            for i, ids in enumerate(prompts):
                sched = logs[label][-len(prompts) + i] if logs[label] else None
                with UniqueExperts() as ue:

                    def decode_only():  # count decode, not the prompt's prefill
                        ue.total = 0
                        if engine is not None:
                            engine.reset_counters()

                    out = run(model, tok, ids, variant_of(label, i), args.tokens, None, decode_only, schedule=sched)
                if out != futures[i]:
                    raise SystemExit(f"{setup} {label}: tokens differ from plain decode")
                if engine is not None:
                    c = engine.counters()
                    eng += c["exact_bytes"] + c["predicted_bytes"]
                tot += ue.total
            sts = stats[label]
            acc, dr = sum(st.accepted for st in sts), sum(st.drafted for st in sts)
            plain_steps = sum(st.block_sizes.get(0, 0) for st in sts) if label != "plain" else n * len(times[label])
            steps = sum(st.verify_steps for st in sts) + plain_steps
            blocks = {}
            for st in sts:
                for b, c in st.block_sizes.items():
                    blocks[b] = blocks.get(b, 0) + c
            info[label] = dict(
                bytes_tok=tot * rec / n,
                eng_tok=eng / n,
                acc=acc,
                dr=dr,
                per_step=n * len(times[label]) / steps if steps else 1.0,
                blocks=blocks,
            )
        plain_t = times["plain"]
        print(
            f"\n== {setup}: demo model, {len(prompts)} code prompts x {args.tokens} tokens, {args.rounds} rounds; "
            f"plain decode {n / statistics.median(plain_t):.1f} tok/s =="
        )
        print(
            f"{'variant':18s} {'tok/step':>9s} {'accept':>7s} {'tok/s vs plain':>15s} "
            f"{'routed KiB/tok':>15s}"
            + (f" {'read KiB/tok':>13s}" if engine is not None else "")
            + "  steps per block size"
        )
        for label, d in info.items():
            ratios = [p / t for p, t in zip(plain_t, times[label])]
            acc = f"{100 * d['acc'] / d['dr']:.0f}%" if d["dr"] else "-"
            line = (
                f"{label:18s} {d['per_step']:9.2f} {acc:>7s} {statistics.median(ratios):14.2f}x "
                f"{d['bytes_tok'] / 1024:15.1f}"
            )
            if engine is not None:
                line += f" {d['eng_tok'] / 1024:13.1f}"
            if label.endswith("governor"):  # over all timed runs
                line += "  " + " ".join(f"B{b}:{c}" for b, c in sorted(d["blocks"].items()))
            print(line, flush=True)
        if engine is not None:
            engine.close()


if __name__ == "__main__":
    main()
