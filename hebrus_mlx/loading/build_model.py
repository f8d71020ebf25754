"""Build the MLX graph from an admitted artifact directory.

Order matters (AFN-004): `admission.admit` runs first and the graph is built
only once every boundary passed, so a rejected artifact allocates nothing.
What each tensor is (float or affine, which group and bits) is read from the
manifest's per-tensor codec and the store codecs, never inferred from key
names or shapes.

Routed experts are either copied out of the ExpertMajor store into the
resident SwitchGLU (affine codecs become models/switch_layers.QuantizedSwitchLinear) or,
when they do not fit (or ``expert_cache_gb`` asks for it), left on disk and
streamed through the engine's arena by ``StreamedSwitchGLU``
(:func:`plan_expert_residency`). PLE tables are read page by page into
their embeddings (resident) or, when they do not fit (or ``ple_cache_gb``
asks for it, :func:`plan_ple_residency`), served from the page stores by
``StreamedNGramTable`` through the same engine as streamed experts.
"""

import hashlib
import io
import os
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .. import admission
from ..artifact import constants as C
from ..artifact import expert_major as em
from ..artifact import fast_check, ple_pages
from ..artifact.errors import AdmissionError, DigestError, GeometryError, TruncatedError
from ..artifact.expert_major import ExpertMajorReader
from ..artifact.manifest import Manifest
from ..artifact.ple_pages import PleReader
from ..errors import UsageError
from ..models import optimize
from ..models.mtp_head import MTPHead, attach_mtp_head
from ..models.qwen4exp import Model, QuantizedNGramTable, set_norm_weights
from ..stream import crossover as sweep_crossover
from ..stream.engine import StreamEngine
from ..stream.experts import StreamedExperts
from ..stream.ple import attach_ple
from ..stream.predict import DEFAULT as DEFAULT_PREFETCH
from ..stream.predict import parse_prefetch
from ..stream.streaming import Streaming
from ..stream.switch import attach
from . import plan
from .plan import RESERVE_BYTES
from .settings import resolve


def _quant_params(codec_name):
    c = C.codec(codec_name)
    return {"group_size": c.group_size, "bits": c.bits, "mode": "affine"}


def quantization_plan(m: Manifest):
    """{module path: to_quantized kwargs} of every layer the manifest says is
    affine: dense tensors by their recorded codec, routed experts by the
    expert store's codec."""
    plan_ = {}
    for name, rec in m.tensors.items():
        if C.codec(rec["codec"]).affine and name.endswith(".weight"):
            plan_[name[: -len(".weight")]] = _quant_params(rec["codec"])
    # One codec name per layer and projection (a per-layer store's table, else the store's codec).
    table = em.layer_codecs(m.family, m.experts.expert_codec)
    for layer, row in enumerate(table):
        for comp, name in zip(C.EXPERT_COMPONENTS, row):
            if C.codec(name).affine:
                plan_[f"model.layers.{layer}.mlp.switch_mlp.{comp}_proj"] = _quant_params(name)
    return plan_


def _quantize(model, plan_):
    done = set()

    def predicate(path, module):
        if path in plan_:
            done.add(path)
            return plan_[path]
        return False

    nn.quantize(model, class_predicate=predicate)
    missing = sorted(set(plan_) - done)
    if missing:
        raise GeometryError(f"manifest.tensors.{missing[0]}.weight", "no quantizable layer at this path")


def _to_mx(a):
    """Store arrays -> MLX; uint16 parts are bf16 bit patterns."""
    if a.dtype == np.uint16:
        return mx.array(a).view(mx.bfloat16)
    return mx.array(a)


def _load_hashed(m: Manifest, s, what: str):
    """A whole safetensors store: admission checked its metadata, not its bytes, so it is read
    once into memory, checked there, and parsed from that same buffer (never re-read from disk
    after its check: a write between check and use cannot reach the weights). A store with a
    fast check (the MTP head of a new artifact) is checked chunk by chunk against its XXH3-128
    table, any other against its whole-file SHA-256. Costs one store-sized buffer while loading."""
    table, xxh3 = m.fast_table(s), fast_check.xxh3_128()
    with open(m.file(s), "rb") as f:
        data = f.read(s.size + 1)  # one byte more than admitted: a store that grew is refused
    if len(data) != s.size:
        raise DigestError(
            f"stores.{s.path}.size",
            f"{what} store is {len(data)}{'+' if len(data) > s.size else ''} "
            f"bytes, admitted {s.size}: changed after admission",
        )
    if table is not None and xxh3 is not None:
        unit = fast_check.MTP_UNIT_BYTES
        for i, want in enumerate(table):
            if xxh3(data[i * unit : (i + 1) * unit]) != want:  # bytes only (a copy of one chunk)
                raise DigestError(f"stores.{s.path}.fast_check", f"{what} store chunk {i} XXH3-128 mismatch")
    elif hashlib.sha256(data).hexdigest() != s.sha256:
        raise DigestError(f"stores.{s.path}.sha256", f"{what} store digest mismatch")
    return mx.load(io.BytesIO(data), format="safetensors")


