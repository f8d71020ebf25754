"""Build the embedded demo model: a small Qwen4Exp trained on the CPython standard library.

The reference implementation (transformers ``Qwen4ExpForCausalLM``, torch, fp32 on CPU) does
the training because torch's CPU matmul is far faster here than MLX's CPU backend; parity with
the MLX graph is proved afterwards on the saved checkpoint.

    nice python tools/train_demo.py --out /work/demo_build/hf --record-dir hebrus_mlx/demo

Every random choice (file split, tokenizer data order, init, batch order) derives from --seed,
so two runs with the same arguments and thread count write identical weights.
"""

import argparse
import io
import json
import math
import os
import random
import sys
import tempfile
import time
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_CORPUS = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
CORPUS_LICENSE = "PSF License Agreement for Python (Python Software Foundation License, version 2)"

# Qwen special tokens, appended after the BPE ranks in this order (ids = bpe_vocab + index).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Qwen2-family pre-tokenizer split: contractions, letter runs with one leading non-letter,
# single digits, punctuation runs, newlines, then whitespace.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

QUANT_GROUP = 64
QUANT_BITS = 4


@dataclass(frozen=True)
class DemoDims:
    """The architecture knobs; everything else in the config follows from these."""

    bpe_vocab: int = 4096
    hidden_size: int = 128
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 64
    partial_rotary_factor: float = 0.25
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    num_experts: int = 64
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 128
    hc_count: int = 4
    hc_lowrank: int = 32
    ple_layer_ids: tuple = (1, 5)
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 2048
    split_ngram_parts: int = 4
    indexer_n_heads: int = 4
    indexer_head_dim: int = 32
    indexer_budget: int = 64
    indexer_compress_ratio: int = 8
    spare_rows: int = 0


# DemoDims knobs that are not config fields of the same name (build_config derives those fields).
DERIVED_KNOBS = ("bpe_vocab", "partial_rotary_factor", "spare_rows", "ple_layer_ids")


def validate_dims(dims: DemoDims) -> None:
    """Reject shapes the 4-bit group-64 conversion or the demo contract cannot hold, before allocating."""
    for name in ("hidden_size", "moe_intermediate_size"):
        value = getattr(dims, name)
        if value <= 0 or value % QUANT_GROUP:
            raise ValueError(f"{name}={value} must be a positive multiple of {QUANT_GROUP} (quantization group)")
    if dims.num_hidden_layers < 8 or dims.num_hidden_layers % 4:
        raise ValueError(f"num_hidden_layers={dims.num_hidden_layers} must be a multiple of 4 and >= 8 (3:1 pattern)")
    if dims.num_experts < 64:
        raise ValueError(f"num_experts={dims.num_experts} must be >= 64")
    if not 4 <= dims.num_experts_per_tok <= dims.num_experts:
        raise ValueError(f"num_experts_per_tok={dims.num_experts_per_tok} must be in [4, num_experts]")
    if dims.bpe_vocab <= 256:
        raise ValueError(f"bpe_vocab={dims.bpe_vocab} must exceed the 256-byte alphabet")
    for layer_id in dims.ple_layer_ids:
        if not 1 <= layer_id <= dims.num_hidden_layers or layer_id % 4 == 0:
            raise ValueError(f"ple_layer_ids entry {layer_id} must be a one-indexed linear_attention layer")


def effective_vocab(dims: DemoDims) -> int:
    return dims.bpe_vocab + len(SPECIAL_TOKENS)


def physical_vocab(dims: DemoDims) -> int:
    # Pad like the real lm_head (248,320 rows for 248,077 ids): round up to 128, plus spare rows.
    return math.ceil((effective_vocab(dims) + dims.spare_rows) / 128) * 128


