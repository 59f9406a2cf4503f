"""Several data sources mixed with weights: `--data a.jsonl:0.7,b/:0.3`, or in a config file
`data: [{path: a.jsonl, weight: 0.7}, {path: b/, weight: 0.3}]` (issue 48).

Each source is read, split (its own held-out share) and tokenized as it would be alone; the train
rows of all of them are one `TokenDataset` whose `parts` say where each source's rows are and its
weight, the held-out rows one split evaluated together. The sampler (sampler.py) draws a mixture
epoch of as many rows as the sources hold together: position j of every epoch takes a row of the
source `interleave` names there, a deterministic interleaving in the weights' proportions (any
run of n positions holds within one row of weight x n of each source), and the source's next row
in its own shuffled order (a source smaller than its share goes round again, a larger one is
visited in part each epoch). Everything is a function of (seed, position): a resumed run draws
the same rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import DataError
from .formats import Source


def parse_mixture(path: str | None) -> list[tuple[str, float]] | None:
    """`a.jsonl:0.7,b/:0.3` -> [(path, weight)] normalized to sum 1; None for one source (a path,
    which may hold colons). DataError naming the part without a weight or with a bad one."""
    if path is None or "," not in path:
        return None
    parts = []
    for part in path.split(","):
        where, sep, weight = part.strip().rpartition(":")
        try:
            w = float(weight) if sep else math.nan
        except ValueError:
            w = math.nan
        if not where or not (w > 0 and math.isfinite(w)):
            raise DataError(f"--data {path!r}: {part.strip()!r} is not PATH:WEIGHT with a weight > 0; several sources "
                            f"are given as a.jsonl:0.7,b.jsonl:0.3")
        parts.append((where, w))
    total = sum(w for _, w in parts)
    return [(p, w / total) for p, w in parts]


def mixture_spec(value: object, source: str) -> str:
    """A config file's list form of a mixture -> the `--data` form parse_mixture reads:
    [{path: a.jsonl, weight: 0.7}, {path: b/, weight: 0.3}] (or "a.jsonl:0.7" items) ->
    "a.jsonl:0.7,b/:0.3". ValueError naming the file and the item for anything else."""
    if not isinstance(value, list) or len(value) < 2:
        raise ValueError(f"{source}: data: a list of sources needs at least two items, each "
                         f"{{path: PATH, weight: W}}; one source is given as `data: PATH`")
    parts = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            where, sep, weight = item.rpartition(":")
            if not sep:
                raise ValueError(f"{source}: data item {i + 1} ({item!r}) has no weight: PATH:WEIGHT or "
                                 f"{{path: PATH, weight: W}}")
        elif isinstance(item, dict) and set(item) == {"path", "weight"}:
            where, weight = item["path"], item["weight"]
        else:
            raise ValueError(f"{source}: data item {i + 1} ({item!r}) is not {{path: PATH, weight: W}}")
        if not isinstance(where, str) or not where or "," in where:
            raise ValueError(f"{source}: data item {i + 1}: path {where!r} must be a non-empty path without a comma")
        try:
            w = float(weight)
        except (TypeError, ValueError):
            w = math.nan
        if not (w > 0 and math.isfinite(w)):
            raise ValueError(f"{source}: data item {i + 1} ({where}): weight {weight!r} must be a number > 0")
        parts.append(f"{where}:{weight}")
    return ",".join(parts)


@dataclass
class MixedSource:
    """The sources of a mixture, read (build.load_source), with their weights."""
    name: str                                   # the --data value
    sources: list[Source]
    weights: list[float]
    format: str = field(init=False)

    def __post_init__(self):
        formats = {s.format for s in self.sources}
        self.format = formats.pop() if len(formats) == 1 else "mixed"


def epoch_counts(weights: list[float], rows: int) -> list[int]:
    """Rows of each source in a mixture epoch of `rows`: weight x rows, the remainder to the largest
    fractions (ties: the earlier source), so they sum to `rows`."""
    exact = [w * rows for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda s: (-(exact[s] - counts[s]), s))
    for s in order[:rows - sum(counts)]:
        counts[s] += 1
    return counts


def interleave(counts: list[int]) -> torch.Tensor:
    """[sum(counts)] int64 the source of each position of a mixture epoch: source s's k-th row at
    its ideal time (k + 0.5) / counts[s], all merged by time (ties: the lower source), so every
    prefix holds within one row of its share of each source."""
    total = sum(counts)
    times, labels = [], []
    for s, c in enumerate(counts):
        if c:
            times.append((torch.arange(c, dtype=torch.float64) + 0.5) / c)
            labels.append(torch.full((c,), s, dtype=torch.int64))
    if not times:
        return torch.zeros(0, dtype=torch.int64)
    t, lab = torch.cat(times), torch.cat(labels)
    order = torch.argsort(t, stable=True)      # sources concatenated in order: a tie goes to the lower
    assert order.numel() == total
    return lab[order]
