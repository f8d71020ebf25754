"""Hugging Face Hub sources: `--model ORG/NAME` and `convert --hf-path ORG/NAME`.

Resolution order for a model name: `demo` -> an existing local directory ->
a Hub repo id. A repo is fetched with `huggingface_hub.snapshot_download`
(resumable, its own progress bars, the shared HF cache), but only after a
free-disk check: the bytes still to download (the repo's file sizes from one
`model_info(files_metadata=True)` call, minus files already complete in the
cache) must fit in the cache's filesystem. The real checkpoints are 100-360 GB;
failing after hours of download is what this prevents.

With HF_HUB_OFFLINE set nothing is asked of the network: a cached snapshot
is used as is, and a repo missing from the cache is a typed error.
"""

import fnmatch
import os
import re
import shutil
from pathlib import Path

from ..artifact.errors import ArtifactError
from ..errors import HebrusError

# What a text checkpoint needs (weights, configs, tokenizer, chat template),
# and a published hebrus-mlx artifact's stores.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.hbem",
    "*.hbpl",
    "*.xxh3",
]  # a published artifact's fast-check digest tables (artifact/fast_check.py)

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


DEMO_DIR = Path(__file__).resolve().parents[1] / "demo" / "model"


class ModelNotFoundError(HebrusError, FileNotFoundError):
    """No model at the given name; the message lists every place that was looked at."""

    default_field = "model"


def resolve_model_path(name: str) -> Path:
    """`demo` -> the shipped demo model; otherwise an artifact dir or an HF checkpoint dir."""
    looked = []
    if name == "demo":
        candidates = [DEMO_DIR]
    else:
        candidates = [Path(name).expanduser()]
    for path in candidates:
        looked.append(str(path / "manifest.json"))
        if (path / "manifest.json").is_file():
            return path
        looked.append(str(path / "config.json"))
        if (path / "config.json").is_file():
            return path
    raise ModelNotFoundError(f"no model {name!r}: looked for " + ", ".join(looked))


class HubError(ArtifactError, ValueError):
    """A Hub repo cannot be resolved, downloaded, or does not fit on disk."""


class DiskSpaceError(HubError):
    """Not enough free disk for a download or a conversion."""


def is_repo_id(name):
    return bool(_REPO_ID.match(name)) and ".." not in name


def offline():
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _existing_parent(path):
    p = Path(path).expanduser().absolute()
    while not p.exists():
        p = p.parent
    return p


def check_free(needed, where, what, field="disk"):
    """Refuse (one line naming needed and free bytes) when `needed` bytes do
    not fit on the filesystem holding `where` (or its nearest existing parent)."""
    free = shutil.disk_usage(_existing_parent(where)).free
    if needed > free:
        raise DiskSpaceError(
            field,
            f"{what} needs {needed} bytes ({needed / 2**30:.1f} GiB) in "
            f"{_existing_parent(where)}, only {free} bytes ({free / 2**30:.1f} GiB) free",
        )
    return free


def _matches(name, patterns):
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def bytes_to_download(repo_id, revision=None, allow_patterns=ALLOW_PATTERNS, cache_dir=None):
    """(bytes still to fetch, total bytes) of the repo's files that match."""
    from huggingface_hub import HfApi, try_to_load_from_cache

    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as e:  # network/auth/not-found: version-dependent exception types
        raise HubError("model", f"{repo_id}: cannot read repo info ({type(e).__name__}: {_first_line(e)})") from None
    total = todo = 0
    for f in info.siblings or ():
        if not _matches(f.rfilename, allow_patterns):
            continue
        if f.size is None:
            raise HubError("model", f"{repo_id}: the Hub gave no size for {f.rfilename}")
        total += f.size
        cached = try_to_load_from_cache(repo_id, f.rfilename, cache_dir=cache_dir, revision=info.sha or revision)
        if not (isinstance(cached, str) and os.path.isfile(cached) and os.path.getsize(cached) == f.size):
            todo += f.size
    return todo, total


def read_config(repo_id, revision=None, cache_dir=None):
    """config.json of a repo (one small download, or the cache when offline)."""
    from huggingface_hub import hf_hub_download

    from ..artifact import untrusted

    if not is_repo_id(repo_id):
        raise HubError("model", f"{repo_id!r} is neither a local directory nor a Hub repo id (ORG/NAME)")
    try:
        path = hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache_dir)
        return untrusted.read_json_path(path, "config")
    except Exception as e:  # offline cache miss, network, auth, bad JSON: version-dependent types
        raise HubError("model", f"{repo_id}: cannot read config.json ({type(e).__name__}: {_first_line(e)})") from None


def _device(path):
    return os.stat(_existing_parent(path)).st_dev


def download(repo_id, revision=None, allow_patterns=ALLOW_PATTERNS, cache_dir=None, also=None):
    """Local snapshot directory of `repo_id`, downloaded after the disk check.
    also=(bytes, path): a later write (the converted artifact) that must fit
    too; on the cache's filesystem the two are added."""
    from huggingface_hub import constants, snapshot_download

    if not is_repo_id(repo_id):
        raise HubError("model", f"{repo_id!r} is neither `demo`, a local directory, nor a Hub repo id (ORG/NAME)")
    if not offline():
        cache = cache_dir or constants.HF_HUB_CACHE
        todo, _ = bytes_to_download(repo_id, revision, allow_patterns, cache_dir)
        if also is not None and _device(also[1]) == _device(cache):
            check_free(todo + also[0], cache, f"downloading {repo_id} and converting it into {also[1]}")
        else:
            check_free(todo, cache, f"downloading {repo_id}")
            if also is not None:
                check_free(also[0], also[1], f"converting {repo_id} into {also[1]}", field="out")
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns, cache_dir=cache_dir)
    except Exception as e:  # offline cache miss, network, auth: version-dependent types
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline() else ""
        raise HubError("model", f"{repo_id}: download failed{hint}: {type(e).__name__}: {_first_line(e)}") from None
    return Path(path)


def resolve_model(name, revision=None):
    """Local path of `demo`, an existing directory, or a downloaded repo."""
    if name == "demo" or Path(name).expanduser().exists() or not is_repo_id(name):
        return resolve_model_path(name)
    return resolve_model_path(str(download(name, revision)))


def _first_line(e):
    text = str(e).strip().splitlines()
    return text[0] if text else ""
