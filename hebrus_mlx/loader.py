"""Model discovery and loading: `load(path) -> (model, tokenizer)` like mlx_lm.load."""

from __future__ import annotations

import glob
from pathlib import Path

import mlx.core as mx

from .errors import UsageError

# Model names resolve in hub.py (demo -> local dir -> Hub repo id); re-exported for load's callers.
from .loading.hub import DEMO_DIR, ModelNotFoundError, is_repo_id, resolve_model, resolve_model_path  # noqa: F401
from .loading.settings import StreamSettings


def is_artifact(path: Path) -> bool:
    return (Path(path) / "manifest.json").is_file()


def load_config(path: Path) -> dict:
    # A regular file inside the directory, size-capped, strict JSON (artifact.untrusted).
    from .artifact import untrusted

    return untrusted.read_json(str(path), "config.json", links=True)


def load_hf_model(path, dtype: mx.Dtype | None = mx.float32, options=None):
    """Build the graph from an HF checkpoint dir (safetensors) via the explicit key tables.

    dtype: floating weights are cast to it (float32 by default: the CPU backend is fastest and
    parity holds at fp32); None keeps the checkpoint dtype. A checkpoint's `mtp.*` head becomes
    `model.mtp_head` (None without one). options: the GraphOptions `models/optimize.apply` builds
    the graph with (None: the defaults for this backend).
    """
    # Imported here so resolving a bad path stays fast.
    from .format.checkpoint_keys import CheckpointKeyError
    from .models import optimize
    from .models.qwen4exp import Model, ModelArgs, set_norm_weights

    path = Path(path)
    args = ModelArgs.from_dict(load_config(path))  # config errors surface before any weight is read
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors in {path}")
    weights = {}
    for file in files:
        # Inside the directory, and its header bounded before MLX parses it (artifact.untrusted).
        from .artifact import untrusted
        from .artifact.safetensors import read_safetensors_header

        read_safetensors_header(untrusted.resolve(str(path), Path(file).name, links=True))
        for key, value in mx.load(file).items():
            if key in weights:
                raise CheckpointKeyError(f"tensor {key!r} appears in more than one shard")
            weights[key] = value
    model = Model(args)
    from .models.mtp_head import attach_mtp_head, load_mtp_head

    head = load_mtp_head(weights, args, dtype)  # the `mtp.*` tensors the text sanitize excludes
    weights = model.sanitize(weights)
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    del weights  # the model holds them: optimize.apply's re-stored copies must free the originals
    mx.eval(model.parameters())
    # HF checkpoints store the zero-centred norm weights (the format's convention): fold them now.
    set_norm_weights(model, folded=False)
    options = optimize.apply(model, options)
    if head is not None:
        set_norm_weights(head, folded=False)
        optimize.apply(head, options)
    model.eval()
    attach_mtp_head(model, head)
    return model


def load_model(
    path,
    dtype: mx.Dtype | None = mx.float32,
    expert_cache_gb: float | None = None,
    ple_cache_gb: float | None = None,
    prefetch=None,
    expert_mirror=None,
    prefill_sweep=None,
    options=None,
    settings=None,
):
    """Artifacts decide resident vs streamed routed experts and PLE tables from their size and
    available memory; `expert_cache_gb` / `ple_cache_gb` force streaming through a cache of that
    size (see `loading.build_model.load_artifact_model`). HF checkpoint dirs always load resident.
    `path`: a directory, or an artifact's admitted Manifest. The five streaming keywords, or one
    `settings` (a loading.settings.StreamSettings), checked once."""
    from .artifact.manifest import Manifest
    from .loading.settings import resolve

    settings = resolve(
        settings,
        expert_cache_gb=expert_cache_gb,
        ple_cache_gb=ple_cache_gb,
        prefetch=prefetch,
        expert_mirror=expert_mirror,
        prefill_sweep=prefill_sweep,
    )
    if isinstance(path, Manifest) or is_artifact(path):
        from .loading.build_model import load_artifact_model  # admission runs before any graph buffer

        return load_artifact_model(path, dtype=dtype, options=options, settings=settings)
    path = Path(path)
    asked = settings.streaming_asked()
    if asked is not None:  # an HF checkpoint loads resident
        raise UsageError(asked, f"streaming needs a converted artifact, {path} is an HF checkpoint dir")
    return load_hf_model(path, dtype=dtype, options=options)


