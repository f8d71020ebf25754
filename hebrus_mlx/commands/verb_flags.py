"""The model, cache and sampling flags of every generating verb: `build_parser` (generate's whole
parser), `check_args` (their values, before the model loads) and `load_from_args`. chat and server
take the ones they use from generate's parser, so the verbs cannot drift, and refuse the rest while
they do not use them (never silently ignored)."""

import argparse

from .. import flags
from ..errors import UsageError
from ..generate import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PREFILL_STEP_SIZE,
    DEFAULT_PROMPT,
    MAX_DRAFT_TOKENS,
    MAX_KV_SIZE_UNSUPPORTED,
    check_max_kv_size,
)
from ..pipeline import launched as pipeline_launched
from ..prompt_cache_disk import DEFAULT_DIR_BYTES, open_dir
from ..sample_utils import SamplingError, check_sampling_args
from .cli_args import (
    LOAD_FLAGS,
    MLX_LM_REFUSED,
    ArgumentParser,
    add_pipeline_arguments,
    add_prefetch_argument,
    add_refused_arguments,
    add_stream_cache_arguments,
    add_sweep_argument,
    check_pipeline_timeout,
    graph_options_from_args,
    prefetch_from_args,
    refuse_mlx_lm_flags,
    str2bool,
    sweep_from_args,
)

# generate's flags that describe the model, its caches and sampling defaults; taken from its parser
# so the two verbs cannot drift. A flag generate gains later appears here too, and is refused
# until this verb uses it (never silently ignored).
USED = LOAD_FLAGS | {
    "max_tokens",
    "temp",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "draft_model",
    "num_draft_tokens",
    "pipeline_split",
    "pipeline_timeout",
}


def share_generate_flags(p: argparse.ArgumentParser, exclude) -> list:
    """Add generate's flags (but `exclude`) to `p`; returns the added actions."""
    added = []
    for action in build_parser()._actions:
        if action.dest not in exclude:
            p._add_action(action)
            added.append(action)
    return added


def refuse_unused(args, actions, used, verb):
    for a in actions:
        if a.dest not in used and getattr(args, a.dest) != a.default:
            raise UsageError(a.option_strings[0], f"not supported by `hebrus-mlx {verb}` yet")


def add_prompt_cache_arguments(p, default_bytes, zero):
    """The prefix-snapshot cache of chat and server: --prompt-cache-bytes in memory (`default_bytes`;
    `zero` says what 0 means to the verb), --prompt-cache-dir and its bound on disk."""
    p.add_argument(
        "--prompt-cache-bytes",
        type=flags.integer(0, flags.INT64_MAX),
        default=default_bytes,
        help=f"byte limit of cached prefix snapshots, LRU (0: {zero})",
    )
    p.add_argument(
        "--prompt-cache-dir",
        default=None,
        metavar="DIR",
        help="keep prefix snapshots in DIR across restarts (keyed by the artifact and the tokens; "
        "foreign, stale or corrupted entries are refused and recomputed)",
    )
    p.add_argument(
        "--prompt-cache-dir-bytes",
        type=flags.integer(1, flags.INT64_MAX),
        default=DEFAULT_DIR_BYTES,
        metavar="N",
        help=f"byte limit of this model's snapshots in --prompt-cache-dir, LRU, shared by every process using "
        f"the directory (default {DEFAULT_DIR_BYTES >> 30} GiB)",
    )


def check_shared_flags(args, parser, verb, also_used=frozenset()):
    """chat's and server's checks of what they share (after generate's own, `check_args`): a
    generate flag the verb does not use (USED | also_used) is refused, then --prompt-cache-bytes and
    the --prompt-cache-dir pair are checked."""
    refuse_unused(args, parser.shared, USED | also_used, verb)
    if args.prompt_cache_bytes < 0:
        raise UsageError("--prompt-cache-bytes", f"must be >= 0, got {args.prompt_cache_bytes}")
    check_prompt_cache_dir(args)


def check_prompt_cache_dir(args):
    if args.prompt_cache_dir is None:
        if args.prompt_cache_dir_bytes != DEFAULT_DIR_BYTES:
            raise UsageError("--prompt-cache-dir-bytes", "needs --prompt-cache-dir")
        return
    if pipeline_launched():
        raise UsageError("--prompt-cache-dir", "not supported under mlx.launch (each rank holds its own layers)")
    import os

    if os.path.exists(args.prompt_cache_dir) and not os.path.isdir(args.prompt_cache_dir):
        raise UsageError("--prompt-cache-dir", f"{args.prompt_cache_dir}: not a directory")
    # Usable (created, writable, its lock file a regular file) before the model loads: a failure
    # later, on the server's worker thread, would end the process from its exit path.
    os.close(open_dir(args.prompt_cache_dir))


