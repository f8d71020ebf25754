"""Shard-by-shard conversion of a Hub checkpoint (`hub_shards`, `convert --stream-shards`).

No network: the fetcher is a recording stand-in that copies files out of a local directory holding
a multi-shard checkpoint (transformers `save_pretrained(max_shard_size=...)` of the tiny config,
seed 0). What is checked: the artifact equals the whole-snapshot conversion of the same checkpoint
(every store and dense tensor digest), at most two fetched shards exist at once and each is deleted
after use, an interrupted run fetches only the shards it had not staged, and the free-disk check
refuses before any shard is fetched.
"""

import json
import os
import shutil

import huggingface_hub
import pytest
from support.artifact_fixture import TEMPLATE, TOKENIZER
from support.convert_fixture import parity_source
from support.mtp_fixture import add_mtp_tensors

from hebrus_mlx.cli import main as cli_main
from hebrus_mlx.convert import convert, hub_shards
from hebrus_mlx.errors import HebrusError
from hebrus_mlx.loading import hub
from hebrus_mlx.testing.tiny_configs import TINY_QWEN4EXP

REPO = "org/tiny"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    d = str(tmp_path_factory.mktemp("sharded"))
    torch.manual_seed(0)
    Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**TINY_QWEN4EXP)).save_pretrained(d, max_shard_size="300KB")
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(TOKENIZER, f)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    assert len([n for n in os.listdir(d) if n.endswith(".safetensors")]) >= 6
    return d


@pytest.fixture(scope="module")
def whole(sharded, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("whole") / "a")
    convert(sharded, out, q_bits=4, quiet=True)
    return _digests(out)


class DirFetcher:
    """Serves `root`'s files by copying them into the directory asked for; records each fetch,
    the most fetched shards present at once, and raises on the shard named `fail`."""

    def __init__(self, root, fail=None):
        self.root, self.fail = root, fail
        self.fetched, self.live, self.peak = [], set(), 0

    def sizes(self):
        return {n: os.path.getsize(os.path.join(self.root, n)) for n in os.listdir(self.root)}

    def __call__(self, name, dest):
        if name == self.fail:
            raise ConnectionError(f"network down at {name}")
        self.fetched.append(name)
        path = os.path.join(dest, name)
        shutil.copyfile(os.path.join(self.root, name), path)
        if name.endswith(".safetensors"):
            self.live = {p for p in self.live if os.path.exists(p)} | {path}
            self.peak = max(self.peak, len(self.live))
        return path


def _digests(out):
    with open(os.path.join(out, "manifest.json")) as f:
        man = json.load(f)
    return {"stores": man["stores"], "tensors": man["tensors"], "source_files": man["source"]["files"]}


def _shards(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))


def test_streamed_artifact_equals_whole_snapshot_conversion(sharded, whole, tmp_path):
    """Same checkpoint, same widths: every store's SHA-256 and every dense tensor's digest equal."""
    out = str(tmp_path / "b")
    fetch = DirFetcher(sharded)
    hub_shards.convert_streamed(REPO, out, fetch=fetch, quiet=True, q_bits=4)
    assert _digests(out) == whole
    assert sorted(n for n in fetch.fetched if n.endswith(".safetensors")) == _shards(sharded)
    assert not os.path.exists(hub_shards.stage_dir(out))  # staging removed once published


def test_at_most_two_shards_on_disk_and_each_deleted(sharded, tmp_path):
    out = str(tmp_path / "b")
    fetch = DirFetcher(sharded)
    hub_shards.convert_streamed(REPO, out, fetch=fetch, quiet=True, q_bits=4)
    assert fetch.peak == 2  # one being encoded, one fetched ahead
    assert all(not os.path.exists(p) for p in fetch.live)
    assert len(fetch.fetched) == len(set(fetch.fetched))  # nothing fetched twice


