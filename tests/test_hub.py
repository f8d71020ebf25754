"""Issue 16: `--model` / `convert --hf-path` accept a Hugging Face repo id.

No network here: huggingface_hub's `HfApi.model_info`, `snapshot_download`
and `try_to_load_from_cache`, and `shutil.disk_usage`, are replaced by
recording fakes. What is tested is hebrus-mlx's side: resolution order
(demo -> local dir -> repo id), the free-disk refusal before any download or
conversion starts (one typed line naming needed and free bytes), the bytes
already in the cache not counted, HF_HUB_OFFLINE asking nothing of the
network, and Hub failures as one-line errors (exit 2).
"""

import importlib
import os
import shutil
from types import SimpleNamespace as N

import huggingface_hub
import pytest
from huggingface_hub import constants

from hebrus_mlx.cli import main as cli_main
from hebrus_mlx.loader import DEMO_DIR
from hebrus_mlx.loading import hub

GB = 10**9
generate = importlib.import_module("hebrus_mlx.generate")  # the package attribute is the function


class FakeHub:
    """Records calls; serves `files` ({name: size}) as the repo's metadata and
    `snapshot` as the downloaded directory."""

    def __init__(self, monkeypatch, files, snapshot, free, cached=None):
        self.files, self.snapshot, self.free, self.cached = files, snapshot, free, cached or {}
        self.calls = []
        fake = self

        class Api:
            def model_info(self, repo_id, revision=None, files_metadata=False):
                fake.calls.append(("model_info", repo_id, revision, files_metadata))
                assert files_metadata
                return N(sha="c0ffee", siblings=[N(rfilename=k, size=v) for k, v in fake.files.items()])

        def snapshot_download(repo_id, revision=None, allow_patterns=None, cache_dir=None):
            fake.calls.append(("snapshot_download", repo_id, revision, tuple(allow_patterns)))
            if isinstance(fake.snapshot, Exception):
                raise fake.snapshot
            return str(fake.snapshot)

        def try_to_load_from_cache(repo_id, filename, cache_dir=None, revision=None):
            return fake.cached.get(filename)

        def hf_hub_download(repo_id, filename, revision=None, cache_dir=None):
            fake.calls.append(("hf_hub_download", repo_id, filename))
            return os.path.join(str(fake.snapshot), filename)

        real_usage = shutil.disk_usage

        def disk_usage(path):
            fake.calls.append(("disk_usage", str(path)))
            u = real_usage(path)
            return type(u)(u.total, u.used, fake.free)

        monkeypatch.setattr(huggingface_hub, "HfApi", Api)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", try_to_load_from_cache)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
        monkeypatch.setattr(hub.shutil, "disk_usage", disk_usage)

    def names(self):
        return [c[0] for c in self.calls]


