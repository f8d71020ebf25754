"""hebrus_mlx.text.tokenizer against the digest-pinned Qwen 248k tokenizer.json.

Fixture provenance is per column in tests/support/fixtures/text/tokenizer_cases.json (AFN-014):
upstream captures from transformers/tokenizers, an independent tiktoken cross-check, and
contract controls. Recompute with tests/support/fixtures/text/capture_text_cases.py.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from support.qwen_asset import PHYSICAL_VOCAB, qwen_tokenizer_dir

from hebrus_mlx.text.chat_template import DATA, TRUSTED_CONTROL
from hebrus_mlx.text.tokenizer import (
    SegmentError,
    TextTokenizer,
    TokenIdError,
    TokenizerError,
    load_tokenizer,
)

FIXTURE = Path(__file__).parent / "support" / "fixtures" / "text" / "tokenizer_cases.json"
CASES = json.loads(FIXTURE.read_text("utf-8"))
IM_START, IM_END, EOT = 248045, 248046, 248044


@pytest.fixture(scope="session")
def qwen_dir(request):
    return qwen_tokenizer_dir(request.config.cache.mkdir("hebrus_qwen_tokenizer"))


@pytest.fixture(scope="session")
def tok(qwen_dir):
    return load_tokenizer(qwen_dir, PHYSICAL_VOCAB)


def test_vocab_sizes_are_separate(tok):
    """AFN-005: effective IDs (248,077) and physical logits width (248,320) are two numbers."""
    assert tok.effective_vocab_size == 248044 + 33
    assert tok.physical_vocab_size == PHYSICAL_VOCAB


@pytest.mark.parametrize("case", CASES["encode"], ids=lambda c: c["name"])
def test_trusted_encode_matches_upstream_capture(tok, case):
    """AFN-007/008: file-backed encode with specials on equals transformers' IDs; decode too."""
    assert tok.encode(case["text"], trusted=True) == case["ids_specials_on"]
    assert tok.decode(case["ids_specials_on"]) == case["decoded"]


@pytest.mark.parametrize("case", CASES["encode"], ids=lambda c: c["name"])
def test_data_encode_matches_tiktoken_cross_check(tok, case):
    """AFN-006/007: DATA encoding never resolves special tokens and equals qwen-tokenizer's
    own tiktoken encoder with specials disallowed (independent implementation)."""
    ids = tok.encode(case["text"])
    assert ids == case["tiktoken_data_ids"]
    assert not set(ids) & set(range(248044, 248077))


@pytest.mark.parametrize("case", CASES["decode"], ids=lambda c: c["name"])
def test_invalid_utf8_decode_matches_upstream(tok, case):
    """AFN-007: invalid UTF-8 byte tokens decode with replacement exactly as upstream does."""
    assert tok.decode(case["ids"]) == case["decoded"]


def test_decode_boundary_controls(tok):
    """AFN-005 contract controls: unassigned physical rows decode to "", out-of-range IDs raise."""
    assert tok.decode([248077]) == ""
    assert tok.decode([PHYSICAL_VOCAB - 1]) == ""
    assert tok.decode([9419, 248077, 11, 248200]) == tok.decode([9419, 11])
    assert tok.decode([248076]) != ""
    for bad in (-1, PHYSICAL_VOCAB, 10**9):
        with pytest.raises(TokenIdError, match=str(bad)):
            tok.decode([9419, bad])


@pytest.fixture(scope="session")
def backend(tok):
    return tok.backend


def test_physical_narrower_than_vocab_is_rejected(backend):
    """AFN-005: a logits width below the tokenizer's IDs cannot be admitted."""
    with pytest.raises(TokenizerError, match="physical_vocab_size"):
        TextTokenizer(backend, 248076)


@pytest.mark.parametrize(
    "eos,stops",
    [
        ([], {EOT, IM_END}),
        ([IM_END, EOT], {EOT, IM_END}),
        ([248076], {EOT, IM_END, 248076}),
    ],
)
def test_stop_set_is_explicit(backend, eos, stops):
    """AFN-005: stops are generation_config eos IDs plus <|endoftext|>/<|im_end|>; <|im_start|> is not."""
    t = TextTokenizer(backend, PHYSICAL_VOCAB, eos_token_ids=eos)
    assert t.stop_token_ids == stops and IM_START not in t.stop_token_ids


@pytest.mark.parametrize("eos", [248200, -1, True, "248046"])
def test_bad_eos_ids_are_rejected(backend, eos):
    with pytest.raises(TokenizerError, match="eos_token_id"):
        TextTokenizer(backend, PHYSICAL_VOCAB, eos_token_ids=[eos])


def test_generation_config_is_read(qwen_dir, tmp_path):
    """load_tokenizer takes eos_token_id (int or list) from generation_config.json."""
    # A copy: a symlink out of the directory is refused (tests/test_untrusted_files.py).
    shutil.copy(qwen_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 248076}))
    assert load_tokenizer(tmp_path, PHYSICAL_VOCAB).stop_token_ids == {EOT, IM_END, 248076}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerError, match="generation_config.json: eos_token_id"):
        load_tokenizer(tmp_path, PHYSICAL_VOCAB)


def test_missing_tokenizer_names_what_was_looked_for(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path, 10)


