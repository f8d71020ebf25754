"""`hebrus-mlx convert`: HF Qwen4Exp checkpoint -> hebrus-mlx artifact directory.

Tensors are read one at a time straight from the safetensors shards (pread of
one tensor's bytes), so peak memory is about the largest tensor plus a
constant, independent of checkpoint size. Every source key is classified by
the explicit key tables (`models/checkpoint_keys.py`): consumed into the dense
file, the ExpertMajor store or a PLE page store, checked as a PLE constant, or
excluded by a named rule; the counts are asserted and recorded.

The whole directory is published atomically and admitted (CPU-only) from the
temp directory before the rename.
"""

import argparse
import json
import os
import sys

import numpy as np

from . import admission
from .artifact import atomic
from .artifact import constants as C
from .artifact import expert_major, manifest as M, ple_pages
from .artifact.errors import ArtifactError, GeometryError
from .artifact.progress import Progress
from .models import checkpoint_keys as keys
from .models.qwen4exp_config import mtp_layer_args, ple_head_offsets, ple_head_vocab_sizes, ple_layer_multipliers

_COMPONENT = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_PLE_CONSTANTS = {
    "layer_multipliers": ple_layer_multipliers,
    "ngram_heads_vocab_sizes": ple_head_vocab_sizes,
    "ngram_heads_offsets": lambda a, t: ple_head_offsets(ple_head_vocab_sizes(a, t)),
}


def profile_for(q_bits, q_group_size, dtype):
    if dtype is not None:
        return {"bfloat16": "text-bf16", "float32": "text-f32"}[dtype]
    name = f"text-affine{q_bits}-g{q_group_size}"
    if name not in C.PROFILES:
        raise ArtifactError("quantization", f"no codec for bits={q_bits} group={q_group_size}; known {sorted(C.PROFILES)}")
    return name


class Source:
    """Index of every tensor in a checkpoint's shards; reads one at a time."""

    def __init__(self, path):
        self.path = path
        self.index = {}
        for name in sorted(os.listdir(path)):
            if not name.endswith(".safetensors"):
                continue
            full = os.path.join(path, name)
            n, header, _ = admission.read_safetensors_header(full)
            for key, e in header.items():
                if key in self.index:
                    raise ArtifactError(f"source.{key}", f"in two shards ({self.index[key][0]} and {full})")
                self.index[key] = (full, 8 + n, e)

    def read(self, key, start=None, stop=None):
        """float32 (or int64 for buffers) ndarray of one source tensor, or of
        rows [start, stop) of its first axis: one pread of just those bytes,
        so a slice of a huge tensor never brings in the rest."""
        path, base, e = self.index[key]
        begin, end = e["data_offsets"]
        shape = list(e["shape"])
        if start is not None:
            if not shape or not 0 <= start <= stop <= shape[0]:
                raise ArtifactError(f"source.{key}", f"rows [{start}, {stop}) outside shape {shape}")
            row = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + start * row, begin + stop * row
            shape[0] = stop - start
        with open(path, "rb") as f:
            raw = os.pread(f.fileno(), end - begin, base + begin)
        if len(raw) != end - begin:
            raise ArtifactError(f"source.{key}", "short read")
        dt = e["dtype"]
        if dt == "BF16":
            a = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dt in ("F32", "F16", "I64"):
            a = np.frombuffer(raw, {"F32": np.float32, "F16": np.float16, "I64": np.int64}[dt])
            a = a.astype(np.float32) if dt == "F16" else a
        else:
            raise ArtifactError(f"source.{key}.dtype", f"unsupported source dtype {dt}")
        return a.reshape(shape), dt

    def shape(self, key):
        return tuple(self.index[key][2]["shape"])

    def key(self, text_key):
        """Raw key for a text-model key, with or without the conditional prefix."""
        if text_key in self.index:
            return text_key
        alt = keys.CONDITIONAL_PREFIX + text_key[len("model."):] if text_key.startswith("model.") else None
        if alt in self.index:
            return alt
        raise ArtifactError(f"source.{text_key}", "missing")