def _dense(m: Manifest, stage=None):
    """The dense tensors (a pipeline stage's only). A stage of an artifact with per-tensor
    digests reads and verifies just its own tensors' byte ranges (it never reads another rank's
    bytes); without them (older artifacts) it reads and verifies the whole file, and says so."""
    if stage is not None and m.dense_digests is not None:
        return _dense_ranges(m, [k for k in sorted(m.tensors) if stage.owns(k)])
    if stage is not None:
        print(
            f"hebrus-mlx: note: rank {stage.rank}: {m.dense.path} has no per-tensor digests (an older "
            f"artifact): this stage reads and verifies the whole file",
            file=sys.stderr,
        )
    weights = _load_hashed(m, m.dense, "dense")
    if set(weights) != set(m.tensors):
        raise AdmissionError("tensors", "dense file changed after admission")
    if stage is not None:
        weights = {k: v for k, v in weights.items() if stage.owns(k)}
    return weights


_NP_DTYPES = {"U32": np.uint32, "BF16": np.uint16, "F32": np.float32}


def _dense_ranges(m: Manifest, names):
    """`names` from the dense store: each tensor's bytes read once (exact-length preads at its
    admitted offsets) and checked against its manifest digest before it becomes an array."""
    fd = os.open(m.file(m.dense), os.O_RDONLY)
    try:
        base = 8 + int.from_bytes(_pread(fd, 8, 0, "tensors.header"), "little")
        out = {}
        for name in names:
            rec = m.tensors[name]
            begin, end = rec["data_offsets"]
            data = _pread(fd, end - begin, base + begin, f"tensors.{name}")
            if hashlib.sha256(data).hexdigest() != m.dense_digests[name]:
                raise DigestError(f"tensors.{name}.sha256", f"digest mismatch in {m.dense.path}")
            out[name] = _to_mx(np.frombuffer(data, _NP_DTYPES[rec["dtype"]]).reshape(rec["shape"]))
        return out
    finally:
        os.close(fd)


def _pread(fd, n, offset, field):
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise TruncatedError(field, f"read {len(data)} of {n} bytes at offset {offset}: file changed after admission")
    return data


def _experts(m: Manifest, layers=None):
    """Runtime SwitchGLU tensors: [E, rows, cols] per component and part (of `layers`, default
    all; a pipeline stage reads only its own records)."""
    s, fam = m.experts, m.family
    out = {}
    with ExpertMajorReader(m.file(s), fam, s.expert_codec, fast=m.fast_table(s)) as r:
        for layer in range(fam.num_hidden_layers) if layers is None else layers:
            layout = r.geometry.layer_layout(layer)
            stacks = {
                (comp, part): np.empty((fam.num_experts,) + shape, dtype) for comp, part, dtype, shape, _, _ in layout
            }
            for e in range(fam.num_experts):
                for comp, parts in r.read_expert(layer, e).items():
                    for part, a in parts.items():
                        stacks[(comp, part)][e] = a
            for (comp, part), a in stacks.items():
                out[f"model.layers.{layer}.mlp.switch_mlp.{comp}_proj.{part}"] = _to_mx(a)
    return out


def _ple(m: Manifest, layers=None):
    """Resident PLE tables (of `layers`, default all): every page read through its digest check."""
    out = {}
    for s in _ple_stores(m, layers):
        with PleReader(m.file(s), m.family, s.codec, fast=m.fast_table(s)) as r:
            g = r.geometry
            raw = np.empty((g.total_rows, g.row_bytes), np.uint8)
            for page in range(g.num_pages):
                first = page * g.rows_per_page
                n = min(g.rows_per_page, g.total_rows - first)
                data = r.read_page(page)
                raw[first : first + n] = np.frombuffer(
                    data, np.uint8, n * g.row_bytes, C.PLE_PAGE_HEADER_BYTES
                ).reshape(n, -1)
            table = raw if g.codec.affine else raw.view(np.uint16 if g.codec.name == "bf16" else np.float32)
        out[f"model.layers.{s.layer}.ple.ple_embedding.ngram_embedding.weight"] = _to_mx(table)
    return out


