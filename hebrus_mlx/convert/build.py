"""`hebrus-mlx convert`: HF Qwen4Exp checkpoint -> hebrus-mlx artifact directory.

Sources: an HF checkpoint directory (bf16/f32/f16 safetensors, or block-FP8,
`convert.fp8`), an MLX-quantized conversion (mlx-vlm / mlx-community layout,
imported without requantizing, `convert.mlx_source`), or a Hub repo id (`hub`).

Tensors are read one at a time straight from the safetensors shards (pread of
one tensor's bytes), so peak memory is about the largest tensor plus a
constant, independent of checkpoint size. Every source key is classified by
the explicit key tables (`format/checkpoint_keys.py`): consumed into the dense
file, the ExpertMajor store or a PLE page store, checked as a PLE constant, or
excluded by a named rule; the counts are asserted and recorded.

The whole directory is published atomically and admitted (CPU-only) from the
temp directory before the rename.
"""

import hashlib
import json
import os
import sys

import numpy as np
from tqdm import tqdm

from .. import admission
from ..artifact import atomic, expert_major, ple_pages, untrusted
from ..artifact import constants as C
from ..artifact import fast_check as FC
from ..artifact import manifest as M
from ..artifact.errors import ArtifactError, GeometryError
from ..format import checkpoint_keys as keys
from ..format.qwen4exp_config import mtp_layer_args
from ..loading import hub
from .sources import COMPONENT_HF_NAMES, Source, encode


def profile_for(q_bits, q_group_size, dtype, expert_bits=None, expert_group_size=None, ple_dtype=None):
    """The profile of per-component widths: dense at q_bits/q_group_size (or `dtype`), routed
    experts at expert_bits/expert_group_size (default: the dense width, or `dtype`'s when the
    dense store is float), the PLE table at ple_dtype (C.PLE_DTYPES; default bf16, f32 under --dtype float32)."""
    floats = {"bfloat16": "bf16", "float32": "f32"}

    def affine(bits, group, field):
        name = C.affine_name(bits, group)
        if name not in C.CODECS or not C.CODECS[name].affine:
            raise ArtifactError(
                field,
                f"no codec for bits={bits} group={group}; affine bits {list(C.AFFINE_BITS)}, "
                f"groups {list(C.AFFINE_GROUPS)}",
            )
        return name

    dense = floats[dtype] if dtype is not None else affine(q_bits, q_group_size, "q_bits")
    if expert_bits is None and expert_group_size is None:
        experts = dense
    else:
        bits = expert_bits if expert_bits is not None else (q_bits if dtype is None else 4)
        group = expert_group_size if expert_group_size is not None else (q_group_size if dtype is None else 64)
        experts = affine(bits, group, "expert_bits" if expert_bits is not None else "expert_group_size")
    ple = C.PLE_DTYPES[ple_dtype] if ple_dtype is not None else ("f32" if dtype == "float32" else "bf16")
    return C.profile_name({"dense": dense, "experts": experts, "ple": ple}, "quantization")


def _dense_items(args, profile):
    shapes = M.dense_shapes(args)
    for key in sorted(shapes):
        yield key, shapes[key], M.dense_codec(key, shapes[key], profile)


def write_header(w, tensors):
    """A safetensors header for `tensors` [(name, dtype, shape)], data laid out in that order;
    returns (header, offset of the data)."""
    header, off = {}, 0
    for name, dtype, shape in tensors:
        n = M.shape_bytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    w.write(len(raw).to_bytes(8, "little") + raw)
    return header, 8 + len(raw)


