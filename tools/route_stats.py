"""Per-layer routing statistics of a Qwen4Exp HF checkpoint, with a random-init control.

    python tools/route_stats.py /work/demo_build/hf [--tokens 2048] [--json out.json]

Top-k expert IDs are captured from each layer's router with forward hooks on the transformers
reference model, over held-out text (the checkpoint's training_record.json names the held-out
files; --text overrides). Reported per layer:

- usage entropy of the expert-usage histogram, in bits, and as a fraction of log2(E);
- reuse: mean share of a token's top-k experts that the previous token also selected;
- union: mean size of the union of top-k sets over non-overlapping blocks of 2..5 tokens.

A model with the same config and fresh random weights is measured on the same tokens; its
numbers are the near-uniform control the trained routes must differ from.
"""

import argparse
import json
import math
import sys
from pathlib import Path

BLOCKS = (2, 3, 4, 5)


def capture_topk(model, windows) -> list:
    """Return, per MoE layer, an int tensor (windows, seq, k) of the router's selected expert IDs."""
    import torch

    layers = model.model.layers
    captured = [[] for _ in layers]
    handles = []
    for i, layer in enumerate(layers):
        # The router returns (logits, scores, indices); the indices are exactly what the experts run.
        def hook(_module, _inputs, output, i=i):
            captured[i].append(output[2].detach().clone())

        handles.append(layer.mlp.gate.register_forward_hook(hook))
    model.eval()
    try:
        with torch.no_grad():
            for w in windows:
                model(input_ids=w[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    seq = windows.shape[1]
    return [torch.stack([c.view(seq, -1) for c in per_layer]) for per_layer in captured]


def layer_stats(topk, num_experts: int) -> dict:
    """Statistics of one layer's selections `topk` of shape (windows, seq, k)."""
    import torch

    n_win, seq, k = topk.shape
    counts = torch.bincount(topk.reshape(-1), minlength=num_experts).double()
    p = counts / counts.sum()
    nz = p[p > 0]
    entropy = float(-(nz * nz.log2()).sum())

    onehot = torch.zeros(n_win, seq, num_experts, dtype=torch.bool)
    onehot.scatter_(-1, topk.long(), True)
    shared = (onehot[:, 1:] & onehot[:, :-1]).sum(-1).double()  # within a window only
    reuse = float(shared.mean() / k)

    union = {}
    for b in BLOCKS:
        nb = seq // b
        blocks = onehot[:, : nb * b].reshape(n_win, nb, b, num_experts).any(2)
        union[b] = float(blocks.sum(-1).double().mean())
    return {
        "entropy_bits": entropy,
        "entropy_fraction": entropy / math.log2(num_experts),
        "used_experts": int((counts > 0).sum()),
        "max_share": float(p.max()),
        "reuse": reuse,
        "union": union,
    }


def uniform_expectations(num_experts: int, k: int) -> dict:
    """What independent uniformly random top-k sets would give."""
    return {
        "entropy_bits": math.log2(num_experts),
        "reuse": k / num_experts,
        "union": {b: num_experts * (1 - (1 - k / num_experts) ** b) for b in BLOCKS},
    }


def heldout_windows(ckpt: Path, tok, n_tokens: int, seq_len: int, text_path):
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import train_demo

    if text_path is not None:
        files = [Path(text_path)]
        source = str(text_path)
    else:
        record_path = ckpt / "training_record.json"
        if not record_path.is_file():
            raise FileNotFoundError(f"{record_path}: needed to find the held-out files (or pass --text)")
        record = json.loads(record_path.read_text(encoding="utf-8"))
        files = [Path(record["corpus"]) / name for name in record["heldout_files"]]
        source = f"held-out files of {record_path.name} ({len(files)} files)"
    stream = train_demo.encode_stream(tok, files)
    windows = train_demo.make_windows(stream, seq_len)
    n = max(1, min(windows.shape[0], n_tokens // seq_len))
    # Evenly spaced windows so the sample spans every held-out file, not just the first.
    idx = torch.linspace(0, windows.shape[0] - 1, n).round().long()
    return windows[idx], source


def format_markdown(trained: list, control: list, uniform: dict, meta: dict) -> str:
    lines = [
        f"Tokens: {meta['tokens']} ({meta['windows']} windows of {meta['seq_len']}) from {meta['source']}. "
        f"E = {meta['num_experts']}, k = {meta['k']}; uniform maximum entropy log2(E) = {uniform['entropy_bits']:.3f} bits; "
        f"independent uniform top-k would give reuse {uniform['reuse']:.3f} and union "
        + ", ".join(f"{b}: {uniform['union'][b]:.2f}" for b in BLOCKS)
        + ".",
        "",
        "| layer | type | model | entropy bits (of max) | experts used | top share | reuse prev | union 2 | union 3 | union 4 | union 5 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (t, c) in enumerate(zip(trained, control)):
        for name, s in (("trained", t), ("random init", c)):
            lines.append(
                f"| {i} | {meta['layer_types'][i]} | {name} | {s['entropy_bits']:.3f} ({s['entropy_fraction']:.3f}) "
                f"| {s['used_experts']} | {s['max_share']:.3f} | {s['reuse']:.3f} | "
                + " | ".join(f"{s['union'][b]:.2f}" for b in BLOCKS)
                + " |"
            )

    def mean(rows, key, b=None):
        vals = [r[key][b] if b else r[key] for r in rows]
        return sum(vals) / len(vals)

    lines.append("")
    for name, rows in (("trained", trained), ("random init", control)):
        lines.append(
            f"- {name}, mean over layers: entropy {mean(rows, 'entropy_fraction'):.3f} of max, "
            f"reuse {mean(rows, 'reuse'):.3f}, union " + ", ".join(f"{b}: {mean(rows, 'union', b):.2f}" for b in BLOCKS)
        )
    return "\n".join(lines) + "\n"


def route_summary(trained: list, control: list, uniform: dict) -> str:
    """One data-derived sentence per property, so the prose never claims more than the tables show."""
    n = len(trained)
    lower_h = sum(t["entropy_bits"] < c["entropy_bits"] for t, c in zip(trained, control))
    more_reuse = sum(t["reuse"] > c["reuse"] for t, c in zip(trained, control))
    smaller_u5 = sum(t["union"][5] < c["union"][5] for t, c in zip(trained, control))
    return (
        f"Trained vs random-init control, same tokens: usage entropy lower on {lower_h}/{n} layers, "
        f"previous-token reuse higher on {more_reuse}/{n} layers, 5-token union smaller on {smaller_u5}/{n} layers. "
        f"The control's reuse sits above the independent-uniform k/E = {uniform['reuse']:.3f} because a repeated "
        "token routes identically even with random weights.\n"
    )


def render_training_md(record: dict, route_md: str, config: dict) -> str:
    """TRAINING.md: the build's provenance and results, from training_record.json plus the route tables."""
    d, b = record["dims"], record["budget"]
    ppl = math.exp(record["final_heldout_loss"])
    uni = record["unigram_heldout_subset"]
    mins = record["train_seconds"] / 60
    held = ", ".join(record["heldout_files"])
    eff, phys = record["effective_vocab"], record["physical_vocab"]
    ple = ", ".join(str(i) for i in d["ple_layer_ids"])
    pattern = " ".join("A" if t == "indexed_attention" else "L" for t in config["layer_types"])
    return f"""# Demo model: training record

A small Qwen4Exp text model (`Qwen4ExpForCausalLM`, transformers {record["transformers"]}) trained on the
CPython standard library (`{Path(record["corpus"]).name}`) so `hebrus-mlx generate --model demo` has trained routes.
Built by `tools/train_demo.py`; routing tables by `tools/route_stats.py`. Reproduce:

```
nice python tools/train_demo.py --out /work/demo_build/hf --record-dir hebrus_mlx/demo \\
    --steps {record["steps"]} --seed {record["seed"]} --threads {record["threads"]}
python tools/route_stats.py /work/demo_build/hf --training-md hebrus_mlx/demo/TRAINING.md
```

## Architecture (every Qwen4Exp feature on)

| field | value |
|---|---|
| layers | {len(config["layer_types"])}: `{pattern}` (L = Gated DeltaNet, A = QSA indexed attention) |
| hidden / hyper-connection streams / hc_lowrank | {d["hidden_size"]} / {d["hc_count"]} / {d["hc_lowrank"]} |
| attention | {d["num_attention_heads"]} heads x {d["head_dim"]}, {d["num_key_value_heads"]} KV head, partial rotary {d["partial_rotary_factor"]} (mrope_section {config["rope_parameters"]["mrope_section"]}) |
| QSA indexer | {d["indexer_n_heads"]} heads x {d["indexer_head_dim"]}, 1 key head, budget {d["indexer_budget"]} tokens, compress ratio {d["indexer_compress_ratio"]} |
| Gated DeltaNet | {d["linear_num_key_heads"]} key heads x {d["linear_key_head_dim"]}, {d["linear_num_value_heads"]} value heads x {d["linear_value_head_dim"]} |
| MoE | {d["num_experts"]} routed experts, top-{d["num_experts_per_tok"]}, moe_intermediate {d["moe_intermediate_size"]}, shared expert {d["shared_expert_intermediate_size"]} |
| PLE | layers {ple} (one-indexed, linear), 3-gram, {d["heads_per_ngram"]} heads per n-gram, ngram_vocab_size_base {d["ngram_vocab_size_base"]}, split_ngram_parts {d["split_ngram_parts"]} |
| vocabulary | effective {eff} ({d["bpe_vocab"]} BPE + 9 specials), lm_head / embedding physical rows {phys} |
| eos_token_id | {config["eos_token_id"]} (`<|endoftext|>`, `<|im_end|>`; PLE uses the first as its segment boundary) |

Parameters: {b["total_params"]:,} total = {b["routed_expert_params"]:,} routed-expert + {b["other_params"]:,} other
(~{b["active_params_per_token_approx"]:,} active per token). Estimated shipped size with 4-bit affine group-64
routed experts and fp16 everything else: {b["routed_bytes_4bit"] / 1e6:.2f} MB + {b["other_bytes_fp16"] / 1e6:.2f} MB =
{b["estimated_artifact_bytes"] / 1e6:.2f} MB (budget 20 MB).

## Corpus and split

- Text: the `*.py` files at the top level of `{record["corpus"]}` ({len(record["train_files"]) + len(record["heldout_files"])} files).
- Licence: {record["corpus_license"]}.
- Split by file before windowing: sorted names shuffled with `random.Random(seed={record["seed"]})`, {len(record["heldout_files"])} files held out:
  {held}.
- Each file is NFC-normalised, tokenised and followed by `<|endoftext|>`; the streams are cut into
  non-overlapping {record["seq_len"]}-token windows: {record["train_tokens"]:,} train tokens ({record["train_windows"]} windows),
  {record["heldout_tokens"]:,} held-out tokens ({record["heldout_windows"]} windows).

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training files only: {d["bpe_vocab"]} ranks (256-byte alphabet
plus merges, min frequency 2), NFC normaliser, Qwen2-style split regex, then the nine Qwen special
tokens appended as ids {d["bpe_vocab"]}..{eff - 1}. Chat template: {record["chat_template_source"]}.
`generation_config.json` stops on {config["eos_token_id"]}.

## Training

fp32 on CPU, torch {record["torch"]}, {record["threads"]} threads, `torch.use_deterministic_algorithms(True)`, seed {record["seed"]}
(init, batch order). AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), peak lr {record["lr"]}, {record["warmup"]}-step
linear warmup then cosine to 10%, gradient clip 1.0, batch {record["batch"]} x {record["seq_len"]} tokens, {record["steps"]} steps
({record["steps"] * record["batch"] * record["seq_len"]:,} tokens, {record["steps"] * record["batch"] / record["train_windows"]:.2f} epochs),
router load-balancing loss coefficient {config["router_aux_loss_coef"]} (the config default).
Wall time: {mins:.1f} min training, {record["total_seconds"] / 60:.1f} min for the whole script, on a shared 2-core machine.

![loss curve](loss_curve.png)

| measure | nats/token | perplexity |
|---|---|---|
| train loss, mean of last 20 steps | {record["final_train_loss_last20"]:.3f} | {math.exp(record["final_train_loss_last20"]):.1f} |
| train windows, final model (same number of evenly spaced train windows) | {record["final_train_eval_loss"]:.3f} | {math.exp(record["final_train_eval_loss"]):.1f} |
| held-out, final model ({record["final_heldout_tokens"]:,} predicted tokens) | {record["final_heldout_loss"]:.3f} | {ppl:.1f} |
| unigram baseline, same held-out tokens (add-one, train counts) | {uni:.3f} | {math.exp(uni):.1f} |
| unigram baseline, whole held-out stream | {record["unigram_heldout_full"]:.3f} | {math.exp(record["unigram_heldout_full"]):.1f} |

Held-out perplexity is {math.exp(uni) / ppl:.1f}x lower than the unigram baseline.

Greedy continuation (reference model, unassigned lm_head rows suppressed) of a held-out prompt from
`{record["prompt_file"]}`:

```python
{record["prompt"]}
```

continues as:

```python
{record["continuation"]}
```

## Routing statistics

{route_md}
## Known limits

- The QSA indexer (`index_qk_proj`, its q/k norms) gets no gradient from the language-model loss: block
  selection is a hard top-k, so the reference graph has no path from the loss to the indexer. Its
  weights stay at their seeded initialisation; selection is still exercised (prompts longer than
  {d["indexer_budget"]} tokens attend to a {d["indexer_budget"]}-token subset plus the incomplete tail block) and is deterministic,
  but it is not a learned selection.
- A 16M-parameter model trained for under an hour: the text is corpus-like, not correct Python.
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--text", type=Path, default=None, help="measure this file instead of the held-out files")
    p.add_argument("--control-seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--training-md", type=Path, default=None, help="also write TRAINING.md with these tables")
    args = p.parse_args(argv)
    if args.tokens <= 0 or args.seq_len <= 0:
        raise ValueError(f"--tokens={args.tokens} and --seq-len={args.seq_len} must be positive")
    if not (args.checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint={args.checkpoint}: no config.json")

    import torch
    from tokenizers import Tokenizer
    from transformers.models.qwen4_exp import Qwen4ExpForCausalLM

    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    windows, source = heldout_windows(args.checkpoint, tok, args.tokens, args.seq_len, args.text)

    model = Qwen4ExpForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    cfg = model.config
    torch.manual_seed(args.control_seed)
    control_model = Qwen4ExpForCausalLM(cfg).float()

    E, k = cfg.num_experts, cfg.num_experts_per_tok
    trained = [layer_stats(t, E) for t in capture_topk(model, windows)]
    control = [layer_stats(t, E) for t in capture_topk(control_model, windows)]
    uniform = uniform_expectations(E, k)
    meta = {
        "tokens": int(windows.numel()),
        "windows": int(windows.shape[0]),
        "seq_len": int(windows.shape[1]),
        "source": source,
        "num_experts": E,
        "k": k,
        "layer_types": list(cfg.layer_types),
        "control_seed": args.control_seed,
    }
    route_md = format_markdown(trained, control, uniform, meta) + "\n" + route_summary(trained, control, uniform)
    print(route_md, end="")
    if args.training_md is not None:
        record = json.loads((args.checkpoint / "training_record.json").read_text(encoding="utf-8"))
        config = json.loads((args.checkpoint / "config.json").read_text(encoding="utf-8"))
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from train_demo import write_file_atomic

        write_file_atomic(args.training_md, render_training_md(record, route_md, config).encode("utf-8"))
    if args.json is not None:
        args.json.write_text(
            json.dumps({"meta": meta, "uniform": uniform, "trained": trained, "control": control}, indent=1) + "\n",
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
