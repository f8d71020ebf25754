"""Shared helper: a tiny Qwen4Exp checkpoint and its converted artifact.

Provenance (AFN-014): the checkpoint tensors and config are an upstream
capture (transformers `Qwen4ExpForCausalLM.save_pretrained`, seed 0); the
tokenizer.json / chat template are contract controls written here by hand.
Negative fixtures mutate one field of the converted artifact at a time.
"""

import hashlib
import json
import os
import shutil
import struct

from hebrus_mlx.testing.tiny_configs import TINY_QWEN4EXP
from support import families  # noqa: F401  (registers the tiny and parity families)

TINY_CONFIG = TINY_QWEN4EXP  # the shared tiny config (hebrus_mlx/testing/tiny_configs.py)


def word_level_tokenizer(*words):
    """tokenizer.json of a word-level vocabulary: <unk> (0), <|im_end|> (1, special), then `words`."""
    im_end = {
        "id": 1,
        "content": "<|im_end|>",
        "special": True,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
    }
    vocab = {w: i for i, w in enumerate(["<unk>", "<|im_end|>", *words])}
    return {
        "version": "1.0",
        "added_tokens": [im_end],
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


TOKENIZER = word_level_tokenizer("a", "b")
TEMPLATE = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"


def tiny_checkpoint(d):
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    os.makedirs(d, exist_ok=True)
    torch.manual_seed(0)
    Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**TINY_CONFIG)).save_pretrained(d)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(TOKENIZER, f)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return d


def tiny_artifact(root, dtype="float32", q_bits=4):
    """(hf_dir, artifact_dir) under `root`, converted with hebrus_mlx.convert."""
    from hebrus_mlx.convert import convert

    hf = tiny_checkpoint(os.path.join(root, "hf"))
    out = os.path.join(root, "artifact")
    convert(hf, out, q_bits=q_bits, dtype=dtype, quiet=True)
    return hf, out


def quantized_artifacts(hf, root, variants):
    """{key: artifact dir}: `hf` converted into root/NAME for each key -> (NAME, convert keywords),
    dense weights at 4 bits, group 64."""
    from hebrus_mlx.convert import convert

    out = {}
    for key, (name, kw) in variants.items():
        out[key] = str(root / name)
        convert(hf, out[key], q_bits=4, q_group_size=64, quiet=True, **kw)
    return out


def copy_artifact(src, dst):
    shutil.copytree(src, dst)
    return dst


# ---- mutation helpers: each edits exactly one thing ------------------------
def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_manifest(d):
    with open(os.path.join(d, "manifest.json")) as f:
        return json.load(f)


def save_manifest(d, m):
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(m, f)


def edit_manifest(d, fn):
    m = load_manifest(d)
    fn(m)
    save_manifest(d, m)


def refresh_store(d, path):
    """Re-record a store's size/digest after it was edited on purpose (and its fast check's
    XXH3-128 table, where the artifact has one: recomputed here with the `xxhash` package)."""
    m = load_manifest(d)
    for s in m["stores"]:
        if s["path"] == path:
            s["size"] = os.path.getsize(os.path.join(d, path))
            s["sha256"] = sha(os.path.join(d, path))
            if "fast_check" in s:
                table = b"".join(_xxh3(u) for u in _units(d, s))
                with open(os.path.join(d, s["fast_check"]["path"]), "wb") as f:
                    f.write(table)
                s["fast_check"].update(size=len(table), sha256=hashlib.sha256(table).hexdigest())
    save_manifest(d, m)


def _xxh3(data):
    import xxhash

    return xxhash.xxh3_128(data).digest()


def _units(d, s):
    """The bytes of every unit a store's fast check covers, as they are on disk now."""
    from hebrus_mlx.artifact import fast_check
    from hebrus_mlx.artifact.expert_major import ExpertMajorReader
    from hebrus_mlx.artifact.ple_pages import PleReader

    p = os.path.join(d, s["path"])
    with open(p, "rb") as f:
        data = f.read()
    if s["role"] == "experts":
        with ExpertMajorReader(p) as r:
            g = r.geometry
            return [data[g.record_offset(i) : g.record_offset(i) + g.record_bytes] for i in range(g.count)]
    if s["role"] == "ple":
        with PleReader(p) as r:
            g = r.geometry
            return [
                data[g.payload_offset + i * g.page_stride : g.payload_offset + (i + 1) * g.page_stride]
                for i in range(g.num_pages)
            ]
    n = fast_check.MTP_UNIT_BYTES
    return [data[i : i + n] for i in range(0, max(len(data), 1), n)]


