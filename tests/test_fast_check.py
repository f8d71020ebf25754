"""The fast per-read check (issue 23 §1, docs/INTEGRITY.md): XXH3-128 per expert record, PLE page
and MTP chunk, beside SHA-256, which stays the publication and `verify` digest.

Provenance: the artifacts are the shipped demo (upgraded: it carries fast checks), the same demo
with the fast checks taken out (exactly an artifact from before them: the pre-upgrade manifest
plus nothing) and a tiny checkpoint converted here; expected fast digests come from the
independent `xxhash` package over bytes read through the SHA-256-checking readers; corruption is
made on disk by the tests.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from support.artifact_fixture import edit_manifest, load_manifest, refresh_store, save_manifest
from support.stream_store import flip_byte

from hebrus_mlx.admission import admit
from hebrus_mlx.artifact import fast_check as FC
from hebrus_mlx.artifact.errors import AdmissionError, ArtifactError, DigestError
from hebrus_mlx.artifact.expert_major import ExpertMajorReader
from hebrus_mlx.artifact.ple_pages import PleReader
from hebrus_mlx.loader import DEMO_DIR, load_model
from hebrus_mlx.stream import engine as se
from hebrus_mlx.upgrade import upgrade
from hebrus_mlx.verify import verify

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = open(os.devnull, "w")


def strip_fast_checks(d):
    """Make `d` an artifact from before the fast check: no fast_check entries, no tables."""
    edit_manifest(d, lambda m: [s.pop("fast_check", None) for s in m["stores"]])
    for name in os.listdir(d):
        if name.endswith(FC.SUFFIX):
            os.unlink(os.path.join(d, name))
    return d


@pytest.fixture
def new(tmp_path):
    return str(shutil.copytree(DEMO_DIR, tmp_path / "new"))


@pytest.fixture
def old(tmp_path):
    return strip_fast_checks(str(shutil.copytree(DEMO_DIR, tmp_path / "old")))


def _units(m, s):
    """Each unit's bytes, read through the SHA-256-checking readers (and chunks of the MTP file
    once its whole-file SHA-256 matched)."""
    if s.role == "experts":
        with ExpertMajorReader(m.file(s), m.family, s.codec) as r:
            return [r.read_record(*divmod(i, m.family.num_experts)) for i in range(r.geometry.count)]
    if s.role == "ple":
        with PleReader(m.file(s), m.family, s.codec) as r:
            return [r.read_page(p) for p in range(r.geometry.num_pages)]
    data = open(m.file(s), "rb").read()
    assert hashlib.sha256(data).hexdigest() == s.sha256
    return [data[i : i + FC.MTP_UNIT_BYTES] for i in range(0, len(data), FC.MTP_UNIT_BYTES)]


def _oracle_tables(m):
    return {s.path: [xxhash.xxh3_128(u).digest() for u in _units(m, s)] for s in m.stores if s.role in FC.ROLES}


def test_demo_carries_fast_checks_equal_to_the_oracle():
    m = admit(str(DEMO_DIR))
    want = _oracle_tables(m)
    assert sorted(want) == sorted(m.fast_digests) == ["experts.hbem", "mtp.safetensors", "ple.0.hbpl", "ple.1.hbpl"]
    for s in m.stores:
        assert m.fast_table(s) == want.get(s.path), s.path
        if s.role in FC.ROLES:
            assert s.fast_check["algorithm"] == "xxh3-128" and s.fast_check["size"] == 16 * len(want[s.path])


def test_convert_writes_both_digests(tmp_path):
    """A fresh conversion publishes SHA-256 (store tables, whole-file digests) and the fast
    tables, and the fast tables equal the oracle over the verified bytes."""
    from support.artifact_fixture import tiny_artifact

    _, out = tiny_artifact(str(tmp_path))
    m = admit(out)
    assert set(m.fast_digests) == {s.path for s in m.stores if s.role in FC.ROLES} and m.ple
    assert {s.path: m.fast_table(s) for s in m.stores if s.role in FC.ROLES} == _oracle_tables(m)
    assert verify(out, stream=QUIET)[1]["fast_checks"] == sum(len(t) for t in _oracle_tables(m).values())


def _stream(d):
    """The demo streamed (experts and PLE through small caches); (model, logits of a prompt)."""
    model = load_model(d, expert_cache_gb=0.004, ple_cache_gb=4 * 65536 / 2**30)
    out = model(mx.array([np.random.default_rng(3).integers(2, 4000, 9).tolist()]), model.make_cache())
    mx.eval(out)
    return model, np.array(out)


def test_new_artifacts_stream_through_the_fast_check_old_ones_through_sha256(new, old):
    m_new, out_new = _stream(new)
    m_old, out_old = _stream(old)
    np.testing.assert_array_equal(out_new, out_old)
    for model, check in ((m_new, "xxh3-128"), (m_old, "sha256")):
        assert model.streaming.experts.check == check
        assert model.streaming.engine.counters()["errors"] == 0
    from hebrus_mlx.stream.experts import StreamedExperts

    for d, check in ((new, "xxh3-128"), (old, "sha256")):
        ex = StreamedExperts.from_artifact(d, rows=4)
        rows, lease = ex.resolve(0, mx.array([1]))
        mx.eval(ex.engine.release_after(rows, lease))
        assert ex.check == check and ex.engine.counters()["misses"] == 1
        ex.engine.close()


def _flip(d, store, offset):
    flip_byte(os.path.join(d, store), offset, 0x40)


def _geometry(d):
    m = admit(d)
    with ExpertMajorReader(m.file(m.experts), m.family, m.experts.codec) as r:
        return r.geometry


def _record_offset(d, layer, expert):
    g = _geometry(d)
    return g.record_offset(g.index(layer, expert))


@pytest.mark.parametrize("domain", ["new", "old"])
def test_a_flipped_expert_record_is_refused_by_its_domain(domain, new, old):
    """Every expert record the streamed demo needs is read through the check: one flipped byte
    fails the step with the typed mismatch of the artifact's domain (XXH3-128 new, SHA-256 old)."""
    d = new if domain == "new" else old
    g = _geometry(d)
    for i in range(g.count):
        _flip(d, "experts.hbem", g.record_offset(i) + 101)
    with pytest.raises(RuntimeError, match="XXH3-128 mismatch" if domain == "new" else "SHA-256 mismatch"):
        _stream(d)


