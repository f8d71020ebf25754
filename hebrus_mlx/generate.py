"""Text generation with the feel of `mlx_lm.generate`: `generate_step`, `stream_generate`,
`generate` and the `hebrus-mlx generate` / `python -m hebrus_mlx.generate` command."""

import argparse
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .errors import GenerationError, UsageError  # noqa: F401 (GenerationError: public here)
from .pipeline import launched as pipeline_launched
from .sample_utils import SamplingError, apply_vocab_mask, check_sampling_args, make_sampler
from .models.cache import rollback_on_error
from .stream.predict import add_prefetch_argument, prefetch_from_args
from .stream.sweep import add_sweep_argument, sweep_from_args
from .traces.schema import KIND_DECODE, KIND_PREFILL

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100
DEFAULT_PREFILL_STEP_SIZE = 2048
CLEAR_CACHE_EVERY = 256  # tokens; as mlx-lm's generate, so the buffer cache does not grow unbounded

# One stream for the model's work, as mlx-lm: host-side work on the default stream does not queue
# behind (or in front of) a generation step. MLX streams belong to the thread that made them, so each
# generating thread (the server's worker, the CLI's main thread) gets its own.
_thread = threading.local()


def generation_stream():
    stream = getattr(_thread, "stream", None)
    if stream is None:
        stream = _thread.stream = mx.new_stream(mx.default_device())
    return stream


@contextmanager
def wired_limit(model):
    """Wire the model's weights while generating when they are a large part of the Metal working set
    (mlx-lm's rule); a no-op without Metal (this machine: not exercised)."""
    if not (hasattr(mx, "metal") and mx.metal.is_available()):
        yield
        return
    from mlx.utils import tree_reduce

    model_bytes = tree_reduce(lambda acc, x: acc + x.nbytes if isinstance(x, mx.array) else acc, model, 0)
    max_rec = mx.metal.device_info()["max_recommended_working_set_size"]
    old = mx.set_wired_limit(min(model_bytes, max_rec)) if model_bytes > 0.9 * max_rec else None
    try:
        yield
    finally:
        if old is not None:
            mx.synchronize(generation_stream())
            mx.set_wired_limit(old)


@dataclass
class GenerationResponse:
    text: str
    token: int
    logprobs: mx.array
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: Optional[str] = None
    from_draft: bool = False  # a drafted token the target accepted (speculative decoding)


def _eval_cache(cache, fallback, extra=()):
    states = cache.arrays
    # Evaluating the cache alone leaves the chunk's vocabulary projection unevaluated.
    mx.eval(*(states if states else [fallback]), *extra)


# mlx-lm's --max-kv-size keeps a rotating window of the last N keys. Qwen4Exp's QSA layers select
# keys from the whole context by the indexer's scores, and GDN layers carry a fixed-size state, so a
# window would silently change which keys QSA can pick: the flag is refused, not approximated.
MAX_KV_SIZE_UNSUPPORTED = ("not supported by Qwen4Exp (QSA selects keys from the whole context; a rotating "
                           "window would change its output)")


def _check_max_kv_size(max_kv_size, field):
    if max_kv_size is not None:
        raise UsageError(field, MAX_KV_SIZE_UNSUPPORTED)