# -- the model, cache and sampling flags of every generating verb (generate, chat, server, cache-prompt) --


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hebrus-mlx generate", description="Generate text with a hebrus-mlx model.")
    p.add_argument("--model", default="demo", help="'demo', a hebrus artifact or an HF checkpoint directory")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="message to send; '-' reads stdin")
    p.add_argument("--system-prompt", default=None)
    p.add_argument(
        "--max-tokens",
        "-m",
        type=flags.integer(1),
        default=DEFAULT_MAX_TOKENS,
        help="tokens to generate (default %(default)s)",
    )
    p.add_argument(
        "--temp", type=flags.number(0, 1e6), default=0.0, help="sampling temperature (default %(default)s: greedy)"
    )
    p.add_argument("--top-p", type=flags.number(0, 1), default=1.0, help="sampling top-p (default %(default)s: off)")
    p.add_argument("--top-k", type=flags.integer(0), default=0, help="sampling top-k (default %(default)s: off)")
    p.add_argument("--min-p", type=flags.number(0, 1), default=0.0, help="sampling min-p (default %(default)s: off)")
    p.add_argument(
        "--min-tokens-to-keep",
        type=flags.integer(1),
        default=1,
        help="tokens min-p always keeps (default %(default)s)",
    )
    p.add_argument(
        "--xtc-probability",
        type=flags.number(0, 1),
        default=0.0,
        help="XTC sampling: probability of excluding the top choices (default %(default)s: off)",
    )
    p.add_argument(
        "--xtc-threshold",
        type=flags.number(0, 0.5),
        default=0.1,
        help="XTC sampling: probability above which a choice may be excluded (default %(default)s)",
    )
    p.add_argument("--seed", type=flags.seed(), default=None, help="random seed (default: unseeded)")
    p.add_argument("--ignore-chat-template", action="store_true", help="tokenize the prompt as plain text")
    p.add_argument(
        "--verbose", type=str2bool, default=True, help="stream text and stats (true) or print only the text (false)"
    )
    p.add_argument("--prefill-step-size", type=flags.integer(1), default=DEFAULT_PREFILL_STEP_SIZE)
    p.add_argument(
        "--max-kv-size", type=flags.integer(1), default=None, help="mlx-lm's flag; refused: " + MAX_KV_SIZE_UNSUPPORTED
    )
    p.add_argument(
        "--prompt-cache-file",
        default=None,
        metavar="FILE",
        help="continue from a state saved by `hebrus-mlx cache-prompt`: --prompt is the rest of its message",
    )
    add_stream_cache_arguments(p)
    add_prefetch_argument(p)
    p.add_argument(
        "--expert-mirror",
        default=None,
        metavar="DIR",
        help="a directory holding a copy of the expert store (e.g. on a second disk); streamed reads "
        "alternate between the two (not verified on two disks here)",
    )
    add_sweep_argument(p)
    p.add_argument(
        "--graph",
        default=None,
        metavar="KEY=VALUE,...",
        help="how the graph is built (models/options.py GraphOptions), e.g. compile=on,cpu_streams=1 or plain; "
        "every choice keeps tokens identical (default: measured per backend)",
    )
    p.add_argument(
        "--trace-out",
        default=None,
        metavar="DIR",
        help="record the native expert routes of this run into DIR (off by default; token IDs are sensitive)",
    )
    p.add_argument(
        "--trace-features",
        type=flags.integer(0),
        default=0,
        metavar="N",
        help="with --trace-out, also record the router input of every Nth position (0 = off)",
    )
    p.add_argument("--trace-owner", default="local", help="opaque owner label stored in the trace")
    p.add_argument(
        "--draft-model",
        default=None,
        help="speculative decoding: 'ngram' (prompt lookup), 'mtp' (the model's MTP head) or a draft model directory",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16", "stored"),
        help="float dtype to run in: auto = float32 on the CPU backend, the stored dtype on Metal",
    )
    add_pipeline_arguments(p)
    p.add_argument(
        "--num-draft-tokens",
        type=flags.integer(1, MAX_DRAFT_TOKENS),
        default=None,
        help="most draft tokens per verify step (default 3; a governor picks each step's block up to it)",
    )
    add_refused_arguments(p, MLX_LM_REFUSED)
    return p


