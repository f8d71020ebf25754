"""mlx-lm's cache protocol on hebrus caches (issue 26 §4): mlx-lm's save_prompt_cache,
can_trim_prompt_cache and trim_prompt_cache on a SequenceCache, hebrus's reader for the file, and
trimming where the state allows it (QSA layers) but not where it does not (Gated DeltaNet / PLE).

Controls are uninterrupted runs on fresh caches fed in the same partition, so logits are compared
bitwise."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

from hebrus_mlx.errors import HebrusError
from hebrus_mlx.models.cache import AttentionCache, CacheTrimError, LinearCache, SequenceCache
from hebrus_mlx.prompt_cache import PromptCacheFileError, load_prompt_cache, prompt_cache_metadata, save_prompt_cache

TEXT = (
    'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the arguments and run the command."""\n'
    "    for name in sorted(os.listdir(argv[1])):\n        print(name)\n    return 0\n"
) * 4


def _feed(model, cache, parts):
    out = None
    for p in parts:
        out = model(mx.array([p], dtype=mx.int32), cache=cache)
    mx.eval(out)
    return out


def _fed(demo, prefix):
    """(model, a fresh cache that has been fed the prefix's head)."""
    model, _ = demo
    cache = model.make_cache()
    _feed(model, cache, [prefix[0]])
    return model, cache


def _continue(model, tok, cache, ids, n=8):
    from hebrus_mlx.generate import generate_step

    steps = generate_step(
        mx.array(ids), model, effective_vocab_size=tok.effective_vocab_size, max_tokens=n, prompt_cache=cache
    )
    tokens, logprobs = zip(*[(t, np.array(lp)) for t, lp in steps])
    return list(tokens), np.stack(logprobs)


@pytest.fixture(scope="module")
def prefix(demo):
    model, tok = demo
    ids = tok.encode(TEXT)
    assert len(ids) > 135 + 16  # twice the QSA budget, many complete indexer groups
    return ids[:135], ids[135:]


def test_protocol_surface(demo):
    model, _ = demo
    cache = model.make_cache()
    assert isinstance(cache, list) and {type(c) for c in cache} == {LinearCache, AttentionCache}
    for c in cache:
        for name in ("state", "meta_state", "is_trimmable", "trim", "size", "empty", "nbytes", "from_state"):
            assert hasattr(c, name), (type(c).__name__, name)
        assert c.empty() and c.nbytes == 0


def test_mlx_lm_save_then_load_continues_bitwise(demo, prefix, tmp_path):
    """mlx-lm's save_prompt_cache writes a hebrus cache; the loaded cache continues generation with
    logits identical to the uninterrupted run."""
    model, tok = demo
    head, tail = prefix
    cache = model.make_cache()
    _feed(model, cache, [head[:40], head[40:]])
    path = tmp_path / "c.safetensors"
    mlx_lm_save(str(path), cache, metadata=prompt_cache_metadata(model, cache, tokens=head))
    loaded, meta = load_prompt_cache(path, model, return_metadata=True)
    assert meta["tokens"] == head and loaded.offset == len(head) and loaded.digest() == cache.digest()

    control = model.make_cache()
    _feed(model, control, [head[:40], head[40:]])
    want_tokens, want_logprobs = _continue(model, tok, control, tail)
    got_tokens, got_logprobs = _continue(model, tok, loaded, tail)
    assert got_tokens == want_tokens
    assert np.array_equal(got_logprobs, want_logprobs)


def test_hebrus_save_is_atomic_and_round_trips(demo, prefix, tmp_path):
    model, tok = demo
    head, tail = prefix
    cache = model.make_cache()
    _feed(model, cache, [head])
    path = tmp_path / "turn1.cache"  # no .safetensors suffix: written exactly here
    assert save_prompt_cache(path, cache, model, tokens=head, metadata={"note": "turn 1"}) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["turn1.cache"]  # no temp left behind
    loaded, meta = load_prompt_cache(path, model, return_metadata=True)
    assert meta["note"] == "turn 1" and loaded.digest() == cache.digest()
    # Continuing the loaded cache leaves the saved one untouched (no shared buffers).
    before = cache.digest()
    _continue(model, tok, loaded, tail, n=4)
    assert cache.digest() == before