def generate_step(
    prompt: mx.array,
    model,
    *,
    effective_vocab_size: int,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable[[mx.array, mx.array], mx.array]]] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    max_kv_size: Optional[int] = None,
    trace=None,
    draft_model=None,
    num_draft_tokens: Optional[int] = None,
) -> Generator[Tuple[int, mx.array], None, None]:
    """Yield (token, logprobs) pairs; logprobs are over the physical width, -inf past the
    effective vocabulary (AFN-005). `max_tokens=-1` runs until the caller stops.

    trace: a `traces.capture.TraceRecorder` records the native routes of every token fed (read
    back once per step or prefill chunk); the caller closes it.

    `draft_model` (a hebrus_mlx.speculative Drafter) decodes speculatively with blocks of up to
    `num_draft_tokens`; the tokens are the same (greedy) or identically distributed (sampling)."""
    if draft_model is not None:
        if trace is not None:
            raise UsageError("trace", "route capture of speculative decoding is not supported (only "
                             "verified tokens may enter a clean-path trace, AFN-021)")
        yield from _speculative(prompt, model, draft_model, effective_vocab_size=effective_vocab_size,
                                max_tokens=max_tokens, sampler=sampler, logits_processors=logits_processors,
                                prompt_cache=prompt_cache, prefill_step_size=prefill_step_size,
                                max_kv_size=max_kv_size, num_draft_tokens=num_draft_tokens)
        return
    if prompt.ndim != 1 or prompt.size == 0:
        raise GenerationError("prompt must be a non-empty 1-D array of token IDs")
    if prefill_step_size < 1:
        raise GenerationError("prefill_step_size", f"must be >= 1, got {prefill_step_size}")
    _check_max_kv_size(max_kv_size, "max_kv_size")
    if prompt_cache is None:
        prompt_cache = model.make_cache()
    sampler = sampler or make_sampler()  # the vocabulary mask is this loop's (below)
    logits_processors = logits_processors or []
    tokens = None
    if trace is not None:
        trace.begin(getattr(prompt_cache, "next_position", 0))

    def _forward(x, kind):
        if trace is None:
            return model(x[None], cache=prompt_cache), None
        cap = trace.capture()
        out = model(x[None], cache=prompt_cache, capture=cap)
        return out, trace.stage(cap, x, kind)

    def _step(y):
        with mx.stream(generation_stream()):
            return _step_on_stream(y)

    def _step_on_stream(y):
        nonlocal tokens
        logits, staged = _forward(y, KIND_DECODE)
        logits = logits[:, -1, :]
        if logits_processors:
            tokens = y if tokens is None else mx.concatenate([tokens, y])
            for proc in logits_processors:
                logits = proc(tokens, logits)
        logits = apply_vocab_mask(logits, effective_vocab_size)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs), logprobs.squeeze(0), staged

    def _pending(staged):
        return staged.arrays if staged is not None else []

    streaming = model.streaming
    if streaming is not None and streaming.prefill_chunk_cap is not None:
        # A streamed chunk pins every expert it routes to in the arena at once (unless swept).
        prefill_step_size = min(prefill_step_size, streaming.prefill_chunk_cap)
    # AFN-010: a step whose evaluation fails (e.g. an SSD read error) must not leave half-applied
    # state. Snapshots are references (MLX arrays are values), so taking one per step is free, and
    # holding it also keeps the previous buffers from being donated to the update.
    snapshot = getattr(prompt_cache, "snapshot", lambda: None)

    def rollback_to(snap):
        return rollback_on_error(prompt_cache, snap)

    y = prompt.astype(mx.int32)
    # Chunked prefill: all but the last prompt token, the cache evaluated chunk by chunk.
    while y.size > 1:
        n = min(prefill_step_size, y.size - 1)
        chunk = y[:n]
        with rollback_to(snapshot()), mx.stream(generation_stream()):
            out, staged = _forward(chunk, KIND_PREFILL)
            _eval_cache(prompt_cache, out, _pending(staged))
        if staged is not None:
            trace.commit(staged)
        if logits_processors:
            tokens = chunk if tokens is None else mx.concatenate([tokens, chunk])
        y = y[n:]

    snap = snapshot()
    with rollback_to(snap):
        y, logprobs, staged = _step(y)
        mx.async_eval(y, logprobs, *_pending(staged))
    n = 0
    while True:
        # Until its token is read, the current step and the one queued on top of it roll back
        # together to the state before the current step.
        with rollback_to(snap):
            if n != max_tokens:
                # Queue the next step before reading this one, so the host never idles the device.
                next_snap = snapshot()
                next_y, next_logprobs, next_staged = _step(y)
                mx.async_eval(next_y, next_logprobs, *_pending(next_staged))
            if staged is not None:
                trace.commit(staged)  # the step that fed the previous token
            if n == max_tokens:
                # The step queued on the last token is in flight: finish it before returning, so
                # the cache and the streamed experts' leases are settled when the caller gets control.
                mx.eval(y, logprobs, *_pending(staged))
                break
            token = y.item()
        yield token, logprobs
        y, logprobs, snap, staged = next_y, next_logprobs, next_snap, next_staged
        n += 1
        if n % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()


