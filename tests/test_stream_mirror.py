"""`--expert-mirror DIR` (issue 13, optional item): a byte-identical copy of the expert store that
the engine alternates reads with (metal_ext/engine.cpp add_mirror / file_reads), admitted by
`admission.admit_mirror`. Not verified on two disks here: this machine has one.

Provenance: the mirror is a copy of the shipped demo store the test makes (then damages); the
reference tokens come from the same demo loaded resident; engine records are random bytes the
test writes.
"""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from support.stream_store import REC, random_store

from hebrus_mlx import cli
from hebrus_mlx.admission import admit, admit_mirror
from hebrus_mlx.artifact.errors import AdmissionError
from hebrus_mlx.loader import DEMO_DIR, load_model
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream.errors import StreamRequestError

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")

STORE = "experts.hbem"
CACHE_GB = 0.0005  # 34 of 512 arena records: most reads miss


@pytest.fixture(scope="module")
def mirror_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("mirror")
    shutil.copyfile(DEMO_DIR / STORE, d / STORE)
    return d


def _greedy(model, prompt, steps):
    cache, tokens = model.make_cache(), list(prompt)
    out = model(mx.array([prompt]), cache)
    for _ in range(steps):
        tokens.append(int(np.array(out[0, -1]).argmax()))
        out = model(mx.array([tokens[-1:]]), cache)
    return tokens


@pytest.fixture(scope="module")
def resident_tokens():
    model = load_model(DEMO_DIR)
    prompt = np.random.default_rng(5).integers(2, model.args.vocab_size, 6).tolist()
    return prompt, _greedy(model, prompt, 12)


def _read(eng, store, i, digest=None):
    t = eng.request(store, i * REC, REC, digest=digest)
    try:
        return eng.read(t)
    finally:
        eng.release(t)


def test_engine_alternates_reads_between_store_and_mirror(tmp_path):
    """Every read returns the store's bytes; reads split between the two files; without a mirror
    all go to the store (the control)."""
    path, data = random_store(tmp_path, 8, seed=1)
    copy = tmp_path / "copy.bin"
    copy.write_bytes(data)
    for mirrored in (False, True):
        eng = se.StreamEngine(cache_bytes=16 * REC, threads=2)
        try:
            store = eng.add_store(str(path))
            if mirrored:
                assert eng.add_mirror(store, str(copy)) == 0
            got = [_read(eng, store, i) for i in range(8)]
            assert got == [data[i * REC : (i + 1) * REC] for i in range(8)]
            files = eng.file_reads(store)
        finally:
            eng.close()
        if mirrored:
            assert files["paths"] == [str(path), str(copy)]
            assert files["reads"] == [4, 4] and files["bytes"] == [4 * REC, 4 * REC]
        else:
            assert files["reads"] == [8]
        assert files["fallbacks"] == 0


def test_engine_redoes_a_bad_mirror_read_from_the_store(tmp_path):
    """A mirror whose bytes differ fails the record digest; the read is redone from the store
    (the caller gets the verified bytes) and counted as a fallback."""
    import hashlib

    path, data = random_store(tmp_path, 4, seed=2)
    bad = bytearray(data)
    for i in range(4):
        bad[i * REC] ^= 0xFF
    copy = tmp_path / "bad.bin"
    copy.write_bytes(bytes(bad))
    eng = se.StreamEngine(cache_bytes=8 * REC, threads=1)
    try:
        store = eng.add_store(str(path))
        eng.add_mirror(store, str(copy))
        for i in range(4):
            rec = data[i * REC : (i + 1) * REC]
            assert _read(eng, store, i, hashlib.sha256(rec).digest()) == rec
        files = eng.file_reads(store)
        assert files["fallbacks"] == 2 and files["reads"] == [4, 2]
    finally:
        eng.close()


def test_engine_refuses_a_mirror_of_another_size(tmp_path):
    path, data = random_store(tmp_path, 2, seed=3)
    short = tmp_path / "short.bin"
    short.write_bytes(data[:-1])
    eng = se.StreamEngine(cache_bytes=4 * REC, threads=1)
    try:
        store = eng.add_store(str(path))
        with pytest.raises(StreamRequestError, match="size differs"):
            eng.add_mirror(store, str(short))
        with pytest.raises(StreamRequestError, match="mirror path"):
            eng.add_mirror(store, str(tmp_path / "absent.bin"))
    finally:
        eng.close()