def to_bf16_bits(a, src_dtype):
    """Round-to-nearest-even float32 -> bf16 bits; exact when the source was bf16."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    if src_dtype == "BF16":
        return (bits >> 16).astype(np.uint16)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(a)
    out[nan] = 0x7FC0
    return out


def encode(a, src_dtype, codec_name):
    """{part: ndarray} of one [rows, cols] (or any-rank float) tensor."""
    c = C.codec(codec_name)
    if codec_name == "f32":
        return {"weight": np.ascontiguousarray(a, np.float32)}
    if codec_name == "bf16":
        return {"weight": to_bf16_bits(a, src_dtype)}
    import mlx.core as mx  # quantization is the one MLX step of conversion

    rows, cols = a.shape
    c.parts(rows, cols)  # rejects a group that does not cover the row
    w = mx.array(to_bf16_bits(a, src_dtype)).view(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=c.group_size, bits=c.bits)
    return {"weight": np.array(q), "scales": np.array(s.view(mx.uint16)), "biases": np.array(b.view(mx.uint16))}


def _dense_items(args, profile):
    shapes = M.dense_shapes(args)
    for key in sorted(shapes):
        yield key, shapes[key], M.dense_codec(key, shapes[key], profile)


def write_dense(w, src, args, profile, progress):
    """Stream the dense safetensors file: header first (all shapes are known),
    then each tensor in header order."""
    stored = M.stored_tensors(args, profile)
    header, off = {}, 0
    for name in sorted(stored):
        dtype, shape = stored[name]
        n = M.shape_bytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    w.write(len(raw).to_bytes(8, "little") + raw)
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
            a, dt = src.read(src.key(key))
            if key.endswith(keys.DEPTHWISE_CONV_SUFFIXES):
                a = a.transpose(0, 2, 1)  # HF [C, 1, K] -> MLX [C, K, 1]
            if tuple(a.shape) != tuple(shape):
                raise GeometryError(f"source.{key}.shape", f"{list(a.shape)} != expected {list(shape)}")
            pending[key] = encode(a, dt, codec_name)
        arr = pending[key].pop(part)
        if not pending[key]:
            del pending[key]
        assert (str(arr.dtype), tuple(arr.shape)) == ({"U32": "uint32", "BF16": "uint16", "F32": "float32"}[stored[name][0]], stored[name][1])
        data = np.ascontiguousarray(arr).tobytes()
        w.write(data)
        progress(len(data))
    return header, 8 + len(raw)


def _expert_matrices(src, layout, layer, e, fam):
    """{component: (float32 [rows, in], source dtype)} of one routed expert.

    Fused checkpoints hold gate_up_proj [E, 2*m, h] (gate rows first, as
    upstream chunks the projection output) and down_proj [E, h, m]; only
    expert e's rows are read."""
    m, h = fam.moe_intermediate_size, fam.hidden_size
    prefix = f"model.layers.{layer}.mlp.experts."
    if layout == "unfused":
        return {comp: src.read(src.key(f"{prefix}{e}.{hf}.weight")) for comp, hf in _COMPONENT.items()}
    gate_up, down = src.key(prefix + "gate_up_proj"), src.key(prefix + "down_proj")
    want = {gate_up: (fam.num_experts, 2 * m, h), down: (fam.num_experts, h, m)}
    for key, shape in want.items():
        if src.shape(key) != shape:
            raise GeometryError(f"source.{key}.shape", f"{list(src.shape(key))} != expected {list(shape)}")
    gu, dt = src.read(gate_up, e, e + 1)
    d, ddt = src.read(down, e, e + 1)
    return {"gate": (gu[0, :m], dt), "up": (gu[0, m:], dt), "down": (d[0], ddt)}


def expert_records(src, args, fam, codec_name, layout="unfused"):
    for layer in range(fam.num_hidden_layers):
        for e in range(fam.num_experts):
            parts = {}
            for comp, (a, dt) in _expert_matrices(src, layout, layer, e, fam).items():
                if tuple(a.shape) != fam.component_shapes()[comp]:
                    raise GeometryError(f"source.layers.{layer}.experts.{e}.{_COMPONENT[comp]}", f"shape {list(a.shape)}")
                parts[comp] = encode(a, dt, codec_name)
            yield layer, e, parts


def _mtp_expert(src, raw, layout, e, comp, fam):
    """(float32 [rows, in], source dtype) of MTP expert e's component, one expert's rows read."""
    m = fam.moe_intermediate_size
    if layout == "unfused":
        return src.read(raw[f"mtp.layers.0.mlp.experts.{e}.{_COMPONENT[comp]}.weight"])
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
    header, off = {}, 0
    for name, (dtype, shape, _) in stored.items():
        n = M.shape_bytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    w.write(len(raw).to_bytes(8, "little") + raw)
    base = 8 + len(raw)
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
                raise GeometryError(f"source.mtp.layers.0.mlp.experts.{e}.{_COMPONENT[comp]}", f"shape {list(a.shape)}")
            put(stem, encode(a, dt, codec_name), e)
    return header