@pytest.mark.parametrize("domain", ["new", "old"])
def test_resident_loads_check_records_and_pages_by_their_domain(domain, new, old):
    """The resident loader reads each record and page once, through the same check."""
    d = new if domain == "new" else old
    g = _geometry(d)
    _flip(d, "experts.hbem", g.record_offset(g.index(3, 1)) + 9)
    with pytest.raises(DigestError, match=("XXH3-128 mismatch" if domain == "new" else "digest mismatch")) as e:
        load_model(d)
    assert e.value.field == f"experts.record[{g.index(3, 1)}]"
    shutil.copy(DEMO_DIR / "experts.hbem", os.path.join(d, "experts.hbem"))
    _flip(d, "ple.1.hbpl", os.path.getsize(os.path.join(d, "ple.1.hbpl")) - 70)
    with pytest.raises(DigestError, match=("XXH3-128" if domain == "new" else "page digest mismatch")) as e:
        load_model(d)
    assert e.value.field.startswith("ple.page[")


@pytest.mark.parametrize("domain", ["new", "old"])
def test_a_flipped_ple_page_and_mtp_chunk_are_refused_by_their_domain(domain, new, old):
    d = new if domain == "new" else old
    m = admit(d)
    with PleReader(m.file(m.ple[0]), m.family, m.ple[0].codec) as r:
        g = r.geometry
    for p in range(g.num_pages):
        _flip(d, m.ple[0].path, g.payload_offset + p * g.page_stride + 200)
    with pytest.raises(RuntimeError, match="XXH3-128 mismatch" if domain == "new" else "SHA-256 mismatch"):
        _stream(d)
    shutil.copy(DEMO_DIR / m.ple[0].path, os.path.join(d, m.ple[0].path))
    _flip(d, "mtp.safetensors", os.path.getsize(os.path.join(d, "mtp.safetensors")) - 5)
    with pytest.raises(DigestError, match="fast_check" if domain == "new" else "mtp.safetensors.sha256"):
        load_model(d)


