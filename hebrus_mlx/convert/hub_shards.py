"""Shard-by-shard conversion of a Hub checkpoint (`convert --hf-path ORG/NAME --stream-shards`).

The whole-snapshot path (`hub.download`) needs the source (the real checkpoint: ~360 GB in 131
shards) and the artifact on disk at once. Here each shard is fetched, every tensor in it encoded
into staged store parts (the same arrays the whole-snapshot conversion computes from it), and the
shard deleted, while the next shard is fetched ahead. The staged parts are then handed to
`build.convert` as its source, which deletes each staged file once the store it feeds has taken
all of it; so the disk holds about the artifact plus two shards at any time.

Staging lives in `.NAME.shards` beside `--out`. `done/SHARD.json` there records, per shard, the
staged files it produced with their size and SHA-256; it is published after those files are
(temp + fsync + rename each), so an interrupted run resumes with the shards whose staged files
all verify, and fetches the others again. A plan change (other repo revision, widths, MTP
choice, index) starts over. Block-FP8 and MLX-quantized sources read tensors across shards (scale
tensors) and are converted from a whole snapshot instead.
"""

import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..artifact import atomic, untrusted
from ..artifact import constants as C
from ..artifact import manifest as M
from ..artifact.errors import ArtifactError, GeometryError
from ..format import checkpoint_keys as keys
from ..format.qwen4exp_config import ple_constants
from ..loading import hub
from . import mlx_source as convert_mlx
from .build import artifact_bytes, check_out, convert, expert_spec, plan
from .fp8 import block_config
from .sources import PLE_CHUNK_ROWS, Source, encode

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PLAN_NAME = "plan.json"  # what the staged files were made for
DONE_DIR = "done"  # one record per staged shard: its files' sizes and SHA-256, its entries
PLAN_SCHEMA = "hebrus-mlx.shard-progress.v1"
WIDTHS = ("q_bits", "q_group_size", "dtype", "expert_bits", "expert_group_size", "ple_dtype")  # plan()'s order
_DTYPES = ("uint8", "uint16", "uint32", "float32")  # what the store encoders give
_COMPONENTS = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))


class HubFetcher:
    """The files of one Hub repo: their sizes from one `model_info` call, each file downloaded
    into a directory the caller owns (and deletes). Pinned to the commit the sizes came from."""

    def __init__(self, repo, revision=None):
        self.repo, self.revision = repo, revision

    def sizes(self):
        from huggingface_hub import HfApi

        try:
            info = HfApi().model_info(self.repo, revision=self.revision, files_metadata=True)
        except Exception as e:  # network/auth/not-found: version-dependent exception types
            raise hub.HubError(
                "model", f"{self.repo}: cannot read repo info ({type(e).__name__}: {_line(e)})"
            ) from None
        self.revision = info.sha or self.revision
        return {f.rfilename: f.size for f in info.siblings or ()}

    def __call__(self, name, dest):
        from huggingface_hub import hf_hub_download

        try:
            return hf_hub_download(self.repo, name, revision=self.revision, local_dir=dest)
        except Exception as e:  # network/auth: version-dependent exception types
            raise hub.HubError(
                "model", f"{self.repo}: cannot download {name} ({type(e).__name__}: {_line(e)})"
            ) from None


def stage_dir(out):
    out = os.path.abspath(out)
    return os.path.join(os.path.dirname(out), "." + os.path.basename(out) + ".shards")