def test_streamed_demo_with_a_mirror_is_bit_identical_and_reads_both_files(mirror_dir, resident_tokens):
    prompt, want = resident_tokens
    model = load_model(DEMO_DIR, expert_cache_gb=CACHE_GB, expert_mirror=str(mirror_dir))
    st = model.streaming
    try:
        assert _greedy(model, prompt, 12) == want
        files = st.engine.file_reads(st.experts.store)
        assert files["paths"][1] == str(mirror_dir / STORE)
        r = files["reads"]
        assert r[0] > 0 and r[1] > 0 and abs(r[0] - r[1]) <= 0.2 * sum(r), r  # round robin
        assert files["fallbacks"] == 0 and st.engine.counters()["errors"] == 0
        assert se.mirror_summary(files).startswith(f"mirror: reads {r[0]} store / {r[1]} mirror")
    finally:
        st.engine.close()


def test_mirror_with_damaged_records_still_gives_identical_tokens(tmp_path, resident_tokens):
    """Payload damage is not visible to admission (no payload read); every record read from
    the mirror is digest-checked and redone from the store: tokens unchanged, fallbacks counted."""
    prompt, want = resident_tokens
    d = tmp_path / "m"
    d.mkdir()
    shutil.copyfile(DEMO_DIR / STORE, d / STORE)
    m = admit(str(DEMO_DIR))
    from hebrus_mlx.artifact.expert_major import ExpertMajorReader

    with ExpertMajorReader(str(DEMO_DIR / STORE), m.family, m.experts.codec) as r:
        g = r.geometry
        offsets = [g.record_offset(i) for i in range(g.count)]
    with open(d / STORE, "r+b") as f:
        for off in offsets:
            f.seek(off + 17)
            b = f.read(1)
            f.seek(off + 17)
            f.write(bytes([b[0] ^ 0x5A]))
    model = load_model(DEMO_DIR, expert_cache_gb=CACHE_GB, expert_mirror=str(d))
    st = model.streaming
    try:
        assert _greedy(model, prompt, 12) == want
        files = st.engine.file_reads(st.experts.store)
        assert files["reads"][1] > 0 and files["fallbacks"] == files["reads"][1]
    finally:
        st.engine.close()


def _damaged(tmp_path, how):
    d = tmp_path / how
    d.mkdir()
    if how == "missing":
        return d
    shutil.copyfile(DEMO_DIR / STORE, d / STORE)
    with open(d / STORE, "r+b") as f:
        if how == "truncated":
            f.truncate(f.seek(0, 2) - 4096)
        elif how == "header":
            f.seek(200)  # inside the digested header: its digest no longer matches
            b = f.read(1)
            f.seek(200)
            f.write(bytes([b[0] ^ 0xFF]))
    return d


@pytest.mark.parametrize(
    "how, field",
    [("missing", "expert-mirror"), ("truncated", "expert-mirror.size"), ("header", "expert-mirror.experts.")],
)
def test_bad_mirror_is_refused_naming_the_field(tmp_path, how, field):
    m = admit(str(DEMO_DIR))
    with pytest.raises(AdmissionError) as e:
        admit_mirror(m, _damaged(tmp_path, how))
    assert e.value.field.startswith(field), e.value
    with pytest.raises(AdmissionError, match="store itself"):
        admit_mirror(m, DEMO_DIR)


def test_cli_bad_mirror_is_one_line(tmp_path, capsys):
    d = _damaged(tmp_path, "truncated")
    assert (
        cli.main(
            ["generate", "--model", "demo", "--expert-cache-gb", str(CACHE_GB), "--expert-mirror", str(d), "-m", "1"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expert-mirror.size" in err[0], err
    # Resident experts read no mirror: refused, not ignored.
    assert cli.main(["generate", "--model", "demo", "--expert-mirror", str(d), "-m", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expert-mirror" in err[0] and "resident" in err[0], err


def test_bench_takes_expert_mirror_as_a_load_option():
    """`hebrus-mlx bench --ab expert-mirror=none,DIR` reaches load() (the harness routes by signature)."""
    from hebrus_mlx.bench.harness import split_config

    assert split_config({"expert-mirror": "/some/dir"}).load == {"expert_mirror": "/some/dir"}
    assert split_config({"expert-mirror": "none"}).load == {"expert_mirror": None}
