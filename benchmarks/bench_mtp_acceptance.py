"""Speculative acceptance of the demo's MTP head on held-out text (greedy, exact verify).

Uses the minimal verify loop of tests/support/spec_loop.py (the protocol in hebrus_mlx.speculative
replaces it once merged). For each of the first --files held-out files of the demo's split, a
--prompt-tokens prompt from the middle of the file, --tokens greedy tokens with --draft drafts per
step; checks the tokens equal plain greedy decoding and prints accepted / drafted.

    python benchmarks/bench_mtp_acceptance.py
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tools")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--draft", type=int, default=3)
    a = p.parse_args(argv)

    from support.spec_loop import plain_greedy, speculative_greedy
    from tokenizers import Tokenizer
    from train_demo import DEFAULT_CORPUS, list_corpus, read_text, split_files

    from hebrus_mlx.loader import load_model
    from hebrus_mlx.speculative.mtp_drafter import MTPDrafter

    art = ROOT / "hebrus_mlx" / "demo" / "model"
    model = load_model(art)
    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    _, held = split_files(list_corpus(DEFAULT_CORPUS), 0.1, 0)
    drafted = accepted = 0
    identical = True
    for f in held[: a.files]:
        ids = tok.encode(read_text(f), add_special_tokens=False).ids
        prompt = ids[len(ids) // 2 : len(ids) // 2 + a.prompt_tokens]
        out, d, acc = speculative_greedy(model, MTPDrafter(model, model.mtp_head), prompt, a.tokens, a.draft, vocab)
        identical &= out == plain_greedy(model, prompt, a.tokens, vocab)
        drafted, accepted = drafted + d, accepted + acc
        print(f"{f.name}: accepted {acc}/{d}", flush=True)
    print(
        f"{a.files} held-out files, {a.prompt_tokens}-token prompts, {a.tokens} greedy tokens, draft {a.draft}: "
        f"accepted {accepted}/{drafted} = {accepted / drafted:.3f}; identical to plain greedy: {identical}"
    )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
