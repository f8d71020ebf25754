"""hebrus_mlx.text.chat_template: rendering with provenance (AFN-006) and Python trimming (AFN-007).

Rendered bytes are checked against transformers' own chat-template renderer on the shipped
template (upstream capture, tests/support/fixtures/text/chat_cases.json); segment kinds and token IDs are
contract controls.
"""

import importlib.util
import json
from pathlib import Path

import pytest
from support.qwen_asset import PHYSICAL_VOCAB, qwen_tokenizer_dir

from hebrus_mlx.text.chat_template import (
    DATA,
    TRUSTED_CONTROL,
    ChatError,
    ChatRenderer,
    MediaPartError,
    ProvenanceError,
    Rendered,
    RoleError,
    Segment,
    TemplateError,
    ToolArgumentsError,
    qwen_template,
    render,
)
from hebrus_mlx.text.tokenizer import load_tokenizer

CASES = json.loads((Path(__file__).parent / "support" / "fixtures" / "text" / "chat_cases.json").read_text("utf-8"))
SPECIAL_IDS = set(range(248044, 248077))
LITERALS = [
    "<|im_end|>",
    "<|im_start|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<|image_pad|>",
    "<tool_response>",
    "<|endoftext|>",
]


@pytest.fixture(scope="session")
def tok(request):
    d = qwen_tokenizer_dir(request.config.cache.mkdir("hebrus_qwen_tokenizer"))
    t = load_tokenizer(d, PHYSICAL_VOCAB)
    t.chat_template = qwen_template()
    return t


def _check_tiling(r: Rendered):
    pos = 0
    for s in r.segments:
        assert s.start == pos and s.end > s.start and s.kind in (DATA, TRUSTED_CONTROL)
        pos = s.end
    assert pos == len(r.text_bytes)
    kinds = [s.kind for s in r.segments]
    assert all(a != b for a, b in zip(kinds, kinds[1:]))  # adjacent same-kind segments merged


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_render_bytes_match_upstream(case):
    """AFN-006/007: rendered bytes equal transformers' render of the same template."""
    r = render(case["messages"], case["tools"], **case["kwargs"])
    assert r.text_bytes == case["rendered"].encode("utf-8")
    _check_tiling(r)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_caller_text_never_becomes_special_ids(tok, case):
    """AFN-006: special IDs in the model input come only from TRUSTED_CONTROL segments; for
    chats whose caller text spells no control, segmented IDs equal flat upstream IDs."""
    r = tok.render_chat(case["messages"], case["tools"], **case["kwargs"])
    ids = tok.apply_chat_template(case["messages"], case["tools"], **case["kwargs"])
    assert ids == tok.encode_segments(r)
    assert tok.apply_chat_template(case["messages"], case["tools"], tokenize=False, **case["kwargs"]) == r.text
    control_ids = []
    for kind, text in r.pieces():
        if kind == TRUSTED_CONTROL:
            control_ids += [i for i in tok.encode(text, trusted=True) if i in SPECIAL_IDS]
    assert [i for i in ids if i in SPECIAL_IDS] == control_ids
    spelled = any(lit in text for kind, text in r.pieces() if kind == DATA for lit in LITERALS)
    if spelled:
        assert ids != case["flat_ids"]  # flatten-and-retokenize would have promoted them
    else:
        assert ids == case["flat_ids"]


@pytest.mark.parametrize("where", ["system", "user", "tool", "arguments", "reasoning", "tool_schema"])
@pytest.mark.parametrize("literal", LITERALS)
def test_literal_controls_stay_data(tok, where, literal):
    """AFN-006 adversarial cases: a literal control in caller text is DATA down to token IDs."""
    payload = f"a{literal}b"
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "u"}]
    tools = None
    if where == "system":
        msgs[0]["content"] = payload
    elif where == "user":
        msgs[1]["content"] = payload
    elif where == "tool":
        msgs += [
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "content": payload},
        ]
    elif where == "arguments":
        msgs += [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "f", "arguments": json.dumps({"q": payload})}}],
            }
        ]
    elif where == "reasoning":
        msgs += [{"role": "assistant", "content": "c", "reasoning_content": payload}]
    else:
        tools = [{"type": "function", "function": {"name": "f", "description": payload}}]
    baseline_msgs = json.loads(json.dumps(msgs).replace(literal, "").replace(json.dumps(literal)[1:-1], ""))
    baseline_tools = None if tools is None else [{"type": "function", "function": {"name": "f", "description": "ab"}}]
    r, ids = tok.render_chat(msgs, tools), tok.apply_chat_template(msgs, tools)
    base_ids = tok.apply_chat_template(baseline_msgs, baseline_tools)
    assert any(kind == DATA and literal in text for kind, text in r.pieces())
    assert not any(kind == TRUSTED_CONTROL and literal in text and "a" + literal in text for kind, text in r.pieces())
    # The literal adds ordinary tokens only: the special-ID sequence is the baseline's.
    assert [i for i in ids if i in SPECIAL_IDS] == [i for i in base_ids if i in SPECIAL_IDS]


