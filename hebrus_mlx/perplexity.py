"""`hebrus-mlx perplexity`: perplexity of a model on held-out text, resident or streamed.

mlx_lm.perplexity's flags and semantics (`--model --data-path --sequence-length --num-samples
--batch-size --seed`): documents are shuffled with the seed, their tokens concatenated and cut
into `num_samples` rows of `sequence_length` tokens; each row predicts its tokens 2..L from the
ones before; the result is exp(mean token loss) with the delta-method standard error.

What differs: `--data-path` is a local file (`.txt`: documents separated by two blank lines;
`.jsonl`: one {"text": ...} object per line), by default the held-out text shipped for the demo
(hebrus_mlx/demo/heldout.txt, written for the purpose). A streamed model (`--expert-cache-gb`,
`--ple-cache-gb`, as generate) runs each row in chunks of at most the tokens its expert arena can
pin at once (the same chunks generate's prefill takes); `perplexity()` takes `chunk` so a resident
run can use the very same chunks (their results are then bitwise equal, tests/test_perplexity.py).

`--kl-divergence REF` (as llama.cpp's): the model's next-token distributions against those of a
reference model REF (an artifact or "demo") on the same rows: KL(P_ref || P_model) per predicted
token, its mean and 99th percentile, and how often both models' top-1 tokens agree.
"""

import math
from pathlib import Path

import numpy as np

from .artifact import untrusted
from .errors import UsageError

DEFAULT_DATA = Path(__file__).resolve().parent / "demo" / "heldout.txt"
MAX_DATA_BYTES = 1 << 30  # a held-out set, not a corpus: refuse anything larger before reading it


