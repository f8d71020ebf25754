"""Prompt-cache files and `--prompt-cache-dir` at the edges (issue 22's rules applied to the prompt
cache): nothing the user owns is replaced or deleted, entries that are not the cache's regular files
are never followed, read unbounded or waited on, two processes sharing a directory keep its byte
bound, malformed files are refused naming the field, and files round-trip through mlx-lm's own
helpers (AFN-010: the state is restored exactly or not at all).

User files, FIFOs, links and crafted files are written here as controls; the cache under test
writes its own entries through the real code."""

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
