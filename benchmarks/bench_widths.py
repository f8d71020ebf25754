"""Expert width vs quality and speed: the demo geometry at 8/6/4/3/2-bit routed experts (issue 23 §2).

Converts the demo's float weights (the HF checkpoint `tools/train_demo.py --out DIR` writes; the
shipped demo artifact holds 4-bit weights only) once per expert width, dense weights at
--q-bits, and prints per width, all measured side by side in one run:

  - perplexity on the demo's held-out text (hebrus-mlx perplexity, resident),
  - expert MB read per token at a cold cache (top-k x layers x record bytes),
  - streamed greedy decode tok/s with an expert cache of --cache-fraction of the records (5%),
    and whether its tokens equal the same artifact's resident run,
  - the simulator's projection for --profile (M5 Pro 48 GB) at that width on the real geometry
    (`hebrus-mlx simulate --expert-bits N`; "n/a" where this build's simulate has no such flag).

Then the PLE row widths (--ple-widths, `convert --ple-dtype`, experts at 4 bits): perplexity,
PLE store MB and PLE bytes per token; and for every expert and PLE width the next-token
distributions against a bf16 reference conversion of the same source (`convert --dtype bfloat16`:
dense, experts and PLE rows all bf16) as `hebrus-mlx perplexity --kl-divergence` computes them:
mean and p99 KL, top-1 agreement.

Then the real model's (qwen3.8-flash-next) expert store size and MB per token at each width, and
its PLE table's size per PLE width (from the page-store layout).

    python benchmarks/bench_widths.py [--hf-path DEMO_HF] [--widths 8,6,4,3,2] [--ple-widths bfloat16,q8,q4]
        [--q-bits 4] [--tokens 32] [--rounds 4] [--cache-fraction 0.05] [--profile m5-pro-48gb]
        [--skip-projection] [--keep DIR] [--json FILE]
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np

from hebrus_mlx import perplexity as PPL
from hebrus_mlx.admission import admit
from hebrus_mlx.artifact import constants as C
from hebrus_mlx.artifact import ple_pages
from hebrus_mlx.artifact.expert_major import Geometry
from hebrus_mlx.convert import convert
from hebrus_mlx.loader import DEMO_DIR, load
from hebrus_mlx.loading import plan

PROMPT = "def parse_args(argv=None):\n"


def demo_float_checkpoint(artifact, out):
    """An HF checkpoint (fused expert layout, bf16 weights, no MTP head) holding the weights the
    artifact runs: affine tensors dequantized, float ones as stored. For the shipped demo (4-bit
    only) this is the float source the widths are converted from when no --hf-path is given:
    widths >= 4 then reproduce the demo's 4-bit weights (nearly) exactly, so only the rows below
    4 bits measure a loss."""
    from hebrus_mlx.format.checkpoint_keys import DEPTHWISE_CONV_SUFFIXES
    from hebrus_mlx.format.qwen4exp_config import ple_constants
    from hebrus_mlx.loading import build_model as B

    m = admit(artifact)
    os.makedirs(out, exist_ok=True)
    w = {}
    dense = B._dense(m)
    for name, a in dense.items():
        if name.endswith((".scales", ".biases")):
            continue
        rec = m.tensors[name]
        c = C.codec(rec["codec"])
        if c.affine:
            stem = name[: -len("weight")]
            a = mx.dequantize(a, dense[stem + "scales"], dense[stem + "biases"], group_size=c.group_size, bits=c.bits)
        if name.endswith(DEPTHWISE_CONV_SUFFIXES):
            a = a.transpose(0, 2, 1)  # MLX [C, K, 1] -> HF [C, 1, K]
        w[name] = a
    c = C.codec(m.experts.codec)
    for layer in range(m.family.num_hidden_layers):
        x = B._experts(m, [layer])
        comp = {}
        for p in ("gate", "up", "down"):
            stem = f"model.layers.{layer}.mlp.switch_mlp.{p}_proj."
            comp[p] = mx.dequantize(
                x[stem + "weight"], x[stem + "scales"], x[stem + "biases"], group_size=c.group_size, bits=c.bits
            )
        w[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = mx.concatenate([comp["gate"], comp["up"]], axis=1)
        w[f"model.layers.{layer}.mlp.experts.down_proj"] = comp["down"]
    args = m.args
    for t, (key, table) in enumerate(sorted(B._ple(m).items(), key=lambda kv: int(kv[0].split(".")[2]))):
        stem = key[: -len("ngram_embedding.weight")]
        for s, part in enumerate(np.array_split(np.arange(table.shape[0]), args.split_ngram_parts)):
            w[f"{stem}ngram_embedding.shard_{s}.weight"] = table[int(part[0]) : int(part[-1]) + 1]
        for name, v in ple_constants(args, t).items():
            w[stem + name] = mx.array(np.array(v, np.int64))
    mx.save_safetensors(os.path.join(out, "model.safetensors"), w, metadata={"format": "pt"})
    for name in C.SOURCE_FILES:
        if os.path.exists(os.path.join(artifact, name)):
            shutil.copy(os.path.join(artifact, name), os.path.join(out, name))
    return out


def cache_gb(m, fraction):
    """GiB for ceil(fraction x records) arena rows (bf16 parts held as fp32), >= one token's top-k."""
    fam = m.family
    g = Geometry(fam, m.experts.codec)
    record = sum(2 * n if d == "uint16" else n for _, _, d, _, _, n in g.layout)
    rows = max(math.ceil(fraction * g.count), fam.num_experts_per_tok)
    return (rows * record + record // 2) / plan.GIB, rows


def decode(model, ids, steps):
    """(greedy tokens, decode seconds) after a prefill of `ids` (chunks the arena can pin)."""
    cap = None if model.streaming is None else model.streaming.max_chunk_tokens
    cache, step = model.make_cache(), cap or len(ids)
    for i in range(0, len(ids), step):
        logits = model(mx.array([ids[i : i + step]]), cache)
    mx.eval(logits)
    out, t0 = [], time.perf_counter()
    for _ in range(steps):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([out[-1:]]), cache)
        mx.eval(logits)
    return out, time.perf_counter() - t0