def _rewrite(src, dst, **changes):
    """A copy of a saved file with metadata fields changed (None removes one)."""
    arrays, meta = mx.load(str(src), return_metadata=True)
    for k, v in changes.items():
        key = f"0.{k}"
        if v is None:
            meta.pop(key)
        else:
            meta[key] = v
    mx.save_safetensors(str(dst), arrays, meta)
    return dst


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"artifact_digest": "manifest:" + "0" * 64}, "prompt_cache_file.artifact_digest"),
        ({"dtype": "mlx.core.bfloat16"}, "prompt_cache_file.dtype"),
        ({"format": None}, "prompt_cache_file.format"),
        ({"offset": "3"}, "prompt_cache_file.offset"),
        ({"offset": "many"}, "prompt_cache_file.offset"),
        ({"tokens": json.dumps([1, 2, 3])}, "prompt_cache_file.tokens"),
    ],
)
def test_foreign_or_inconsistent_files_are_refused_by_field(demo, prefix, tmp_path, changes, field):
    model, cache = _fed(demo, prefix)
    good = save_prompt_cache(tmp_path / "good.safetensors", cache, model, tokens=prefix[0])
    bad = _rewrite(good, tmp_path / "bad.safetensors", **changes)
    with pytest.raises(PromptCacheFileError) as e:
        load_prompt_cache(bad, model, return_metadata=True)
    assert e.value.field == field


def test_unbound_or_broken_files_are_refused(demo, prefix, tmp_path):
    model, cache = _fed(demo, prefix)
    plain = tmp_path / "plain.safetensors"
    mlx_lm_save(str(plain), cache)  # mlx-lm's file without hebrus's binding
    with pytest.raises(PromptCacheFileError, match="format"):
        load_prompt_cache(plain, model)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(PromptCacheFileError, match="not a readable"):
        load_prompt_cache(junk, model)
    with pytest.raises(PromptCacheFileError, match="no such file"):
        load_prompt_cache(tmp_path / "missing.safetensors", model)
    # A layer renamed to a class the reader does not know is refused, never looked up.
    good = save_prompt_cache(tmp_path / "good.safetensors", cache, model)
    arrays, meta = mx.load(str(good), return_metadata=True)
    meta["1.0"] = "KVCache"
    mx.save_safetensors(str(tmp_path / "renamed.safetensors"), arrays, meta)
    with pytest.raises(PromptCacheFileError) as e:
        load_prompt_cache(tmp_path / "renamed.safetensors", model)
    assert e.value.field == "prompt_cache_file.layers"
    # A state array cut short (layer 3's keys, in its ArraysCache container).
    key = "3.0.0"
    arrays[key] = arrays[key][:, :, :2]
    mx.save_safetensors(
        str(tmp_path / "short.safetensors"), arrays, meta | {"1.0": "ArraysCache"}
    )  # the class save_prompt_cache writes
    with pytest.raises(PromptCacheFileError) as e:
        load_prompt_cache(tmp_path / "short.safetensors", model)
    assert e.value.field.startswith("prompt_cache_file.layers.3")


def test_save_needs_a_bound_model_and_a_plain_sequence(demo, tmp_path):
    model, _ = demo
    with pytest.raises(PromptCacheFileError) as e:
        save_prompt_cache(tmp_path / "x.safetensors", list(model.make_cache()), model)
    assert e.value.field == "cache"
    with pytest.raises(PromptCacheFileError) as e:
        save_prompt_cache(tmp_path / "x.safetensors", model.make_cache(), model, metadata={"offset": "1"})
    assert e.value.field == "metadata"
    assert not list(tmp_path.iterdir())


# -- trimming -------------------------------------------------------------------------------------------