def write_dense(w, src, args, profile, progress, digests=None):
    """Stream the dense safetensors file: header first (all shapes are known),
    then each tensor in header order. `digests` (a dict) receives each stored tensor's SHA-256,
    so a pipeline rank can verify the tensors it reads without reading the others."""
    stored = M.stored_tensors(args, profile)
    header, base = write_header(w, [(name, *stored[name]) for name in sorted(stored)])
    # Stored names are written in sorted order; an affine tensor's parts
    # (x.biases, x.scales, x.weight) are adjacent there, so only one source
    # tensor's encoding is held at a time.
    source_of = {}
    for key, shape, codec_name in _dense_items(args, profile):
        if C.codec(codec_name).affine:
            stem = key[: -len("weight")]
            for part in C.AFFINE_PARTS:
                source_of[stem + part] = (key, shape, codec_name, part)
        else:
            source_of[key] = (key, shape, codec_name, "weight")
    pending = {}
    for name in sorted(stored):
        key, shape, codec_name, part = source_of[name]
        if key not in pending:
            pending[key] = src.dense_parts(key, shape, codec_name)
        arr = pending[key].pop(part)
        if not pending[key]:
            del pending[key]
        assert (str(arr.dtype), tuple(arr.shape)) == (
            {"U32": "uint32", "BF16": "uint16", "F32": "float32"}[stored[name][0]],
            stored[name][1],
        )
        data = np.ascontiguousarray(arr).tobytes()
        w.write(data)
        if digests is not None:
            digests[name] = hashlib.sha256(data).hexdigest()
        progress(len(data))
    return header, base


def expert_spec(config, profile):
    """What the expert store is written with: the profile's expert codec, or for a per-layer
    profile (an MLX source whose routed experts differ in width per layer or projection) the
    per-layer (gate, up, down) table of the source (mlx_source.expert_codecs)."""
    name = C.profile_codecs(profile)["experts"]
    if name != C.PER_LAYER:
        return name
    from . import mlx_source as convert_mlx

    return convert_mlx.expert_codecs(config)


def expert_records(src, args, fam, codec_name, layout="unfused"):
    """`codec_name`: one codec name, or a per-layer table (each layer's records get its row)."""
    for layer in range(fam.num_hidden_layers):
        row = codec_name if isinstance(codec_name, str) else codec_name[layer]
        for e in range(fam.num_experts):
            yield layer, e, src.expert_parts(layer, e, fam, row, layout)


def _mtp_expert(src, raw, layout, e, comp, fam):
    """(float32 [rows, in], source dtype) of MTP expert e's component, one expert's rows read."""
    m = fam.moe_intermediate_size
    if layout == "unfused":
        return src.read(raw[f"mtp.layers.0.mlp.experts.{e}.{COMPONENT_HF_NAMES[comp]}.weight"])
    if comp == "down":
        d, dt = src.read(raw["mtp.layers.0.mlp.experts.down_proj"], e, e + 1)
        return d[0], dt
    gu, dt = src.read(raw["mtp.layers.0.mlp.experts.gate_up_proj"], e, e + 1)
    return (gu[0, :m] if comp == "gate" else gu[0, m:]), dt


def write_mtp(w, src, args, fam, profile, report, progress=None):
    """The MTP store: one safetensors file of the head's tensors under runtime names, each encoded
    with the codec the profile gives the same kind of tensor in the text model. Header first, then
    every tensor written at its offset; routed experts are encoded one expert at a time."""
    stored = M.mtp_stored_tensors(args, profile)
    header, base = write_header(w, [(name, dtype, shape) for name, (dtype, shape, _) in stored.items()])
    keys_by_name = report["keys"]

    def put(stem, parts, index=None):
        for part, arr in parts.items():
            e = header[stem + part]
            data = np.ascontiguousarray(arr).tobytes()
            at = base + e["data_offsets"][0] + (0 if index is None else index * len(data))
            w.pwrite(data, at)
            if progress is not None:
                progress(len(data))

    for key, shape, codec_name, comp in M.mtp_weights(args, profile):
        stem = key[: -len("weight")]
        if comp is None:
            a, dt = src.read(keys_by_name[key])
            if tuple(a.shape) != tuple(shape):
                raise GeometryError(f"source.{keys_by_name[key]}.shape", f"{list(a.shape)} != expected {list(shape)}")
            put(stem, encode(a, dt, codec_name))
            continue
        for e in range(args.num_experts):
            a, dt = _mtp_expert(src, keys_by_name, report["expert_layout"], e, comp, fam)
            if tuple(a.shape) != tuple(shape):
                raise GeometryError(
                    f"source.mtp.layers.0.mlp.experts.{e}.{COMPONENT_HF_NAMES[comp]}", f"shape {list(a.shape)}"
                )
            put(stem, encode(a, dt, codec_name), e)
    return header


