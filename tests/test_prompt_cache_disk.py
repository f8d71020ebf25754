"""Issue 24 §4: prefix snapshots on disk (--prompt-cache-dir), across a restart.

A "restart" is a fresh model load and a fresh PromptCache + DiskPromptCache over the same
directory. Controls are plain model calls on fresh caches with the same token partition (no
PromptCache), as in test_prompt_cache.py."""

import json
import logging
import os

import numpy as np
import pytest
from test_prompt_cache import _feed, _greedy, _two_request_control

from hebrus_mlx.prompt_cache import PromptCache, Usage
from hebrus_mlx.prompt_cache_disk import DiskPromptCache


@pytest.fixture(scope="module")
def demo():
    from hebrus_mlx import load

    return load("demo")


def _restart(directory, max_bytes=1 << 30):
    from hebrus_mlx import load

    model, tok = load("demo")
    pc = PromptCache(1 << 30)
    pc.disk = DiskPromptCache(directory, max_bytes, model)
    return model, tok, pc


def test_restored_from_disk_is_bitwise_a_fresh_run_with_the_same_partition(demo, tmp_path):
    model, tok = demo
    pc = PromptCache(1 << 30)
    pc.disk = DiskPromptCache(tmp_path, 1 << 30, model)
    a = tok.apply_chat_template([{"role": "user", "content": "Open a file."}])
    a_tokens, _ = _greedy(model, tok, a, pc, 6)
    assert pc.disk.flush(60)
    assert pc.disk.saves == 2 and len(list(tmp_path.glob("*.json"))) == 2  # a[:-1] and a + reply
    model2, tok2, pc2 = _restart(tmp_path)
    assert len(pc2.disk.entries) == 2
    b = a + a_tokens + tok.encode("\n# and then close it\n")
    u = Usage(0, 0)
    b_tokens, b_logprobs = _greedy(model2, tok2, b, pc2, 6, u)
    assert u.cached_tokens == len(a) + len(a_tokens) and pc2.disk.hits == 1
    control = _two_request_control(model, tok, a, a_tokens, b)
    assert np.array_equal(b_logprobs[0], control)
    assert b_tokens == _greedy(model, tok, b, None, 6)[0]


def _one_entry(model, tok, directory, text="def read(path):\n"):
    pc = PromptCache(1 << 30)
    pc.disk = DiskPromptCache(directory, 1 << 30, model)
    ids = tok.encode(text)
    _greedy(model, tok, ids, pc, 1)
    assert pc.disk.flush(60)
    return ids


def _corrupt_data(d):
    for data in d.glob("*.safetensors"):
        raw = bytearray(data.read_bytes())
        raw[-10] ^= 0xFF
        data.write_bytes(bytes(raw))


def _stale_index(d):
    for p in d.glob("*.json"):
        rec = json.loads(p.read_text())
        rec["format"] = "hebrus-mlx/prompt-cache-dir/0"
        p.write_text(json.dumps(rec))


def _foreign_data(d):
    # Another artifact's state under this artifact's index record (a file copied in by hand).
    import hebrus_mlx.prompt_cache as pcm
    from hebrus_mlx.prompt_cache import serialize_prompt_cache

    for p in d.glob("*.json"):
        rec = json.loads(p.read_text())
        data = p.with_suffix(".safetensors")
        real = pcm.model_artifact_digest
        pcm.model_artifact_digest = lambda model: "0" * 64
        try:
            from hebrus_mlx import load

            model, tok = load("demo")
            cache = model.make_cache()
            ids = rec["tokens"]
            _feed(model, cache, [ids])
            payload = serialize_prompt_cache(cache, model, ids)
        finally:
            pcm.model_artifact_digest = real
        data.write_bytes(payload)
        import hashlib

        rec["sha256"] = hashlib.sha256(payload).hexdigest()
        p.write_text(json.dumps(rec))


