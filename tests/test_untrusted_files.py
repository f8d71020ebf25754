"""Issue 22 §2: every file read from an artifact or a checkpoint is bounded before it is read
(hebrus_mlx/artifact/untrusted.py): a regular file inside the directory (no symlink out of it),
a size cap per kind named in the error, a capped safetensors header (bytes and entries), strict
JSON (duplicate keys refused naming the key, nesting bounded: never a RecursionError).

Provenance (AFN-014): artifacts are copies of the shipped demo with one file mutated here
(contract controls); oversized files are sparse, so they cost no disk.
"""

import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from hebrus_mlx.artifact.errors import AdmissionError
from hebrus_mlx.artifact.safetensors import read_safetensors_header
from hebrus_mlx.cli import main
from hebrus_mlx.loader import DEMO_DIR

ROOT = Path(__file__).resolve().parents[1]
ARGV = ["-p", "hi", "--ignore-chat-template", "-m", "2", "--verbose", "false"]


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _refused(verb, argv, *needles):
    rc, out, err = _run([verb, *argv])
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, (rc, out, err[-3000:])
    assert err.startswith(f"hebrus-mlx {verb}: error: ")
    for n in needles:
        assert n in err, err
    return err


@pytest.fixture
def demo(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(DEMO_DIR, d)
    return d


def _sha(data):
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _set_source(d, name, data):
    """Write source file `name` and give the manifest its digest: a digest-valid hostile file."""
    (d / name).write_bytes(data)
    m = json.loads((d / "manifest.json").read_text())
    m["source"]["files"][name] = _sha(data)
    (d / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")


# -- symlinks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer.json", "manifest.json", "config.json"])
def test_symlinked_file_out_of_the_artifact_is_refused(demo, tmp_path, name):
    """The link points at a byte-identical copy (its digest would match): refused for being a link,
    before it is opened, by admit, verify and generate."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(str(demo / name), outside / name)
    (demo / name).symlink_to(outside / name)
    for verb, argv in (("admit", [str(demo)]), ("verify", [str(demo)]), ("generate", ["--model", str(demo), *ARGV])):
        _refused(verb, argv, name, "symlink")


def test_checkpoint_links_must_stay_inside(tmp_path):
    """A checkpoint may link inside itself, or (a Hub cache snapshot) into its repo's blobs/."""
    from hebrus_mlx.artifact import untrusted

    repo = tmp_path / "models--org--name"
    snap = repo / "snapshots" / "abc"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_text("{}")
    (snap / "config.json").symlink_to("../../blobs/f00d")
    assert untrusted.read_json(str(snap), "config.json", links=True) == {}
    with pytest.raises(untrusted.UntrustedFileError, match="symlink"):
        untrusted.read_json(str(snap), "config.json")  # an artifact holds no links at all
    (tmp_path / "secret.json").write_text("{}")
    (snap / "tokenizer.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(untrusted.UntrustedFileError, match="outside"):
        untrusted.read_bytes(str(snap), "tokenizer.json", links=True)
    os.mkfifo(snap / "generation_config.json")  # would block a plain open() forever
    with pytest.raises(untrusted.UntrustedFileError, match="not a regular file"):
        untrusted.read_bytes(str(snap), "generation_config.json", links=True)
    for bad in ("../x.json", "a/b.json", "", ".."):
        with pytest.raises(untrusted.UntrustedFileError, match="plain file name"):
            untrusted.read_bytes(str(snap), bad, "json")


def test_hf_checkpoint_tokenizer_symlinked_outside_is_refused(tmp_path):
    from support.convert_fixture import parity_source

    from hebrus_mlx.text.tokenizer import load_tokenizer

    d = Path(parity_source("tiny_a", str(tmp_path / "hf")))
    shutil.move(str(d / "tokenizer.json"), tmp_path / "tokenizer.json")
    (d / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    with pytest.raises(AdmissionError, match="outside"):  # untrusted.UntrustedFileError
        load_tokenizer(d, 512)


# -- size caps -------------------------------------------------------------------------------------

_RSS_CHILD = """
import resource, sys
from hebrus_mlx.text.tokenizer import load_tokenizer
print("base_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
try:
    load_tokenizer(sys.argv[1], 512)
    print("loaded")
except Exception as e:
    print(type(e).__name__, e)
print("maxrss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_oversized_tokenizer_is_refused_before_it_is_read(tmp_path):
    """A 600 MB tokenizer.json (sparse) is refused by its size, naming the cap; the process never
    holds it (peak RSS far below the file)."""
    from support.convert_fixture import parity_source

    d = Path(parity_source("tiny_a", str(tmp_path / "hf")))
    size = 600 << 20
    with open(d / "tokenizer.json", "r+b") as f:
        f.truncate(size)
    r = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(d)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    lines = r.stdout.strip().splitlines()
    assert "exceeds the tokenizer cap of 64 MiB" in lines[1] and "LIMITS['tokenizer']" in lines[1], r.stdout + r.stderr
    grew = (int(lines[-1].split()[1]) - int(lines[0].split()[1])) * 1024  # peak RSS over the imports'
    assert grew < size / 16, grew


def test_oversized_artifact_files_name_their_cap(demo):
    caps = {"tokenizer": 64 << 20, "config": 4 << 20, "template": 1 << 20, "manifest": 16 << 20}
    for name, kind in (
        ("tokenizer.json", "tokenizer"),
        ("config.json", "config"),
        ("chat_template.jinja", "template"),
        ("manifest.json", "manifest"),
    ):
        p = demo / name
        keep = p.read_bytes()
        with open(p, "r+b") as f:
            f.truncate(caps[kind] + 1)
        try:
            _refused("admit", [str(demo)], f"exceeds the {kind} cap of", name.split(".")[0])
        finally:
            p.write_bytes(keep)


def _safetensors(path, entries, declared=None, pad=0):
    body = b"{" + b",".join(b'"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i for i in range(entries)) + b"}"
    n = len(body) if declared is None else declared
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + body)
        f.truncate(8 + max(n, len(body)) + pad)


def test_safetensors_header_caps_bytes_and_entries(tmp_path):
    ok = tmp_path / "ok.safetensors"
    _safetensors(ok, 3)
    assert len(read_safetensors_header(str(ok))[1]) == 3
    # 94 MB declared (sparse): refused from the 8-byte length, nothing allocated.
    big = tmp_path / "big.safetensors"
    _safetensors(big, 1, declared=94 << 20)
    with pytest.raises(AdmissionError, match=re.escape("LIMITS['safetensors_header']")):
        read_safetensors_header(str(big))
    many = tmp_path / "many.safetensors"
    _safetensors(many, (1 << 18) + 1)  # untrusted.SAFETENSORS_MAX_ENTRIES + 1
    with pytest.raises(AdmissionError, match="SAFETENSORS_MAX_ENTRIES"):
        read_safetensors_header(str(many))
    dup = tmp_path / "dup.safetensors"
    body = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    dup.write_bytes(struct.pack("<Q", len(body)) + body + b"x")
    with pytest.raises(AdmissionError, match="duplicate JSON key 'a'"):
        read_safetensors_header(str(dup))


# -- strict JSON -----------------------------------------------------------------------------------


def test_deep_json_manifest_is_one_line_from_admit_verify_generate(demo):
    (demo / "manifest.json").write_text("[" * 5000 + "]" * 5000)
    for verb, argv in (("admit", [str(demo)]), ("verify", [str(demo)]), ("generate", ["--model", str(demo), *ARGV])):
        _refused(verb, argv, "nested deeper than", "manifest")


def test_deep_json_in_a_digest_valid_config_is_refused(demo):
    cfg = json.loads((demo / "config.json").read_text())
    text = json.dumps(cfg)
    _set_source(demo, "config.json", (text[:-1] + ', "rope_scaling": ' + "[" * 3000 + "]" * 3000 + "}").encode())
    _refused("admit", [str(demo)], "nested deeper than", "config")


def test_duplicate_tensor_digest_is_refused_naming_the_key(demo):
    """A tensor's sha256 given twice (the last one correct): today the last wins and it admits."""
    text = (demo / "manifest.json").read_text()
    m = re.search(r'"sha256": "([0-9a-f]{64})"', text[text.index('"tensors"') :])
    at = text.index('"tensors"') + m.start()
    text = text[:at] + f'"sha256": "{"0" * 64}",\n   ' + text[at:]
    (demo / "manifest.json").write_text(text)
    _refused("admit", [str(demo)], "duplicate JSON key 'sha256'")


def test_lone_surrogate_and_duplicate_keys_in_tokenizer_config(demo):
    tc = (demo / "tokenizer_config.json").read_bytes()
    # Parsed by the tokenizer loader (admission reads it only without chat_template.jinja).
    _set_source(demo, "tokenizer_config.json", tc.rstrip().rstrip(b"}") + b', "x_token": "\\ud800"}')
    _refused("generate", ["--model", str(demo), *ARGV], "lone UTF-16 surrogate", "tokenizer_config.json")
    _set_source(demo, "tokenizer_config.json", b'{"a": 1, "a": 2}')
    _refused("generate", ["--model", str(demo), *ARGV], "duplicate JSON key 'a'")


# -- every other JSON a user may be handed (issue 22 §2, audit: profile, reports, traces, bench) ----

DEEP = "[" * 5000 + "]" * 5000
DUPLICATE = '{"schema": "hebrus-mlx/machine-profile/1", "machine": {}, "machine": {}}'


@pytest.mark.parametrize(
    "text,needle",
    [(DEEP, "nested deeper than"), (DUPLICATE, "duplicate JSON key 'machine'")],
    ids=["deep", "duplicate"],
)
def test_machine_profile_is_read_strictly(tmp_path, text, needle):
    """read_profile (every load reads it; qualify/bench write it): a typed ProfileError naming
    the file, never a RecursionError, and a duplicate key is not resolved last-wins."""
    from hebrus_mlx.machine_profile import ProfileError, read_profile

    p = tmp_path / "profile.json"
    p.write_text(text)
    with pytest.raises(ProfileError, match=re.escape(needle)):
        read_profile(p)


@pytest.mark.parametrize(
    "text,needle",
    [
        (DEEP, "nested deeper than"),
        ('{"schema": "x", "schema": "hebrus-mlx/qualify-report/1"}', "duplicate JSON key 'schema'"),
    ],
    ids=["deep", "duplicate"],
)
def test_simulate_profile_and_report_files_are_read_strictly(tmp_path, text, needle):
    f = tmp_path / "report.json"
    f.write_text(text)
    _refused("simulate", ["--profile", str(f)], "--profile", needle)
    _refused("simulate", ["--validate", "--report", str(f)], "--report", needle)


def test_bench_against_is_read_strictly(tmp_path):
    f = tmp_path / "bench.json"
    f.write_text(DEEP)
    _refused(
        "bench",
        ["--model", "demo", "--against", str(f), "--out", str(tmp_path / "o")],
        "--against",
        "nested deeper than",
    )


def test_traces_export_manifest_is_read_strictly(tmp_path):
    """traces eval/export read an export's manifest.json: strict, bounded, no symlink."""
    from hebrus_mlx.traces.export import read_export
    from hebrus_mlx.traces.schema import TraceError

    out = tmp_path / "export"
    out.mkdir()
    (out / "manifest.json").write_text(DEEP)
    with pytest.raises(TraceError, match="nested deeper than"):
        read_export(out)
    (out / "manifest.json").write_text('{"schema": 1, "schema": 2}')
    with pytest.raises(TraceError, match="duplicate JSON key 'schema'"):
        read_export(out)
    _refused("traces", ["eval", str(out)], "duplicate JSON key 'schema'")


def test_trace_shard_header_is_read_strictly(tmp_path):
    """A shard's header (JSON inside its safetensors metadata) is parsed strictly too."""
    import numpy as np
    from safetensors.numpy import save

    from hebrus_mlx.traces.schema import SCHEMA, SCHEMA_VERSION, TraceError
    from hebrus_mlx.traces.shards import _read_one

    p = tmp_path / "s.safetensors"
    p.write_bytes(
        save(
            {"token_ids": np.zeros(1, np.int32)},
            metadata={"schema": SCHEMA, "schema_version": str(SCHEMA_VERSION), "header": DEEP},
        )
    )
    with pytest.raises(TraceError, match="nested deeper than"):
        _read_one(p)


def test_bench_machine_record_reads_the_manifest_strictly(demo):
    from hebrus_mlx.bench.machine import expert_store

    (demo / "manifest.json").write_text(DEEP)
    with pytest.raises(AdmissionError, match="nested deeper than"):
        expert_store(demo)


def test_deep_tool_call_in_model_output_stays_content():
    """parse_tool_calls (the server's reading of the model's text): a deeply nested block is left
    in the content, never a RecursionError (a 500)."""
    import mlx.core  # noqa: F401  (the server module needs MLX first)

    from hebrus_mlx.serve.output import parse_tool_calls

    text = "<tool_call>\n" + DEEP + "\n</tool_call>"
    assert parse_tool_calls(text) == (text, [])