def convert_streamed(repo, out, fetch=None, revision=None, quiet=False, mtp=True, overwrite=False, **widths):
    """Convert Hub repo `repo` into `out` one shard at a time. `fetch`: an object with `sizes()`
    ({file name: bytes} of the repo) and `fetch(name, dest) -> path` (the file downloaded into
    directory `dest`); default `HubFetcher(repo, revision)`. `widths`: convert's q_bits,
    q_group_size, dtype, expert_bits, expert_group_size, ple_dtype. Returns the admitted artifact."""
    check_out(out, overwrite)  # refused now, not after hours of fetching
    fetch = fetch or HubFetcher(repo, revision)
    stage = stage_dir(out)
    sizes = fetch.sizes()
    meta = os.path.join(stage, "meta")
    if os.path.lexists(stage):
        _check_stage_is_ours(stage)
    shutil.rmtree(meta, ignore_errors=True)  # small files, fetched afresh: the repo may have moved on
    os.makedirs(meta)
    for name in sorted(set(C.SOURCE_FILES) | {INDEX_NAME}):
        if name in sizes:
            _fetch_into(fetch, name, meta)
    config = untrusted.read_json(meta, "config.json")
    if convert_mlx.is_mlx_config(config) or block_config(config) is not None:
        raise ArtifactError(
            "--stream-shards", "block-FP8 and MLX-quantized sources are converted from a whole snapshot (drop the flag)"
        )
    weight_map = _weight_map(meta, sizes)
    shards = sorted(set(weight_map.values()))
    for s in shards:
        if sizes.get(s) is None:
            raise hub.HubError("model", f"{repo}: the Hub gave no size for {s}")
    profile, args, _, fam = plan(config, *(widths.get(k) for k in WIDTHS))
    experts = expert_spec(config, profile)
    staged = StagedSource(stage, weight_map)
    counts = keys.check_key_set(list(weight_map), args)
    mtp_report = keys.check_mtp_key_set(list(weight_map), args) if mtp else None
    jobs = _jobs(staged, args, fam, profile, experts, counts["expert_layout"], mtp_report)

    identity = {
        "repo": repo,
        "revision": getattr(fetch, "revision", revision),
        "profile": profile,
        "mtp": mtp_report is not None,
        "config_sha256": M.sha256_file(os.path.join(meta, "config.json")),
        "weight_map_sha256": hashlib.sha256(json.dumps(weight_map, sort_keys=True).encode()).hexdigest(),
    }
    done = _resume(stage, identity, shards, quiet)
    todo = [s for s in shards if s not in done]
    # Before any shard is fetched: the artifact, plus the two largest shards that will be on
    # disk at once, less what earlier runs already staged (it becomes the artifact).
    done_bytes = sum(f["size"] for rec in done.values() for f in rec["files"].values())
    largest = sum(sorted(sizes[s] for s in todo)[-2:])
    needed = max(0, artifact_bytes(args, fam, profile, experts) + largest - done_bytes)
    hub.check_free(needed, out, f"converting {repo} shard by shard into {out}", field="out")

    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(_fetch_shard, fetch, todo[0], stage) if todo else None
        try:
            for i, shard in enumerate(todo):
                path = ahead.result()
                # The next shard downloads while this one is encoded: two on disk at most.
                ahead = pool.submit(_fetch_shard, fetch, todo[i + 1], stage) if i + 1 < len(todo) else None
                rec = _stage_shard(stage, shard, path, weight_map, jobs, config)
                shutil.rmtree(os.path.dirname(path))
                _publish_json(os.path.join(stage, DONE_DIR, shard + ".json"), rec)
                done[shard] = rec
                if not quiet:
                    print(f"hebrus-mlx convert: staged {shard} ({i + 1}/{len(todo)} this run)", file=sys.stderr)
        finally:
            if ahead is not None:
                ahead.exception()  # wait for it before its directory goes
            shutil.rmtree(os.path.join(stage, "fetch"), ignore_errors=True)

    staged.load(done)
    result = convert(
        meta,
        out,
        revision=identity["revision"],
        repo=repo,
        quiet=quiet,
        mtp=mtp,
        overwrite=overwrite,
        source=staged,
        **widths,
    )
    shutil.rmtree(stage, ignore_errors=True)
    return result