def projection(widths, profile):
    """{bits: (default tok/s, best tok/s, limiting term)} from the simulator, or a reason string."""
    try:
        from hebrus_mlx.commands.simulate import project_widths
    except ImportError:
        project_widths = None
    if project_widths is not None:
        rows = project_widths(profile, expert_bits=tuple(widths))
        return {
            r["expert_bits"]: (r["default_tok_s"], r["best_tok_s"], r.get("default_limit") or r.get("best_limit"))
            for r in rows
        }
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "p.json")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "hebrus_mlx.cli",
                "simulate",
                "--profile",
                profile,
                "--quiet",
                "--expert-bits",
                ",".join(map(str, widths)),
                "--json",
                out,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            return (
                "n/a (simulate has no --expert-bits)"
                if "expert-bits" in proc.stderr
                else f"n/a (simulate: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode})"
            )
        res = json.load(open(out))
        return {
            b: ((c.get("default") or {}).get("tok_s"), c["best"]["tok_s"], c.get("default_limit"))
            for b, c in zip(widths, res["by_codec"])
        }


def real_geometry(widths, group):
    fam = C.QWEN38_FLASH_NEXT
    out = []
    for b in widths:
        g = Geometry(fam, C.affine_name(b, group))
        out.append(
            {
                "expert_bits": b,
                "record_mib": g.record_bytes / 2**20,
                "store_gb": g.file_bytes / 1e9,
                "mb_per_token": fam.num_experts_per_tok * fam.num_hidden_layers * g.record_stride / 1e6,
            }
        )
    return out