def mtp_store(tmp, header, args, profile, consumed):
    """Manifest entry of the MTP store; its inventory records every stored tensor's codec."""
    s = _store(tmp, "mtp", M.MTP_PATH, "safetensors", C.PROFILES[profile]["dense"])
    stored = M.mtp_stored_tensors(args, profile)
    s["tensors"] = {name: dict(e, codec=stored[name][2]) for name, e in sorted(header.items())}
    s["source_tensors"] = consumed
    return s


# Rows of a PLE shard read per step: bounds conversion memory by a constant
# however large a shard is.
PLE_CHUNK_ROWS = 1 << 16


def ple_chunks(src, args, layer, codec_name):
    for s in range(args.split_ngram_parts):
        key = src.key(f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{s}.weight")
        rows = src.shape(key)[0]
        for start in range(0, rows, PLE_CHUNK_ROWS):
            a, dt = src.read(key, start, min(rows, start + PLE_CHUNK_ROWS))
            yield encode(a, dt, codec_name)["weight"]


def check_ple_constants(src, args):
    for t, layer_id in enumerate(args.ple_layer_ids):
        for name, derive in _PLE_CONSTANTS.items():
            key = f"model.layers.{layer_id - 1}.ple.ple_embedding.{name}"
            a, _ = src.read(src.key(key))
            if a.tolist() != list(derive(args, t)):
                raise ArtifactError(f"source.{key}", f"{a.tolist()} != derived {list(derive(args, t))}")


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


def convert(hf_path, out, q_bits=4, q_group_size=64, dtype=None, revision=None, repo=None, quiet=False,
            mtp=True):
    """mtp: keep the checkpoint's `mtp.*` head (when it has one) as the artifact's optional MTP
    store; False excludes it (counted under the "mtp" exclusion rule)."""
    if not os.path.isdir(hf_path):
        from huggingface_hub import snapshot_download

        repo = hf_path
        hf_path = snapshot_download(hf_path, revision=revision,
                                    allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"])
    profile = profile_for(q_bits, q_group_size, dtype)
    codecs = C.PROFILES[profile]
    with open(os.path.join(hf_path, "config.json"), "rb") as f:
        config = json.loads(f.read())
    args = M.model_args(config)
    constants = M.model_constants(config)
    fam = detect_family(constants)
    src = Source(hf_path)
    counts = keys.check_key_set(list(src.index), args)
    mtp_report = keys.check_mtp_key_set(list(src.index), args) if mtp else None
    if mtp_report is not None:
        mtp_layer_args(args)  # the head's QSA layer needs the indexer fields
    check_ple_constants(src, args)
    sink = open(os.devnull, "w") if quiet else None

    def bar(label, total):
        return Progress(label, total, stream=sink)

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
            result["header"], result["base"] = write_dense(w, src, args, profile, p)

        atomic.publish_file(os.path.join(tmp, M.DENSE_PATH), dense)
        p.close()
        stores.append(_store(tmp, "dense", M.DENSE_PATH, "safetensors", codecs["dense"]))

        g = expert_major.Geometry(fam, codecs["experts"])
        p = bar("experts", g.payload_bytes)
        expert_major.publish(os.path.join(tmp, M.EXPERTS_PATH), fam, codecs["experts"],
                             expert_records(src, args, fam, codecs["experts"], counts["expert_layout"]), progress=p)
        p.close()
        stores.append(_store(tmp, "experts", M.EXPERTS_PATH, "expert_major.v2", codecs["experts"]))

        for t, layer_id in enumerate(args.ple_layer_ids):
            g = ple_pages.Geometry(fam, t, codecs["ple"])
            p = bar(f"ple[{t}]", g.payload_bytes)
            ple_pages.publish(os.path.join(tmp, M.ple_path(t)), fam, t, codecs["ple"],
                              ple_chunks(src, args, layer_id - 1, codecs["ple"]), progress=p)
            p.close()
            s = _store(tmp, "ple", M.ple_path(t), "ple_pages.v1", codecs["ple"])
            s.update(table=t, layer=layer_id - 1, rows_per_page=g.rows_per_page)
            stores.append(s)

        if mtp_report is not None:
            p = bar("mtp", sum(M.shape_bytes(d, sh) for d, sh, _ in M.mtp_stored_tensors(args, profile).values()))
            mtp_header = {}

            def write(w):
                mtp_header.update(write_mtp(w, src, args, fam, profile, mtp_report, p))

            atomic.publish_file(os.path.join(tmp, M.MTP_PATH), write)
            p.close()
            stores.append(mtp_store(tmp, mtp_header, args, profile, mtp_report["consumed"]))

        tensors = {}
        shapes = M.dense_shapes(args)
        for name, e in result["header"].items():
            wkey = name if name in shapes else name.rsplit(".", 1)[0] + ".weight"
            tensors[name] = {"dtype": e["dtype"], "shape": e["shape"], "data_offsets": e["data_offsets"],
                             "codec": M.dense_codec(wkey, shapes[wkey], profile)}
        man = M.build(family=fam.name, profile=profile, source_files=source_files, revision=revision,
                      repo=repo, constants=constants, stores=stores, tensors=tensors,
                      exclusions=counts["excluded"], consumed=counts["consumed"], mtp=mtp_report is not None)
        data = M.dumps(man)
        atomic.publish_file(os.path.join(tmp, C.MANIFEST_NAME), lambda w: w.write(data))

    atomic.publish_dir(out, build, verify=admission.admit)
    if sink is not None:
        sink.close()
    return admission.admit(out)


def add_mtp(artifact, mtp_source, quiet=False):
    """Republish `artifact` with the MTP head read from `mtp_source` (a directory of safetensors
    holding exactly the `mtp.*` tensors, e.g. a trained head), encoded with the artifact's own
    profile codecs. Every other file is copied byte for byte; the new directory is admitted before
    it atomically replaces the old one. Replaces an MTP store already present."""
    from .models.qwen4exp_config import ModelArgs

    admission.admit(artifact)
    with open(os.path.join(artifact, C.MANIFEST_NAME), "rb") as f:
        man = json.loads(f.read())
    with open(os.path.join(artifact, "config.json"), "rb") as f:
        args = ModelArgs.from_dict(json.loads(f.read()))
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
    sink = open(os.devnull, "w") if quiet else None

    def build(tmp):
        for s in man["stores"]:
            if s["role"] != "mtp":
                atomic.publish_file(os.path.join(tmp, s["path"]), lambda w, p=os.path.join(artifact, s["path"]): _copy(p, w))
        for name in man["source"]["files"]:
            atomic.publish_file(os.path.join(tmp, name), lambda w, p=os.path.join(artifact, name): _copy(p, w))
        p = Progress("mtp", sum(M.shape_bytes(d, sh) for d, sh, _ in M.mtp_stored_tensors(args, profile).values()), stream=sink)
        header = {}
        atomic.publish_file(os.path.join(tmp, M.MTP_PATH), lambda w: header.update(write_mtp(w, src, args, fam, profile, report, p)))
        p.close()
        new = dict(man, stores=[s for s in man["stores"] if s["role"] != "mtp"] + [mtp_store(tmp, header, args, profile, report["consumed"])],
                   policy=dict(man["policy"], mtp="included"), exclusions=dict(man["exclusions"], mtp=0))
        data = M.dumps(new)
        atomic.publish_file(os.path.join(tmp, C.MANIFEST_NAME), lambda w: w.write(data))

    atomic.publish_dir(artifact, build, verify=admission.admit)
    if sink is not None:
        sink.close()
    return admission.admit(artifact)


def _copy(path, w):
    with open(path, "rb") as f:
        while True:
            b = f.read(8 << 20)
            if not b:
                break
            w.write(b)


def _store(tmp, role, path, fmt, codec_name):
    full = os.path.join(tmp, path)
    return {"role": role, "path": path, "format": fmt, "codec": codec_name,
            "size": os.path.getsize(full), "sha256": M.sha256_file(full)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="hebrus-mlx convert", description="Convert a Qwen4Exp HF checkpoint")
    p.add_argument("--hf-path", required=True, help="local directory or Hugging Face repo id")
    p.add_argument("--out", required=True, help="artifact directory to publish")
    p.add_argument("--q-bits", type=int, default=4)
    p.add_argument("--q-group-size", type=int, default=64)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="store unquantized instead")
    p.add_argument("--revision", help="source revision (recorded; used for repo downloads)")
    p.add_argument("--no-mtp", action="store_true", help="leave out the checkpoint's MTP head (mtp.*)")
    a = p.parse_args(argv)
    try:
        report = convert(a.hf_path, a.out, a.q_bits, a.q_group_size, a.dtype, a.revision, mtp=not a.no_mtp)
    except ArtifactError as e:
        print(f"convert: {e}", file=sys.stderr)
        return 2
    except keys.CheckpointKeyError as e:
        print(f"convert: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: report[k] for k in ("family", "profile", "support", "stores", "exclusions")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