class StagedSource(Source):
    """The staged parts of every shard, answering what `convert` asks of a source. Each dense,
    expert and PLE entry is read once; a staged file is deleted when its last entry has been read,
    and `reclaimed_bytes` (what those files hold) is credited to convert's free-disk check."""

    def __init__(self, stage, weight_map):
        self.path, self.stage = stage, stage
        self.index = {k: None for k in weight_map}
        self.entries, self.left = {}, {}
        self.reclaimed_bytes = 0
        self.raw = None

    def load(self, done):
        for rec in done.values():
            self.entries.update(rec["entries"])
            for fname, f in rec["files"].items():
                if fname.endswith(".bin"):  # the raw tensors are read again and again: kept to the end
                    self.reclaimed_bytes += f["size"]
        if any(name.endswith(".safetensors") for name in os.listdir(self.stage)):
            self.raw = Source(self.stage)
        for loc in self.entries.values():
            for part in loc.values():
                self.left[part[0]] = self.left.get(part[0], 0) + 1

    def _parts(self, entry):
        if entry not in self.entries:
            raise ArtifactError(f"source.{entry}", "missing from the staged shards")
        out = {}
        for part, (fname, dtype, shape, offset) in self.entries[entry].items():
            count = int(np.prod(shape, dtype=np.int64))
            a = np.fromfile(os.path.join(self.stage, fname), dtype=dtype, count=count, offset=offset)
            if a.size != count:
                raise ArtifactError(f"source.{entry}", f"staged file {fname} is short")
            out[part] = a.reshape(shape)
            self.left[fname] -= 1
            if self.left[fname] == 0:
                os.remove(os.path.join(self.stage, fname))
        return out

    # PLE constants and the MTP head: the source's own bytes, read as the source would be.
    def read(self, key, start=None, stop=None):
        if self.raw is None or key not in self.raw.index:
            raise ArtifactError(f"source.{key}", "missing from the staged shards")
        return self.raw.read(key, start, stop)

    def shape(self, key):
        return self.raw.shape(key)

    def dense_parts(self, key, shape, codec_name):
        return self._parts(f"dense|{key}")

    def expert_parts(self, layer, e, fam, codec_name, layout):
        return {comp: self._parts(f"expert|{layer}|{e}|{comp}") for comp, _ in _COMPONENTS}

    def ple_chunks(self, args, layer, codec_name):
        for s in range(args.split_ngram_parts):
            c = 0
            while f"ple|{layer}|{s}|{c}" in self.entries:
                yield self._parts(f"ple|{layer}|{s}|{c}")["weight"]
                c += 1


def _jobs(src, args, fam, profile, experts, layout, mtp_report):
    """{raw key: [(group, produce)]}: what each source tensor is staged as; `produce(shard_src,
    raw)` yields (entry, {part: array}), the arrays the whole-snapshot conversion
    computes from that tensor."""
    jobs = {}

    def add(text_key, group, produce):
        raw = src.key(text_key)
        jobs.setdefault(raw, []).append((group, produce))

    shapes = M.dense_shapes(args)
    for key in sorted(shapes):
        codec_name = M.dense_codec(key, shapes[key], profile)
        add(key, "dense", lambda s, raw, k=key, c=codec_name: [(f"dense|{k}", s.dense_parts(k, shapes[k], c))])

    for layer in range(fam.num_hidden_layers):
        row = experts if isinstance(experts, str) else experts[layer]
        prefix = f"model.layers.{layer}.mlp.experts."
        if layout == "unfused":
            for e in range(fam.num_experts):
                for comp, hf in _COMPONENTS:
                    add(f"{prefix}{e}.{hf}.weight", f"experts.{layer}", _expert(layer, comp, fam, row, e))
        else:
            add(prefix + "gate_up_proj", f"experts.{layer}", _expert(layer, "gate_up", fam, row))
            add(prefix + "down_proj", f"experts.{layer}", _expert(layer, "down", fam, row))

    codecs = C.profile_codecs(profile)
    for t, layer_id in enumerate(args.ple_layer_ids):
        for s in range(args.split_ngram_parts):
            key = f"model.layers.{layer_id - 1}.ple.ple_embedding.ngram_embedding.shard_{s}.weight"
            add(key, f"ple.{t}", _ple(layer_id - 1, s, codecs["ple"]))
        for name in ple_constants(args, t):
            add(f"model.layers.{layer_id - 1}.ple.ple_embedding.{name}", "raw", None)
    if mtp_report is not None:
        for raw in mtp_report["keys"].values():
            jobs.setdefault(raw, []).append(("raw", None))
    return jobs


def _expert(layer, comp, fam, codec_name, e=None):
    m, h = fam.moe_intermediate_size, fam.hidden_size
    want = {"gate_up": (fam.num_experts, 2 * m, h), "down": (fam.num_experts, h, m)}

    def checked(name, a, dt, c):
        if tuple(a.shape) != fam.component_shapes()[c]:
            raise GeometryError(f"source.layers.{layer}.experts.{name}", f"shape {list(a.shape)}")
        return encode(a, dt, codec_name)

    def produce(s, raw):
        if e is not None:  # one expert's component (the unfused layout)
            a, dt = s.read(raw)
            return [(f"expert|{layer}|{e}|{comp}", checked(f"{e}.{comp}", a, dt, comp))]
        if s.shape(raw) != want[comp]:
            raise GeometryError(f"source.{raw}.shape", f"{list(s.shape(raw))} != expected {list(want[comp])}")
        return _fused(s, raw, layer, comp, fam, checked)

    return produce