def _quantized_ple_tables(m: Manifest, model, dtype, layers=None):
    """Give every resident PLE table of affine rows (of ``layers``) a QuantizedNGramTable, which
    holds the rows as stored and decodes the gathered ones."""
    for s in _ple_stores(m, layers):
        g = ple_pages.Geometry(m.family, s.table, s.codec)
        if g.codec.affine:
            emb = model.model.layers[s.layer].ple.ple_embedding
            emb.ngram_embedding = QuantizedNGramTable(
                g.total_rows, g.width, g.codec.bits, g.group_size, g.row_bytes, dtype
            )


def _store_bytes(m: Manifest, roles):
    return sum(s.size for s in m.stores if s.role in roles)


def _ple_stores(m: Manifest, layers=None):
    return [s for s in m.ple if layers is None or s.layer in layers]


def _dense_bytes(m: Manifest, stage=None):
    """Dense (+ MTP head) store bytes, or a pipeline stage's share of the dense tensors (the MTP
    head is not loaded by stages)."""
    if stage is None:
        return _store_bytes(m, ("dense", "mtp"))
    own = sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in m.tensors.items() if stage.owns(k))
    return own + (_store_bytes(m, ("mtp",)) if stage.heads else 0)


def plan_ple_residency(m: Manifest, dtype=mx.float32, ple_cache_gb=None, stage=None):
    """None: load the PLE tables resident; otherwise the engine slab-cache
    bytes to stream their pages through. From file metadata only: the tables'
    in-memory size (bf16 rows widened to fp32 when ``dtype`` is float32)
    against available memory minus ``RESERVE_BYTES`` and the dense (+ MTP head) store;
    ``ple_cache_gb`` forces streaming with that cache."""
    stores = _ple_stores(m, None if stage is None else stage.layers)
    if not stores:
        if ple_cache_gb is not None:
            raise UsageError("ple_cache_gb", "this artifact has no PLE tables" + (" in this stage" if stage else ""))
        return None
    wide = dtype is not None and dtype == mx.float32
    table = pages = page = 0
    for s in stores:
        with PleReader(m.file(s), m.family, s.codec) as r:
            g = r.geometry
            table += g.total_rows * g.row_bytes * (2 if wide and g.codec.name == "bf16" else 1)
            pages += g.num_pages
            page = max(page, g.page_stride)
    return plan.plan_ple(
        table, page, pages, plan.available_memory(), RESERVE_BYTES + _dense_bytes(m, stage), ple_cache_gb
    )


def plan_expert_residency(m: Manifest, dtype=mx.float32, expert_cache_gb=None, ple_cache_bytes=None, stage=None):
    """None: load the routed experts resident; otherwise the number of arena
    rows to stream them through. From file metadata only (no expert byte is
    read): the experts' in-memory size (bf16 parts widened to fp32 when
    ``dtype`` is float32) against available memory minus ``RESERVE_BYTES``
    and the dense + PLE (+ MTP head) store bytes (the PLE cache instead when
    ``ple_cache_bytes`` says PLE streams); ``expert_cache_gb`` forces
    streaming with that cache. At least top-k rows (one decode token of one
    layer)."""
    fam = m.family
    wide = dtype is not None and dtype == mx.float32
    g = em.Geometry(fam, m.experts.expert_codec)
    own = range(fam.num_hidden_layers) if stage is None else stage.layers

    def size(layer):
        return sum(2 * n if wide and d == "uint16" else n for _, _, d, _, _, n in g.layer_layout(layer))

    # A per-layer store streams through one arena per distinct layer codec, each of the same rows
    # (stream.experts): a row costs one record of every distinct layout.
    first = {}
    for layer, row in enumerate(g.layer_codecs):
        first.setdefault(row, layer)
    record = sum(size(layer) for layer in first.values())
    part = max(
        2 * n if wide and d == "uint16" else n for layer in first.values() for *_, d, _, _, n in g.layer_layout(layer)
    )
    resident = sum(size(layer) for layer in own) * fam.num_experts
    resident_other = _dense_bytes(m, stage)
    if ple_cache_bytes is None:
        resident_other += sum(s.size for s in _ple_stores(m, None if stage is None else stage.layers))
    else:
        resident_other += ple_cache_bytes
    return plan.plan_experts(
        resident,
        record,
        plan.available_memory(),
        RESERVE_BYTES + resident_other,
        expert_cache_gb,
        min_rows=fam.num_experts_per_tok,
        part_bytes=part,
    )