def test_interrupted_run_resumes_without_refetching_staged_shards(sharded, whole, tmp_path):
    out = str(tmp_path / "b")
    shards = _shards(sharded)
    k = 5
    first = DirFetcher(sharded, fail=shards[k])
    with pytest.raises(ConnectionError):
        hub_shards.convert_streamed(REPO, out, fetch=first, quiet=True, q_bits=4)
    assert not os.path.exists(out)
    stage = hub_shards.stage_dir(out)
    assert not os.path.exists(os.path.join(stage, "fetch"))  # no fetched shard left behind
    second = DirFetcher(sharded)
    hub_shards.convert_streamed(REPO, out, fetch=second, quiet=True, q_bits=4)
    assert [n for n in second.fetched if n.endswith(".safetensors")] == shards[k:]
    assert _digests(out) == whole


def test_resume_refetches_a_shard_whose_staged_file_is_damaged(sharded, whole, tmp_path):
    """A staged file that no longer matches its recorded digest is never trusted."""
    out = str(tmp_path / "b")
    shards = _shards(sharded)
    with pytest.raises(ConnectionError):
        hub_shards.convert_streamed(REPO, out, fetch=DirFetcher(sharded, fail=shards[3]), quiet=True, q_bits=4)
    stage = hub_shards.stage_dir(out)
    victim = shards[1]
    with open(os.path.join(stage, "done", victim + ".json")) as f:
        fname = sorted(json.load(f)["files"])[0]
    with open(os.path.join(stage, fname), "r+b") as f:
        f.write(b"\xff\xff")
    second = DirFetcher(sharded)
    hub_shards.convert_streamed(REPO, out, fetch=second, quiet=True, q_bits=4)
    assert [n for n in second.fetched if n.endswith(".safetensors")] == sorted([victim, *shards[3:]])
    assert _digests(out) == whole


def test_free_disk_check_refuses_before_any_shard_is_fetched(sharded, tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda p: type(real(p))(real(p).total, real(p).used, 1000))
    fetch = DirFetcher(sharded)
    out = str(tmp_path / "b")
    with pytest.raises(hub.DiskSpaceError) as e:
        hub_shards.convert_streamed(REPO, out, fetch=fetch, quiet=True, q_bits=4)
    assert e.value.field == "out" and "only 1000 bytes" in str(e.value)
    sizes = sorted(os.path.getsize(os.path.join(sharded, n)) for n in _shards(sharded))
    needed = int(str(e.value).split(" needs ")[1].split()[0])
    assert needed > sizes[-1] + sizes[-2]  # the artifact plus the two largest shards
    assert not [n for n in fetch.fetched if n.endswith(".safetensors")]
    assert not os.path.exists(out)


def test_cli_stream_shards_refuses_a_local_directory(sharded, tmp_path, capsys):
    rc = cli_main(["convert", "--hf-path", sharded, "--out", str(tmp_path / "b"), "--stream-shards"])
    err = capsys.readouterr().err
    assert rc == 2 and "--stream-shards" in err and len(err.strip().splitlines()) == 1


def _reshard(single, d, n):
    """`single`'s one model.safetensors split into `n` shards (tensors in key order) with an index,
    the layout `save_pretrained(max_shard_size=...)` writes; the other files copied."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(d)
    tensors = load_file(os.path.join(single, "model.safetensors"))
    names = sorted(tensors)
    step = -(-len(names) // n)
    weight_map = {}
    for i in range(n):
        shard = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = names[i * step : (i + 1) * step]
        save_file({k: tensors[k] for k in part}, os.path.join(d, shard))
        weight_map.update(dict.fromkeys(part, shard))
    with open(os.path.join(d, hub_shards.INDEX_NAME), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    for name in os.listdir(single):
        if name != "model.safetensors":
            shutil.copy(os.path.join(single, name), d)
    return d


def test_per_expert_source_with_mtp_head_equals_whole_snapshot(tmp_path):
    """The per-expert layout (one tensor per expert and projection, split across shards) and the MTP
    head (read back from the staged raw tensors) give the whole-snapshot conversion's artifact."""
    single = add_mtp_tensors(parity_source("tiny_a", str(tmp_path / "single")), layout="unfused")
    sharded = _reshard(single, str(tmp_path / "sharded"), 7)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    convert(single, a, dtype="float32", quiet=True)
    fetch = DirFetcher(sharded)
    hub_shards.convert_streamed(REPO, b, fetch=fetch, quiet=True, dtype="float32")
    assert any(s["role"] == "mtp" for s in _digests(b)["stores"])
    assert _digests(b) == _digests(a)
    assert fetch.peak == 2