# `--dtype`: the float dtype weights and activations run in; "stored" keeps the artifact's own.
DTYPES = {"auto": None, "float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16, "stored": None}


def default_dtype() -> mx.Dtype | None:
    """float32 on the CPU backend (fastest there, and the parity dtype); the stored dtype (None)
    where MLX runs on the GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else None


def _apply_machine_profile(options=None):
    """Switch on only what `hebrus-mlx qualify` passed on this machine (AFN-013); without a
    readable profile nothing optional is on."""
    import warnings

    from . import kernels
    from .machine_profile import ProfileError, ignored_claims, read_profile
    from .stream import engine as stream_engine

    try:
        profile = read_profile()
    except ProfileError as e:
        warnings.warn(f"{e}; optional kernels stay off (re-run `hebrus-mlx qualify`)", stacklevel=4)
        profile = None
    ignored = ignored_claims(profile)
    if ignored:
        warnings.warn(
            f"machine profile: {', '.join(ignored)} marked passed but not honoured here (written on "
            "another machine, OS or MLX, or no Metal device); they stay off (re-run `hebrus-mlx qualify`)",
            stacklevel=4,
        )
    stream_engine.configure(profile, options)
    return kernels.configure(profile)


def configure_runtime(options=None) -> None:
    """What every load does before it builds a graph, `load` and a pipeline stage's
    (`pipeline.load_pipeline`) alike: switch on what the machine profile qualified (AFN-013) for
    these GraphOptions and say when the graph will be compiled."""
    _apply_machine_profile(options)
    _say_if_compiling(options)


def _say_if_compiling(options) -> None:
    import sys

    from .models.options import GraphOptions, jit_notice

    notice = jit_notice(options or GraphOptions())
    if notice is not None:
        print(notice, file=sys.stderr, flush=True)


# mlx_lm.load's keywords that have no meaning here, and why (the value that changes nothing is accepted).
_REFUSED = {
    "adapter_path": (None, "LoRA adapters are not supported by hebrus-mlx"),
    "lazy": (
        False,
        "not supported: admission reads and checks the dense weights at load, and routed experts "
        "that do not fit are already streamed from the SSD on demand",
    ),
    "trust_remote_code": (False, "hebrus-mlx runs no code from a checkpoint"),
}
TOKENIZER_CONFIG_KEYS = ("eos_token", "chat_template", "trust_remote_code")


def _check_mlx_lm_kwargs(tokenizer_config, model_config, unknown, **refusable) -> dict:
    """Typed errors naming the argument for what load() cannot honour; the tokenizer overrides."""
    if unknown:
        raise UsageError(
            sorted(unknown)[0],
            "not an argument of hebrus_mlx.load (see its docstring for mlx_lm.load's arguments that apply here)",
        )
    for name, value in refusable.items():
        accepted, why = _REFUSED[name]
        if value is not accepted and value != accepted:
            raise UsageError(name, why)
    if model_config:
        if not isinstance(model_config, dict):
            raise UsageError("model_config", f"must be a dict, got {type(model_config).__name__}")
        raise UsageError(
            f"model_config.{sorted(model_config)[0]}",
            "not supported: the model's config is the checkpoint's (an artifact's is pinned by its "
            "manifest); convert a checkpoint with the changed config.json instead",
        )
    if tokenizer_config is None:
        return {}
    if not isinstance(tokenizer_config, dict):
        raise UsageError("tokenizer_config", f"must be a dict, got {type(tokenizer_config).__name__}")
    for key in tokenizer_config:
        if key not in TOKENIZER_CONFIG_KEYS:
            raise UsageError(
                f"tokenizer_config.{key}", f"not supported (supported: {', '.join(TOKENIZER_CONFIG_KEYS)})"
            )
    if tokenizer_config.get("trust_remote_code", False) is not False:
        raise UsageError("tokenizer_config.trust_remote_code", _REFUSED["trust_remote_code"][1])
    return {k: tokenizer_config[k] for k in ("eos_token", "chat_template") if tokenizer_config.get(k) is not None}


def _resolve(path_or_name, revision) -> Path:
    """demo -> a local directory -> a Hub repo id, as the CLI's --model (downloaded after a free-disk
    check; HF_HUB_OFFLINE uses the cache only)."""
    name = str(path_or_name)
    local = name == "demo" or Path(name).expanduser().exists() or not is_repo_id(name)
    if revision is not None:
        if not isinstance(revision, str) or not revision:
            raise UsageError("revision", f"must be a non-empty string, got {revision!r}")
        if local:
            raise UsageError("revision", f"applies to a Hub repo id (ORG/NAME); {name!r} is not one")
    return resolve_model(name, revision)


def load(
    path_or_name: str,
    dtype="auto",
    expert_cache_gb: float | None = None,
    ple_cache_gb: float | None = None,
    prefetch=None,
    expert_mirror=None,
    prefill_sweep=None,
    *,
    tokenizer_config: dict | None = None,
    model_config: dict | None = None,
    adapter_path=None,
    lazy: bool = False,
    return_config: bool = False,
    revision: str | None = None,
    trust_remote_code: bool = False,
    options=None,
    **unknown,
):
    """Load (model, tokenizer) from `demo`, an artifact dir, an HF checkpoint dir or a Hub repo id
    (`ORG/NAME`, resolved as the CLI's `--model`: a local directory of that name wins).

    dtype: "auto" (default_dtype(): float32 on CPU, the stored dtype on Metal), an mx.Dtype, or
    None for the stored dtype.

    expert_cache_gb: stream an artifact's routed experts through a cache of this many GiB
    (`--expert-cache-gb`); ple_cache_gb: its PLE table pages (`--ple-cache-gb`). None decides
    from available memory. prefetch: streamed experts' read-ahead (`--prefetch`, see
    `stream.predict`); None: the default. expert_mirror: a directory with a copy of the expert
    store that streamed reads alternate with (`--expert-mirror`; not verified on two disks here).
    prefill_sweep: `auto|on|off` (`--prefill-sweep`, see `stream.sweep`); None: auto.
    options: a `models.options.GraphOptions` (how the graph is built and run: joined projections,
    compiled regions, CPU streams, ...; every choice keeps tokens identical); None: the defaults.

    mlx_lm.load's keywords: `tokenizer_config` ({"eos_token": str, "chat_template": str}),
    `return_config` (also return config.json as a dict), `revision` (of a Hub repo id). Refused
    with a UsageError naming the argument: `adapter_path`, `lazy=True`, `trust_remote_code=True`,
    any `model_config` key, and any argument load does not know.
    """
    from .admission import product_vocabulary
    from .text.tokenizer import load_tokenizer

    tokenizer_overrides = _check_mlx_lm_kwargs(
        tokenizer_config,
        model_config,
        unknown,
        adapter_path=adapter_path,
        lazy=lazy,
        trust_remote_code=trust_remote_code,
    )
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise UsageError("dtype", f"expected one of {', '.join(DTYPES)}, an mlx dtype or None, got {dtype!r}")
        dtype = default_dtype() if dtype == "auto" else DTYPES[dtype]
    # The streaming settings, checked here once (before the Hub resolves a name or a byte is read).
    settings = StreamSettings(
        expert_cache_gb=expert_cache_gb,
        ple_cache_gb=ple_cache_gb,
        prefetch=prefetch,
        expert_mirror=expert_mirror,
        prefill_sweep=prefill_sweep,
    )
    configure_runtime(options)
    path = _resolve(path_or_name, revision)
    source, sources = path, None
    if is_artifact(path):
        from .admission import admit

        # One admission: the graph and the tokenizer use exactly the bytes it checked.
        source = admit(str(path))
        sources = source.sources
    model = load_model(source, dtype=dtype, options=options, settings=settings)
    tokenizer = load_tokenizer(path, physical_vocab_size=model.args.vocab_size, sources=sources, **tokenizer_overrides)
    if product_vocabulary(model.args.vocab_size, tokenizer.effective_vocab_size):
        model.effective_vocab_size = tokenizer.effective_vocab_size  # the model masks its unassigned rows (AFN-005)
    model.source_path = path  # route traces pin the artifact by its digest
    model.tokenizer_vocab_size = tokenizer.effective_vocab_size  # generate_step's default (AFN-005)
    if return_config:
        config = dict(source.config) if sources is not None else load_config(path)
        return model, tokenizer, config
    return model, tokenizer
