"""Issue 22 §3: caller text is tokenized in chunks so no tokenizers call holds the GIL for long
(4 MB in one call stalled the server's event loop for 10 s). Exactness: the chunked DATA encoding
equals the one-call encoding (normaliser, pre-tokenizer and model each run once over the whole
text, as before) and the Rust `encode` of the same text, on the real Qwen tokenizer and the demo's,
for seeded texts built to stress the cut points (whitespace runs, contractions, combining marks,
CJK, digits, code).

Provenance (AFN-014): the texts are contract controls generated here from fixed seeds; the oracle
is the tokenizers library itself.
"""

import random

import pytest
from support.qwen_asset import PHYSICAL_VOCAB, qwen_tokenizer_dir

from hebrus_mlx.loader import DEMO_DIR
from hebrus_mlx.text import tokenizer as T

WORDS = [
    "lorem",
    "ipsum",
    "it's",
    "we'll",
    "they'd",
    "x",
    "Qwen",
    "naïve",
    "cafe\u0301",
    "日本語",
    "テキスト",
    "😀",
    "1234567",
    "3.14",
    "def",
    "f(x)",
    "a_b",
    "->",
    "{",
    "}",
    "==",
    "'s",
    "'LL",
    "\u00a0",
    "ǅ",
]
SPACES = [" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", " \n", "\r\n", "\u3000", " \t "]


def _text(seed, n_chars):
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(WORDS) + rng.choice(SPACES)
        out.append(w)
        size += len(w)
    return "".join(out)


def _one_call(tok, text):
    t = tok.backend
    if t.normalizer is not None:
        text = t.normalizer.normalize_str(text)
    pieces = [p for p, _ in t.pre_tokenizer.pre_tokenize_str(text)]
    return [x.id for p in pieces for x in t.model.tokenize(p)]


@pytest.fixture(scope="module")
def tokenizers(request):
    qwen = T.load_tokenizer(qwen_tokenizer_dir(request.config.cache.mkdir("hebrus_qwen_tokenizer")), PHYSICAL_VOCAB)
    demo = T.load_tokenizer(DEMO_DIR, 4224)
    return {"qwen": qwen, "demo": demo}


@pytest.mark.parametrize("name", ["qwen", "demo"])
@pytest.mark.parametrize("seed", range(4))
def test_chunked_data_encoding_is_exact(tokenizers, name, seed):
    tok = tokenizers[name]
    text = _text(seed, 6 * T.CHUNK_CHARS + 777)
    calls = []
    real = T._chunked

    def spy(text, pieces, *a, **k):
        calls.append(len(text))
        return real(text, lambda s: (calls.append(-len(s)), pieces(s))[1], *a, **k)

    T._chunked = spy
    try:
        got = tok.encode(text)
    finally:
        T._chunked = real
    assert got == _one_call(tok, text) == tok.backend.encode(text, add_special_tokens=False).ids
    # It really was chunked: no single call saw more than a chunk.
    assert max(-c for c in calls if c < 0) <= T.CHUNK_CHARS


def test_no_cut_point_falls_back_to_one_call(tokenizers):
    tok = tokenizers["demo"]
    text = "a" * (3 * T.CHUNK_CHARS)  # no space anywhere
    assert tok.encode(text) == _one_call(tok, text)