def test_cli_stream_shards_converts_a_repo_through_the_hub_client(sharded, whole, tmp_path, monkeypatch, capsys):
    """`convert --hf-path ORG/NAME --stream-shards`: sizes from one model_info call, each file
    downloaded with hf_hub_download into the staging directory (never the HF cache)."""
    from types import SimpleNamespace as N

    calls = []

    class Api:
        def model_info(self, repo_id, revision=None, files_metadata=False):
            calls.append(("model_info", repo_id, revision, files_metadata))
            names = sorted(os.listdir(sharded))
            return N(
                sha="c0ffee", siblings=[N(rfilename=n, size=os.path.getsize(os.path.join(sharded, n))) for n in names]
            )

    def hf_hub_download(repo_id, filename, revision=None, local_dir=None):
        calls.append(("hf_hub_download", repo_id, filename, revision))
        assert local_dir is not None
        shutil.copyfile(os.path.join(sharded, filename), os.path.join(local_dir, filename))
        return os.path.join(local_dir, filename)

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    out = str(tmp_path / "b")
    rc = cli_main(["convert", "--hf-path", REPO, "--out", out, "--stream-shards"])
    assert rc == 0, capsys.readouterr().err
    assert _digests(out) == whole
    assert calls[0] == ("model_info", REPO, None, True)
    shards = [c[2] for c in calls[1:] if c[2].endswith(".safetensors")]
    assert sorted(shards) == _shards(sharded) and len(shards) == len(set(shards))
    assert all(c[3] == "c0ffee" for c in calls[1:])  # pinned to the commit the sizes came from
    with open(os.path.join(out, "manifest.json")) as f:
        assert json.load(f)["source"]["repo"] == REPO


def _tree_bytes(root):
    # The read-ahead fetch runs on another thread: a temp file it renames between the walk and the
    # stat is counted under its new name on the next sample, not here.
    total = 0
    for d, _, names in os.walk(root):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(d, n))
            except FileNotFoundError:
                pass
    return total


def test_peak_disk_is_the_artifact_plus_two_shards(sharded, tmp_path, monkeypatch):
    """Bytes under the output's parent, sampled at every shard fetch and before every staged-file
    deletion (the peaks of the fetch and assembly phases), stay within the artifact plus the two
    largest shards plus the small files kept to the end (config/tokenizer copies, PLE constants);
    the whole-snapshot path would hold every shard and the artifact."""
    root = tmp_path / "disk"
    root.mkdir()
    out = str(root / "b")
    samples = []

    class Sampling(DirFetcher):
        def __call__(self, name, dest):
            path = super().__call__(name, dest)
            samples.append(_tree_bytes(root))
            return path

    sampling = Sampling(sharded)
    real_remove = os.remove

    def remove(path, *a, **k):
        if str(path).startswith(str(root)):
            samples.append(_tree_bytes(root))
        return real_remove(path, *a, **k)

    monkeypatch.setattr(hub_shards.os, "remove", remove)
    hub_shards.convert_streamed(REPO, out, fetch=sampling, quiet=True, q_bits=4)
    monkeypatch.setattr(hub_shards.os, "remove", real_remove)
    shards = sorted(os.path.getsize(os.path.join(sharded, n)) for n in _shards(sharded))
    small = sum(os.path.getsize(os.path.join(sharded, n)) for n in os.listdir(sharded) if not n.endswith("safetensors"))
    artifact = _tree_bytes(out)
    assert len(samples) > len(shards)
    assert max(samples) <= artifact + shards[-1] + shards[-2] + small + 64 * 1024
    assert max(samples) < artifact + sum(shards)  # what the whole-snapshot path holds
    print(
        f"peak {max(samples)} B; artifact {artifact} B, two largest shards {shards[-1] + shards[-2]} B, all {sum(shards)} B"
    )


