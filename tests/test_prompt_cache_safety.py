"""Prompt-cache files and `--prompt-cache-dir` at the edges (issue 22's rules applied to the prompt
cache): nothing the user owns is replaced or deleted, entries that are not the cache's regular files
are never followed, read unbounded or waited on, two processes sharing a directory keep its byte
bound, malformed files are refused naming the field, and files round-trip through mlx-lm's own
helpers (AFN-010: the state is restored exactly or not at all).

User files, FIFOs, links and crafted files are written here as controls; the cache under test
writes its own entries through the real code."""

import json
import os

import pytest

from hebrus_mlx.cli import main as cli_main

USER = b"my notes: not written by any tool\n"


@pytest.fixture(scope="module")
def demo():
    from hebrus_mlx import load

    return load("demo")


def _refused(capsys, argv, field):
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"error: {field}: " in err, err
    return err


# -- cache-prompt --prompt-cache-file ------------------------------------------------------------------


def _cache_prompt(f, *extra):
    return ["cache-prompt", "--prompt", "x", "--prompt-cache-file", str(f), "--verbose", "false", *extra]


def test_cache_prompt_refuses_an_existing_file_without_overwrite(demo, capsys, tmp_path):
    f = tmp_path / "mine.safetensors"
    f.write_bytes(USER)
    err = _refused(capsys, _cache_prompt(f), "--prompt-cache-file")
    assert "--overwrite" in err
    assert f.read_bytes() == USER and os.listdir(tmp_path) == ["mine.safetensors"]
    assert cli_main(_cache_prompt(f, "--overwrite")) == 0
    assert f.read_bytes() != USER and os.listdir(tmp_path) == ["mine.safetensors"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_cache_prompt_never_replaces_a_symlink(demo, capsys, tmp_path, overwrite):
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(USER)
    link = tmp_path / "link.safetensors"
    link.symlink_to(victim)
    err = _refused(capsys, _cache_prompt(link, *(["--overwrite"] if overwrite else [])), "--prompt-cache-file")
    assert "symlink" in err
    assert os.path.islink(link) and os.readlink(link) == str(victim) and victim.read_bytes() == USER


def test_cache_prompt_alias_and_help_lists_only_used_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["cache_prompt", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "hebrus-mlx cache-prompt" in out and "--prompt-cache-file" in out and "--overwrite" in out
    for used in ("--model", "--prompt", "--system-prompt", "--ignore-chat-template", "--prefill-step-size"):
        assert used in out, used
    for refused in ("--temp", "--max-tokens", "--top-p", "--draft-model", "--seed-text"):
        assert refused not in out, refused
    # A refused flag is still named as refused, not as unknown.
    _refused(capsys, ["cache_prompt", "--prompt", "x", "--prompt-cache-file", "f", "--temp", "0.5"], "--temp")


# -- malformed --prompt-cache-file: refused naming the field, never restored --------------------------

DOC = "def read(path):\n    with open(path) as f:\n        return f.read()\n"


@pytest.fixture(scope="module")
def saved(demo, tmp_path_factory):
    """A file written by the real `cache-prompt` (plain text: its state after DOC)."""
    f = tmp_path_factory.mktemp("saved") / "doc.safetensors"
    argv = ["cache-prompt", "--prompt", DOC, "--prompt-cache-file", str(f), "--ignore-chat-template"]
    assert cli_main(argv + ["--verbose", "false"]) == 0
    return f


def _layer_keys(arrays, meta, layer):
    """The array keys of one layer and the scalar ones (key -> kind), whatever container it is saved in."""
    scalars = {}
    i = 1
    while f"2.{i}.0" in meta:
        scalars[meta[f"2.{i}.0"]] = meta[f"2.{i}.1"]
        i += 1
    keys = sorted((k for k in arrays if k.split(".")[0] == str(layer)), key=lambda k: [int(x) for x in k.split(".")])
    return keys, scalars


def _offset_disagrees(arrays, meta):
    # Every attention layer's length counter (and the file's offset) one less than its rows.
    import mlx.core as mx

    n = int(meta["0.offset"])
    for layer in (3, 7):
        keys, scalars = _layer_keys(arrays, meta, layer)
        length = [k for k in keys if scalars.get(k) == "scalar"][0]  # the first counter is `length`
        arrays[length] = mx.array(n - 1)
    meta["0.offset"] = str(n - 1)
    return "prompt_cache_file.layers.3.keys"


def _not_finite(arrays, meta):
    import mlx.core as mx

    keys, _ = _layer_keys(arrays, meta, 1)
    rec = next(k for k in keys if arrays[k].ndim == 4)  # the recurrent state
    arrays[rec] = mx.full(arrays[rec].shape, float("nan"), dtype=arrays[rec].dtype)
    return "prompt_cache_file.layers.1.recurrent_state"


def _none_made_scalar(arrays, meta):
    # mlx-lm's scalar list claims an empty array is an integer (its loader calls .item() on it).
    i = next(i for i in range(1, 1000) if meta.get(f"2.{i}.1") == "none")
    meta[f"2.{i}.1"] = "scalar"
    return f"prompt_cache_file.{meta[f'2.{i}.0']}"


def _string_of_floats(arrays, meta):
    keys, _ = _layer_keys(arrays, meta, 0)
    i = 1
    while f"2.{i}.0" in meta:
        i += 1
    meta[f"2.{i}.0"], meta[f"2.{i}.1"] = keys[0], "string"  # a float array decoded as a string
    return f"prompt_cache_file.{keys[0]}"


@pytest.mark.parametrize("craft", [_offset_disagrees, _not_finite, _none_made_scalar, _string_of_floats])
def test_a_malformed_prompt_cache_file_is_refused_naming_the_field(demo, saved, tmp_path, capsys, craft):
    import mlx.core as mx

    arrays, meta = mx.load(str(saved), return_metadata=True)
    field = craft(arrays, meta)
    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(bad), arrays, meta)
    argv = ["generate", "--prompt-cache-file", str(bad), "--prompt", "x", "--ignore-chat-template"]
    _refused(capsys, argv + ["--max-tokens", "2"], "--prompt-cache-file")
    from hebrus_mlx.prompt_cache import PromptCacheFileError, load_prompt_cache

    with pytest.raises(PromptCacheFileError) as e:
        load_prompt_cache(bad, demo[0])
    assert e.value.field == field


def test_mlx_lm_helpers_round_trip_a_hebrus_file(demo, saved, tmp_path):
    """mlx-lm's own load_prompt_cache reads a file hebrus-mlx saved, its save_prompt_cache writes
    the loaded layers back, and hebrus restores that file bitwise (AFN-010)."""
    from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
    from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

    from hebrus_mlx.prompt_cache import load_prompt_cache

    model, _ = demo
    mine, meta = load_prompt_cache(saved, model, return_metadata=True)
    layers, their_meta = mlx_lm_load(str(saved), return_metadata=True)
    assert len(layers) == len(mine) and json.loads(their_meta["tokens"]) == meta["tokens"]
    again = tmp_path / "again.safetensors"
    mlx_lm_save(str(again), layers, their_meta)
    back, back_meta = load_prompt_cache(again, model, return_metadata=True)
    assert back.digest() == mine.digest() and back_meta["tokens"] == meta["tokens"]