def test_sequence_cache_is_not_trimmable_and_mlx_lm_leaves_it_alone(demo, prefix):
    model, cache = _fed(demo, prefix)
    before = cache.digest()
    assert can_trim_prompt_cache(cache) is False
    assert trim_prompt_cache(cache, 5) == 0  # mlx-lm's contract for caches it cannot trim
    assert cache.digest() == before and cache.offset == len(prefix[0])
    with pytest.raises(CacheTrimError, match="Gated DeltaNet"):
        cache.trim(5)
    linear = next(c for c in cache if isinstance(c, LinearCache))
    with pytest.raises(CacheTrimError):
        linear.trim(1)
    assert cache.digest() == before
    assert isinstance(CacheTrimError("x"), HebrusError)


def test_qsa_layers_trim_exactly(demo, prefix):
    """mlx-lm's trim_prompt_cache on the QSA layers alone, the recurrent layers rolled back by
    snapshot: continuing gives the logits of a cache that never saw the trimmed tokens (the cut
    crosses an indexer group boundary, so block keys are dropped and recomputed)."""
    model, _ = demo
    head, tail = prefix
    k, m = 125, 6  # 125 // 8 = 15 complete groups, 131 // 8 = 16; 134 tokens for a 64-token budget
    cache = model.make_cache()
    _feed(model, cache, [head[:k]])
    linear = {i: c.snapshot() for i, c in enumerate(cache) if isinstance(c, LinearCache)}
    _feed(model, cache, [head[k : k + m]])
    attention = [c for c in cache if isinstance(c, AttentionCache)]
    assert can_trim_prompt_cache(attention) and all(c.n_groups == (k + m) // 8 for c in attention)
    assert trim_prompt_cache(attention, m) == m
    assert all(c.size() == k and c.n_groups == k // 8 for c in attention)
    for i, snap in linear.items():
        cache[i].restore(snap)
    cache.offset = k
    got = np.array(_feed(model, cache, [tail[:5], tail[5:9]]))
    control = model.make_cache()
    _feed(model, control, [head[:k]])
    want = np.array(_feed(model, control, [tail[:5], tail[5:9]]))
    assert np.array_equal(got, want)


def test_state_round_trip_of_each_layer_kind(demo, prefix):
    model, cache = _fed(demo, prefix)
    copy = cache.copy()
    assert type(copy) is SequenceCache and copy.digest() == cache.digest()
    for c in cache:
        again = type(c).from_state(c.state, c.meta_state)
        assert again.nbytes == c.nbytes and again.size() == c.size()
    bad = [c for c in cache if isinstance(c, AttentionCache)][0].state
    with pytest.raises(HebrusError, match="AttentionCache.state"):
        AttentionCache.from_state(bad[:3])


def test_save_cleans_stale_temps_of_a_killed_save_never_a_live_one(demo, prefix, tmp_path):
    """Issue 22 §1 (AFN-010): a save killed mid-write leaves `.NAME.tmp-HEX.safetensors`; the next
    save of NAME removes it (and the plain `.NAME.tmp-HEX` form), never another file's temps and
    never a temp whose writer still holds its lock."""
    import fcntl
    import os

    model, _ = demo
    head, _ = prefix
    cache = model.make_cache()
    _feed(model, cache, [head])
    path = tmp_path / "turn1.cache"
    stale = [tmp_path / ".turn1.cache.tmp-0123456789ab.safetensors", tmp_path / ".turn1.cache.tmp-0123456789ac"]
    for s in stale:
        s.write_bytes(b"half a cache")
    other = tmp_path / ".other.cache.tmp-0123456789ab.safetensors"
    other.write_bytes(b"not this target's")
    held = tmp_path / ".turn1.cache.tmp-aaaaaaaaaaaa.safetensors"
    held.write_bytes(b"a live save")
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        save_prompt_cache(path, cache, model, tokens=head)
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["turn1.cache", other.name, held.name])
    assert load_prompt_cache(path, model).digest() == cache.digest()
