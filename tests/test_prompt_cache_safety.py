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
from support.cli_refused import refused

from hebrus_mlx.cli import main as cli_main

USER = b"my notes: not written by any tool\n"


@pytest.fixture(scope="module")
def demo():
    from hebrus_mlx import load

    return load("demo")


# -- cache-prompt --prompt-cache-file ------------------------------------------------------------------


def _cache_prompt(f, *extra):
    return ["cache-prompt", "--prompt", "x", "--prompt-cache-file", str(f), "--verbose", "false", *extra]


def test_cache_prompt_refuses_an_existing_file_without_overwrite(demo, capsys, tmp_path):
    f = tmp_path / "mine.safetensors"
    f.write_bytes(USER)
    err = refused(capsys, _cache_prompt(f), "--prompt-cache-file")
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
    err = refused(capsys, _cache_prompt(link, *(["--overwrite"] if overwrite else [])), "--prompt-cache-file")
    assert "symlink" in err
    assert os.path.islink(link) and os.readlink(link) == str(victim) and victim.read_bytes() == USER


def test_the_library_save_never_replaces_a_symlink(demo, tmp_path):
    """save_prompt_cache itself (the CLI's second check, right before the publish): a symlink is
    never replaced, a regular file only with overwrite (its default, as mlx-lm's)."""
    from hebrus_mlx.errors import UsageError
    from hebrus_mlx.prompt_cache import save_prompt_cache

    model, _ = demo
    victim = tmp_path / "victim"
    victim.write_bytes(USER)
    link = tmp_path / "link.safetensors"
    link.symlink_to(victim)
    with pytest.raises(UsageError) as e:
        save_prompt_cache(link, model.make_cache(), model)
    assert e.value.field == "prompt_cache_file" and "symlink" in e.value.message
    assert os.readlink(link) == str(victim) and victim.read_bytes() == USER
    with pytest.raises(UsageError):
        save_prompt_cache(victim, model.make_cache(), model, overwrite=False)
    assert victim.read_bytes() == USER


