"""hebrus_mlx.load accepts mlx_lm.load's keyword arguments where they mean something here, and Hub
repo ids as the CLI's --model does (issue 26 §4); the rest is a typed error naming the argument,
raised before anything is read."""

import inspect
import json

import pytest

from hebrus_mlx import loader
from hebrus_mlx.errors import HebrusError, UsageError
from hebrus_mlx.loader import DEMO_DIR, load


def test_every_mlx_lm_load_keyword_is_a_parameter():
    from mlx_lm.utils import load as mlx_lm_load

    ours = inspect.signature(load).parameters
    theirs = [n for n in inspect.signature(mlx_lm_load).parameters if n != "path_or_hf_repo"]
    assert [n for n in theirs if n not in ours] == []


@pytest.fixture
def nothing_is_read(monkeypatch):
    """Any refusal below must come before the machine profile, admission or a weight is touched."""

    def boom(*a, **k):
        raise AssertionError("load went past its argument checks")

    monkeypatch.setattr(loader, "_apply_machine_profile", boom)
    monkeypatch.setattr(loader, "load_model", boom)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"adapter_path": "adapters/"}, "adapter_path"),
        ({"lazy": True}, "lazy"),
        ({"trust_remote_code": True}, "trust_remote_code"),
        ({"model_config": {"rope_theta": 1.0}}, "model_config.rope_theta"),
        ({"model_config": ["x"]}, "model_config"),
        ({"tokenizer_config": "eos"}, "tokenizer_config"),
        ({"tokenizer_config": {"padding_side": "left"}}, "tokenizer_config.padding_side"),
        ({"tokenizer_config": {"trust_remote_code": True}}, "tokenizer_config.trust_remote_code"),
        ({"expert_cache_gbs": 1.0}, "expert_cache_gbs"),
        ({"dtype": "float64"}, "dtype"),
    ],
)
def test_unsupported_arguments_are_typed_errors_before_any_work(nothing_is_read, kwargs, field):
    with pytest.raises(UsageError) as e:
        load("demo", **kwargs)
    assert e.value.field == field


@pytest.mark.parametrize("name,revision", [("demo", "main"), (str(DEMO_DIR), "v1"), ("someorg/x", "")])
def test_revision_needs_a_hub_repo_id(monkeypatch, name, revision):
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(UsageError) as e:
        load(name, revision=revision)
    assert e.value.field == "revision"


def test_accepted_keywords_and_return_config():
    model, tok, config = load(
        "demo",
        tokenizer_config={"eos_token": "<|im_start|>"},
        model_config={},
        adapter_path=None,
        lazy=False,
        return_config=True,
        trust_remote_code=False,
    )
    assert config == json.loads((DEMO_DIR / "config.json").read_text())
    start = tok.added_tokens["<|im_start|>"]
    assert tok.eos_token == "<|im_start|>" and tok.eos_token_id == start
    assert start in tok.eos_token_ids and tok.added_tokens["<|im_end|>"] in tok.eos_token_ids
    from hebrus_mlx import stream_generate
    from hebrus_mlx.sample_utils import make_logits_processors

    rs = list(
        stream_generate(
            model, tok, "x = 1", max_tokens=4, logits_processors=make_logits_processors(logit_bias={start: 1e4})
        )
    )
    assert [r.token for r in rs] == [start] and rs[-1].finish_reason == "stop"


def test_chat_template_override_and_bad_eos_token():
    _, tok = load("demo", tokenizer_config={"chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"})
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    with pytest.raises(HebrusError) as e:
        load("demo", tokenizer_config={"eos_token": "no such token"})
    assert e.value.field == "tokenizer_config.eos_token"


def test_hub_repo_id_is_resolved_like_the_cli(monkeypatch):
    from test_hub import GB, FakeHub

    fake = FakeHub(monkeypatch, {"config.json": 10, "model.safetensors": GB}, DEMO_DIR, free=10 * GB)
    model, tok = load("someorg/demo-copy", revision="v1")
    assert ("snapshot_download", "someorg/demo-copy", "v1") == fake.calls[-1][:3]
    assert model.source_path.resolve() == DEMO_DIR.resolve() and tok.effective_vocab_size == 4105