def mtp_store(tmp, header, args, profile, consumed, fast=False):
    """Manifest entry of the MTP store; its inventory records every stored tensor's codec.
    fast: also publish its XXH3-128 chunk table (artifact/fast_check.py)."""
    chunks = FC.scan_file(os.path.join(tmp, M.MTP_PATH), M.MTP_PATH)[1] if fast else None
    s = _store(tmp, "mtp", M.MTP_PATH, "safetensors", C.profile_codecs(profile)["dense"], chunks)
    stored = M.mtp_stored_tensors(args, profile)
    s["tensors"] = {name: dict(e, codec=stored[name][2]) for name, e in sorted(header.items())}
    s["source_tensors"] = consumed
    return s


def detect_family(constants):
    matches = []
    for name in C.FAMILIES:
        try:
            matches.append(C.match_family(constants, name))
        except ArtifactError:
            pass
    if len(matches) != 1:
        raise ArtifactError("family", "config matches no registered family descriptor")
    return matches[0]


def artifact_bytes(args, fam, profile, experts=None):
    """Bytes the stores of `profile` will take (source files excluded: small); `experts`: the
    expert store's codec or per-layer table (`expert_spec`), default the profile's codec."""
    codecs = C.profile_codecs(profile)
    n = sum(M.shape_bytes(d, s) for d, s in M.stored_tensors(args, profile).values())
    n += expert_major.Geometry(fam, experts or codecs["experts"]).file_bytes
    n += sum(ple_pages.Geometry(fam, t, codecs["ple"]).file_bytes for t in range(len(args.ple_layer_ids)))
    return n


def open_source(path, config):
    """The reader for a checkpoint directory: HF safetensors (bf16/f32, or
    block-FP8), or an MLX-quantized conversion (`mlx_source`)."""
    from . import mlx_source as convert_mlx

    if convert_mlx.is_mlx_config(config):
        return convert_mlx.MlxSource(path, config)
    return Source(path, config)


def plan(config, q_bits=None, q_group_size=None, dtype=None, expert_bits=None, expert_group_size=None, ple_dtype=None):
    """(profile, args, constants, family) of a source config; q_bits and
    q_group_size default to 4/64 for float sources, experts to the dense width;
    an MLX-quantized source imports into the profile of its own quantization."""
    from . import mlx_source as convert_mlx

    if convert_mlx.is_mlx_config(config):
        profile = convert_mlx.source_profile(
            config, q_bits, q_group_size, dtype, expert_bits, expert_group_size, ple_dtype
        )
    else:
        profile = profile_for(
            4 if q_bits is None else q_bits,
            64 if q_group_size is None else q_group_size,
            dtype,
            expert_bits,
            expert_group_size,
            ple_dtype,
        )
    constants = M.model_constants(config)
    return profile, M.model_args(config), constants, detect_family(constants)


def replaceable_artifact(path):
    """None when directory `path` is a hebrus-mlx artifact whose manifest owns every entry in it
    (replacing it loses nothing the user put there), else the reason it is not."""
    try:
        man = untrusted.read_json(path, C.MANIFEST_NAME, "manifest")
    except FileNotFoundError:
        return "no manifest.json"
    except (OSError, ArtifactError) as e:
        return f"manifest.json: {getattr(e, 'message', e)}"
    if type(man) is not dict or man.get("schema") != C.MANIFEST_SCHEMA:
        return "manifest.json is not a hebrus-mlx manifest"
    owned = {C.MANIFEST_NAME}
    for s in man.get("stores") if type(man.get("stores")) is list else ():
        if type(s) is dict and type(s.get("path")) is str:
            owned.add(s["path"])
        fc = s.get("fast_check") if type(s) is dict else None  # the store's digest table file
        if type(fc) is dict and type(fc.get("path")) is str:
            owned.add(fc["path"])
    source = man.get("source") if type(man.get("source")) is dict else {}
    if type(source.get("files")) is dict:
        owned |= set(source["files"])
    extra = sorted(set(os.listdir(path)) - owned)
    if extra:
        return f"{extra[0]!r} is not a file of its manifest"
    return None