# Every entry is damaged; a stale index is refused when the directory is scanned (both entries), a
# corrupted or foreign data file when its prefix is about to be restored (the one entry tried).
@pytest.mark.parametrize(
    "damage,why,n",
    [(_corrupt_data, "checksum mismatch", 1), (_stale_index, "stale format", 2), (_foreign_data, "foreign", 1)],
)
def test_foreign_stale_or_corrupted_is_refused_with_one_line_and_recomputed(demo, tmp_path, caplog, damage, why, n):
    model, tok = demo
    ids = _one_entry(model, tok, tmp_path)
    damage(tmp_path)
    caplog.set_level(logging.WARNING, logger="hebrus_mlx.prompt_cache")
    model2, tok2, pc2 = _restart(tmp_path)
    longer = ids + tok.encode("    return open(path).read()\n")
    u = Usage(0, 0)
    tokens, _ = _greedy(model2, tok2, longer, pc2, 4, u)
    assert pc2.disk.flush(60)
    assert u.cached_tokens == 0  # recomputed, not restored
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == n and all(why in line for line in lines), lines
    assert tokens == _greedy(model, tok, longer, None, 4)[0]
    # Recomputed and published again: the next restart restores it.
    _, _, pc3 = _restart(tmp_path)
    assert pc3.disk.longest(longer) is not None and pc3.disk.refused == 0


def test_bounded_in_bytes_lru_and_other_artifacts_left_alone(demo, tmp_path):
    model, tok = demo
    one = _one_entry(model, tok, tmp_path / "probe")
    per = max(p.stat().st_size for p in (tmp_path / "probe").glob("*.safetensors"))
    d = tmp_path / "cache"
    d.mkdir()
    # A file of another artifact sharing the directory, and a file that is not the cache's.
    other = {
        "format": "hebrus-mlx/prompt-cache-dir/1",
        "artifact_digest": "f" * 64,
        "dtype": "float32",
        "tokens": [1, 2],
        "bytes": 1,
        "sha256": "0" * 64,
    }
    (d / ("a" * 40 + ".json")).write_text(json.dumps(other))
    (d / "notes.txt").write_text("mine")
    pc = PromptCache(1 << 30)
    pc.disk = DiskPromptCache(d, int(per * 2.5), model)
    for text in ["a = 1\n", "b = 2\n", "c = 3\n"]:
        _greedy(model, tok, tok.encode(text), pc, 1)
        assert pc.disk.flush(60)
    assert pc.disk.nbytes <= int(per * 2.5) and len(pc.disk.entries) == 2
    assert sum(p.stat().st_size for p in d.glob("*.safetensors")) == pc.disk.nbytes
    c = tuple(tok.encode("c = 3\n"))
    assert all(k[: len(c) - 1] == c[:-1] for k in pc.disk.entries)  # the newest survive
    assert (d / ("a" * 40 + ".json")).exists() and (d / "notes.txt").read_text() == "mine"
    assert one  # the probe ran


def test_cli_flags(capsys):
    from hebrus_mlx.cli import main as cli_main

    assert cli_main(["server", "--prompt-cache-dir-bytes", "5"]) == 2
    assert "--prompt-cache-dir-bytes: needs --prompt-cache-dir" in capsys.readouterr().err
    assert cli_main(["chat", "--prompt-cache-dir", os.devnull]) == 2
    assert "--prompt-cache-dir" in capsys.readouterr().err


def test_server_worker_restores_across_a_restart(demo, tmp_path):
    """The server's worker with --prompt-cache-dir: a second worker (the restarted server) restores
    the first one's prefix from disk and gives the same text as the in-process run."""
    import asyncio

    from support.scripted_server import run_job

    from hebrus_mlx import load, stream_generate
    from hebrus_mlx.serve.sampling import Sampling
    from hebrus_mlx.serve.worker import ServerDefaults, Worker

    model, tok = demo
    ids = tok.encode("class Reader:\n    def __init__(self, path):\n")

    def complete(worker, prompt):
        return asyncio.run(run_job(worker, prompt, Sampling(None, 0.0, 1.0, 0, 0.0, None, [], True, False), 6))

    defaults = ServerDefaults(prompt_cache_dir=str(tmp_path))
    w1 = Worker(lambda: load("demo"), 1 << 30, defaults)
    try:
        complete(w1, ids)
    finally:
        w1.stop()
    assert w1.prompt_cache.disk.flush(60)
    w2 = Worker(lambda: load("demo"), 1 << 30, defaults)
    longer = ids + tok.encode("        self.path = path\n")
    try:
        text, usage = complete(w2, longer)
    finally:
        w2.stop()
    assert usage.cached_tokens == len(ids) - 1
    assert text == "".join(r.text for r in stream_generate(model, tok, longer, max_tokens=6))