def layer_types(num_layers: int) -> list:
    return ["indexed_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]


def build_config(dims: DemoDims):
    from transformers.models.qwen4_exp import Qwen4ExpTextConfig

    validate_dims(dims)
    eot = dims.bpe_vocab + SPECIAL_TOKENS.index("<|endoftext|>")
    im_end = dims.bpe_vocab + SPECIAL_TOKENS.index("<|im_end|>")
    rotary_dim = int(dims.head_dim * dims.partial_rotary_factor)
    half = rotary_dim // 2
    # mrope sections split the rotary frequency pairs T/H/W like the real [11, 11, 10] for 32 pairs.
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    # The knobs named like config fields pass through; the rest of the config follows from them.
    fields = {k: v for k, v in asdict(dims).items() if k not in DERIVED_KNOBS}
    return Qwen4ExpTextConfig(
        **fields,
        vocab_size=physical_vocab(dims),
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": dims.partial_rotary_factor,
            "mrope_section": mrope_section,
            "mrope_interleaved": True,
        },
        layer_types=layer_types(dims.num_hidden_layers),
        ple_layer_ids=list(dims.ple_layer_ids),
        indexer_kv_heads=1,
        eos_token_id=[eot, im_end],
        pad_token_id=eot,
        tie_word_embeddings=False,
        use_cache=True,
    )


def parameter_budget(model, dims: DemoDims) -> dict:
    """Count parameters by class and estimate the shipped size (4-bit routed experts, fp16 rest)."""
    routed = other = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            routed += p.numel()
        else:
            other += p.numel()
    # Affine 4-bit: packed weights plus one fp16 scale and one fp16 bias per group of 64.
    routed_bytes = routed * QUANT_BITS // 8 + (routed // QUANT_GROUP) * 2 * 2
    other_bytes = other * 2
    return {
        "routed_expert_params": routed,
        "other_params": other,
        "total_params": routed + other,
        "active_params_per_token_approx": other + routed * dims.num_experts_per_tok // dims.num_experts,
        "routed_bytes_4bit": routed_bytes,
        "other_bytes_fp16": other_bytes,
        "estimated_artifact_bytes": routed_bytes + other_bytes,
    }


# ---------------------------------------------------------------- corpus


def list_corpus(root: Path) -> list:
    files = sorted(p for p in Path(root).glob("*.py") if p.is_file())
    if not files:
        raise ValueError(f"corpus={root}: no *.py files found")
    return files


