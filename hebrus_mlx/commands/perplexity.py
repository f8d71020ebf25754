"""`hebrus-mlx perplexity` (like mlx_lm.perplexity): the verb's command line over
hebrus_mlx/perplexity.py (perplexity and `--kl-divergence` of a model on held-out text)."""

import sys
import time

from .. import flags
from ..errors import HebrusError, UsageError
from ..perplexity import (
    DEFAULT_DATA,
    KL_BOOTSTRAP,
    check_reference,
    kl_divergence,
    load_data,
    perplexity,
    read_documents,
    stream_chunk,
)
from .cli_args import ArgumentParser, add_prefetch_argument, add_stream_cache_arguments, prefetch_from_args


def build_parser():
    p = ArgumentParser(prog="hebrus-mlx perplexity", description="Perplexity of a model on held-out text")
    p.add_argument("--model", default="demo", help="'demo', a hebrus artifact or an HF checkpoint directory")
    p.add_argument(
        "--data-path",
        default=str(DEFAULT_DATA),
        help='a local .txt (documents separated by two blank lines) or .jsonl ({"text": ...} per '
        "line); default: the demo's held-out text",
    )
    p.add_argument("--sequence-length", type=flags.integer(2), default=512, help="tokens per sample")
    p.add_argument("--num-samples", type=flags.integer(-1), default=256, help="samples to score (-1: all)")
    p.add_argument("--batch-size", type=flags.integer(1), default=8, help="samples per forward")
    p.add_argument("--seed", type=flags.integer(0), default=123, help="shuffles the documents")
    p.add_argument(
        "--kl-divergence",
        metavar="REF",
        help="also compare the next-token distributions with reference model REF ('demo' or an artifact with "
        "the same tokenizer): mean and p99 KL(REF || model) and top-1 agreement, with standard errors",
    )
    add_stream_cache_arguments(p)
    add_prefetch_argument(p)
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    if a.num_samples == 0:
        raise UsageError("--num-samples", "must be -1 (all) or at least 1")
    prefetch = prefetch_from_args(a)
    read_documents(a.data_path)  # a bad path fails before the model loads
    from ..loader import load
    from ..loading.hub import resolve_model, resolve_model_path

    ref_path = None
    if a.kl_divergence is not None:
        try:
            ref_path = resolve_model_path(a.kl_divergence)
        except HebrusError as e:  # ModelNotFoundError: names --model otherwise
            raise UsageError("--kl-divergence", e.message) from None

    print(f"Loading model from {a.model}...", file=sys.stderr)
    model, tokenizer = load(
        resolve_model(a.model), expert_cache_gb=a.expert_cache_gb, ple_cache_gb=a.ple_cache_gb, prefetch=prefetch
    )
    data = load_data(tokenizer, a.data_path, a.num_samples, a.sequence_length, a.seed)
    if a.num_samples > len(data):
        print(
            f"note: {a.data_path} holds {len(data)} samples of {a.sequence_length} tokens "
            f"(--num-samples {a.num_samples}); scoring those",
            file=sys.stderr,
        )
    chunk, rows = stream_chunk(model, a.batch_size)
    ref = None
    if ref_path is not None:
        print(f"Loading reference from {a.kl_divergence}...", file=sys.stderr)
        ref, ref_tok = load(ref_path)
        check_reference(model, tokenizer, ref, ref_tok, a.data_path)

    def progress(i, n):
        print(f"  Processed {i}/{n} batches...", end="\r", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    ppl, se, n = perplexity(model, data, rows, chunk, progress)
    dt = time.perf_counter() - t0
    print(file=sys.stderr)
    mode = (
        "resident"
        if getattr(model, "streaming", None) is None
        else (f"streamed, {chunk} tokens x {rows} rows per forward")
    )
    print(f"Model: {a.model} ({mode})")
    print(f"Data: {a.data_path}: {len(data)} samples x {a.sequence_length} tokens, seed {a.seed}")
    print(f"Perplexity: {ppl:.3f} ± {se:.3f}")
    print(f"Evaluation time: {dt:.2f} seconds ({n / dt:.0f} tokens/s)")
    if ref is not None:
        k = kl_divergence(model, ref, data, rows, chunk)
        print(f"KL divergence vs {a.kl_divergence} ({k['tokens']} tokens):")
        print(f"  Mean KLD: {k['kl_mean']:.6f} ± {k['kl_mean_se']:.6f}")
        print(f"  99.0% KLD: {k['kl_p99']:.6f} ± {k['kl_p99_se']:.6f}")
        print(f"  Same top-1: {100 * k['top1']:.2f} ± {100 * k['top1_se']:.2f} %")
        print(f"  (± : analytic standard error for the mean and top-1, bootstrap of {KL_BOOTSTRAP} for the p99)")
    return 0


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("perplexity", main))