# The prefill sweep's ring may take at most this share of an arena planned from free memory.
RING_SHARE = 0.25


def _make_room_for_ring(m: Manifest, dtype, rows, expert_cache_gb, sweep_mode):
    """When the arena was sized from free memory (no ``--expert-cache-gb``), it would take every
    byte and leave the sweep's two-layer ring no room, so ``auto`` would always stay off: give the
    ring its bytes out of the arena if that costs the arena at most RING_SHARE of its rows (and
    still leaves top-k). A forced cache size is the user's budget and stays as asked."""
    if rows is None or expert_cache_gb is not None or sweep_mode == "off" or m.experts.layer_codecs is not None:
        return rows  # (a per-layer store is not swept: stream.experts)
    fam = m.family
    ring_rows = 2 * fam.num_experts  # stream.sweep.ring_bytes: two layers, records laid out as rows
    if ring_rows > RING_SHARE * rows or rows - ring_rows < fam.num_experts_per_tok:
        return rows
    return rows - ring_rows


def _routed_expert_keys(model):
    return {k for k, _ in tree_flatten(model.parameters()) if ".mlp.switch_mlp." in k}


def _ple_keys(model):
    return {k for k, _ in tree_flatten(model.parameters()) if ".ple.ple_embedding.ngram_embedding." in k}


def _attach_ple(m: Manifest, model, engine, dtype, layers=None):
    """Swap every PLE table (of ``layers``) for a StreamedNGramTable over its
    page store; the parameters removed must be exactly the tables the
    resident path would load."""
    before = _ple_keys(model)
    attach_ple(model, m, engine, dtype, layers=layers)
    replaced = before - _ple_keys(model)
    want = {f"model.layers.{s.layer}.ple.ple_embedding.ngram_embedding.weight" for s in _ple_stores(m, layers)}
    if replaced != want or _ple_keys(model):
        raise GeometryError("ple", f"streamed PLE replaced {len(replaced)} tables, the artifact holds {len(want)}")


def _attach_streamed(m: Manifest, model, rows, dtype, engine, layers=None, mirror=None):
    """Swap every switch_mlp (of ``layers``) for a StreamedSwitchGLU over a
    ``rows``-record arena; the parameters removed must be exactly the
    routed-expert tensors the resident path would load from the store's
    layout."""
    fam = m.family
    layers = range(fam.num_hidden_layers) if layers is None else layers
    experts = StreamedExperts.from_artifact(m, rows, dtype=dtype, engine=engine, mirror=mirror)
    before = _routed_expert_keys(model)
    switches = attach([model.model.layers[i].mlp for i in layers], experts, layers)
    replaced = before - _routed_expert_keys(model)
    g = em.Geometry(fam, m.experts.expert_codec)
    want = {
        f"model.layers.{layer}.mlp.switch_mlp.{comp}_proj.{part}"
        for layer in layers
        for comp, part, *_ in g.layer_layout(layer)
    }
    if replaced != want or _routed_expert_keys(model):
        raise GeometryError(
            "experts", f"streamed experts replaced {len(replaced)} tensors, the store holds {len(want)}"
        )
    return experts, switches


class _Absent(nn.Module):
    """Stands where another pipeline rank's module would be: no parameters, never called."""

    def __call__(self, *args, **kwargs):  # pragma: no cover - a wiring bug if reached
        raise RuntimeError("called a module owned by another pipeline rank")


def prune(model, stage):
    """Drop every module another pipeline rank owns, before any weight is loaded or evaluated
    (their lazy initial values are never materialised)."""
    layers = model.model.layers
    for i in range(len(layers)):
        if i not in stage.layers:
            layers[i] = _Absent()
    if not stage.first:
        model.model.embed_tokens = _Absent()
    if not (stage.last or stage.heads):
        model.model.hyper_connection_mixer = _Absent()
        model.lm_head = _Absent()
    return model