def _gen(capsys, *args):
    rc = cli_main(["generate", "-p", "def f", "-m", "3", "--ignore-chat-template", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_resolution_order_demo_then_local_dir_then_repo(monkeypatch, tmp_path):
    fake = FakeHub(monkeypatch, {"config.json": 10}, DEMO_DIR, free=10 * GB)
    assert hub.resolve_model("demo") == DEMO_DIR
    # a local directory spelled like a repo id wins over the Hub
    monkeypatch.chdir(tmp_path)
    shutil.copytree(DEMO_DIR, tmp_path / "someorg" / "tiny")
    assert hub.resolve_model("someorg/tiny").resolve() == (tmp_path / "someorg" / "tiny").resolve()
    assert fake.calls == []
    assert hub.resolve_model("otherorg/tiny") == DEMO_DIR
    assert fake.names() == ["model_info", "disk_usage", "snapshot_download"]
    assert fake.calls[-1] == ("snapshot_download", "otherorg/tiny", None, tuple(hub.ALLOW_PATTERNS))


def test_generate_runs_a_downloaded_repo(monkeypatch, capsys):
    fake = FakeHub(
        monkeypatch, {"model.safetensors": 3 * GB, "config.json": 10, "README.md": 50 * GB}, DEMO_DIR, free=4 * GB
    )
    rc, out, err = _gen(capsys, "--model", "someorg/demo-copy")
    assert rc == 0, err
    assert fake.names() == ["model_info", "disk_usage", "snapshot_download"]
    rc_local, out_local, _ = _gen(capsys, "--model", "demo")
    text = out.split("==========")[1]
    assert text.strip() and text == out_local.split("==========")[1]  # the demo's tokens


def test_not_enough_disk_refuses_before_download(monkeypatch, capsys):
    fake = FakeHub(
        monkeypatch,
        {f"model-{i:05d}.safetensors": 5 * GB for i in range(72)} | {"config.json": 7},
        DEMO_DIR,
        free=100 * GB,
    )
    rc, out, err = _gen(capsys, "--model", "Qwen/Qwen3.8-Flash-Next")
    assert rc == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and "disk:" in line
    assert f"needs {72 * 5 * GB + 7} bytes" in line and f"only {100 * GB} bytes" in line
    assert "snapshot_download" not in fake.names()


def test_cached_files_are_not_counted(monkeypatch, tmp_path):
    done = tmp_path / "model-00001.safetensors"
    done.write_bytes(b"x" * 1000)
    partial = tmp_path / "model-00002.safetensors"
    partial.write_bytes(b"x" * 10)  # a size mismatch counts as still to fetch
    files = {"model-00001.safetensors": 1000, "model-00002.safetensors": 1000, "config.json": 5}
    FakeHub(
        monkeypatch,
        files,
        DEMO_DIR,
        free=0,
        cached={"model-00001.safetensors": str(done), "model-00002.safetensors": str(partial)},
    )
    assert hub.bytes_to_download("o/r") == (1005, 2005)
    with pytest.raises(hub.DiskSpaceError) as e:
        hub.download("o/r")
    assert "needs 1005 bytes" in str(e.value)


def test_offline_uses_the_cache_and_asks_no_network(monkeypatch, capsys):
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fake = FakeHub(monkeypatch, {"config.json": 10}, DEMO_DIR, free=0)
    rc, _, err = _gen(capsys, "--model", "someorg/cached")
    assert rc == 0, err
    assert fake.names() == ["snapshot_download"]
    fake.snapshot = LocalEntryNotFoundError("Cannot find the requested files in the disk cache.")
    rc, out, err = _gen(capsys, "--model", "someorg/missing")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "someorg/missing" in err and "HF_HUB_OFFLINE" in err


def test_unknown_repo_is_one_line(monkeypatch, capsys):
    from huggingface_hub.errors import RepositoryNotFoundError

    fake = FakeHub(monkeypatch, {}, DEMO_DIR, free=GB)

    def missing(*a, **k):
        raise RepositoryNotFoundError(
            "404 Client Error.\nRepository Not Found for url: x", response=N(headers={}, status_code=404, request=None)
        )

    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: N(model_info=missing))
    rc, out, err = _gen(capsys, "--model", "nobody/nothing")
    assert rc == 2 and err.count("\n") == 1 and "nobody/nothing" in err and "RepositoryNotFoundError" in err
    assert "snapshot_download" not in fake.names()
    # neither a directory nor a repo id: the local-path error, no Hub call
    rc, _, err = _gen(capsys, "--model", "./no/such/dir")
    assert rc == 2 and "no model" in err and fake.calls == []


def test_convert_downloads_a_repo_and_checks_the_output_disk(monkeypatch, tmp_path, capsys):
    from support.artifact_fixture import tiny_checkpoint

    hf = tiny_checkpoint(str(tmp_path / "snap"))
    size = sum(os.path.getsize(os.path.join(hf, n)) for n in os.listdir(hf))
    fake = FakeHub(monkeypatch, {n: os.path.getsize(os.path.join(hf, n)) for n in os.listdir(hf)}, hf, free=size)
    out = str(tmp_path / "art")
    capsys.readouterr()
    rc = cli_main(["convert", "--hf-path", "someorg/tiny", "--out", out, "--dtype", "float32"])
    err = capsys.readouterr().err
    # the download alone would fit; with the f32 artifact (bigger than the
    # source) it does not: refused before the download starts
    assert rc == 2 and err.count("\n") == 1 and f"only {size} bytes" in err and "convert" in err
    assert "snapshot_download" not in fake.names() and not os.path.exists(out)
    assert fake.names()[:2] == ["hf_hub_download", "model_info"]
    fake.free = 10 * GB
    assert cli_main(["convert", "--hf-path", "someorg/tiny", "--out", out, "--dtype", "float32"]) == 0
    import json

    assert json.load(open(os.path.join(out, "manifest.json")))["source"]["repo"] == "someorg/tiny"


@pytest.mark.parametrize("same_fs", [True, False])
def test_download_and_artifact_share_the_free_space_of_one_filesystem(monkeypatch, tmp_path, same_fs):
    """convert from a repo: download + artifact are added when the HF cache
    and --out share a filesystem, checked apart when they do not."""
    fake = FakeHub(monkeypatch, {"model.safetensors": 600, "config.json": 0}, DEMO_DIR, free=1000)
    monkeypatch.setattr(hub, "_device", lambda p: 1 if same_fs or str(p).startswith(str(tmp_path)) else 2)
    also = (500, str(tmp_path / "art"))
    if same_fs:
        with pytest.raises(hub.DiskSpaceError) as e:
            hub.download("o/r", also=also)
        assert "needs 1100 bytes" in str(e.value) and "snapshot_download" not in fake.names()
    else:
        assert hub.download("o/r", also=also) == DEMO_DIR
        assert fake.names().count("disk_usage") == 2