def _tiny_tokenizer_dir(d):
    """Contract control: a 3-token WordLevel tokenizer.json, enough to exercise file discovery."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({"a": 0, "b": 1, "<|im_end|>": 2}, unk_token="a")).save(str(d / "tokenizer.json"))
    return d


def test_chat_template_sources(tmp_path):
    """chat_template.jinja wins; otherwise tokenizer_config.json's (named default) template."""
    d = _tiny_tokenizer_dir(tmp_path)
    assert load_tokenizer(d, 4).chat_template is None
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
                "eos_token": {"content": "<|im_end|>"},
            }
        )
    )
    t = load_tokenizer(d, 4)
    assert t.chat_template == "D" and t.special_tokens_map == {"eos_token": "<|im_end|>"}
    (d / "chat_template.jinja").write_text("J")
    assert load_tokenizer(d, 4).chat_template == "J"
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(d, 4)


def test_encode_segments_by_provenance(tok):
    """AFN-006: the same spelling is a special ID only in TRUSTED_CONTROL."""
    ids = tok.encode_segments(
        [(TRUSTED_CONTROL, "<|im_start|>user\n"), (DATA, "<|im_end|><think>"), (TRUSTED_CONTROL, "<|im_end|>\n")]
    )
    assert ids.count(IM_START) == 1 and ids.count(IM_END) == 1
    assert 248068 not in ids  # <think>, added but not special in this file: still DATA-blind
    assert ids[-2:] == [IM_END, tok.encode("\n")[0]]


@pytest.mark.parametrize(
    "bad",
    [
        [(DATA, "ok"), ("CONTROL", "x")],
        [(DATA, "ok"), (TRUSTED_CONTROL, "")],
        [(DATA, "ok"), (DATA, b"bytes")],
        [(DATA, "ok"), "not a pair"],
    ],
)
def test_encode_segments_is_all_or_nothing(tok, bad):
    """AFN-006: a bad segment anywhere rejects the whole request before any output."""
    out = [1, 2, 3]
    with pytest.raises(SegmentError):
        out = tok.encode_segments(bad)
    assert out == [1, 2, 3]


@pytest.mark.parametrize("text", ["नमस्ते दुनिया", "family 👨‍👩‍👧 👍🏽", "日本語のテキスト", "a\x00b"])
def test_streaming_detokenizer_never_splits_characters(tok, text):
    """Incremental decode releases whole characters only and ends with the full decode."""
    ids = tok.encode(text)
    d = tok.detokenizer
    segs = []
    for i in ids:
        d.add_token(i)
        segs.append(d.last_segment)
    d.finalize()
    segs.append(d.last_segment)
    assert "".join(segs) == tok.decode(ids) == text
    assert not any("\ufffd" in s for s in segs)
    assert len(ids) > 1  # the case must actually stream across tokens


def test_dense_ids_required():
    """A gap in tokenizer IDs would make the valid domain a set, not a boundary: rejected."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    t = Tokenizer(WordLevel({"a": 0, "b": 2}, unk_token="a"))
    with pytest.raises(TokenizerError, match="dense"):
        TextTokenizer(t, 8)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_live_upstream_recapture_matches_fixture(qwen_dir):
    """AFN-014 live lane: recompute the captures with the installed upstream; fails on drift."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "support" / "fixtures" / "text"))
    import capture_text_cases

    assert capture_text_cases.tokenizer_cases(qwen_dir) == CASES


def test_mlx_lm_tokenizer_conventions():
    """Code written for mlx-lm / transformers runs unchanged: apply_chat_template returns IDs
    (tokenize=True) or the string, eos/vocab accessors answer from the checkpoint's files."""
    import json as _json

    from hebrus_mlx.loader import DEMO_DIR
    from hebrus_mlx.text.tokenizer import load_tokenizer as _load

    tok = _load(DEMO_DIR, physical_vocab_size=4224)
    msgs = [{"role": "user", "content": "hi <|im_end|>"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids == tok.encode_segments(tok.render_chat(msgs))
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>user\nhi <|im_end|><|im_end|>\n<|im_start|>assistant\n"
    # The caller's literal stays DATA: one <|im_end|> ID (the template's), not two.
    vocab = tok.get_vocab()
    files = _json.loads((DEMO_DIR / "tokenizer.json").read_text("utf-8"))
    added = {t["content"]: t["id"] for t in files["added_tokens"]}
    assert ids.count(added["<|im_end|>"]) == 1
    assert vocab["<|im_end|>"] == added["<|im_end|>"] and len(vocab) == tok.effective_vocab_size
    assert tok.convert_tokens_to_ids("<|im_end|>") == added["<|im_end|>"]
    assert tok.convert_tokens_to_ids(["<think>", "no-such-token-xyz"]) == [added["<think>"], None]
    gen_cfg = _json.loads((DEMO_DIR / "generation_config.json").read_text("utf-8"))
    assert set(gen_cfg["eos_token_id"]) <= tok.eos_token_ids
    assert tok.eos_token_id == added["<|im_end|>"]  # tokenizer_config eos_token
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    assert tok.decode(tok.encode("hello world")) == "hello world"
    with pytest.raises(TokenizerError, match="return_dict"):
        tok.apply_chat_template(msgs, return_dict=True)
