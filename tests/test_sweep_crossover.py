"""The prefill sweep's per-machine crossover (issue 13): `hebrus-mlx qualify` measures it on an
artifact's expert store (stream.crossover.measure), the machine profile carries it, and the loader's
`--prefill-sweep auto` uses it only where the profile stands for this machine and store.

Provenance: the measured entry is qualify's own run on the shipped demo store, here, cold; the
other profiles are written by the tests (values to be honoured or refused); the decision is checked
by the sweep's own counters after a real forward, and the swept logits against the slot path's."""

import json
import math
import os
import warnings

import mlx.core as mx
import numpy as np
import pytest
from support.stream_store import cache_gb

from hebrus_mlx import machine_profile as prof
from hebrus_mlx import qualify as q
from hebrus_mlx.loader import DEMO_DIR, load_model
from hebrus_mlx.machine_profile import SCHEMA, ProfileError, read_profile, write_profile
from hebrus_mlx.stream import crossover as X
from hebrus_mlx.stream import engine as se
from hebrus_mlx.stream import sweep as S

pytestmark = pytest.mark.skipif(not se.available(), reason="extension not built")


@pytest.mark.parametrize(
    "slot, sweep, want",
    [
        ([1, 2, 3], 0.5, (0.1, True)),  # the sweep wins at every fraction
        ([1, 2, 3], 5.0, (1.0, False)),  # never: only chunks past the arena are swept
        ([1, 2, 3], 2.5, (0.75, True)),  # between 0.5 and 1.0
        ([1, 9, 2, 3], 2.5, (0.75, True)),  # one slow run at a small fraction does not decide
    ],
)
def test_crossover_from_measured_times(slot, sweep, want):
    fractions = [0.1, 0.5, 1.0] if len(slot) == 3 else [0.1, 0.3, 0.5, 1.0]
    got = X.crossover_from(fractions, slot, sweep)
    assert got[1] == want[1] and got[0] == pytest.approx(want[0])


@pytest.fixture(scope="module")
def measured():
    """qualify's crossover probe on the demo store (8 layers x 64 records of 13.8 KB), one round."""
    return q.sweep_crossover_section("demo", rounds=1)


def _profile(tmp_path, monkeypatch, entry, machine=None):
    path = write_profile(
        {
            "schema": SCHEMA,
            "created_unix": 0,
            "machine": machine or prof.this_machine(),
            "io": {"sweep_crossover": entry},
        },
        tmp_path / "profile.json",
    )
    monkeypatch.setenv("HEBRUS_PROFILE", str(path))
    return path


def _streamed(**kw):
    return load_model(DEMO_DIR, expert_cache_gb=cache_gb(DEMO_DIR, 0.2)[0], **kw)


def test_qualify_measures_it_and_the_profile_round_trips_into_the_loader(measured, tmp_path, monkeypatch):
    e = measured
    assert e["status"] == X.MEASURED and e["passes"] == 2
    assert len(e["slot_ms"]) == len(e["fractions"]) == len(X.FRACTIONS)
    assert all(len(runs) == 2 and min(runs) > 0 for runs in e["slot_ms"]) and min(e["sweep_ms"]) > 0
    assert X.crossover_from(e["fractions"], e["slot_ms_median"], e["sweep_ms_median"]) == (
        e["crossover"],
        e["sweep_won"],
    )
    assert e["fractions"][0] <= e["crossover"] <= 1.0
    model = _streamed()
    ex = model.streaming.experts
    assert e["record_bytes"] == sum(ex.part_bytes) and e["num_experts"] == ex.num_experts
    assert os.path.samefile(e["store"], ex.store_path)
    path = _profile(tmp_path, monkeypatch, e)
    assert read_profile(path)["io"]["sweep_crossover"] == json.loads(json.dumps(e))
    st = _streamed().streaming
    assert st.sweep.crossover == pytest.approx(e["crossover"])
    assert st.crossover_source == f"machine profile {e['crossover']:.2f}"
    # The sweep line says where auto's crossover came from.
    assert st.sweep_summary().endswith(f"crossover machine profile {e['crossover']:.2f}")
    monkeypatch.setenv("HEBRUS_PROFILE", str(tmp_path / "none.json"))
    st = _streamed().streaming
    assert st.sweep.crossover == S.CROSSOVER and st.crossover_source.startswith("built-in")