def _fused(s, raw, layer, comp, fam, checked):
    m = fam.moe_intermediate_size
    for e in range(fam.num_experts):
        a, dt = s.read(raw, e, e + 1)
        if comp == "down":
            yield f"expert|{layer}|{e}|down", checked(f"{e}.down", a[0], dt, "down")
        else:
            yield f"expert|{layer}|{e}|gate", checked(f"{e}.gate", a[0, :m], dt, "gate")
            yield f"expert|{layer}|{e}|up", checked(f"{e}.up", a[0, m:], dt, "up")


def _ple(layer, s, codec_name):
    def produce(src, raw):
        rows = src.shape(raw)[0]
        for c, start in enumerate(range(0, rows, PLE_CHUNK_ROWS)):
            a, dt = src.read(raw, start, min(rows, start + PLE_CHUNK_ROWS))
            yield f"ple|{layer}|{s}|{c}", {"weight": encode(a, dt, codec_name)["weight"]}

    return produce


def _stage_shard(stage, shard, path, weight_map, jobs, config):
    """Encode every tensor of one fetched shard into its staged files (one per group, each
    published atomically); returns the shard's progress record."""
    src = Source(os.path.dirname(path), config)
    want = sorted(k for k, s in weight_map.items() if s == shard)
    if sorted(src.index) != want:
        extra = sorted(set(src.index) ^ set(want))
        raise ArtifactError(f"source.{shard}", f"tensors differ from {INDEX_NAME}'s weight_map (e.g. {extra[0]!r})")
    groups = {}
    for raw in want:
        for group, produce in jobs.get(raw, ()):
            groups.setdefault(group, []).append((raw, produce))
    rec = {"files": {}, "entries": {}}
    stem = shard[: -len(".safetensors")]
    raw = [k for k, _ in groups.pop("raw", ())]
    if raw:  # copied byte for byte into a safetensors file of their own
        fname = f"{stem}.raw.safetensors"
        atomic.publish_file(os.path.join(stage, fname), lambda w: _copy_tensors(w, src, raw))
        path_ = os.path.join(stage, fname)
        rec["files"][fname] = {"size": os.path.getsize(path_), "sha256": M.sha256_file(path_)}
    for group, items in groups.items():
        fname = f"{stem}.{group}.bin"
        digest, offset = hashlib.sha256(), 0

        def write(w, items=items, fname=fname):
            nonlocal offset
            for raw, produce in items:
                for entry, parts in produce(src, raw):
                    loc = rec["entries"].setdefault(entry, {})
                    for part, arr in parts.items():
                        data = np.ascontiguousarray(arr).tobytes()
                        w.write(data)
                        digest.update(data)
                        loc[part] = [fname, str(arr.dtype), list(arr.shape), offset]
                        offset += len(data)

        atomic.publish_file(os.path.join(stage, fname), write)
        rec["files"][fname] = {"size": offset, "sha256": digest.hexdigest()}
    return rec


def _copy_tensors(w, src, names):
    """Tensors `names` of shard source `src` as one safetensors file, their bytes unchanged."""
    entries = [src.index[k] for k in names]
    header, off = {}, 0
    for k, (_, _, e) in zip(names, entries):
        n = e["data_offsets"][1] - e["data_offsets"][0]
        header[k] = {"dtype": e["dtype"], "shape": e["shape"], "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    w.write(len(raw).to_bytes(8, "little") + raw)
    for k, (path, base, e) in zip(names, entries):
        begin, end = e["data_offsets"]
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), end - begin, base + begin)
        if len(data) != end - begin:
            raise ArtifactError(f"source.{k}", "short read")
        w.write(data)