def test_an_occupied_out_is_refused_before_anything_is_fetched(sharded, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    fetch = DirFetcher(sharded)
    with pytest.raises(HebrusError) as e:
        hub_shards.convert_streamed(REPO, str(out), fetch=fetch, quiet=True, q_bits=4)
    assert e.value.field == "--out" and fetch.fetched == []
    assert (out / "notes.txt").read_text() == "mine"


def test_a_run_killed_while_assembling_the_stores_resumes(sharded, whole, tmp_path, monkeypatch):
    """Staged files the stores already took are gone: exactly the shards they came from are fetched
    again (their records no longer verify), and the artifact is the same."""
    from hebrus_mlx.convert import build as convert_module

    out = str(tmp_path / "b")

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module.ple_pages, "publish", killed)  # after the dense and expert stores
    with pytest.raises(KeyboardInterrupt):
        hub_shards.convert_streamed(REPO, out, fetch=DirFetcher(sharded), quiet=True, q_bits=4)
    monkeypatch.undo()
    stage = hub_shards.stage_dir(out)
    gone = set()
    for name in os.listdir(os.path.join(stage, "done")):
        with open(os.path.join(stage, "done", name)) as f:
            if not all(os.path.exists(os.path.join(stage, n)) for n in json.load(f)["files"]):
                gone.add(name[: -len(".json")])
    assert gone
    second = DirFetcher(sharded)
    hub_shards.convert_streamed(REPO, out, fetch=second, quiet=True, q_bits=4)
    assert sorted(n for n in second.fetched if n.endswith(".safetensors")) == sorted(gone)
    assert _digests(out) == whole


def test_a_record_naming_a_file_outside_the_staging_directory_is_not_trusted(sharded, whole, tmp_path):
    """A staging record is input too: an entry naming another file makes its shard be fetched again,
    and that file is neither read nor deleted."""
    out = str(tmp_path / "b")
    shards = _shards(sharded)
    with pytest.raises(ConnectionError):
        hub_shards.convert_streamed(REPO, out, fetch=DirFetcher(sharded, fail=shards[2]), quiet=True, q_bits=4)
    bystander = tmp_path / "mine.bin"
    bystander.write_bytes(b"\0" * 4096)
    record = os.path.join(hub_shards.stage_dir(out), "done", shards[0] + ".json")
    with open(record) as f:
        rec = json.load(f)
    for loc in rec["entries"].values():
        for part in loc.values():
            part[0] = "../mine.bin"
    with open(record, "w") as f:
        json.dump(rec, f)
    second = DirFetcher(sharded)
    hub_shards.convert_streamed(REPO, out, fetch=second, quiet=True, q_bits=4)
    assert [n for n in second.fetched if n.endswith(".safetensors")] == [shards[0], *shards[2:]]
    assert bystander.read_bytes() == b"\0" * 4096
    assert _digests(out) == whole


def test_other_widths_start_over(sharded, tmp_path):
    """Parts staged for one profile are never reused for another: every shard is fetched again."""
    out = str(tmp_path / "b")
    shards = _shards(sharded)
    with pytest.raises(ConnectionError):
        hub_shards.convert_streamed(REPO, out, fetch=DirFetcher(sharded, fail=shards[4]), quiet=True, q_bits=4)
    second = DirFetcher(sharded)
    report = hub_shards.convert_streamed(REPO, out, fetch=second, quiet=True, q_bits=8).report
    assert [n for n in second.fetched if n.endswith(".safetensors")] == shards
    assert report["profile"] == "text-affine8-g64"


def test_cli_too_small_disk_is_one_line_naming_out(sharded, tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace as N

    fetched = []

    class Api:
        def model_info(self, repo_id, revision=None, files_metadata=False):
            names = sorted(os.listdir(sharded))
            return N(
                sha="c0ffee", siblings=[N(rfilename=n, size=os.path.getsize(os.path.join(sharded, n))) for n in names]
            )

    def hf_hub_download(repo_id, filename, revision=None, local_dir=None):
        fetched.append(filename)
        shutil.copyfile(os.path.join(sharded, filename), os.path.join(local_dir, filename))
        return os.path.join(local_dir, filename)

    real = shutil.disk_usage
    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda p: type(real(p))(real(p).total, real(p).used, 1000))
    rc = cli_main(["convert", "--hf-path", REPO, "--out", str(tmp_path / "b"), "--stream-shards"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "out" in err[0] and "only 1000 bytes" in err[0], err
    assert not [n for n in fetched if n.endswith(".safetensors")]
