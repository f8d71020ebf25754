"""Which rank owns which layers: the MLX-free half of pipeline parallelism.

A pipeline stage is a contiguous layer range. The first rank also owns the token embedding (and
so tokenization and sampling), the last the final hyper-connection mixer and lm_head. The split
is planned from the artifact's manifest (bytes per layer, no tensor read) against each rank's
budget, so every rank computes the same plan from the same inputs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import HebrusError

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_FIRST = ("model.embed_tokens.",)
_LAST = ("lm_head.", "model.hyper_connection_mixer.")


class PipelineSplitError(HebrusError, ValueError):
    """The layers cannot be split over the ranks as asked; the message names the field."""


@dataclass(frozen=True)
class Stage:
    rank: int
    size: int
    start: int  # first owned layer
    stop: int  # one past the last owned layer
    # Rank 0 also holds the final mixer + lm_head (and the MTP head), to draft with MTP: the last
    # rank then sends the final pre-mixer state back with the logits.
    heads: bool = False

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    def owns(self, key: str) -> bool:
        """Whether tensor `key` (runtime layout) lives on this rank. Unknown keys are an error,
        never a guess: a new top-level tensor must be given an owner here."""
        m = _LAYER.match(key)
        if m:
            return self.start <= int(m.group(1)) < self.stop
        if key.startswith(_FIRST):
            return self.first
        if key.startswith(_LAST):
            return self.last or self.heads
        raise PipelineSplitError("tensors", f"no pipeline owner for tensor {key!r}")


def stages(counts: Sequence[int], heads: bool = False) -> list:
    """Layers per rank -> the ranks' stages (`heads`: rank 0 also holds mixer, lm_head, MTP head)."""
    out, start = [], 0
    for rank, n in enumerate(counts):
        out.append(Stage(rank, len(counts), start, start + n, heads and rank == 0))
        start += n
    return out


def parse_split(text: str, num_layers: int, size: int) -> list:
    """`--pipeline-split 5,3` -> layers per rank, checked against the model and the launch."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise PipelineSplitError("--pipeline-split", f"expected comma-separated layer counts, got {text!r}") from None
    if len(counts) != size:
        raise PipelineSplitError("--pipeline-split", f"{len(counts)} counts for {size} ranks")
    if any(n < 1 for n in counts):
        raise PipelineSplitError("--pipeline-split", f"every rank needs at least one layer, got {text!r}")
    if sum(counts) != num_layers:
        raise PipelineSplitError(
            "--pipeline-split", f"counts add up to {sum(counts)}, the model has {num_layers} layers"
        )
    return counts


def layer_bytes(manifest) -> tuple:
    """(bytes per layer, bytes only the first rank holds, bytes only the last rank holds, streamable
    bytes per layer) from the admitted manifest alone: dense tensors by their recorded offsets,
    expert records per layer, PLE page stores by their layer (the optional MTP head is not loaded
    by pipeline stages). Experts and PLE pages can stream from the rank's SSD; dense tensors
    cannot."""
    n = manifest.family.num_hidden_layers
    per_layer = [0] * n
    streamable = [0] * n
    first = last = 0
    for key, rec in manifest.tensors.items():
        size = rec["data_offsets"][1] - rec["data_offsets"][0]
        m = _LAYER.match(key)
        if m:
            per_layer[int(m.group(1))] += size
        elif key.startswith(_FIRST):
            first += size
        elif key.startswith(_LAST):
            last += size
        else:
            raise PipelineSplitError("tensors", f"no pipeline owner for tensor {key!r}")
    for store in manifest.stores:
        if store.role == "experts":
            for i in range(n):
                per_layer[i] += store.size // n
                streamable[i] += store.size // n
        elif store.role == "ple":
            per_layer[store.layer] += store.size
            streamable[store.layer] += store.size
    return per_layer, first, last, streamable


def _best_split(per_layer, first, last, budgets):
    """The contiguous split minimising the largest load/budget ratio (exact, dynamic programming
    over cut points) and that ratio."""
    n, size = len(per_layer), len(budgets)
    prefix = [0]
    for b in per_layer:
        prefix.append(prefix[-1] + b)

    def load(rank, a, b):
        return prefix[b] - prefix[a] + (first if rank == 0 else 0) + (last if rank == size - 1 else 0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(size)]  # best[r][j]: layers [0, j) on ranks [0, r]
    cut = [[0] * (n + 1) for _ in range(size)]
    for j in range(1, n + 1):
        best[0][j] = load(0, 0, j) / budgets[0]
    for r in range(1, size):
        for j in range(r + 1, n + 1):
            for i in range(r, j):
                v = max(best[r - 1][i], load(r, i, j) / budgets[r])
                if v < best[r][j]:
                    best[r][j], cut[r][j] = v, i
    counts, j = [], n
    for r in range(size - 1, 0, -1):
        counts.append(j - cut[r][j])
        j = cut[r][j]
    counts.append(j)
    return counts[::-1], best[size - 1][n]


def _check(counts, per_layer, first, last, budgets, what):
    start = 0
    size = len(budgets)
    for rank, c in enumerate(counts):
        need = sum(per_layer[start : start + c]) + (first if rank == 0 else 0) + (last if rank == size - 1 else 0)
        if need > budgets[rank]:
            raise PipelineSplitError(
                "pipeline split",
                f"rank {rank} needs {need / 2**30:.2f} GiB{what} for layers {start}-{start + c - 1} but has "
                f"{budgets[rank] / 2**30:.2f} GiB; that part of the model is {(sum(per_layer) + first + last) / 2**30:.2f} "
                f"GiB, the ranks have {sum(budgets) / 2**30:.2f} GiB together",
            )
        start += c


def plan_split(
    per_layer: Sequence[int],
    first: int,
    last: int,
    budgets: Sequence[int],
    override: Sequence[int] | None = None,
    streamable: Sequence[int] | None = None,
) -> list:
    """Layers per rank. With `override`, only checked; otherwise the contiguous split that
    minimises the largest load/budget ratio. When no split holds everything resident and
    `streamable` (experts + PLE pages per layer) is given, the split is planned on what must stay
    resident and each rank streams the rest from its own SSD. Raises naming the rank otherwise."""
    n, size = len(per_layer), len(budgets)
    if size < 1 or n < size:
        raise PipelineSplitError("ranks", f"{size} ranks for {n} layers: every rank needs a layer")
    if any(b <= 0 for b in budgets):
        raise PipelineSplitError("budgets", f"a rank has no memory budget: {list(budgets)}")
    fixed = per_layer if streamable is None else [a - b for a, b in zip(per_layer, streamable)]
    if override is not None:
        counts = list(override)
        try:
            _check(counts, per_layer, first, last, budgets, "")
        except PipelineSplitError:
            if streamable is None:
                raise
            _check(counts, fixed, first, last, budgets, " resident (experts and PLE pages streamed)")
        return counts
    counts, ratio = _best_split(per_layer, first, last, budgets)
    if ratio > 1 and streamable is not None:
        counts, _ = _best_split(fixed, first, last, budgets)
        _check(counts, fixed, first, last, budgets, " resident (experts and PLE pages streamed)")
        return counts
    _check(counts, per_layer, first, last, budgets, "")
    return counts