def test_a_deliberate_edit_that_rewrites_the_fast_digest_is_caught_by_verify_deep(new):
    """The threat model: the fast check catches bit rot, torn and misplaced records, not an edit
    made on purpose. Edit a record and rewrite its fast digest (and the table's SHA-256 and the
    store's whole-file SHA-256 in the manifest): admission passes and streaming serves the edited
    bytes, but `verify --deep` refuses them by the record's SHA-256 in the store's own table."""
    g = _geometry(new)
    i = g.index(2, 5)
    off = g.record_offset(i)
    before = open(os.path.join(new, "experts.hbem.xxh3"), "rb").read()
    _flip(new, "experts.hbem", off + 7)
    refresh_store(new, "experts.hbem")  # rewrites the fast table (and the whole-file SHA-256) to match
    after = open(os.path.join(new, "experts.hbem.xxh3"), "rb").read()
    assert [j for j in range(g.count) if before[16 * j : 16 * j + 16] != after[16 * j : 16 * j + 16]] == [i]
    from hebrus_mlx.stream.experts import StreamedExperts

    ex = StreamedExperts.from_artifact(new, rows=4)
    rows, lease = ex.resolve(2, mx.array([5]))
    mx.eval(rows)
    got = np.array(ex.weights["gate"]["weight"][int(np.array(rows)[0])]).tobytes()
    mx.eval(ex.engine.release_after(rows, lease))
    ex.engine.close()
    assert got != open(DEMO_DIR / "experts.hbem", "rb").read()[off : off + len(got)]  # the edit streams
    # Default verify trusts the manifest, whose whole-file digest now describes the edited bytes;
    # --deep also checks the store's own record digests, which the edit left behind.
    assert verify(new, stream=QUIET)[1]["stores"] == 5
    with pytest.raises(DigestError, match=rf"experts\.record\[{i}\]"):
        verify(new, stream=QUIET, deep=True)


def _resolve_one(d, layer, expert):
    from hebrus_mlx.stream.experts import StreamedExperts

    ex = StreamedExperts.from_artifact(d, rows=4)
    try:
        rows, lease = ex.resolve(layer, mx.array([expert]))
        mx.eval(rows)
        mx.eval(ex.engine.release_after(rows, lease))
    finally:
        ex.engine.close()