def read_documents(path) -> list:
    """The documents of a local .txt (separated by two blank lines) or .jsonl ({"text": str} per line)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError("--data-path", f"{path}: not a file (a local .txt or .jsonl)")
    if p.suffix not in (".txt", ".jsonl"):
        raise UsageError("--data-path", f"{path}: expected a .txt or .jsonl file")
    if p.stat().st_size > MAX_DATA_BYTES:
        raise UsageError("--data-path", f"{path}: larger than {MAX_DATA_BYTES >> 20} MiB")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError("--data-path", f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    if p.suffix == ".txt":
        docs = [d.strip("\n") for d in text.replace("\r\n", "\n").split("\n\n\n")]
        # Two blank lines (PEP 8 between top-level blocks) separate documents; one stays inside.
        docs = [d for d in docs if d.strip()]
    else:
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:  # strict and bounded: nesting capped, no lone surrogates the tokenizer cannot encode
                obj = untrusted.loads(line, f"{path}:{n}", root="")
            except untrusted.UntrustedFileError as e:
                where = f"{path}:{n}" + (f": {e.field}" if e.field != f"{path}:{n}" else "")
                raise UsageError("--data-path", f"{where}: {e.message}") from None
            if type(obj) is not dict or type(obj.get("text")) is not str:
                raise UsageError("--data-path", f"{path}:{n}: expected an object with a string 'text'")
            docs.append(obj["text"])
    if not docs:
        raise UsageError("--data-path", f"{path}: no text")
    return docs


def load_data(tokenizer, data_path, num_samples: int, sequence_length: int, seed: int) -> np.ndarray:
    """[rows, sequence_length] token ids: documents in a seeded random order, concatenated, cut
    into whole rows, the first `num_samples` (-1: all) kept."""
    docs = read_documents(data_path)
    order = np.random.default_rng(seed).permutation(len(docs))
    want = sequence_length * num_samples if num_samples > 0 else None
    tokens = []
    for i in order:
        tokens.extend(tokenizer.encode(docs[i]))
        if want is not None and len(tokens) >= want:
            break
    rows = len(tokens) // sequence_length
    if rows == 0:
        raise UsageError("--sequence-length", f"{sequence_length} tokens, but {data_path} holds only {len(tokens)}")
    data = np.array(tokens[: rows * sequence_length], dtype=np.int32).reshape(rows, sequence_length)
    return data if num_samples < 0 else data[:num_samples]


def token_losses(model, data: np.ndarray, batch_size: int = 8, chunk: int | None = None, progress=None):
    """Cross-entropy of every predicted token, float32 [rows * (L - 1)]. `chunk`: tokens per row
    per forward (a fresh cache per batch carries the rows across chunks); None: whole rows."""
    import mlx.core as mx
    import mlx.nn as nn

    out = []
    batches = range(0, len(data), batch_size)
    for b, s in enumerate(batches):
        batch = mx.array(data[s : s + batch_size])
        inputs, targets = batch[:, :-1], batch[:, 1:]
        n = inputs.shape[1]
        step = n if chunk is None else chunk
        cache = model.make_cache() if step < n else None
        parts = []
        for i in range(0, n, step):
            logits = model(inputs[:, i : i + step], cache).astype(mx.float32)
            parts.append(nn.losses.cross_entropy(logits, targets[:, i : i + step], reduction="none"))
            mx.eval(parts[-1])
        out.append(np.array(mx.concatenate(parts, axis=1)).reshape(-1))  # rows, then positions
        if progress is not None:
            progress(b + 1, len(batches))
    return np.concatenate(out)


def perplexity(model, data: np.ndarray, batch_size: int = 8, chunk: int | None = None, progress=None):
    """(perplexity, its standard error, tokens scored), as mlx_lm.perplexity.eval_ppl computes them."""
    losses = token_losses(model, data, batch_size, chunk, progress).astype(np.float64)
    mean = float(losses.mean())
    ppl = math.exp(mean)
    se = float(losses.std(ddof=1)) / math.sqrt(losses.size) if losses.size > 1 else float("nan")
    return ppl, ppl * se, int(losses.size)


KL_BOOTSTRAP = 200  # resamples for the p99's standard error


def kl_divergence(model, ref, data: np.ndarray, batch_size: int = 8, chunk: int | None = None, seed: int = 0):
    """KL(P_ref || P_model) of every predicted token of `data` and the top-1 agreement: {"kl_mean",
    "kl_mean_se", "kl_p99", "kl_p99_se", "top1", "top1_se", "tokens"}. Standard errors treat the
    tokens as independent: analytic for the mean (s / sqrt(n)) and the agreement (binomial), a
    seeded bootstrap of KL_BOOTSTRAP resamples for the p99. Each forward is reduced to per-token
    numbers at once, so a large vocabulary never holds more than one chunk's logits."""
    import mlx.core as mx

    kls, agree = [], []
    for s in range(0, len(data), batch_size):
        inputs = mx.array(data[s : s + batch_size, :-1])
        n = inputs.shape[1]
        step = n if chunk is None else chunk
        caches = (model.make_cache(), ref.make_cache()) if step < n else (None, None)
        for i in range(0, n, step):
            x = inputs[:, i : i + step]
            lq = model(x, caches[0]).astype(mx.float32)
            lp = ref(x, caches[1]).astype(mx.float32)
            lq, lp = lq - mx.logsumexp(lq, -1, keepdims=True), lp - mx.logsumexp(lp, -1, keepdims=True)
            kl = (mx.exp(lp) * (lp - lq)).sum(-1)
            same = mx.argmax(lp, -1) == mx.argmax(lq, -1)
            mx.eval(kl, same)
            kls.append(np.array(kl).reshape(-1))
            agree.append(np.array(same).reshape(-1))
    kl, agree = np.concatenate(kls).astype(np.float64), np.concatenate(agree).astype(np.float64)
    n = kl.size
    boot = np.random.default_rng(seed).integers(0, n, (KL_BOOTSTRAP, n))
    p99 = np.percentile(kl[boot], 99, axis=1)
    top1 = float(agree.mean())
    return {
        "kl_mean": float(kl.mean()),
        "kl_mean_se": float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
        "kl_p99": float(np.percentile(kl, 99)),
        "kl_p99_se": float(p99.std(ddof=1)),
        "top1": top1,
        "top1_se": math.sqrt(top1 * (1 - top1) / n),
        "tokens": n,
    }


def check_reference(model, tokenizer, ref, ref_tokenizer, data_path):
    """REF must score the same token ids: same vocabulary size and the same ids for the text."""
    got, want = ref.args.vocab_size, model.args.vocab_size
    if got != want:
        raise UsageError("--kl-divergence", f"the reference's vocabulary has {got} tokens, the model's {want}")
    for doc in read_documents(data_path):
        if ref_tokenizer.encode(doc) != tokenizer.encode(doc):
            raise UsageError("--kl-divergence", "the reference's tokenizer gives other token ids for the text")


def stream_chunk(model, batch_size: int) -> (int | None, int):
    """(tokens per row per forward, rows per forward) a model takes: a streamed model pins every
    expert one forward routes to, so batch x chunk stays within its arena (max_chunk_tokens)."""
    streaming = getattr(model, "streaming", None)
    cap = None if streaming is None else streaming.max_chunk_tokens
    if cap is None:
        return None, batch_size
    rows = max(1, min(batch_size, cap))
    return max(1, cap // rows), rows