def _resume(stage, identity, shards, quiet):
    """{shard: record} of the shards an earlier run with the same plan staged and whose staged files
    all verify (size and SHA-256); every other record and staged file is removed."""
    try:
        old = untrusted.read_json(stage, PLAN_NAME, "json")
    except (OSError, ArtifactError, ValueError):
        old = None
    plan_ = {"schema": PLAN_SCHEMA, "identity": identity}
    same = old == plan_
    records = os.path.join(stage, DONE_DIR)
    os.makedirs(records, exist_ok=True)
    done = {}
    for name in sorted(os.listdir(records)):
        shard = name[: -len(".json")]
        if same and name.endswith(".json") and shard in shards:
            try:
                rec = untrusted.read_json(records, name, "json")
                if _entries_ok(rec) and all(_verify(stage, fname, f) for fname, f in rec["files"].items()):
                    done[shard] = rec
                    continue
            except (OSError, ArtifactError, ValueError, KeyError, TypeError, AttributeError):
                pass
            if not quiet:
                print(f"hebrus-mlx convert: {shard} is fetched again (its staged files do not verify)", file=sys.stderr)
        os.remove(os.path.join(records, name))
    keep = {f for rec in done.values() for f in rec["files"]}
    for name in os.listdir(stage):
        if name.endswith((".bin", ".safetensors")) and name not in keep:
            os.remove(os.path.join(stage, name))
    if not same:
        _publish_json(os.path.join(stage, PLAN_NAME), plan_)
    return done


def _entries_ok(rec):
    """Every entry names one of the record's own files, a plain dtype, a shape and an offset."""
    for loc in rec["entries"].values():
        for fname, dtype, shape, offset in loc.values():
            if fname not in rec["files"] or dtype not in _DTYPES or type(offset) is not int or offset < 0:
                return False
            if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
                return False
    return True


def _verify(stage, fname, f):
    path = os.path.join(stage, fname)
    if os.path.basename(fname) != fname or not os.path.isfile(path) or os.path.getsize(path) != f["size"]:
        return False
    return M.sha256_file(path) == f["sha256"]


def _publish_json(path, obj):
    data = json.dumps(obj, sort_keys=True).encode()
    atomic.publish_file(path, lambda w: w.write(data))


def _check_stage_is_ours(stage):
    """The staging directory holds only what this module writes (it removes stale files there)."""
    if os.path.islink(stage) or not os.path.isdir(stage):
        raise ArtifactError("--out", f"{stage} is in the way of the shard-by-shard staging directory")
    for name in os.listdir(stage):
        if (
            name not in ("meta", "fetch", DONE_DIR, PLAN_NAME)
            and not name.endswith((".bin", ".safetensors"))
            and not name.startswith(".")
        ):
            raise ArtifactError("--out", f"{stage} holds {name!r}, not a file of a shard-by-shard conversion")


def _weight_map(meta, sizes):
    """{raw key: shard file} from the index (or the one `model.safetensors`); shard names are plain
    file names of the repo."""
    if os.path.isfile(os.path.join(meta, INDEX_NAME)):
        index = untrusted.read_json(meta, INDEX_NAME, "index")
        wm = index.get("weight_map") if type(index) is dict else None
        if type(wm) is not dict or not all(type(v) is str for v in wm.values()):
            raise ArtifactError(f"{INDEX_NAME}.weight_map", "not a {tensor: file} object")
    elif SINGLE_NAME in sizes:
        raise ArtifactError(
            "--stream-shards", f"the repo is one file ({SINGLE_NAME}): nothing to stream (drop the flag)"
        )
    else:
        raise ArtifactError("--hf-path", f"the repo has neither {INDEX_NAME} nor {SINGLE_NAME}")
    for v in set(wm.values()):
        if os.path.basename(v) != v or not v.endswith(".safetensors") or v.startswith("."):
            raise ArtifactError(f"{INDEX_NAME}.weight_map", f"{v!r} is not a shard file name")
    return wm


def _fetch_shard(fetch, shard, stage):
    dest = os.path.join(stage, "fetch", shard[: -len(".safetensors")])
    shutil.rmtree(dest, ignore_errors=True)  # a partial file of an interrupted run
    os.makedirs(dest)
    return _fetch_into(fetch, shard, dest)


def _fetch_into(fetch, name, dest):
    path = fetch(name, dest)
    if os.path.realpath(path) != os.path.realpath(os.path.join(dest, name)):
        raise ArtifactError("fetch", f"{name} was not downloaded into {dest}")
    return path


def _line(e):
    text = str(e).strip().splitlines()
    return text[0] if text else ""
