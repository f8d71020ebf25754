"""Drafters behind the one interface of base.py: prompt lookup (n-gram), a draft model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..artifact import untrusted
from ..sample_utils import masked_logprobs
from .base import CompatibilityError, Drafter, DrafterError, Proposal


class NGramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last k tokens
    (k = max_ngram down to min_ngram) and propose what followed it. Model-free; strong where text
    repeats (code, agent traffic). Candidates per position come from other earlier matches."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_candidates: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise DrafterError(f"ngram: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.max_candidates = max_ngram, min_ngram, max_candidates
        self.seq: list[int] = []

    def begin(self, prompt, hidden):
        self.seq = list(prompt)

    def commit(self, accepted, hidden):
        self.seq.extend(int(t) for t in accepted)

    def reset(self):
        self.seq = []

    def _matches(self, k: int) -> list[int]:
        """Start indices of continuations after earlier occurrences of the last k tokens, latest first."""
        s, L = self.seq, len(self.seq)
        if L <= k:
            return []
        tail = s[L - k :]
        return [i + k for i in range(L - k - 1, -1, -1) if s[i : i + k] == tail]

    def propose(self, n):
        if n <= 0:
            return Proposal([])
        for k in range(min(self.max_ngram, len(self.seq) - 1), self.min_ngram - 1, -1):
            starts = self._matches(k)
            if not starts:
                continue
            best = starts[0]
            tokens = self.seq[best : best + n]
            if not tokens:
                continue
            cands = []
            for i, t in enumerate(tokens):
                c = [t]
                for st in starts[1:]:
                    # Another match that agrees with the path so far offers its own next token.
                    if st + i < len(self.seq) and self.seq[st : st + i] == tokens[:i] and self.seq[st + i] not in c:
                        c.append(self.seq[st + i])
                        if len(c) == self.max_candidates:
                            break
                cands.append(c)
            return Proposal(tokens, cands)
        return Proposal([])


# -- draft model ------------------------------------------------------------------------------------------


def _tokenizer_contract(tok) -> dict:
    backend = tok.backend if hasattr(tok, "backend") else tok._tok
    return {
        "tokenizer.vocab": backend.get_vocab(with_added_tokens=True),
        "effective_vocab_size": tok.effective_vocab_size,
        "added_tokens": dict(tok.added_tokens),
        "stop_token_ids": sorted(tok.stop_token_ids),
        "special_tokens_map": dict(tok.special_tokens_map),
    }


def check_compatible(target_tok, target_vocab: int, draft_tok, draft_vocab: int) -> None:
    """AFN-020's gate: the draft must share the target's token contract exactly. Raises
    CompatibilityError naming the first differing field; never slices, pads or renames."""
    t, d = _tokenizer_contract(target_tok), _tokenizer_contract(draft_tok)
    for key in t:
        if t[key] != d[key]:
            if key == "tokenizer.vocab":
                diff = sorted(set(t[key].items()) ^ set(d[key].items()), key=str)[:1]
                raise CompatibilityError(f"draft_model: tokenizer.vocab differs from the target's (first: {diff[0]!r})")
            raise CompatibilityError(f"draft_model: {key} is {d[key]!r}, the target's is {t[key]!r}")
    if target_vocab != draft_vocab:
        raise CompatibilityError(
            f"draft_model: vocab_size (logit width) is {draft_vocab}, the target's is {target_vocab}"
        )


class DraftModelDrafter(Drafter):
    """Any small MLX model sharing the target's tokenizer: a hebrus-mlx model (SequenceCache,
    rolled back by snapshot/restore) or an mlx-lm model (trimmable KV caches).

    distribution: the target sampler's `distribution` (None: greedy drafts, deterministic). With a
    distribution the draft samples each token from the same transform of its own logits and returns
    those probabilities as q, so the protocol's rejection sampling keeps the target's distribution.
    """

    name = "draft-model"

    def __init__(
        self,
        model,
        effective_vocab_size: int,
        distribution: Callable | None = None,
        prefill_step_size: int = 512,
        num_candidates: int = 3,
    ):
        self.model = model
        self.effective_vocab_size = effective_vocab_size
        self.distribution = distribution
        self.prefill_step_size = prefill_step_size
        self.num_candidates = num_candidates
        self.cache = None
        self.pending: list[int] = []
        self.base = None

    # cache handling for both model families
    def _make_cache(self):
        if hasattr(self.model, "make_cache"):
            cache = self.model.make_cache()
            if hasattr(cache, "snapshot"):
                return cache
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        cache = make_prompt_cache(self.model)
        if not can_trim_prompt_cache(cache):
            raise DrafterError("draft_model: its cache cannot be rolled back (not trimmable)")
        return cache

    def _snapshot(self):
        if hasattr(self.cache, "snapshot"):
            return self.cache.snapshot()
        return self.cache[0].offset

    def _restore(self, snap):
        if hasattr(self.cache, "snapshot"):
            self.cache.restore(snap)
        else:
            from mlx_lm.models.cache import trim_prompt_cache

            trim_prompt_cache(self.cache, self.cache[0].offset - snap)

    def _forward(self, ids):
        return self.model(mx.array(ids, dtype=mx.int32)[None], cache=self.cache)

    def begin(self, prompt, hidden):
        self.cache = self._make_cache()
        self.pending = list(prompt)
        self.base = None

    def commit(self, accepted, hidden):
        if self.base is not None:
            self._restore(self.base)  # drop the drafted tokens' state
            self.base = None
        self.pending.extend(int(t) for t in accepted)

    def reset(self):
        self.cache, self.pending, self.base = None, [], None

    def propose(self, n):
        if n <= 0 or not self.pending:
            return Proposal([])
        logits = None
        for i in range(0, len(self.pending), self.prefill_step_size):
            logits = self._forward(self.pending[i : i + self.prefill_step_size])
            mx.eval(logits)
        self.pending = []
        self.base = self._snapshot()
        tokens, cands, probs = [], [], []
        for i in range(n):
            row = masked_logprobs(logits[0, -1:].astype(mx.float32), self.effective_vocab_size)
            if self.distribution is None:
                order = mx.argsort(-row[0])[: self.num_candidates]
                c = np.array(order).tolist()
            else:
                q = self.distribution(row)[0]
                t = int(mx.random.categorical(mx.log(q)).item())
                probs.append(q)
                c = [t] + [x for x in np.array(mx.argsort(-q)[: self.num_candidates]).tolist() if x != t]
                c = c[: self.num_candidates]
            tokens.append(c[0])
            cands.append(c)
            if i < n - 1:
                logits = self._forward([c[0]])
        return Proposal(tokens, cands, mx.stack(probs) if probs else None)


def _is_hebrus_dir(path: Path) -> bool:
    if (path / "manifest.json").is_file():
        return True
    try:
        cfg = untrusted.read_json(str(path), "config.json", links=True)
        return isinstance(cfg, dict) and str(cfg.get("model_type", "")).startswith("qwen4_exp")
    except (OSError, ValueError, untrusted.UntrustedFileError):
        return False


def load_draft_model(path, target_tokenizer, target_vocab: int, distribution=None) -> DraftModelDrafter:
    """A draft model dir (hebrus artifact / HF checkpoint, or an mlx-lm model dir) behind the
    compatibility gate; its tokenizer is read with the target's own loader."""
    from ..text.tokenizer import load_tokenizer

    p = Path(path).expanduser()
    if not (p / "config.json").is_file() and not (p / "manifest.json").is_file():
        raise DrafterError(f"draft_model: {path!r} is not 'mtp', 'ngram' or a model directory (no config.json)")
    if _is_hebrus_dir(p):
        from ..loader import load_model

        cfg = untrusted.read_json(str(p), "config.json", links=True)
        draft_vocab = int(cfg["vocab_size"])
        draft_tok = load_tokenizer(p, physical_vocab_size=draft_vocab)
        check_compatible(target_tokenizer, target_vocab, draft_tok, draft_vocab)  # before any weight
        model = load_model(p)
    else:
        cfg = untrusted.read_json(str(p), "config.json", links=True)
        draft_vocab = cfg.get("vocab_size", cfg.get("text_config", {}).get("vocab_size"))
        if draft_vocab is None:
            raise CompatibilityError("draft_model: config.json has no vocab_size")
        draft_tok = load_tokenizer(p, physical_vocab_size=int(draft_vocab))
        check_compatible(target_tokenizer, target_vocab, draft_tok, int(draft_vocab))
        from mlx_lm.utils import load as mlx_lm_load

        model, _ = mlx_lm_load(str(p))
    return DraftModelDrafter(model, target_tokenizer.effective_vocab_size, distribution)