def _speculative(prompt, model, drafter, *, max_kv_size, prompt_cache, with_draft_flag=False, **kwargs):
    from .speculative import speculative_generate_step
    from .speculative.protocol import check_drafter

    check_drafter(drafter)  # names and directories resolve in stream_generate (they need the tokenizer)
    _check_max_kv_size(max_kv_size, "max_kv_size")
    if prompt_cache is None:
        prompt_cache = model.make_cache()
    for token, logprobs, from_draft in speculative_generate_step(prompt, model, drafter, prompt_cache=prompt_cache,
                                                                 stream=generation_stream(), **kwargs):
        yield (token, logprobs, from_draft) if with_draft_flag else (token, logprobs)


def _prompt_ids(tokenizer, prompt) -> mx.array:
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)  # caller text: DATA, no special-token resolution
    elif isinstance(prompt, mx.array):
        ids = prompt.tolist()
    else:
        ids = list(prompt)
    ids = tokenizer.check_ids(ids)
    if not ids:
        raise GenerationError("prompt is empty")
    bad = [i for i in ids if i >= tokenizer.effective_vocab_size]
    if bad:
        raise GenerationError(f"prompt contains unassigned token ID {bad[0]} (>= {tokenizer.effective_vocab_size})")
    return mx.array(ids, dtype=mx.int32)


def _context_limit(model) -> Optional[int]:
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, Sequence[int], mx.array],
    max_tokens: int = 256,
    *,
    trace_out=None,
    trace_features: int = 0,
    trace_owner: str = "local",
    trace_generation: int = 0,
    trace_sampling: Optional[dict] = None,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """Generate, yielding a GenerationResponse per token; stops on the tokenizer's stop set.

    trace_out: record a route trace of this sequence into that directory (off by default; token
    IDs are sensitive). trace_features=N also records the router input of every Nth position;
    trace_owner/trace_generation are opaque labels; trace_sampling describes the sampler."""
    ids = _prompt_ids(tokenizer, prompt)
    limit = _context_limit(model)
    if limit is not None and ids.size > limit:
        raise GenerationError(f"prompt has {ids.size} tokens; the model context is {limit}")
    if max_tokens != -1 and max_tokens < 1:
        raise GenerationError("max_tokens", f"must be >= 1, got {max_tokens}")
    if limit is not None:
        room = limit - ids.size
        max_tokens = room if max_tokens == -1 else min(max_tokens, room)

    if trace_out is not None:
        # The same loop with a recorder, closed (remaining observations published) however it ends.
        from .traces.capture import TraceRecorder

        if trace_sampling is None:
            trace_sampling = {"sampler": "greedy" if kwargs.get("sampler") is None else "caller"}
        recorder = TraceRecorder.for_model(trace_out, model, tokenizer, owner=trace_owner,
                                           generation=trace_generation, sampling=trace_sampling,
                                           feature_every=trace_features)
        try:
            yield from stream_generate(model, tokenizer, ids, max_tokens, trace=recorder, **kwargs)
        finally:
            recorder.close()
        return

    detok = tokenizer.detokenizer
    stops = tokenizer.stop_token_ids
    draft_model = kwargs.pop("draft_model", None)
    num_draft_tokens = kwargs.pop("num_draft_tokens", None)
    speculative_stats = kwargs.pop("speculative_stats", None)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    if draft_model is None:
        steps = ((t, lp, False) for t, lp in generate_step(
            ids, model, effective_vocab_size=tokenizer.effective_vocab_size, max_tokens=max_tokens, **kwargs))
    else:
        # Speculative decoding: a name (ngram, mtp), a draft model directory or a Drafter.
        from .speculative import make_drafter

        drafter = make_drafter(draft_model, model, tokenizer, kwargs.get("sampler"), num_draft_tokens)
        steps = _speculative(ids, model, drafter, effective_vocab_size=tokenizer.effective_vocab_size,
                             max_tokens=max_tokens, num_draft_tokens=num_draft_tokens, stats=speculative_stats,
                             with_draft_flag=True, prompt_cache=kwargs.pop("prompt_cache", None),
                             max_kv_size=kwargs.pop("max_kv_size", None), **kwargs)
    with wired_limit(model):
        yield from _responses(steps, ids, tokenizer, detok, stops, max_tokens, tic)


