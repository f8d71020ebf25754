"""Issue 35 §2: the streaming settings are one typed object, checked once where it is made;
the planner and the streaming layer below take it as it is."""

import math

import pytest

from hebrus_mlx.errors import UsageError
from hebrus_mlx.loader import DEMO_DIR, load, load_model
from hebrus_mlx.loading import settings as settings_mod
from hebrus_mlx.loading.settings import StreamSettings
from hebrus_mlx.stream.predict import PrefetchSpec


@pytest.mark.parametrize(
    "field, value",
    [
        ("expert_cache_gb", 0),
        ("expert_cache_gb", -1.0),
        ("expert_cache_gb", math.nan),
        ("expert_cache_gb", math.inf),
        ("expert_cache_gb", 1e300),
        ("expert_cache_gb", True),
        ("expert_cache_gb", "8"),
        ("ple_cache_gb", 0),
        ("ple_cache_gb", math.nan),
        ("prefetch", "bogus"),
        ("prefetch", "router-reuse:9"),
        ("prefetch", 3),
        ("prefill_sweep", "maybe"),
        ("expert_mirror", 5),
    ],
)
def test_each_bad_value_is_refused_naming_its_field(field, value):
    with pytest.raises(UsageError) as e:
        StreamSettings(**{field: value})
    assert e.value.field.replace("-", "_") == field


def test_values_are_normalised_once():
    s = StreamSettings(expert_cache_gb=2, prefetch="router-reuse:2", prefill_sweep=None)
    assert s.expert_cache_gb == 2.0 and isinstance(s.expert_cache_gb, float)
    assert s.prefetch == PrefetchSpec("router-reuse", 2)
    assert s.prefill_sweep == "auto"
    assert s.streaming_asked() == "expert_cache_gb"
    assert StreamSettings(prefill_sweep="off").streaming_asked() is None
    assert StreamSettings(prefill_sweep="on").streaming_asked() == "prefill_sweep"


def test_load_checks_the_settings_once_and_before_resolving_the_model(monkeypatch):
    made = []
    real = StreamSettings.__post_init__

    def counting(self):
        made.append(1)
        real(self)

    monkeypatch.setattr(StreamSettings, "__post_init__", counting)
    model, _ = load("demo", expert_cache_gb=0.004, prefetch="previous")
    assert model.streaming is not None and model.streaming.prefetch.kind == "previous"
    assert len(made) == 1  # load -> load_model -> load_artifact_model: one object, one check
    made.clear()
    with pytest.raises(UsageError) as e:  # refused before the name is looked up anywhere
        load("no/such-model-anywhere", expert_cache_gb=math.nan)
    assert e.value.field == "expert_cache_gb" and len(made) == 1


def test_settings_or_keywords_not_both():
    with pytest.raises(UsageError) as e:
        load_model(DEMO_DIR, expert_cache_gb=1.0, settings=StreamSettings(expert_cache_gb=2.0))
    assert e.value.field == "expert_cache_gb"
    with pytest.raises(UsageError) as e:
        settings_mod.resolve({"expert_cache_gb": 1.0})
    assert e.value.field == "settings"


def test_a_settings_object_loads_like_its_keywords():
    a = load_model(DEMO_DIR, settings=StreamSettings(expert_cache_gb=0.004, prefetch="off"))
    b = load_model(DEMO_DIR, expert_cache_gb=0.004, prefetch="off")
    assert a.streaming.experts.rows == b.streaming.experts.rows
    assert a.streaming.prefetch == b.streaming.prefetch