@pytest.mark.parametrize("damage", ["torn", "misplaced"])
def test_torn_and_misplaced_records_are_refused_by_the_fast_check(damage, new):
    """The rest of the README's threat model (issue 23 §1): a torn record (its second half from
    another record, as a write interrupted between two sectors leaves it) and a misplaced one (a
    whole, valid record written at another record's offset) both fail the record's XXH3-128 on the
    streamed read; the control (no damage) streams."""
    g = _geometry(new)
    i, j = g.index(2, 5), g.index(2, 6)
    _resolve_one(new, 2, 5)  # the undamaged control
    n = g.record_bytes
    p = os.path.join(new, "experts.hbem")
    with open(p, "r+b") as f:
        f.seek(g.record_offset(j))
        other = f.read(n)
        if damage == "torn":
            f.seek(g.record_offset(i) + n // 2)
            f.write(other[n // 2 :])
        else:
            f.seek(g.record_offset(i))
            f.write(other)
    with pytest.raises(RuntimeError, match="XXH3-128 mismatch"):
        _resolve_one(new, 2, 5)


# ---- admission: strict, typed, naming the field ---------------------------------------------------
def _fc(i, fn):
    return lambda d: edit_manifest(d, lambda m: fn(m["stores"][i]["fast_check"]))


def _rewrite_table(name, fn):
    """Change a table file and record its new SHA-256 (and size) in the manifest."""

    def mutate(d):
        p = os.path.join(d, name)
        data = fn(open(p, "rb").read())
        open(p, "wb").write(data)

        def fix(m):
            s = next(s for s in m["stores"] if s.get("fast_check", {}).get("path") == name)
            s["fast_check"].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())

        edit_manifest(d, fix)

    return mutate


def _dense_table(d):
    open(os.path.join(d, "model.safetensors.xxh3"), "wb").write(bytes(16))
    edit_manifest(d, lambda m: m["stores"][0].__setitem__("fast_check", FC.entry("model.safetensors", bytes(16))))


BAD = [
    (
        "not-an-object",
        lambda d: edit_manifest(d, lambda m: m["stores"][1].__setitem__("fast_check", [])),
        "stores[1].fast_check",
    ),
    ("unknown-field", _fc(1, lambda fc: fc.__setitem__("units", 512)), "stores[1].fast_check.units"),
    ("missing-sha", _fc(1, lambda fc: fc.pop("sha256")), "stores[1].fast_check.sha256"),
    ("algorithm", _fc(1, lambda fc: fc.__setitem__("algorithm", "crc32c")), "stores[1].fast_check.algorithm"),
    ("path", _fc(1, lambda fc: fc.__setitem__("path", "ple.0.hbpl.xxh3")), "stores[1].fast_check.path"),
    ("size-type", _fc(1, lambda fc: fc.__setitem__("size", "8192")), "stores[1].fast_check.size"),
    ("sha-format", _fc(1, lambda fc: fc.__setitem__("sha256", "ab")), "stores[1].fast_check.sha256"),
    ("wrong-length", _rewrite_table("experts.hbem.xxh3", lambda b: b[:-16]), "stores[1].fast_check.size"),
    ("size-vs-file", _fc(2, lambda fc: fc.__setitem__("size", fc["size"] + 16)), "stores[2].fast_check.size"),
    ("digest", lambda d: _flip(d, "ple.1.hbpl.xxh3", 3), "stores[3].fast_check.sha256"),
    ("table-missing", lambda d: os.unlink(os.path.join(d, "mtp.safetensors.xxh3")), "stores[4].fast_check.path"),
    ("all-or-none", lambda d: edit_manifest(d, lambda m: m["stores"][3].pop("fast_check")), "bounds.ple.1.hbpl.xxh3"),
    (
        "all-or-none-clean",
        lambda d: (
            edit_manifest(d, lambda m: m["stores"][3].pop("fast_check")),
            os.unlink(os.path.join(d, "ple.1.hbpl.xxh3")),
        ),
        "stores[3].fast_check",
    ),
    ("dense", _dense_table, "stores[0].fast_check"),
]


@pytest.mark.parametrize("name,mutate,field", BAD, ids=[b[0] for b in BAD])
def test_fast_check_entries_are_admitted_strictly(new, name, mutate, field):
    assert [s["role"] for s in load_manifest(new)["stores"]] == ["dense", "experts", "ple", "ple", "mtp"]
    mutate(new)
    with pytest.raises(AdmissionError) as e:
        admit(new)
    assert e.value.field == field, str(e.value)


def test_admission_error_is_one_line_at_the_cli(new):
    _fc(1, lambda fc: fc.__setitem__("algorithm", "crc32c"))(new)
    for verb in ("admit", "upgrade"):
        r = subprocess.run(
            [sys.executable, "-m", "hebrus_mlx.cli", verb, new],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
        )
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"hebrus-mlx {verb}: error: stores[1].fast_check.algorithm: ")


# ---- hebrus-mlx upgrade ----------------------------------------------------------------------------
def _snapshot(d):
    return {
        n: (os.stat(os.path.join(d, n)).st_ino, hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest())
        for n in sorted(os.listdir(d))
    }


def test_upgrade_adds_the_oracle_tables_and_keeps_every_store_byte(old):
    before = _snapshot(old)
    m, summary = upgrade(old, stream=QUIET)
    assert summary == {
        "upgraded": True,
        "fast_checks": {"experts.hbem": 512, "ple.0.hbpl": 9, "ple.1.hbpl": 9, "mtp.safetensors": 1},
    }
    after = _snapshot(old)
    tables = {n for n in after if n.endswith(".xxh3")}
    assert set(after) == set(before) | tables and len(tables) == 4
    for n, (ino, digest) in before.items():
        if n != "manifest.json":
            assert after[n] == (ino, digest), n  # the same files, linked, not rewritten
    assert {s.path: m.fast_table(s) for s in m.stores if s.role in FC.ROLES} == _oracle_tables(m)
    assert load_manifest(old) == load_manifest(str(DEMO_DIR))
    assert verify(old, stream=QUIET)[1]["fast_checks"] == 531
    assert upgrade(old, stream=QUIET)[1] == {"upgraded": False, "reason": "the artifact already has fast checks"}


def test_upgrade_refresh_retakes_stale_tables_from_verified_bytes(new):
    """After a store is rebuilt (here: one record's bytes and the store's SHA-256 tables rewritten
    as a rebuild would), the old fast table is stale and the record fails its fast check;
    `upgrade --refresh` takes the tables again from the SHA-256-verified bytes."""
    g = _geometry(new)
    i = g.index(1, 4)
    m = admit(new)
    with ExpertMajorReader(m.file(m.experts), m.family, m.experts.codec) as r:
        record = bytearray(r.read_record(1, 4))
    record[5] ^= 0x10
    _rewrite_record(new, g, i, bytes(record))
    with pytest.raises(DigestError, match="XXH3-128"):
        load_model(new)
    r = subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.cli", "upgrade", "--refresh", new],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 0, r.stderr
    m = admit(new)
    assert m.fast_table(m.experts)[i] == xxhash.xxh3_128(bytes(record)).digest()
    assert verify(new, stream=QUIET)[1]["fast_checks"] == 531
    load_model(new)


def _rewrite_record(d, g, i, data):
    """Replace record i and every SHA-256 that covers it (record table, table digest, payload and
    header digests, the manifest's whole-file digest): a consistent rebuilt store."""
    from hebrus_mlx.artifact import expert_major as em

    p = os.path.join(d, "experts.hbem")
    raw = bytearray(open(p, "rb").read())
    raw[g.record_offset(i) : g.record_offset(i) + g.record_bytes] = data
    entry = g.table_offset + i * em.EXPERT_MAJOR_ENTRY_BYTES
    raw[entry + em.EXPERT_MAJOR_ENTRY_BYTES - 32 : entry + em.EXPERT_MAJOR_ENTRY_BYTES] = hashlib.sha256(data).digest()
    h = dict(zip(em._HEADER_FIELDS, em._HEADER.unpack_from(raw)))
    table_sha = hashlib.sha256(raw[g.table_offset : g.table_offset + g.table_bytes]).digest()
    payload_sha = hashlib.sha256(raw[g.payload_offset : g.payload_offset + g.payload_bytes]).digest()
    raw[: em.EXPERT_MAJOR_HEADER_BYTES] = em._pack_header(h, table_sha, payload_sha)
    open(p, "wb").write(bytes(raw))
    m = load_manifest(d)
    m["stores"][1]["sha256"] = hashlib.sha256(raw).hexdigest()
    save_manifest(d, m)


def _siblings(d):
    return sorted(n for n in os.listdir(os.path.dirname(d)) if os.path.basename(d) in n)


def test_upgrade_refuses_a_corrupt_artifact_and_changes_nothing(old):
    _flip(old, "experts.hbem", _record_offset(old, 1, 2) + 3)
    before, sib = _snapshot(old), _siblings(old)
    with pytest.raises(DigestError, match=r"experts\.record\["):
        upgrade(old, stream=QUIET)
    assert _snapshot(old) == before and _siblings(old) == sib
    r = subprocess.run(
        [sys.executable, "-m", "hebrus_mlx.cli", "upgrade", old],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 2 and "experts.record[" in r.stderr and _snapshot(old) == before


def test_upgrade_failing_at_publication_leaves_the_artifact_and_no_temp(old, monkeypatch):
    from hebrus_mlx.artifact import atomic

    before, sib = _snapshot(old), _siblings(old)
    real = atomic.publish_file

    def failing(target, *a, **k):
        if target.endswith("manifest.json"):
            raise OSError(28, "No space left on device")
        return real(target, *a, **k)

    monkeypatch.setattr(atomic, "publish_file", failing)
    with pytest.raises(ArtifactError, match="No space left"):  # PublishError, typed
        upgrade(old, stream=QUIET)
    assert _snapshot(old) == before and _siblings(old) == sib


def test_upgrade_refuses_bad_input(tmp_path, old):
    link = tmp_path / "link"
    os.symlink(old, link)
    with pytest.raises(ArtifactError, match="symbolic link"):
        upgrade(str(link), stream=QUIET)
    with pytest.raises(AdmissionError, match="not a directory"):
        upgrade(str(tmp_path / "missing"), stream=QUIET)
    open(os.path.join(old, "stray.bin"), "wb").write(b"x")  # not the artifact's: admission refuses
    with pytest.raises(AdmissionError, match="bounds.stray.bin"):
        upgrade(old, stream=QUIET)
    assert "fast_check" not in json.dumps(load_manifest(old))