def split_files(files: list, heldout_fraction: float, seed: int) -> tuple:
    """Split by file before any windowing, so no held-out text leaks into training windows."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction={heldout_fraction} must be in (0, 1)")
    order = sorted(files, key=lambda p: p.name)
    random.Random(seed).shuffle(order)
    n_held = max(1, round(len(order) * heldout_fraction))
    return sorted(order[n_held:], key=lambda p: p.name), sorted(order[:n_held], key=lambda p: p.name)


def read_text(path: Path) -> str:
    return unicodedata.normalize("NFC", Path(path).read_text(encoding="utf-8", errors="replace"))


def train_tokenizer(files: list, bpe_vocab: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer, length=len(files))
    if tok.get_vocab_size() != bpe_vocab:
        raise ValueError(f"bpe_vocab={bpe_vocab}: corpus only supports {tok.get_vocab_size()} BPE tokens")
    tok.add_special_tokens(SPECIAL_TOKENS)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != bpe_vocab + i:
            raise RuntimeError(f"special token {s} landed at {tok.token_to_id(s)}, expected {bpe_vocab + i}")
    return tok


def encode_stream(tok, files: list):
    """One token stream: each file's tokens followed by <|endoftext|> (the PLE segment boundary)."""
    import torch

    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for f in files:
        ids.extend(tok.encode(read_text(f), add_special_tokens=False).ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def make_windows(stream, seq_len: int):
    n = stream.numel() // seq_len
    if n == 0:
        raise ValueError(f"seq_len={seq_len} exceeds the token stream length {stream.numel()}")
    return stream[: n * seq_len].view(n, seq_len)


# ---------------------------------------------------------------- training


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_order(n_windows: int, steps: int, batch: int, seed: int):
    """Deterministic epoch-wise shuffles of window indices, concatenated as needed."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    need = steps * batch
    chunks = []
    while sum(c.numel() for c in chunks) < need:
        chunks.append(torch.randperm(n_windows, generator=gen))
    return torch.cat(chunks)[:need].view(steps, batch)


def new_model(config, seed: int):
    import torch
    from transformers.models.qwen4_exp import Qwen4ExpForCausalLM

    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(config)
    return model.float()


def evaluate(model, windows, batch: int) -> tuple:
    """Mean next-token cross-entropy (nats) over all target positions of `windows`."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch):
            x = windows[i : i + batch]
            logits = model(input_ids=x, use_cache=False).logits[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += x[:, 1:].numel()
    model.train()
    return total / count, count


def train(model, windows, *, steps, batch, lr, warmup, seed, eval_windows=None, eval_every=0, log=print):
    import torch

    order = batch_order(windows.shape[0], steps, batch, seed)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    model.train()
    history = {"step": [], "loss": [], "aux": [], "eval_step": [], "eval_loss": [], "step_seconds": []}
    for step in range(steps):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        x = windows[order[step]]
        out = model(input_ids=x, labels=x, use_cache=False, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        lm_loss = out.loss.item() - model.router_aux_loss_coef * out.aux_loss.item()
        history["step"].append(step + 1)
        history["loss"].append(lm_loss)
        history["aux"].append(out.aux_loss.item())
        history["step_seconds"].append(dt)
        if eval_windows is not None and eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            ev, _ = evaluate(model, eval_windows, batch)
            history["eval_step"].append(step + 1)
            history["eval_loss"].append(ev)
            log(
                f"step {step + 1}/{steps} loss {lm_loss:.4f} aux {out.aux_loss.item():.3f} held-out {ev:.4f} ({dt:.2f}s/step)"
            )
        elif (step + 1) % 10 == 0 or step == 0:
            log(f"step {step + 1}/{steps} loss {lm_loss:.4f} aux {out.aux_loss.item():.3f} ({dt:.2f}s/step)")
    return history


def unigram_nll(train_stream, targets, vocab: int) -> float:
    """Add-one smoothed unigram cross-entropy (nats/token) of `targets`, counts from `train_stream`."""
    import torch

    counts = torch.bincount(train_stream, minlength=vocab)[:vocab].double() + 1.0
    logp = counts.log() - counts.sum().log()
    return -logp[targets].mean().item()


def greedy_continuation(model, tok, prompt_ids, new_tokens: int, effective: int) -> str:
    import torch

    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            # Unassigned physical rows must never be selected (AFN-005).
            suppress_tokens=list(range(effective, model.config.vocab_size)),
            eos_token_id=list(model.config.eos_token_id),
            pad_token_id=model.config.pad_token_id,
        )
    return tok.decode(out[0, len(prompt_ids) :].tolist(), skip_special_tokens=False)


# ---------------------------------------------------------------- output


def chat_template_text(repo_root: Path) -> tuple:
    shared = repo_root / "hebrus_mlx" / "text" / "templates" / "qwen_chat_template.jinja"
    if shared.is_file():
        return shared.read_text(encoding="utf-8"), str(shared.relative_to(repo_root))
    # Minimal Qwen-style template used only when the shared one does not exist yet.
    text = (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    return text, "minimal fallback in tools/train_demo.py"


def save_tokenizer(tok, out_dir: Path, dims: DemoDims, chat_template: str) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)
    (out_dir / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def write_generation_config(out_dir: Path, config) -> None:
    gen = {
        "do_sample": False,
        "eos_token_id": list(config.eos_token_id),
        "pad_token_id": config.pad_token_id,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")


def fsync_tree(path: Path) -> None:
    for root, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish_dir(tmp: Path, final: Path) -> None:
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    fsync_tree(tmp)
    os.rename(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    from hebrus_mlx.artifact.atomic import publish_file  # temp + fsync + rename + directory fsync

    path.parent.mkdir(parents=True, exist_ok=True)
    publish_file(path, lambda w: w.write(data))


def plot_losses(history: dict, unigram: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps, loss = history["step"], history["loss"]
    k = 20
    smooth = [sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))]
    ax.plot(steps, loss, color="0.8", lw=0.8, label="train (per step)")
    ax.plot(steps, smooth, color="C0", lw=1.5, label=f"train ({k}-step mean)")
    ax.plot(history["eval_step"], history["eval_loss"], "o-", color="C1", ms=3, label="held-out")
    ax.axhline(unigram, color="C3", ls="--", lw=1, label="unigram baseline (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("hebrus-mlx demo model: Qwen4Exp on CPython stdlib")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_file_atomic(path, buf.getvalue())


# ---------------------------------------------------------------- main


def training_flags(p, steps: int, batch: int, warmup: int, seq_len: int, seq_len_help: str | None = None):
    """The flags the model's and the MTP head's training share, with each one's defaults."""
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq-len", type=int, default=seq_len, help=seq_len_help)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--heldout-fraction", type=float, default=0.1)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="HF checkpoint directory to create (must not exist)")
    p.add_argument("--record-dir", type=Path, default=None, help="where TRAINING.md and loss_curve.png go")
    training_flags(p, steps=600, batch=8, warmup=40, seq_len=256)
    p.add_argument("--eval-windows", type=int, default=16, help="held-out windows for the periodic curve")
    p.add_argument("--final-eval-windows", type=int, default=96)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--probe", type=int, default=0, help="time this many steps, print, and exit")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq_len", "threads"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    if not args.probe and args.out.exists():
        raise FileExistsError(f"--out={args.out} already exists; refusing to replace a published checkpoint")
    return args


def main(argv=None, dims=None):
    """`dims` lets tests build a miniature model through the same path; the CLI always uses DemoDims()."""
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    dims = DemoDims() if dims is None else dims
    config = build_config(dims)
    t_start = time.time()

    files = list_corpus(args.corpus)
    train_files, held_files = split_files(files, args.heldout_fraction, args.seed)
    tok = train_tokenizer(train_files, dims.bpe_vocab)
    train_stream = encode_stream(tok, train_files)
    held_stream = encode_stream(tok, held_files)
    train_w = make_windows(train_stream, args.seq_len)
    held_w = make_windows(held_stream, args.seq_len)
    print(
        f"corpus: {len(files)} files ({len(train_files)} train / {len(held_files)} held-out); "
        f"tokens {train_stream.numel()} / {held_stream.numel()}; windows {train_w.shape[0]} / {held_w.shape[0]}"
    )

    model = new_model(config, args.seed)
    budget = parameter_budget(model, dims)
    print("parameter budget:", json.dumps(budget, indent=2))
    print(f"experts implementation: {model.config._experts_implementation}")

    # Held-out subsets are evenly spaced over the held-out stream so every held-out file can contribute.
    def spaced(n):
        n = min(n, held_w.shape[0])
        idx = torch.linspace(0, held_w.shape[0] - 1, n).round().long()
        return held_w[idx]

    if args.probe:
        hist = train(model, train_w, steps=args.probe, batch=args.batch, lr=args.lr, warmup=args.warmup, seed=args.seed)
        t = hist["step_seconds"]
        print(f"probe: {args.probe} steps, per-step seconds {[round(s, 2) for s in t]}")
        t0 = time.perf_counter()
        evaluate(model, spaced(args.eval_windows), args.batch)
        print(f"probe: eval of {args.eval_windows} windows {time.perf_counter() - t0:.1f}s")
        return 0

    t_train = time.time()
    history = train(
        model,
        train_w,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        warmup=args.warmup,
        seed=args.seed,
        eval_windows=spaced(args.eval_windows),
        eval_every=args.eval_every,
    )
    train_seconds = time.time() - t_train

    final_eval = spaced(args.final_eval_windows)
    held_loss, held_count = evaluate(model, final_eval, args.batch)
    train_eval_loss, _ = evaluate(
        model, train_w[torch.linspace(0, train_w.shape[0] - 1, args.final_eval_windows).round().long()], args.batch
    )
    eff = effective_vocab(dims)
    uni_subset = unigram_nll(train_stream, final_eval[:, 1:].reshape(-1), eff)
    uni_full = unigram_nll(train_stream, held_stream, eff)

    # Greedy continuation of a held-out prompt: the start of the first held-out file's first "def"
    # (or that file's opening text when no held-out file has one).
    prompt_text, prompt_file = read_text(held_files[0])[:160], held_files[0].name
    for f in held_files:
        text = read_text(f)
        at = text.find("\ndef ")
        if at >= 0:
            prompt_text, prompt_file = text[at + 1 : at + 1 + 160], f.name
            break
    prompt_ids = tok.encode(prompt_text, add_special_tokens=False).ids
    continuation = greedy_continuation(model, tok, prompt_ids, 80, eff)

    out_final = args.out
    out_final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_final.parent, prefix=f".{out_final.name}."))
    model.save_pretrained(tmp)
    template, template_src = chat_template_text(Path(__file__).resolve().parents[1])
    save_tokenizer(tok, tmp, dims, template)
    write_generation_config(tmp, config)
    record = {
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup": args.warmup,
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "dims": asdict(dims),
        "effective_vocab": eff,
        "physical_vocab": physical_vocab(dims),
        "budget": budget,
        "corpus": str(args.corpus),
        "corpus_license": CORPUS_LICENSE,
        "train_files": [f.name for f in train_files],
        "heldout_files": [f.name for f in held_files],
        "train_tokens": train_stream.numel(),
        "heldout_tokens": held_stream.numel(),
        "train_windows": train_w.shape[0],
        "heldout_windows": held_w.shape[0],
        "train_seconds": train_seconds,
        "total_seconds": time.time() - t_start,
        "final_train_loss_last20": sum(history["loss"][-20:]) / len(history["loss"][-20:]),
        "final_train_eval_loss": train_eval_loss,
        "final_heldout_loss": held_loss,
        "final_heldout_tokens": held_count,
        "unigram_heldout_subset": uni_subset,
        "unigram_heldout_full": uni_full,
        "prompt_file": prompt_file,
        "prompt": prompt_text,
        "continuation": continuation,
        "chat_template_source": template_src,
        "history": history,
    }
    (tmp / "training_record.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    publish_dir(tmp, out_final)
    print(f"saved {out_final}")

    from transformers.models.qwen4_exp import Qwen4ExpForCausalLM

    reloaded = Qwen4ExpForCausalLM.from_pretrained(out_final, dtype=torch.float32)
    x = final_eval[:2]
    with torch.no_grad():
        diff = (reloaded(input_ids=x, use_cache=False).logits - model(input_ids=x, use_cache=False).logits).abs().max()
    print(f"reload check: max |logit diff| = {diff.item():.3e}")
    if diff.item() > 1e-4:
        raise RuntimeError(f"reloaded checkpoint disagrees with the trained model (max diff {diff.item()})")

    if args.record_dir is not None:
        plot_losses(history, uni_full, args.record_dir / "loss_curve.png")
    print(
        json.dumps({k: v for k, v in record.items() if k not in ("history", "train_files", "heldout_files")}, indent=1)
    )
    return 0


# ---------------------------------------------------------------- MTP head
#
#     nice python tools/train_demo.py mtp --artifact hebrus_mlx/demo/model --publish
#
# Trains only the MTP head (MLX, fp32) with the shipped demo artifact as the frozen target: the
# head sees exactly the (quantized) target states it will draft from at run time. Pair t is
# (h_t, corpus token t+1); its label is the target's greedy token after consuming t+1 (the token a
# greedy verify accepts), so the loss is distillation onto the target's top-1. Same corpus split as
# the target (by file, --seed); windows evenly spaced over each split.


def mtp_parse_args(argv):
    p = argparse.ArgumentParser(prog="train_demo.py mtp", description="train the demo's MTP head (target frozen)")
    p.add_argument(
        "--artifact", type=Path, default=Path(__file__).resolve().parent.parent / "hebrus_mlx" / "demo" / "model"
    )
    training_flags(
        p,
        steps=160,
        batch=16,
        warmup=10,
        seq_len=64,
        seq_len_help="window length (<= the QSA window keeps prefill dense)",
    )
    p.add_argument("--train-windows", type=int, default=640)
    p.add_argument("--heldout-windows", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="write the trained head (HF mtp.* layout) here")
    p.add_argument("--publish", action="store_true", help="republish --artifact with the trained head (add_mtp)")
    args = p.parse_args(argv)
    for name in ("seq_len", "train_windows", "heldout_windows", "steps", "batch"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    return args


def _spaced_windows(ids, seq_len, n):
    import numpy as np

    total = len(ids) // seq_len
    if total == 0:
        raise ValueError(f"seq_len={seq_len} exceeds the token stream length {len(ids)}")
    pick = np.unique(np.linspace(0, total - 1, min(n, total)).round().astype(np.int64))
    return np.stack([ids[i * seq_len : (i + 1) * seq_len] for i in pick]).astype(np.int32)


def mtp_head_state(head):
    """Trained head -> HF `mtp.*` tensors in the released per-expert layout (numpy fp32)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    out = {}
    for name, value in tree_flatten(head.parameters()):
        value = np.array(value.astype(mx.float32))
        if ".switch_mlp." in name:
            comp = name.split(".switch_mlp.")[1].split(".")[0]
            for e in range(value.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.{comp}.weight"] = np.ascontiguousarray(value[e])
        else:
            out["mtp." + name] = value
    return out


def mtp_main(argv=None):
    args = mtp_parse_args(argv)
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from tokenizers import Tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from hebrus_mlx.loader import load_model
    from hebrus_mlx.models.mtp_head import MTPHead
    from hebrus_mlx.models.qwen4exp import Capture

    t_start = time.time()
    mx.random.seed(args.seed)
    target = load_model(args.artifact)
    target.freeze()
    tok = Tokenizer.from_file(str(args.artifact / "tokenizer.json"))
    vocab = tok.get_vocab_size()  # effective: unassigned lm_head rows are never a label
    eot = tok.token_to_id("<|endoftext|>")
    files = list_corpus(args.corpus)
    train_files, held_files = split_files(files, args.heldout_fraction, args.seed)

    def stream(fs):
        ids = []
        for f in fs:
            ids.extend(tok.encode(read_text(f), add_special_tokens=False).ids)
            ids.append(eot)
        return np.array(ids, dtype=np.int32)

    train_ids, held_ids = stream(train_files), stream(held_files)
    train_w = _spaced_windows(train_ids, args.seq_len, args.train_windows)
    held_w = _spaced_windows(held_ids, args.seq_len, args.heldout_windows)
    print(
        f"mtp corpus: {len(train_files)} train / {len(held_files)} held-out files; "
        f"windows {len(train_w)} / {len(held_w)} of {args.seq_len} tokens",
        flush=True,
    )

    def target_pass(windows):
        """Target final pre-mixer states h [N, L, W] and greedy labels [N, L] (frozen, once)."""
        hs, labels = [], []
        for i in range(0, len(windows), args.batch):
            cap = Capture()
            logits = target(mx.array(windows[i : i + args.batch]), capture=cap)
            lab = mx.argmax(logits[..., :vocab], axis=-1).astype(mx.int32)
            mx.eval(cap.hidden[-1], lab)
            hs.append(cap.hidden[-1])
            labels.append(lab)
        return mx.concatenate(hs), mx.concatenate(labels)

    t0 = time.time()
    train_h, train_lab = target_pass(train_w)
    held_h, held_lab = target_pass(held_w)
    t_target = time.time() - t0
    print(f"target states: {t_target:.0f} s", flush=True)
    train_x, held_x = mx.array(train_w), mx.array(held_w)

    embed, lm_head = target.model.embed_tokens, target.lm_head

    def head_logits(head, x, h):
        mixed, _ = head(embed(x[:, 1:]), h[:, :-1], head.make_cache())
        return lm_head(mixed)[..., :vocab]

    def loss_fn(head, x, h, lab):
        return nn.losses.cross_entropy(head_logits(head, x, h), lab[:, 1:]).mean()

    def accuracy(head):
        hits = total = 0
        for i in range(0, len(held_w), args.batch):
            x, h, lab = held_x[i : i + args.batch], held_h[i : i + args.batch], held_lab[i : i + args.batch]
            pred = mx.argmax(head_logits(head, x, h), axis=-1)
            hits += (pred == lab[:, 1:]).sum().item()
            total += pred.size
        return hits / total, total

    head = MTPHead(target.args)
    mx.eval(head.parameters())
    untrained_acc, n_pairs = accuracy(head)

    # Trivial baseline: the most frequent successor of token t+1 in the training stream.
    succ = np.zeros((vocab, vocab), dtype=np.int32)
    np.add.at(succ, (train_ids[:-1], train_ids[1:]), 1)
    bigram = succ.argmax(axis=1)
    held_np, lab_np = np.array(held_w), np.array(held_lab)
    bigram_acc = float((bigram[held_np[:, 1:]] == lab_np[:, 1:]).mean())

    opt = optim.AdamW(learning_rate=args.lr, betas=[0.9, 0.95], weight_decay=0.01)
    value_and_grad = nn.value_and_grad(head, loss_fn)
    order = np.random.default_rng(args.seed).permutation(np.resize(np.arange(len(train_w)), args.steps * args.batch))
    losses = []
    t0 = time.time()
    for step in range(args.steps):
        opt.learning_rate = lr_at(step, args.steps, args.lr, args.warmup)
        idx = mx.array(order[step * args.batch : (step + 1) * args.batch])
        loss, grads = value_and_grad(head, train_x[idx], train_h[idx], train_lab[idx])
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        losses.append(loss.item())
        if step % 20 == 0 or step == args.steps - 1:
            print(f"mtp step {step}: loss {losses[-1]:.3f} ({time.time() - t0:.0f} s)", flush=True)
    t_train = time.time() - t0
    head.eval()
    trained_acc, _ = accuracy(head)

    record = {
        "train_windows": len(train_w),
        "heldout_windows": len(held_w),
        "seq_len": args.seq_len,
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "seed": args.seed,
        "heldout_pairs": n_pairs,
        "heldout_top1_trained": trained_acc,
        "heldout_top1_untrained_init": untrained_acc,
        "heldout_top1_bigram_baseline": bigram_acc,
        "loss_first": losses[0],
        "loss_last20_mean": float(np.mean(losses[-20:])),
        "seconds_target_states": round(t_target, 1),
        "seconds_training": round(t_train, 1),
    }
    state = mtp_head_state(head)
    if args.out is not None or args.publish:
        from safetensors.numpy import save_file

        out = args.out or Path(tempfile.mkdtemp(prefix="mtp-head-"))
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "mtp.safetensors"))
        print(f"saved head: {out / 'mtp.safetensors'}")
        if args.publish:
            from hebrus_mlx.convert import add_mtp

            add_mtp(str(args.artifact), str(out), quiet=True)
            print(f"published {args.artifact} with its MTP head")
            # The shipped head is quantized with the artifact's codecs: measure that one too.
            record["heldout_top1_shipped"] = accuracy(load_model(args.artifact).mtp_head)[0]
    record["seconds_total"] = round(time.time() - t_start, 1)
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "mtp":
        sys.exit(mtp_main(sys.argv[2:]))
    sys.exit(main())