def check_out(out, overwrite, source=None):
    """`--out` may be new, an empty directory, or (with overwrite) an earlier artifact; never the
    source, a parent of it, the working directory, a file or a symlink (atomic.check_replaceable)."""
    atomic.check_replaceable(
        out, overwrite=overwrite, is_ours=replaceable_artifact, protect=(source,), what="artifact", field="--out"
    )


def convert(
    hf_path,
    out,
    q_bits=None,
    q_group_size=None,
    dtype=None,
    revision=None,
    repo=None,
    quiet=False,
    mtp=True,
    overwrite=False,
    expert_bits=None,
    expert_group_size=None,
    ple_dtype=None,
    source=None,
):
    """source: an open source answering what `Source` answers (check, dense_parts, expert_parts,
    ple_chunks, index), read instead of opening `hf_path`'s shards (hf_path still gives config.json
    and the source files), e.g. a generated checkpoint of the real geometry.
    expert_bits / expert_group_size: the routed experts' own affine width (default: the dense
    one); ple_dtype: the PLE table's ("bfloat16", "float32", "q8" or "q4"). mtp: keep the checkpoint's `mtp.*` head (when it has one) as the artifact's optional MTP
    store; False excludes it (counted under the "mtp" exclusion rule). overwrite: `out` may be an
    earlier artifact, replaced once the new one is admitted (`check_out`)."""
    widths = (expert_bits, expert_group_size, ple_dtype)
    check_out(out, overwrite, hf_path if os.path.exists(hf_path) else None)
    for t in atomic.clean_stale(out):  # a killed run's temporaries (flock-free: their writer is gone)
        if not quiet:
            print(f"hebrus-mlx convert: removed {t} (left by an interrupted conversion)", file=sys.stderr)
    if not os.path.isdir(hf_path):
        # A path-like name that is not a directory is a typo, not a Hub repo id.
        if os.path.isabs(hf_path) or hf_path.startswith((".", "~")) or os.path.exists(hf_path):
            raise ArtifactError("hf_path", f"{hf_path} is not a checkpoint directory")
        # Plan from the repo's config.json first, so one disk check covers the
        # download and the artifact before either starts.
        repo = hf_path
        repo_config = hub.read_config(repo, revision)
        profile, args, _, fam = plan(repo_config, q_bits, q_group_size, dtype, *widths)
        also = artifact_bytes(args, fam, profile, expert_spec(repo_config, profile))
        hf_path = str(hub.download(repo, revision, also=(also, out)))
        check_out(out, overwrite, hf_path)  # never the HF cache that holds the download
    config = untrusted.read_json(hf_path, "config.json", links=True)
    profile, args, constants, fam = plan(config, q_bits, q_group_size, dtype, *widths)
    codecs = C.profile_codecs(profile)
    experts = expert_spec(config, profile)
    src = source if source is not None else open_source(hf_path, config)
    counts = src.check(args)
    mtp_report = keys.check_mtp_key_set(list(src.index), args) if mtp else None
    if mtp_report is not None:
        mtp_layer_args(args)  # the head's QSA layer needs the indexer fields
    # The artifact is written next to `out` before the rename: refuse up front
    # rather than fail with ENOSPC after hours of a 100+ GB conversion.
    # A staged source (hub_shards) deletes its files as the stores take them: those bytes come back.
    needed = artifact_bytes(args, fam, profile, experts) - getattr(src, "reclaimed_bytes", 0)
    hub.check_free(max(0, needed), out, f"converting into {out}", field="out")

    def bar(label, total):
        # Bytes written; shown on a terminal only (tqdm's disable=None).
        return tqdm(
            total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, disable=True if quiet else None
        )

    def build(tmp):
        source_files = {}
        for name in C.SOURCE_FILES:
            p = os.path.join(hf_path, name)
            if os.path.isfile(p):
                atomic.publish_file(os.path.join(tmp, name), lambda w, p=p: _copy(p, w))
                source_files[name] = M.sha256_file(p)
        stores = []

        p = bar("dense", sum(M.shape_bytes(d, s) for d, s in M.stored_tensors(args, profile).values()))
        result = {}

        def dense(w):
            result["header"], result["base"] = write_dense(
                w, src, args, profile, p.update, result.setdefault("sha256", {})
            )

        atomic.publish_file(os.path.join(tmp, M.DENSE_PATH), dense)
        p.close()
        stores.append(_store(tmp, "dense", M.DENSE_PATH, "safetensors", codecs["dense"]))

        g = expert_major.Geometry(fam, experts)
        p = bar("experts", g.payload_bytes)
        fast = _collector(g.count, M.EXPERTS_PATH)
        expert_major.publish(
            os.path.join(tmp, M.EXPERTS_PATH),
            fam,
            experts,
            expert_records(src, args, fam, experts, counts["expert_layout"]),
            progress=p.update,
            fast=fast,
        )
        p.close()
        fmt = "expert_major.v3" if g.per_layer else "expert_major.v2"
        stores.append(_store(tmp, "experts", M.EXPERTS_PATH, fmt, codecs["experts"], fast))
        if g.per_layer:  # each layer's [gate, up, down] codecs (the header binds their digest)
            stores[-1]["layer_codecs"] = [list(row) for row in g.layer_codecs]

        for t, layer_id in enumerate(args.ple_layer_ids):
            g = ple_pages.Geometry(fam, t, codecs["ple"])
            p = bar(f"ple[{t}]", g.payload_bytes)
            fast = _collector(g.num_pages, M.ple_path(t))
            ple_pages.publish(
                os.path.join(tmp, M.ple_path(t)),
                fam,
                t,
                codecs["ple"],
                src.ple_chunks(args, layer_id - 1, codecs["ple"]),
                progress=p.update,
                fast=fast,
            )
            p.close()
            s = _store(tmp, "ple", M.ple_path(t), "ple_pages.v1", codecs["ple"], fast)
            s.update(table=t, layer=layer_id - 1, rows_per_page=g.rows_per_page)
            stores.append(s)

        if mtp_report is not None:
            p = bar("mtp", sum(M.shape_bytes(d, sh) for d, sh, _ in M.mtp_stored_tensors(args, profile).values()))
            mtp_header = {}

            def write(w):
                mtp_header.update(write_mtp(w, src, args, fam, profile, mtp_report, p.update))

            atomic.publish_file(os.path.join(tmp, M.MTP_PATH), write)
            p.close()
            stores.append(
                mtp_store(tmp, mtp_header, args, profile, mtp_report["consumed"], fast=FC.xxh3_128() is not None)
            )

        tensors = {}
        shapes = M.dense_shapes(args)
        for name, e in result["header"].items():
            wkey = name if name in shapes else name.rsplit(".", 1)[0] + ".weight"
            tensors[name] = {
                "dtype": e["dtype"],
                "shape": e["shape"],
                "data_offsets": e["data_offsets"],
                "codec": M.dense_codec(wkey, shapes[wkey], profile),
                "sha256": result["sha256"][name],
            }
        man = M.build(
            family=fam.name,
            profile=profile,
            source_files=source_files,
            revision=revision,
            repo=repo,
            constants=constants,
            stores=stores,
            tensors=tensors,
            exclusions=counts["excluded"],
            consumed=counts["consumed"],
            mtp=mtp_report is not None,
        )
        data = M.dumps(man)
        atomic.publish_file(os.path.join(tmp, C.MANIFEST_NAME), lambda w: w.write(data))

    # Checked again at the swap: the conversion may have taken hours.
    atomic.publish_dir(out, build, verify=admission.admit, replace=lambda t: check_out(t, overwrite, hf_path))
    return admission.admit(out)