def test_a_measured_crossover_changes_autos_decision(measured, tmp_path, monkeypatch):
    """A chunk below the built-in crossover and inside the arena stays on the slot path; with a
    profile measuring 0.3 for this store the same chunk is swept, with identical logits."""
    monkeypatch.setenv("HEBRUS_PROFILE", str(tmp_path / "none.json"))
    builtin = _streamed()
    args, cap = builtin.args, builtin.streaming.max_chunk_tokens
    tokens = next(
        t for t in range(2, cap + 1) if S.expected_unique_fraction(t, args.num_experts_per_tok, args.num_experts) >= 0.3
    )
    assert S.expected_unique_fraction(tokens, args.num_experts_per_tok, args.num_experts) < S.CROSSOVER
    _profile(tmp_path, monkeypatch, dict(measured, crossover=0.3))
    swept = _streamed()
    prompt = mx.array([np.random.default_rng(3).integers(2, args.vocab_size, tokens).tolist()])
    out = {}
    for name, model in (("builtin", builtin), ("profile", swept)):
        logits = model(prompt, model.make_cache())
        mx.eval(logits)
        out[name] = (np.array(logits), model.streaming.sweep.counters()["sweeps"])
    assert out["builtin"][1] == 0 and out["profile"][1] == args.num_hidden_layers
    np.testing.assert_array_equal(out["builtin"][0], out["profile"][0])


def _other_fs_file():
    here = os.stat(os.path.join(DEMO_DIR, "experts.hbem")).st_dev
    for p in ("/proc/self/stat", "/dev/null"):
        if os.path.exists(p) and os.stat(p).st_dev != here:
            return p
    pytest.skip("no file on another file system")


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda e, m: m.update(release="0.0-other"), "another release"),
        (lambda e, m: m.update(machine="other-arch", mlx="0.0.1"), "another machine/mlx"),
        (lambda e, m: e.update(record_bytes=2 * e["record_bytes"]), "B records"),
        (lambda e, m: e.update(num_experts=512), "512 x"),
        (lambda e, m: e.update(store="/nonexistent/experts.hbem"), "is gone"),
        (lambda e, m: e.update(store=_other_fs_file()), "another file system"),
        (lambda e, m: e.update(status="not qualified on this machine"), "'not qualified on this machine'"),
    ],
)
def test_a_foreign_measurement_keeps_the_built_in_value_and_says_why(measured, change, why):
    entry, machine = dict(measured, crossover=0.3), dict(prof.this_machine())
    change(entry, machine)
    profile = {"schema": SCHEMA, "machine": machine, "io": {"sweep_crossover": entry}}
    value, source = X.from_profile(profile, measured["store"], measured["record_bytes"], measured["num_experts"])
    assert value == S.CROSSOVER and source.startswith("built-in") and why in source, source
    unchanged = {
        "schema": SCHEMA,
        "machine": dict(prof.this_machine()),
        "io": {"sweep_crossover": dict(measured, crossover=0.3)},
    }
    assert X.from_profile(unchanged, measured["store"], measured["record_bytes"], measured["num_experts"])[0] == 0.3


@pytest.mark.parametrize(
    "key, value",
    [
        ("crossover", "0.3"),
        ("crossover", 1.5),
        ("crossover", -0.1),
        ("crossover", math.nan),
        ("crossover", True),
        ("crossover", None),
        ("record_bytes", 0),
        ("num_experts", "64"),
        ("store", None),
    ],
)
def test_a_malformed_value_is_refused_naming_the_field(measured, tmp_path, monkeypatch, key, value):
    entry = dict(measured, **{key: value})
    profile = {"schema": SCHEMA, "machine": dict(prof.this_machine()), "io": {"sweep_crossover": entry}}
    with pytest.raises(ProfileError) as e:
        X.from_profile(profile, measured["store"], measured["record_bytes"], measured["num_experts"])
    assert e.value.field == f"io.sweep_crossover.{key}"
    # The loader does not fail on it: auto keeps the built-in value, warns, and the line says why.
    _profile(tmp_path, monkeypatch, entry)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st = _streamed().streaming
    assert st.sweep.crossover == S.CROSSOVER
    assert f"refused: io.sweep_crossover.{key}:" in st.crossover_source
    assert any(f"io.sweep_crossover.{key}" in str(w.message) for w in caught)


def test_an_entry_that_is_not_an_object_is_refused(measured):
    profile = {"schema": SCHEMA, "machine": dict(prof.this_machine()), "io": {"sweep_crossover": 0.3}}
    with pytest.raises(ProfileError) as e:
        X.from_profile(profile, measured["store"], measured["record_bytes"], measured["num_experts"])
    assert e.value.field == "io.sweep_crossover"