def load_artifact_model(
    path,
    dtype=mx.float32,
    expert_cache_gb=None,
    ple_cache_gb=None,
    stage=None,
    prefetch=None,
    expert_mirror=None,
    prefill_sweep=None,
    options=None,
    settings=None,
) -> Model:
    """Admit `path` (or take an already admitted Manifest), then build and fill the graph from the
    admitted manifest (manifest.json and config.json are not read again).

    dtype: float tensors (dense floats, f32/bf16 experts, PLE rows) are cast
    to it; None keeps the stored dtype. Affine weights stay packed; their
    bf16 scales/biases are cast too (with fp32 activations MLX's CPU
    quantized matmul then equals the dequantized fp32 product; bf16 scales
    make a quantized embedding emit bf16 activations, ~0.5% off).

    settings: a loading.settings.StreamSettings, or its five fields as keywords (checked once,
    there). expert_cache_gb: stream the routed experts through a cache of this size
    instead of deciding from available memory (:func:`plan_expert_residency`);
    the expert store is then never read into memory. ple_cache_gb: the same
    for the PLE tables' pages (:func:`plan_ple_residency`). Streamed experts
    and PLE share one engine; ``model.streaming`` is the
    :class:`~hebrus_mlx.stream.streaming.Streaming` (engine, experts),
    None when everything is resident. Only the streamed parameters are
    left out of the strict weight load.

    stage: a pipeline stage (:class:`hebrus_mlx.pipeline.split.Stage`): only its layers (and the
    embedding on the first rank, mixer + lm_head on the last) are built and read — no dense
    tensor (given per-tensor digests), expert record or PLE page of another rank is touched; the
    other modules are pruned before any weight is evaluated. A stage streams its own experts / PLE pages through its own engine when its share
    does not fit (or a cache size is given), exactly as a whole model does. Stages leave out the
    MTP head, except rank 0 of a pipeline that drafts with it (`stage.heads`).

    prefetch: the streamed experts' read-ahead (``stream.predict``: ``"off"``, ``"previous"``,
    ``"router-reuse:2"``, ``"hyper-reuse"`` or a PrefetchSpec); None: ``stream.predict.DEFAULT``. Naming one
    for a model whose experts are resident is a UsageError.

    expert_mirror: a directory holding a byte-identical copy of the expert store (a second disk);
    streamed reads alternate between the two files (``admission.admit_mirror`` checks it first).
    Not verified on two disks here. Naming one for resident experts is a UsageError.

    prefill_sweep: ``"auto"`` (None), ``"on"`` or ``"off"`` (``stream.sweep``): long prefill chunks
    read each layer's whole expert extent into a two-layer ring. The ring must fit available memory
    minus ``RESERVE_BYTES`` after the load: ``on`` is refused otherwise (SweepBudgetError), ``auto``
    then stays off. ``on`` for resident experts is a UsageError. ``auto`` switches at the crossover
    the machine profile measured for this store's geometry and file system (``hebrus-mlx qualify``,
    ``stream.crossover``), else at the built-in one; the sweep line names which.
    """
    # The settings are checked before admission; admission raises before anything below allocates.
    settings = resolve(
        settings,
        expert_cache_gb=expert_cache_gb,
        ple_cache_gb=ple_cache_gb,
        prefetch=prefetch,
        expert_mirror=expert_mirror,
        prefill_sweep=prefill_sweep,
    )
    expert_cache_gb, prefetch, expert_mirror = settings.expert_cache_gb, settings.prefetch, settings.expert_mirror
    sweep_mode = settings.prefill_sweep
    m = path if isinstance(path, Manifest) else admission.admit(str(Path(path)))
    plan_ = quantization_plan(m)
    layers = None
    if stage is not None:
        plan_ = {k: v for k, v in plan_.items() if stage.owns(k + ".weight")}
        layers = stage.layers
    ple_cache = plan_ple_residency(m, dtype, settings.ple_cache_gb, stage)
    rows = plan_expert_residency(m, dtype, expert_cache_gb, ple_cache, stage)
    rows = _make_room_for_ring(m, dtype, rows, expert_cache_gb, sweep_mode)
    if prefetch is not None and prefetch.kind != "off" and rows is None:
        raise UsageError("prefetch", "only streamed routed experts are read ahead; this model's experts are resident")
    if expert_mirror is not None and rows is None:
        raise UsageError(
            "expert-mirror", "only streamed routed experts read a mirror; this model's experts are resident"
        )
    if sweep_mode == "on" and rows is None:
        raise UsageError("prefill_sweep", "only streamed routed experts are swept; this model's experts are resident")
    if rows is not None and dtype is not None and dtype != mx.float32:
        raise UsageError("dtype", f"streamed experts run in float32 or the stored dtype (None), got {dtype}")

    # Built whole (expert modules quantized too) so the parameters a streamed
    # switch_mlp replaces are exactly the resident ones; the replaced
    # modules' lazy initial values are never evaluated.
    model = Model(m.args)
    # A product family's model masks its unassigned vocabulary rows itself (AFN-005).
    model.effective_vocab_size = admission.EFFECTIVE_VOCAB.get(m.family.name)
    if stage is not None:
        prune(model, stage)
    if plan_:
        _quantize(model, plan_)
    experts = engine = None
    switches = ()
    if rows is not None or ple_cache is not None:
        # One engine: PLE pages in its slab cache, experts in their arena
        # (the slab budget's record backs the copying ops).
        record = em.Geometry(m.family, m.experts.expert_codec).record_bytes  # the largest layer's
        # CLOCK: measured on demo decode at 5-50% of the records it is within a point of LRU or
        # above it (benchmarks/bench_cache_policy.py), as public runtimes found.
        engine = StreamEngine(cache_bytes=(ple_cache or 0) + C.align_up(record), threads=8, policy="clock")
    try:
        if rows is not None:
            experts, switches = _attach_streamed(m, model, rows, dtype, engine, layers, expert_mirror)
        if ple_cache is not None:
            _attach_ple(m, model, engine, dtype, layers)
        weights = _dense(m, stage)
        if experts is None:
            weights.update(_experts(m, layers))
        if ple_cache is None:
            _quantized_ple_tables(m, model, dtype, layers)
            weights.update(_ple(m, layers))
        if dtype is not None:
            weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
        model.load_weights(list(weights.items()), strict=True)
        # The model holds every array now. Kept here, the dict would keep alive each float weight
        # optimize.apply re-stores ([in, out] copies, joined projections) until this returns: a
        # second copy of them at the load's peak (2.6 GiB at the real geometry), left behind as
        # freed heap in RSS after it.
        del weights
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    mx.eval(model.parameters())
    # The artifact's metadata says whether its norm weights are zero-centred (fold 1 + w here) or
    # already folded; admission validated the field.
    set_norm_weights(model, folded=m.norm_weights == "folded")
    options = optimize.apply(model, options)  # GraphOptions (models/options.py)
    model.eval()
    if engine is not None:
        if prefetch is None and experts is not None:
            prefetch = parse_prefetch(DEFAULT_PREFETCH)
        # A pipeline stage takes rank 0's chunks whether or not it has a sweep ring.
        model.streaming = Streaming(
            engine, experts, switches, prefetch=prefetch, layers=model.model.layers, sweep_lifts_cap=stage is None
        )
        if experts is not None:
            try:
                kw = {}
                # The machine's measured crossover where the profile stands for it (a per-layer store
                # is not swept).
                if sweep_mode == "auto" and not experts.per_layer:
                    cross, source = sweep_crossover.for_store(
                        experts.store_path, sum(experts.part_bytes), experts.num_experts
                    )
                    kw = dict(crossover=cross, crossover_source=source)
                model.streaming.set_prefill_sweep(sweep_mode, budget=plan.available_memory() - RESERVE_BYTES, **kw)
            except BaseException:
                engine.close()
                raise
    if stage is None or stage.heads:
        attach_mtp_head(model, _mtp_head(m, model.args, dtype, options))
    return model


def _mtp_head(m: Manifest, args, dtype, options=None):
    """The optional MTP head, resident (one layer), built from its store's recorded codecs; None
    when the artifact has no MTP store. Hashed and loaded through one open file, like the dense
    store."""
    s = m.mtp
    if s is None:
        return None
    weights = _load_hashed(m, s, "MTP")
    if set(weights) != set(s.tensors):
        raise AdmissionError("mtp.tensors", "MTP file changed after admission")
    head = MTPHead(args)
    plan = {
        name[len("mtp.") : -len(".weight")]: _quant_params(rec["codec"])
        for name, rec in s.tensors.items()
        if C.codec(rec["codec"]).affine and name.endswith(".weight")
    }
    if plan:
        _quantize(head, plan)
    weights = {k[len("mtp.") :]: v for k, v in weights.items()}
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    head.load_weights(list(weights.items()), strict=True)
    del weights  # as in load_artifact_model: optimize.apply's copies must free the originals
    mx.eval(head.parameters())
    set_norm_weights(head, folded=m.norm_weights == "folded")
    optimize.apply(head, options)
    head.eval()
    return head