def _responses(steps, ids, tokenizer, detok, stops, max_tokens, tic):
    prompt_tps = 0.0
    for n, (token, logprobs, from_draft) in enumerate(steps, start=1):
        if n == 1:
            prompt_tps = ids.size / (time.perf_counter() - tic)
            tic = time.perf_counter()
        finish = "stop" if token in stops else ("length" if n == max_tokens else None)
        if finish != "stop":
            detok.add_token(token)
        if finish is not None:
            detok.finalize()
        yield GenerationResponse(
            text=detok.last_segment, token=token, logprobs=logprobs, prompt_tokens=ids.size,
            prompt_tps=prompt_tps, generation_tokens=n,
            generation_tps=n / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish, from_draft=from_draft,
        )
        if finish is not None:
            return


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """Generate a complete response; with `verbose`, stream it and print mlx_lm-style stats."""
    text = ""
    response = None
    if kwargs.get("draft_model") is not None:
        from .speculative import SpeculativeStats, make_drafter

        # Resolved before anything is printed: a bad --draft-model is one line on stderr.
        kwargs["draft_model"] = make_drafter(kwargs["draft_model"], model, tokenizer, kwargs.get("sampler"),
                                             kwargs.get("num_draft_tokens"))
        if kwargs.get("speculative_stats") is None:
            kwargs["speculative_stats"] = SpeculativeStats()
    if verbose:
        print("=" * 10)
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if response is None:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
        if kwargs.get("speculative_stats") is not None:
            print(kwargs["speculative_stats"].summary())
        if model.streaming is not None:
            from .stream.engine import io_summary

            sweep_line = model.streaming.sweep_summary()
            if sweep_line:
                print(sweep_line)
            print(io_summary(model.streaming.engine.counters(), model.streaming.prefetch))
            experts = model.streaming.experts
            if experts is not None and experts.mirror is not None:
                from .stream.engine import mirror_summary

                print(mirror_summary(model.streaming.engine.file_reads(experts.store)))
    return text


# -- command line -------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError("arguments", message)