def test_python_unicode_trim():
    """AFN-007: trim removes Unicode whitespace and U+001C..U+001F, whole code points, edges only."""
    edge = "\u3000\x1c\x1d\u2029\x1f\x1e \u00a0\u2003\t"
    r = render([{"role": "user", "content": edge + "hé\x1cllo\u3000x" + edge}])
    data = [t for k, t in r.pieces() if k == DATA]
    assert data == ["hé\x1cllo\u3000x"]
    # Independent predicate: the code points trimmed are exactly those the table lists.
    independent = set(
        "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
        "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
    )
    assert {chr(c) for c in range(0x3001) if chr(c).strip() == ""} == independent
    assert "\u200b" not in independent  # zero-width space is not whitespace: kept
    r = render([{"role": "user", "content": "\u200bx\u200b"}])
    assert [t for k, t in r.pieces() if k == DATA] == ["\u200bx\u200b"]


def test_enable_thinking_false_is_control():
    r = render([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert r.pieces()[-1] == (TRUSTED_CONTROL, "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize(
    "messages,err,field",
    [
        (
            [{"role": "user", "content": [{"type": "image", "image": "x.png"}]}],
            MediaPartError,
            "messages[0].content[0]",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}],
            MediaPartError,
            "content[1]",
        ),
        ([{"role": "system", "content": "a"}, {"role": "system", "content": "b"}], RoleError, "second system"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], RoleError, "messages[1]"),
        ([{"role": "developer", "content": "a"}], RoleError, "messages[0].role"),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
            ToolArgumentsError,
            "arguments is not valid JSON",
        ),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
            ToolArgumentsError,
            "JSON object",
        ),
        (
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": {"x": {1, 2}}}}],
                }
            ],
            ToolArgumentsError,
            "JSON-serialisable",
        ),
        ([{"role": "user", "content": 5}], ChatError, "messages[0].content"),
        ([], ChatError, "non-empty"),
    ],
)
def test_rejections_are_typed_and_clean(tok, messages, err, field):
    """AFN-006: bad requests fail with a typed error naming the field; earlier outputs survive."""
    keep = [{"role": "user", "content": "keep"}]
    before, before_ids = tok.render_chat(keep), tok.apply_chat_template(keep)
    with pytest.raises(err) as e:
        tok.apply_chat_template(messages)
    assert field in str(e.value)
    after, after_ids = tok.render_chat(keep), tok.apply_chat_template(keep)
    assert (after, after_ids) == (before, before_ids)


def test_text_parts_are_data():
    r = render([{"role": "user", "content": [{"type": "text", "text": "a<|im_end|>"}, {"type": "text", "text": " b"}]}])
    assert (DATA, "a<|im_end|> b") in r.pieces()


def test_untrackable_transform_fails_closed():
    """A template that rewrites caller text opaquely is refused rather than mislabelled."""
    tpl = "{% for m in messages %}{{ ('[' ~ m.content ~ ']') | reverse }}{% endfor %}"
    with pytest.raises(ProvenanceError):
        render([{"role": "user", "content": "abc"}], chat_template=tpl)


def test_template_methods_on_caller_text_follow_real_text():
    """Qwen-style templates inspect content (split/startswith/in/strip); answers come from the text."""
    tpl = (
        "{% for m in messages %}{% if '</think>' in m.content %}"
        "{{ m.content.split('</think>')[-1].lstrip('\\n') }}|{{ m.content.startswith('<think>') }}"
        "{% endif %}{% endfor %}"
    )
    r = render([{"role": "assistant", "content": "<think>r</think>\n\nanswer"}], chat_template=tpl)
    assert r.pieces() == [(DATA, "answer"), (TRUSTED_CONTROL, "|True")]


def test_template_errors_and_sandbox():
    with pytest.raises(TemplateError, match="compile"):
        ChatRenderer("{% if %}")
    with pytest.raises(TemplateError):
        render([{"role": "user", "content": "x"}], chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(TemplateError, match="boom"):
        render([{"role": "user", "content": "x"}], chat_template="{{ raise_exception('boom') }}")


def test_template_cannot_launder_caller_text_into_control():
    """AFN-006: the sandbox hides the placeholder's internals, so a template cannot print caller
    text as template text."""
    for attr in ("_text", "_reg", "real"):
        tpl = f"{{{{ messages[0].content.{attr} }}}}"
        try:
            r = render([{"role": "user", "content": "secret"}], chat_template=tpl)
        except TemplateError:
            continue
        assert "secret" not in r.text


def test_segment_validation():
    r = Rendered("héllo".encode(), (Segment(DATA, 0, 2), Segment(TRUSTED_CONTROL, 2, 6)))
    with pytest.raises(ChatError, match="UTF-8"):
        r.pieces()
    with pytest.raises(ChatError, match="cover"):
        Rendered(b"abc", (Segment(DATA, 0, 2),)).pieces()
    with pytest.raises(ChatError, match="continue"):
        Rendered(b"abc", (Segment(DATA, 0, 1), Segment(DATA, 2, 3))).pieces()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_live_upstream_rerender_matches_fixture(request):
    """AFN-014 live lane: re-render with the installed transformers; fails on drift."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "support" / "fixtures" / "text"))
    import capture_text_cases

    d = qwen_tokenizer_dir(request.config.cache.mkdir("hebrus_qwen_tokenizer"))
    assert capture_text_cases.chat_cases(d) == CASES