def add_mtp(artifact, mtp_source, quiet=False):
    """Republish `artifact` with the MTP head read from `mtp_source` (a directory of safetensors
    holding exactly the `mtp.*` tensors, e.g. a trained head), encoded with the artifact's own
    profile codecs. Every other file is copied byte for byte; the new directory is admitted before
    it atomically replaces the old one. Replaces an MTP store already present."""
    from ..format.qwen4exp_config import ModelArgs

    admission.admit(artifact)
    man = untrusted.read_json(artifact, C.MANIFEST_NAME, "manifest")
    args = ModelArgs.from_dict(untrusted.read_json(artifact, "config.json"))
    mtp_layer_args(args)
    fam = C.family(man["family"])
    src = Source(mtp_source)
    report = keys.check_mtp_key_set(list(src.index), args)
    if report is None:
        raise ArtifactError("mtp_source", f"{mtp_source} holds no mtp.* tensors")
    extra = sorted(set(src.index) - set(report["keys"].values()))
    if extra:
        raise ArtifactError(f"mtp_source.{extra[0]}", "not an MTP tensor")
    profile = man["profile"]

    fast = any("fast_check" in s for s in man["stores"])

    def build(tmp):
        for s in man["stores"]:
            if s["role"] != "mtp":
                for name in [s["path"]] + ([s["fast_check"]["path"]] if "fast_check" in s else []):
                    atomic.publish_file(os.path.join(tmp, name), lambda w, p=os.path.join(artifact, name): _copy(p, w))
        for name in man["source"]["files"]:
            atomic.publish_file(os.path.join(tmp, name), lambda w, p=os.path.join(artifact, name): _copy(p, w))
        p = tqdm(
            total=sum(M.shape_bytes(d, sh) for d, sh, _ in M.mtp_stored_tensors(args, profile).values()),
            desc="mtp",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            disable=True if quiet else None,
        )
        header = {}
        atomic.publish_file(
            os.path.join(tmp, M.MTP_PATH),
            lambda w: header.update(write_mtp(w, src, args, fam, profile, report, p.update)),
        )
        p.close()
        new = dict(
            man,
            stores=[s for s in man["stores"] if s["role"] != "mtp"]
            + [mtp_store(tmp, header, args, profile, report["consumed"], fast)],
            policy=dict(man["policy"], mtp="included"),
            exclusions=dict(man["exclusions"], mtp=0),
        )
        data = M.dumps(new)
        atomic.publish_file(os.path.join(tmp, C.MANIFEST_NAME), lambda w: w.write(data))

    atomic.publish_dir(artifact, build, verify=admission.admit)
    return admission.admit(artifact)