def ple_geometry(m):
    """(PLE store MB, row bytes read per token, page bytes per token at a cold cache) of artifact `m`:
    every table gathers one row per n-gram head per token, each from its own page."""
    row = page = 0
    for s in m.ple:
        g = ple_pages.Geometry(m.family, s.table, s.codec)
        heads = len(g.heads)
        row, page = row + heads * g.row_bytes, page + heads * g.page_stride
    return sum(s.size for s in m.ple) / 1e6, row, page


def real_ple(ple_widths):
    fam, out = C.QWEN38_FLASH_NEXT, []
    for w in ple_widths:
        g = ple_pages.Geometry(fam, 0, C.PLE_DTYPES[w])
        out.append(
            {
                "ple_dtype": w,
                "codec": g.codec.name,
                "group": g.group_size,
                "row_bytes": g.row_bytes,
                "rows_per_page": g.rows_per_page,
                "pages": g.num_pages,
                "store_gb": g.file_bytes / 1e9,
                "payload_gb": g.total_rows * g.row_bytes / 1e9,
                "row_bytes_per_token": len(g.heads) * g.row_bytes * fam.ple_tables,
            }
        )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--hf-path",
        default=None,
        help="the demo's float HF checkpoint (tools/train_demo.py --out); default: the shipped demo's "
        "4-bit weights, dequantized (see demo_float_checkpoint)",
    )
    p.add_argument("--widths", default="8,6,4,3,2")
    p.add_argument("--ple-widths", default="bfloat16,q8,q4", help="convert --ple-dtype values (experts at 4 bits)")
    p.add_argument("--q-bits", type=int, default=4, help="dense weights' width (all widths share it)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32, help="decode tokens per streamed run")
    p.add_argument("--cache-fraction", type=float, default=0.05)
    p.add_argument("--rounds", type=int, default=4, help="streamed decode runs per width, interleaved")
    p.add_argument("--ppl-seq-len", type=int, default=256)
    p.add_argument("--profile", default="m5-pro-48gb")
    p.add_argument("--skip-projection", action="store_true", help="leave out the simulator's projection (minutes)")
    p.add_argument("--keep", default=None, help="keep the artifacts in this directory")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    widths = [int(x) for x in a.widths.split(",")]
    ple_widths = a.ple_widths.split(",")
    root = a.keep or tempfile.mkdtemp(prefix="bench_widths_")
    rows = []
    try:
        hf = a.hf_path or demo_float_checkpoint(str(DEMO_DIR), os.path.join(root, "hf"))

        # What every quantized artifact shares: dense width and one group size for all weights.
        shared = {"q_bits": a.q_bits, "q_group_size": a.group_size, "expert_group_size": a.group_size}

        def quantized(name, **kw):
            """The artifact `name` under root at these widths (converted unless it is there)."""
            path = os.path.join(root, name)
            if not os.path.exists(path):
                convert(hf, path, quiet=True, mtp=False, **shared, **kw)
            return path

        arts = {b: quantized(f"e{b}", expert_bits=b) for b in widths}
        ref_art = os.path.join(root, "ref-bf16")
        if not os.path.exists(ref_art):
            convert(hf, ref_art, dtype="bfloat16", quiet=True, mtp=False)
        ple_arts = {}
        for w in ple_widths:
            if w == "bfloat16" and 4 in arts:  # the 4-bit expert width's artifact
                ple_arts[w] = arts[4]
                continue
            ple_arts[w] = quantized(f"p{w}", expert_bits=4, ple_dtype=w)
        ref_model, _ = load(ref_art)
        kl_rows = []

        def kl(label, model, data):
            if any(r["artifact"] == label for r in kl_rows):  # PLE bf16 at 4-bit experts is the e4 artifact
                return
            k = PPL.kl_divergence(model, ref_model, data, batch_size=4)
            kl_rows.append({"artifact": label, **k})
            print(f"{label}: KL {k['kl_mean']:.5f} p99 {k['kl_p99']:.5f} top-1 {k['top1']:.4f}", file=sys.stderr)

        streamed, want = {}, {}
        for b in widths:
            m = admit(arts[b])
            fam, g = m.family, Geometry(m.family, m.experts.codec)
            resident, tok = load(arts[b])
            data = PPL.load_data(tok, PPL.DEFAULT_DATA, -1, a.ppl_seq_len, 123)
            ppl, se, n = PPL.perplexity(resident, data, batch_size=4)
            ids = tok.encode(PROMPT)
            want[b], _ = decode(resident, ids, a.tokens)
            gb, arena = cache_gb(m, a.cache_fraction)
            streamed[b] = load(arts[b], expert_cache_gb=gb)[0]
            rows.append(
                {
                    "expert_bits": b,
                    "codec": m.experts.codec,
                    "ppl": ppl,
                    "ppl_se": se,
                    "ppl_tokens": n,
                    "record_bytes": g.record_bytes,
                    "store_mb": m.experts.size / 1e6,
                    "mb_per_token": fam.num_experts_per_tok * fam.num_hidden_layers * g.record_stride / 1e6,
                    "arena_rows": arena,
                    "tok_s": [],
                    "tokens_equal_resident": True,
                }
            )
            print(f"e{b}: ppl {ppl:.3f} ± {se:.3f}", file=sys.stderr)
            kl(f"experts {m.experts.codec}, PLE {m.codecs['ple']}", resident, data)
        ple_rows = []
        for w in ple_widths:
            m = admit(ple_arts[w])
            model, tok = load(ple_arts[w])
            data = PPL.load_data(tok, PPL.DEFAULT_DATA, -1, a.ppl_seq_len, 123)
            ppl, se, n = PPL.perplexity(model, data, batch_size=4)
            mb, row_bytes, page_bytes = ple_geometry(m)
            ple_rows.append(
                {
                    "ple_dtype": w,
                    "codec": m.codecs["ple"],
                    "ppl": ppl,
                    "ppl_se": se,
                    "store_mb": mb,
                    "row_bytes_per_token": row_bytes,
                    "page_bytes_per_token": page_bytes,
                }
            )
            print(f"ple {w}: ppl {ppl:.3f} ± {se:.3f}", file=sys.stderr)
            kl(f"experts {m.experts.codec}, PLE {m.codecs['ple']}", model, data)
        ref_ppl = PPL.perplexity(ref_model, data, batch_size=4)
        # Decode speed side by side: rounds interleave the widths (forward, then backward order),
        # each run a fresh cache over the model's warm-or-cold arena as the previous round left it.
        by = {r["expert_bits"]: r for r in rows}
        for rnd in range(a.rounds):
            for b in widths if rnd % 2 == 0 else widths[::-1]:
                got, dt = decode(streamed[b], ids, a.tokens)
                by[b]["tok_s"].append(a.tokens / dt)
                by[b]["tokens_equal_resident"] &= got == want[b]
        for r in rows:
            r["stream_tok_s"] = float(np.median(r["tok_s"]))
            r["stream_tok_s_range"] = [min(r["tok_s"]), max(r["tok_s"])]
        for model in streamed.values():
            model.streaming.close()
        proj = "skipped" if a.skip_projection else projection(widths, a.profile)
    finally:
        if a.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    base = next((r for r in rows if r["expert_bits"] == 4), rows[0])
    print(
        f"Demo geometry ({C.QWEN4EXP_DEMO.num_hidden_layers} layers x {C.QWEN4EXP_DEMO.num_experts} experts, "
        f"top-{C.QWEN4EXP_DEMO.num_experts_per_tok}), dense affine{a.q_bits}-g{a.group_size}, "
        f"held-out text {os.path.basename(PPL.DEFAULT_DATA)} ({rows[0]['ppl_tokens']} tokens scored), "
        f"streamed at {a.cache_fraction:.0%} of the expert records, {a.tokens} greedy tokens, median of {a.rounds} "
        f"interleaved runs (range); "
        f"simulator: {a.profile}, PROJECTION"
    )
    print()
    print(
        "| expert width | perplexity | expert store MB | expert MB/token (cold) | streamed tok/s | vs 4-bit "
        "| tokens = resident | M5 Pro 48 GB projected tok/s (default / best) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        pr = (
            proj
            if isinstance(proj, str)
            else (
                "n/a"
                if r["expert_bits"] not in proj
                else f"{proj[r['expert_bits']][0] or float('nan'):.1f} / {proj[r['expert_bits']][1]:.1f}"
            )
        )
        print(
            f"| {r['codec']} | {r['ppl']:.3f} ± {r['ppl_se']:.3f} | {r['store_mb']:.2f} | {r['mb_per_token']:.3f} "
            f"| {r['stream_tok_s']:.1f} ({r['stream_tok_s_range'][0]:.1f}–{r['stream_tok_s_range'][1]:.1f}) "
            f"| {r['stream_tok_s'] / base['stream_tok_s']:.2f}x "
            f"| {'yes' if r['tokens_equal_resident'] else 'NO'} | {pr} |"
        )
    print()
    print(
        f"Real geometry ({C.QWEN38_FLASH_NEXT.name}: {C.QWEN38_FLASH_NEXT.num_hidden_layers} layers x "
        f"{C.QWEN38_FLASH_NEXT.num_experts} experts, top-{C.QWEN38_FLASH_NEXT.num_experts_per_tok}), group {a.group_size}:"
    )
    print()
    print("| expert width | record MiB | expert store GB | MB/token (cold) |")
    print("|---|---|---|---|")
    real = real_geometry(widths, a.group_size)
    for r in real:
        print(
            f"| affine{r['expert_bits']}-g{a.group_size} | {r['record_mib']:.2f} | {r['store_gb']:.1f} | {r['mb_per_token']:.0f} |"
        )
    print()
    print(f"PLE row widths on the demo (dense affine{a.q_bits}-g{a.group_size}, experts affine4-g{a.group_size}):")
    print()
    print("| PLE width | perplexity | PLE store MB | PLE row bytes/token | PLE page bytes/token (cold) |")
    print("|---|---|---|---|---|")
    for r in ple_rows:
        print(
            f"| {r['codec']} | {r['ppl']:.3f} ± {r['ppl_se']:.3f} | {r['store_mb']:.2f} | {r['row_bytes_per_token']} "
            f"| {r['page_bytes_per_token']} |"
        )
    print()
    print(
        f"Next-token distributions vs the bf16 reference conversion (perplexity {ref_ppl[0]:.3f} ± {ref_ppl[1]:.3f}), "
        f"{kl_rows[0]['tokens']} tokens; ± analytic SE (mean, top-1), bootstrap SE (p99):"
    )
    print()
    print("| artifact | mean KL | p99 KL | same top-1 |")
    print("|---|---|---|---|")
    for r in kl_rows:
        print(
            f"| {r['artifact']} | {r['kl_mean']:.5f} ± {r['kl_mean_se']:.5f} | {r['kl_p99']:.4f} ± {r['kl_p99_se']:.4f} "
            f"| {100 * r['top1']:.2f}% ± {100 * r['top1_se']:.2f} |"
        )
    print()
    fam = C.QWEN38_FLASH_NEXT
    print(
        f"Real PLE table ({fam.name}: {fam.ple_rows[0]:,} rows x {fam.ple_width} values, {len(fam.ple_head_sizes(0))} "
        "rows per token; whole file incl. header, digest table, 64-byte page headers and page padding):"
    )
    print()
    print("| PLE width | group | row bytes | rows/page | pages | payload rows GB | store GB | row bytes/token |")
    print("|---|---|---|---|---|---|---|---|")
    real_p = real_ple(ple_widths)
    for r in real_p:
        print(
            f"| {r['codec']} | {r['group'] or '-'} | {r['row_bytes']} | {r['rows_per_page']} | {r['pages']:,} "
            f"| {r['payload_gb']:.2f} | {r['store_gb']:.2f} | {r['row_bytes_per_token']} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"demo": rows, "projection": proj, "real": real, "ple": ple_rows, "kl": kl_rows, "real_ple": real_p},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
