"""Which rank owns which layers: the MLX-free half of pipeline parallelism.

A pipeline stage is a contiguous layer range. The first rank also owns the token embedding (and
so tokenization and sampling), the last the final hyper-connection mixer and lm_head. The split
is planned from the artifact's manifest (bytes per layer, no tensor read) against each rank's
budget, so every rank computes the same plan from the same inputs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_FIRST = ("model.embed_tokens.",)
_LAST = ("lm_head.", "model.hyper_connection_mixer.")


class PipelineSplitError(ValueError):
    """The layers cannot be split over the ranks as asked; the message names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Stage:
    rank: int
    size: int
    start: int  # first owned layer
    stop: int  # one past the last owned layer

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
            return self.last
        raise PipelineSplitError("tensors", f"no pipeline owner for tensor {key!r}")


def stages(counts: Sequence[int]) -> list:
    """Layers per rank -> the ranks' stages."""
    out, start = [], 0
    for rank, n in enumerate(counts):
        out.append(Stage(rank, len(counts), start, start + n))
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
        raise PipelineSplitError("--pipeline-split", f"counts add up to {sum(counts)}, the model has {num_layers} layers")
    return counts


def layer_bytes(manifest: dict) -> tuple:
    """(bytes per layer, bytes only the first rank holds, bytes only the last rank holds) from
    the manifest alone: dense tensors by their recorded offsets, expert records per layer, PLE
    page stores by their layer."""
    consts = manifest["model_constants"]
    n = consts["num_hidden_layers"]
    per_layer = [0] * n
    first = last = 0
    for key, rec in manifest["tensors"].items():
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
    for store in manifest["stores"]:
        if store["role"] == "experts":
            for i in range(n):
                per_layer[i] += store["size"] // n
        elif store["role"] == "ple":
            per_layer[store["layer"]] += store["size"]
    return per_layer, first, last


def plan_split(per_layer: Sequence[int], first: int, last: int, budgets: Sequence[int],
               override: Optional[Sequence[int]] = None) -> list:
    """Layers per rank. With `override`, only checked; otherwise the contiguous split that
    minimises the largest load/budget ratio (exact, by dynamic programming over cut points).
    Raises naming the rank when the best split still overfills a rank's budget."""
    n, size = len(per_layer), len(budgets)
    if size < 1 or n < size:
        raise PipelineSplitError("ranks", f"{size} ranks for {n} layers: every rank needs a layer")
    if any(b <= 0 for b in budgets):
        raise PipelineSplitError("budgets", f"a rank has no memory budget: {list(budgets)}")
    prefix = [0]
    for b in per_layer:
        prefix.append(prefix[-1] + b)

    def load(rank, a, b):
        return prefix[b] - prefix[a] + (first if rank == 0 else 0) + (last if rank == size - 1 else 0)

    if override is not None:
        counts = list(override)
    else:
        # best[r][j]: the smallest max ratio placing layers [0, j) on ranks [0, r].
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(size)]
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
            i = cut[r][j]
            counts.append(j - i)
            j = i
        counts.append(j)
        counts.reverse()
    start = 0
    for rank, c in enumerate(counts):
        need = load(rank, start, start + c)
        if need > budgets[rank]:
            raise PipelineSplitError(
                "pipeline split",
                f"rank {rank} needs {need / 2**30:.2f} GiB for layers {start}-{start + c - 1} but has "
                f"{budgets[rank] / 2**30:.2f} GiB; the model needs {(prefix[n] + first + last) / 2**30:.2f} GiB, "
                f"the ranks have {sum(budgets) / 2**30:.2f} GiB together",
            )
        start += c
    return counts