def add_dense_digests(artifact):
    """Give an older artifact's manifest the per-tensor digests of its dense store (what a pipeline
    rank verifies instead of the whole file). Only manifest.json is republished (temp + fsync +
    rename); the digests are taken from bytes whose whole-file digest matched first."""
    m = admission.admit(artifact)
    man = untrusted.read_json(artifact, C.MANIFEST_NAME, "manifest")
    with open(m.file(m.dense), "rb") as f:
        raw = f.read()
    if hashlib.sha256(raw).hexdigest() != m.dense.sha256:
        raise ArtifactError(f"stores.{m.dense.path}.sha256", "dense store digest mismatch")
    base = 8 + int.from_bytes(raw[:8], "little")
    for rec in man["tensors"].values():
        begin, end = rec["data_offsets"]
        rec["sha256"] = hashlib.sha256(raw[base + begin : base + end]).hexdigest()
    data = M.dumps(man)
    atomic.publish_file(os.path.join(artifact, C.MANIFEST_NAME), lambda w: w.write(data))
    return admission.admit(artifact)


def _copy(path, w):
    with open(path, "rb") as f:
        while True:
            b = f.read(8 << 20)
            if not b:
                break
            w.write(b)


def _store(tmp, role, path, fmt, codec_name, fast=None):
    """A store's manifest entry; `fast` (a fast_check.Collector fed by the store's verify pass):
    its XXH3-128 digest table is published beside it and named in the entry."""
    full = os.path.join(tmp, path)
    s = {
        "role": role,
        "path": path,
        "format": fmt,
        "codec": codec_name,
        "size": os.path.getsize(full),
        "sha256": M.sha256_file(full),
    }
    if fast is not None:
        table = fast.table()
        atomic.publish_file(os.path.join(tmp, FC.table_path(path)), lambda w: w.write(table))
        s["fast_check"] = FC.entry(path, table)
    return s


def _collector(units, path):
    """What the verify pass of a new store feeds its records/pages to, for the fast check;
    None without the compiled extension (the artifact then checks reads by SHA-256)."""
    return FC.Collector(units, path) if FC.xxh3_128() is not None else None
