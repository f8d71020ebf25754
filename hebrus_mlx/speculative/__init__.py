"""Speculative decoding: the protocol (protocol.py: the strategy generate's decode loop calls, run by
`hebrus_mlx.generate.speculative_generate_step`), the drafter interface (base.py), drafters
(drafters.py; the MTP head lives in mtp_drafter.py when built), the block-size governor (governor.py).

`DRAFTERS` maps a `--draft-model` name to `factory(model, args) -> Drafter`; any other value is a
draft model directory. `args` is a DraftArgs. A module that provides a drafter registers it here;
`mtp` resolves by importing `hebrus_mlx.speculative.mtp_drafter`, which exposes
`make_drafter(model, args) -> Drafter` or `MTPDrafter(model, model.mtp_head)`; a missing module or
head is a DrafterError (one line, exit 2 at the CLI).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import CompatibilityError, Drafter, DrafterError, Proposal
from .governor import Governor
from .protocol import Speculation, SpeculativeStats

__all__ = [
    "DRAFTERS",
    "DraftArgs",
    "Drafter",
    "DrafterError",
    "CompatibilityError",
    "Governor",
    "Proposal",
    "Speculation",
    "SpeculativeStats",
    "make_drafter",
]


@dataclass
class DraftArgs:
    """What a drafter factory may use besides the target model."""

    tokenizer: Any  # the target's TextTokenizer
    distribution: Callable | None = None  # the target sampler's distribution (None: greedy)
    num_draft_tokens: int | None = None


def _ngram(model, args):
    from .drafters import NGramDrafter

    return NGramDrafter()


def _mtp(model, args):
    try:
        import hebrus_mlx.speculative.mtp_drafter as mod
    except ModuleNotFoundError as e:
        if e.name != "hebrus_mlx.speculative.mtp_drafter":
            raise
        raise DrafterError(
            "draft_model: 'mtp' needs hebrus_mlx.speculative.mtp_drafter, which this build does not have"
        ) from None
    factory = getattr(mod, "make_drafter", None)
    if factory is None and hasattr(mod, "MTPDrafter"):
        # The MTP branch's drafter: MTPDrafter(model, model.mtp_head) (the loaders attach the head).
        factory = lambda m, a: mod.MTPDrafter(m, getattr(m, "mtp_head", None))  # noqa: E731
    if factory is None:
        raise DrafterError("draft_model: hebrus_mlx.speculative.mtp_drafter has no make_drafter(model, args)")
    try:
        return factory(model, args)
    except DrafterError:
        raise
    except ValueError as e:  # e.g. no MTP head in this artifact
        raise DrafterError(str(e) if str(e).startswith("draft_model") else f"draft_model: mtp: {e}") from None


DRAFTERS: dict[str, Callable[[Any, DraftArgs], Drafter]] = {"ngram": _ngram, "mtp": _mtp}


def make_drafter(spec, model, tokenizer, sampler=None, num_draft_tokens=None) -> Drafter:
    """`spec`: a Drafter (used as is), a DRAFTERS name, or a draft model directory."""
    from .protocol import check_drafter

    if isinstance(spec, Drafter) or (not isinstance(spec, str) and hasattr(spec, "propose")):
        return check_drafter(spec)
    if not isinstance(spec, str) or not spec:
        raise DrafterError(
            f"draft_model: expected a name ({', '.join(DRAFTERS)}), a directory or a Drafter, got {spec!r}"
        )
    distribution = getattr(sampler, "distribution", None)
    args = DraftArgs(tokenizer, distribution, num_draft_tokens)
    if spec in DRAFTERS:
        return check_drafter(DRAFTERS[spec](model, args))
    from .drafters import load_draft_model

    return load_draft_model(spec, tokenizer, model.args.vocab_size, distribution)