def check_args(args) -> None:
    """Refuse bad values of generate's flags (UsageError naming the flag) before the model loads."""
    if args.max_tokens is not None and args.max_tokens < 1:  # None: the server's "not given"
        raise UsageError("--max-tokens", f"must be >= 1, got {args.max_tokens}")
    refuse_mlx_lm_flags(args)
    try:
        check_sampling_args(**sampling_from_args(args))
    except SamplingError as e:  # name the flag
        raise UsageError("--" + e.field.replace("_", "-"), e.message) from None
    if args.prefill_step_size < 1:
        raise UsageError("--prefill-step-size", f"must be >= 1, got {args.prefill_step_size}")
    if args.max_kv_size is not None and args.max_kv_size < 1:
        raise UsageError("--max-kv-size", f"must be >= 1, got {args.max_kv_size}")
    check_max_kv_size(args.max_kv_size, "--max-kv-size")
    for flag, value in (("--expert-cache-gb", args.expert_cache_gb), ("--ple-cache-gb", args.ple_cache_gb)):
        if value is not None and not (0 < value < float("inf")):
            raise UsageError(flag, f"must be a positive number of GiB, got {value}")
    check_pipeline_timeout(args)
    sweep_from_args(args)  # a bad --prefill-sweep fails before the model loads
    if getattr(args, "prompt_cache_file", None) is not None and pipeline_launched():  # generate, cache-prompt
        raise UsageError("--prompt-cache-file", "not supported under mlx.launch (each rank holds its own layers)")
    graph_options_from_args(args)
    if args.trace_features < 0:
        raise UsageError("--trace-features", f"must be >= 0, got {args.trace_features}")
    if args.num_draft_tokens is not None:
        if args.draft_model is None:
            raise UsageError("--num-draft-tokens", "needs --draft-model")
        if args.num_draft_tokens < 1:
            raise UsageError("--num-draft-tokens", f"must be >= 1, got {args.num_draft_tokens}")


def sampling_from_args(args) -> dict:
    """generate's sampling flags as the keyword arguments of sample_utils.make_sampler (and
    check_sampling_args): what check_args checks is what generate samples with."""
    return {
        "temp": args.temp,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "top_k": args.top_k,
        "min_tokens_to_keep": args.min_tokens_to_keep,
        "xtc_probability": args.xtc_probability,
        "xtc_threshold": args.xtc_threshold,
    }


def load_from_args(args):
    """(model, tokenizer) named by generate's model and cache flags (`--model`: demo, a local
    directory or a Hub repo id, downloaded after a disk check)."""
    from ..loader import load
    from ..loading.hub import resolve_model

    return load(
        resolve_model(args.model),
        dtype=None if args.dtype == "stored" else args.dtype,
        expert_cache_gb=args.expert_cache_gb,
        ple_cache_gb=args.ple_cache_gb,
        prefetch=prefetch_from_args(args),
        expert_mirror=args.expert_mirror,
        prefill_sweep=sweep_from_args(args),
        options=graph_options_from_args(args),
    )


def trace_kwargs(args) -> dict:
    if args.trace_out is None:
        return {}
    sampling = {"temp": args.temp, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed}
    return {
        "trace_out": args.trace_out,
        "trace_features": args.trace_features,
        "trace_owner": args.trace_owner,
        "trace_sampling": sampling,
    }


def draft_kwargs(args) -> dict:
    if args.draft_model is None:
        return {}
    return {"draft_model": args.draft_model, "num_draft_tokens": args.num_draft_tokens}


def load_or_serve(path, args):
    """Under `mlx.launch`: this rank's stage, loaded as `args` say. (pipeline, model, tokenizer) on
    rank 0; (None, None, None) on a serving rank once done."""
    from ..pipeline import load_pipeline
    from ..pipeline.ranks import serve_or_return

    if args.dtype != "auto":
        raise UsageError("--dtype", "pipeline stages run in the default dtype (float32 on CPU) for now")
    if getattr(args, "expert_mirror", None) is not None:
        raise UsageError("--expert-mirror", "pipeline stages do not read a mirror yet")
    pipe = load_pipeline(
        path,
        split=args.pipeline_split,
        timeout=args.pipeline_timeout,
        expert_cache_gb=args.expert_cache_gb,
        ple_cache_gb=args.ple_cache_gb,
        prefetch=prefetch_from_args(args),
        prefill_sweep=sweep_from_args(args),
        mtp=getattr(args, "draft_model", None) == "mtp",
        options=graph_options_from_args(args),
    )
    return serve_or_return(pipe, path)