def edit_source_file(d, name, fn, refresh_digest=True):
    p = os.path.join(d, name)
    with open(p, "rb") as f:
        data = fn(f.read())
    with open(p, "wb") as f:
        f.write(data)
    if refresh_digest:
        edit_manifest(d, lambda m: m["source"]["files"].__setitem__(name, sha(p)))


def edit_safetensors_header(d, fn, path="model.safetensors", inventory=False):
    """fn(header dict) mutates the header; data bytes are kept as they are."""
    p = os.path.join(d, path)
    with open(p, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    fn(header)
    body = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    body += b" " * (-len(body) % 8)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    refresh_store(d, path)
    if inventory:  # keep the manifest inventory in step with the file

        def sync(m):
            m["tensors"] = {
                k: {
                    "dtype": v["dtype"],
                    "shape": v["shape"],
                    "data_offsets": v["data_offsets"],
                    "codec": m["tensors"].get(k, {}).get("codec", "f32"),
                }
                for k, v in header.items()
                if k != "__metadata__"
            }

        edit_manifest(d, sync)


def patch_bytes(path, offset, fmt, value, digest_range=None, digest_at=None):
    """Overwrite a struct field; optionally recompute a SHA-256 over
    digest_range (with the digest slot zeroed) and store it at digest_at."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))
        if digest_range is not None:
            a, b = digest_range
            f.seek(a)
            blob = bytearray(f.read(b - a))
            blob[digest_at - a : digest_at - a + 32] = bytes(32)
            f.seek(digest_at)
            f.write(hashlib.sha256(blob).digest())


# ---- fuzzing: byte flips and truncations of every artifact file ------------
def data_digest(d):
    """SHA-256 over the bytes a runtime would read: every dense tensor, every
    expert record and every PLE row, through the real readers."""
    from hebrus_mlx.admission import read_safetensors_header
    from hebrus_mlx.artifact.expert_major import ExpertMajorReader
    from hebrus_mlx.artifact.ple_pages import PleReader

    h = hashlib.sha256()
    m = load_manifest(d)
    for s in m["stores"]:
        p = os.path.join(d, s["path"])
        if s["role"] == "dense":
            n, header, _ = read_safetensors_header(p)
            with open(p, "rb") as f:
                for name in sorted(header):
                    a, b = header[name]["data_offsets"]
                    h.update(name.encode() + os.pread(f.fileno(), b - a, 8 + n + a))
        elif s["role"] == "experts":
            with ExpertMajorReader(p) as r:
                for i in range(r.geometry.count):
                    h.update(r.read_record(*divmod(i, r.family.num_experts)))
        else:
            with PleReader(p) as r:
                h.update(r.read_rows(range(r.geometry.total_rows)).tobytes())
    return h.hexdigest()


def fuzz(d, cases, seed=0):
    """Run `cases` single mutations over every file of artifact `d` (restored
    after each). Returns {(file, outcome): count}; outcome is "typed"
    (an ArtifactError) or "identical" (accepted, data byte-identical).
    Accepted-but-different data or any other exception propagates."""
    import random

    from hebrus_mlx.artifact.errors import ArtifactError
    from hebrus_mlx.verify import verify

    rng = random.Random(seed)
    names = sorted(os.listdir(d))
    originals = {n: open(os.path.join(d, n), "rb").read() for n in names}
    baseline = data_digest(d)
    counts = {}
    with open(os.devnull, "w") as quiet:
        for i in range(cases):
            name = names[i % len(names)]
            data = bytearray(originals[name])
            if rng.random() < 0.75:
                for _ in range(rng.randint(1, 3)):
                    data[rng.randrange(len(data))] ^= rng.randint(1, 255)
            else:
                del data[rng.randrange(len(data)) :]
            path = os.path.join(d, name)
            with open(path, "wb") as f:
                f.write(data)
            try:
                verify(d, stream=quiet)
                got = data_digest(d)
                if got != baseline:
                    raise AssertionError(f"case {i}: {name} accepted with different data")
                outcome = "identical"
            except ArtifactError:
                outcome = "typed"
            finally:
                with open(path, "wb") as f:
                    f.write(originals[name])
            counts[(name, outcome)] = counts.get((name, outcome), 0) + 1
    return counts