def _str2bool(s):
    if s.lower() in ("true", "t", "1", "yes"):
        return True
    if s.lower() in ("false", "f", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hebrus-mlx generate", description="Generate text with a hebrus-mlx model.")
    p.add_argument("--model", default="demo", help="'demo', a hebrus artifact or an HF checkpoint directory")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="message to send; '-' reads stdin")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-chat-template", action="store_true", help="tokenize the prompt as plain text")
    p.add_argument("--verbose", type=_str2bool, default=True, help="stream text and stats (true) or print only the text (false)")
    p.add_argument("--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP_SIZE)
    p.add_argument("--max-kv-size", type=int, default=None, help="mlx-lm's flag; refused: " + MAX_KV_SIZE_UNSUPPORTED)
    p.add_argument("--expert-cache-gb", type=float, default=None,
                   help="stream routed experts through a cache of this many GiB (default: decide from free memory)")
    p.add_argument("--ple-cache-gb", type=float, default=None,
                   help="stream PLE table pages through a cache of this many GiB (default: decide from free memory)")
    add_prefetch_argument(p)
    p.add_argument("--expert-mirror", default=None, metavar="DIR",
                   help="a directory holding a copy of the expert store (e.g. on a second disk); streamed reads "
                        "alternate between the two (not verified on two disks here)")
    add_sweep_argument(p)
    p.add_argument("--trace-out", default=None, metavar="DIR",
                   help="record the native expert routes of this run into DIR (off by default; token IDs are sensitive)")
    p.add_argument("--trace-features", type=int, default=0, metavar="N",
                   help="with --trace-out, also record the router input of every Nth position (0 = off)")
    p.add_argument("--trace-owner", default="local", help="opaque owner label stored in the trace")
    p.add_argument("--draft-model", default=None,
                   help="speculative decoding: 'ngram' (prompt lookup), 'mtp' (the model's MTP head) or a draft model directory")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16", "stored"),
                   help="float dtype to run in: auto = float32 on the CPU backend, the stored dtype on Metal")
    p.add_argument("--pipeline-split", default=None,
                   help="under mlx.launch: layers per rank, e.g. 5,3 (default: from each rank's free memory)")
    p.add_argument("--pipeline-timeout", type=float, default=None,
                   help="under mlx.launch: seconds a rank waits on another before the run ends with an error (default 60)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="most draft tokens per verify step (default 3; a governor picks each step's block up to it)")
    return p


def _check_args(args):
    if args.max_tokens < 1:
        raise UsageError("--max-tokens", f"must be >= 1, got {args.max_tokens}")
    try:
        check_sampling_args(args.temp, args.top_p, args.min_p, args.top_k)
    except SamplingError as e:  # name the flag
        raise UsageError("--" + e.field.replace("_", "-"), e.message) from None
    if args.prefill_step_size < 1:
        raise UsageError("--prefill-step-size", f"must be >= 1, got {args.prefill_step_size}")
    if args.max_kv_size is not None and args.max_kv_size < 1:
        raise UsageError("--max-kv-size", f"must be >= 1, got {args.max_kv_size}")
    _check_max_kv_size(args.max_kv_size, "--max-kv-size")
    for flag, value in (("--expert-cache-gb", args.expert_cache_gb), ("--ple-cache-gb", args.ple_cache_gb)):
        if value is not None and not (0 < value < float("inf")):
            raise UsageError(flag, f"must be a positive number of GiB, got {value}")
    if args.pipeline_timeout is not None and not (0 < args.pipeline_timeout < float("inf")):
        raise UsageError("--pipeline-timeout", f"must be a positive number of seconds, got {args.pipeline_timeout}")
    sweep_from_args(args)  # a bad --prefill-sweep fails before the model loads
    if args.trace_features < 0:
        raise UsageError("--trace-features", f"must be >= 0, got {args.trace_features}")
    if args.num_draft_tokens is not None:
        if args.draft_model is None:
            raise UsageError("--num-draft-tokens", "needs --draft-model")
        if args.num_draft_tokens < 1:
            raise UsageError("--num-draft-tokens", f"must be >= 1, got {args.num_draft_tokens}")


def _load(name: str, expert_cache_gb: Optional[float] = None, ple_cache_gb: Optional[float] = None,
          prefetch=None, dtype="auto", expert_mirror=None, prefill_sweep=None):
    from .hub import resolve_model  # demo -> local dir -> Hub repo id (downloaded after a disk check)
    from .utils import load

    return load(resolve_model(name), dtype=None if dtype == "stored" else dtype, expert_cache_gb=expert_cache_gb,
                ple_cache_gb=ple_cache_gb, prefetch=prefetch, expert_mirror=expert_mirror,
                prefill_sweep=prefill_sweep)


def _trace_kwargs(args) -> dict:
    if args.trace_out is None:
        return {}
    sampling = {"temp": args.temp, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed}
    return {"trace_out": args.trace_out, "trace_features": args.trace_features, "trace_owner": args.trace_owner,
            "trace_sampling": sampling}


def _draft_kwargs(args) -> dict:
    if args.draft_model is None:
        return {}
    return {"draft_model": args.draft_model, "num_draft_tokens": args.num_draft_tokens}


def main(argv=None) -> int:
    """`hebrus-mlx generate`; typed errors propagate to `cli.run` (one line, exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise UsageError("--prompt", "the prompt is empty")
    if args.seed is not None:
        mx.random.seed(args.seed)
    if pipeline_launched():
        from .hub import resolve_model
        from .pipeline.cli import load_or_serve

        pipe, model, tokenizer = load_or_serve(resolve_model(args.model), args)
        if pipe is None:
            return 0  # a serving rank: rank 0 prints
    else:
        model, tokenizer = _load(args.model, args.expert_cache_gb, args.ple_cache_gb, prefetch_from_args(args),
                                 args.dtype, args.expert_mirror, prefill_sweep=sweep_from_args(args))
    if args.ignore_chat_template or tokenizer.chat_template is None:
        ids = tokenizer.encode(prompt)
    else:
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)
    text = generate(model, tokenizer, ids, verbose=args.verbose, max_tokens=args.max_tokens,
                    sampler=sampler, prefill_step_size=args.prefill_step_size, **_trace_kwargs(args), **_draft_kwargs(args))
    if not args.verbose:
        print(text, flush=True)
    if pipeline_launched():
        from .pipeline.cli import finish

        finish(model, verbose=args.verbose)  # last: the launcher ends rank 0 once a peer exits
    return 0


if __name__ == "__main__":
    from .cli import run

    sys.exit(run("generate", main))