def test_cache_prompt_alias_and_help_lists_only_used_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["cache_prompt", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "hebrus-mlx cache-prompt" in out and "--prompt-cache-file" in out and "--overwrite" in out
    for used in ("--model", "--prompt", "--system-prompt", "--ignore-chat-template", "--prefill-step-size"):
        assert used in out, used
    for flag in ("--temp", "--max-tokens", "--top-p", "--draft-model", "--trace-out", "--pipeline-split"):
        assert flag not in out, flag
    # A refused flag is still named as refused, not as unknown.
    refused(capsys, ["cache_prompt", "--prompt", "x", "--prompt-cache-file", "f", "--temp", "0.5"], "--temp")


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


def _narrow_heads(arrays, meta):
    # Every attention layer's keys and values cut to half their head width: consistent across the
    # file's layers, not the model's.
    for layer in (3, 7):
        keys, _ = _layer_keys(arrays, meta, layer)
        for k in [k for k in keys if arrays[k].ndim == 4]:
            arrays[k] = arrays[k][..., : arrays[k].shape[-1] // 2]
    return "prompt_cache_file.layers.3.keys"


def _ple_context_dropped(arrays, meta):
    # A PLE layer without its n-gram context at a non-zero offset (its run would restart from EOS).
    import mlx.core as mx

    keys, _ = _layer_keys(arrays, meta, 0)
    ngram = next(k for k in keys if arrays[k].dtype == mx.int64)
    arrays[ngram] = mx.array([], dtype=mx.float32)
    i = 1
    while f"2.{i}.0" in meta:
        i += 1
    meta[f"2.{i}.0"], meta[f"2.{i}.1"] = ngram, "none"
    return "prompt_cache_file.layers.0.ngram_context"


CRAFTS = [_offset_disagrees, _not_finite, _none_made_scalar, _string_of_floats, _narrow_heads, _ple_context_dropped]


@pytest.mark.parametrize("craft", CRAFTS)
def test_a_malformed_prompt_cache_file_is_refused_naming_the_field(demo, saved, tmp_path, capsys, craft):
    import mlx.core as mx

    arrays, meta = mx.load(str(saved), return_metadata=True)
    field = craft(arrays, meta)
    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(str(bad), arrays, meta)
    argv = ["generate", "--prompt-cache-file", str(bad), "--prompt", "x", "--ignore-chat-template"]
    refused(capsys, argv + ["--max-tokens", "2"], "--prompt-cache-file")
    from hebrus_mlx.prompt_cache import PromptCacheFileError, load_prompt_cache

    with pytest.raises(PromptCacheFileError) as e:
        load_prompt_cache(bad, demo[0])
    assert e.value.field == field


def test_a_prompt_cache_file_that_is_a_fifo_is_refused_not_waited_on(demo, tmp_path, capsys):
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    argv = ["generate", "--prompt-cache-file", str(fifo), "--prompt", "x", "--max-tokens", "1"]
    err = _within(lambda: refused(capsys, argv, "--prompt-cache-file"))
    assert "not a regular file" in err


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


# -- --prompt-cache-dir: only what the cache provably wrote is ever removed ---------------------------


def _disk(directory, model, max_bytes=1 << 30):
    from hebrus_mlx.prompt_cache import PromptCache
    from hebrus_mlx.prompt_cache_disk import DiskPromptCache

    pc = PromptCache(1 << 30)
    pc.disk = DiskPromptCache(directory, max_bytes, model)
    return pc


def _entry(demo, directory, text="def read(path):\n"):
    """One entry written by the real cache (the prompt minus its last token), alone in `directory`
    (a fresh one); (ids, its key)."""
    from test_prompt_cache import _greedy

    model, tok = demo
    pc = _disk(directory, model)
    ids = tok.encode(text)
    _greedy(model, tok, ids, pc, 1)
    assert pc.disk.flush(60)
    (tokens,) = [t for t in pc.disk.entries if len(t) == len(ids) - 1]
    key = pc.disk.entries[tokens]["key"]
    for p in directory.glob("*.*"):  # the prompt + reply entry: a later prompt may start with it
        if p.stem != key and p.suffix in (".json", ".safetensors"):
            p.unlink()
    return ids, key


def _within(fn, seconds=120):
    """fn() on a thread; fails (instead of hanging the suite) if it has not returned in `seconds`."""
    import threading

    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised on the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} did not return: it blocks on the file"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _old(path, seconds=3600):
    t = os.stat(path, follow_symlinks=False).st_mtime - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def _snapshot(d):
    return {p.name: (p.read_bytes() if p.is_file() else None) for p in d.iterdir() if p.name[0] != "."}


def test_user_files_with_cache_like_names_are_never_deleted(demo, tmp_path, caplog):
    import logging

    import mlx.core as mx

    model, _ = demo
    d = tmp_path / "cache"
    d.mkdir()
    names = iter("%040x" % (0xABC0 + i) for i in range(10))
    (d / f"{next(names)}.json").write_text("[1, 2, 3]")
    (d / f"{next(names)}.json").write_text("my shopping list\n")
    imitation = {"format": "hebrus-mlx/prompt-cache-dir/1", "tokens": [1, 2], "bytes": 1, "sha256": "0" * 64}
    probe = _disk(tmp_path / "probe", model).disk
    imitation |= {"artifact_digest": probe.digest, "dtype": probe.dtype}
    (d / f"{next(names)}.json").write_text(json.dumps(imitation))  # its tokens do not hash to its name
    raw = d / f"{next(names)}.safetensors"
    raw.write_bytes(os.urandom(4096))
    mine = d / f"{next(names)}.safetensors"
    mx.save_safetensors(str(mine), {"w": mx.ones((4,))}, {"note": "my weights"})
    for p in (raw, mine):
        _old(p)
    before = _snapshot(d)
    caplog.set_level(logging.WARNING, logger="hebrus_mlx.prompt_cache")
    pc = _disk(d, model)
    assert len(pc.disk.entries) == 0 and pc.disk.refused == 0
    assert _snapshot(d) == before
    assert sum("left alone" in r.getMessage() for r in caplog.records) == 5
    # Entries published beside them (each publish accounts from the directory) log them no more;
    # neither that nor a restart deletes them.
    from test_prompt_cache import _greedy

    caplog.clear()
    _greedy(model, demo[1], demo[1].encode("a = 1\n"), pc, 1)
    assert pc.disk.flush(60) and pc.disk.saves == 2
    assert not [r for r in caplog.records if "left alone" in r.getMessage()]
    _disk(d, model)
    assert {k: v for k, v in _snapshot(d).items() if k in before} == before


def test_a_killed_write_of_the_cache_is_still_removed(demo, tmp_path):
    """Control: a data file whose own metadata proves it is this cache's, left without its record by
    a killed write, is removed once it is over a minute old (and not before)."""
    d = tmp_path / "cache"
    _, key = _entry(demo, d)
    (d / f"{key}.json").unlink()
    _disk(d, demo[0])
    assert (d / f"{key}.safetensors").exists()  # young: a live write may still publish its record
    _old(d / f"{key}.safetensors")
    _disk(d, demo[0])
    assert not (d / f"{key}.safetensors").exists()


# -- --prompt-cache-dir: entries that are not regular files -------------------------------------------


def _fifo(p):
    p.unlink()
    os.mkfifo(p)


def _dev_zero(p):
    p.unlink()
    p.symlink_to("/dev/zero")


def _directory(p):
    p.unlink()
    p.mkdir()


@pytest.mark.parametrize("plant", [_fifo, _dev_zero, _directory])
@pytest.mark.parametrize("when", ["before start-up", "after start-up"])
def test_a_data_file_that_is_not_regular_is_refused_and_left_alone(demo, tmp_path, plant, when):
    from test_prompt_cache import _greedy

    from hebrus_mlx.prompt_cache import Usage

    model, tok = demo
    d = tmp_path / "cache"
    ids, key = _entry(demo, d)
    data = d / f"{key}.safetensors"
    if when == "before start-up":
        plant(data)
    pc = _within(lambda: _disk(d, model))
    if when == "after start-up":
        plant(data)
    kind = os.lstat(data).st_mode
    longer = ids + tok.encode("    return 1\n")
    u = Usage(0, 0)
    tokens, _ = _within(lambda: _greedy(model, tok, longer, pc, 2, u))
    assert u.cached_tokens == 0 and pc.disk.refused == 1
    _within(lambda: _greedy(model, tok, longer, pc, 2))  # recomputed from then on, never an error
    assert pc.disk.refused == 1 and os.lstat(data).st_mode == kind  # left where it is
    assert tokens == _greedy(model, tok, longer, None, 2)[0]


def test_a_fifo_or_deeply_nested_index_does_not_hang_or_crash_startup(demo, tmp_path):
    model, _ = demo
    d = tmp_path / "cache"
    _, key = _entry(demo, d)
    _, other = _entry(demo, tmp_path / "o", "x = 1\n")
    for p in (tmp_path / "o").glob(f"{other}.*"):
        os.replace(p, d / p.name)
    _fifo(d / f"{key}.json")
    (d / f"{other}.json").write_text("[" * 100000 + "]" * 100000)
    pc = _within(lambda: _disk(d, model))
    assert (d / f"{key}.json").is_fifo() and (d / f"{other}.json").stat().st_size == 200000
    assert all(e["key"] not in (key, other) for e in pc.disk.entries.values())


def test_a_data_file_linked_outside_the_directory_is_not_followed(demo, tmp_path):
    model, tok = demo
    d = tmp_path / "cache"
    ids, key = _entry(demo, d)
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(d / f"{key}.safetensors", outside)
    (d / f"{key}.safetensors").symlink_to(outside)
    _old(outside)
    mtime, content = outside.stat().st_mtime_ns, outside.read_bytes()
    from test_prompt_cache import _greedy

    from hebrus_mlx.prompt_cache import Usage

    pc = _disk(d, model)
    u = Usage(0, 0)
    _greedy(model, tok, ids + tok.encode("pass\n"), pc, 1, u)
    assert u.cached_tokens == 0 and pc.disk.refused == 1
    assert outside.stat().st_mtime_ns == mtime and outside.read_bytes() == content
    assert (d / f"{key}.safetensors").is_symlink()


# -- --prompt-cache-dir shared by two processes: one byte bound for the directory ---------------------


def test_two_caches_sharing_a_directory_keep_its_bound(demo, tmp_path):
    from test_prompt_cache import _greedy

    model, tok = demo
    _entry(demo, tmp_path / "probe")
    per = max(p.stat().st_size for p in (tmp_path / "probe").glob("*.safetensors"))
    d = tmp_path / "shared"
    bound = int(per * 2.5)
    a, b = _disk(d, model, bound), _disk(d, model, bound)  # two servers' caches over one directory
    for pc, text in [(a, "a = 1\n"), (b, "b = 2\n"), (a, "c = 3\n"), (b, "d = 4\n")]:
        _greedy(model, tok, tok.encode(text), pc, 1)
        assert pc.disk.flush(60)
    on_disk = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    assert on_disk <= bound and len(list(d.glob("*.json"))) == 2, (on_disk, bound)
    # Each sees the other's entries (it accounts from the directory) and restores them.
    d_ids = tok.encode("d = 4\n")
    assert a.disk.longest(d_ids + [1]) is not None and b.disk.longest(d_ids + [1]) is not None


# -- an unusable --prompt-cache-dir: one line, exit 2, before the model loads -------------------------


def _no_load(monkeypatch):
    from support.verb_loading import patch_load_from_args

    def boom(args):
        raise AssertionError("the model was loaded before --prompt-cache-dir was checked")

    patch_load_from_args(monkeypatch, boom)


def test_an_unusable_cache_dir_is_refused_before_the_model_loads(capsys, tmp_path, monkeypatch):
    _no_load(monkeypatch)
    f = tmp_path / "file"
    f.write_bytes(USER)
    for verb in ("server", "chat"):
        refused(capsys, [verb, "--model", "demo", "--prompt-cache-dir", str(f / "sub")], "--prompt-cache-dir")
    d = tmp_path / "cache"
    d.mkdir()
    os.mkfifo(d / ".hebrus-prompt-cache.lock")
    err = _within(
        lambda: refused(capsys, ["server", "--model", "demo", "--prompt-cache-dir", str(d)], "--prompt-cache-dir")
    )
    assert "not a regular file" in err and f.read_bytes() == USER


def test_an_unusable_cache_dir_exits_2_not_sigabrt(tmp_path):
    import subprocess
    import sys

    for _ in range(3):  # the abort came in about 1 of 3 runs
        r = subprocess.run(
            [sys.executable, "-m", "hebrus_mlx.cli", "server", "--model", "demo", "--port", "0"]
            + ["--prompt-cache-dir", "/proc/no-such-dir/cache"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (r.returncode, r.stderr)
        assert "--prompt-cache-dir" in r.stderr
