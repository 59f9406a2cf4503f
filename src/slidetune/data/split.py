"""The held-out split, at the document/example level (before packing)."""
from __future__ import annotations

import torch

from .errors import DataError


def heldout_split(n: int, fraction: float, seed: int,
                  source_name: str) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices) of ``n`` examples, each list in ascending order.

    The held-out set is the first ``round(n * fraction)`` entries of a permutation drawn from
    ``torch.Generator().manual_seed(seed)``: the same on every machine and independent of the
    tokenizer, so every model of a comparison is evaluated on the same documents. With
    ``fraction > 0`` each split gets at least one example. ``fraction == 0`` gives an empty
    held-out split (no evaluation).
    """
    if fraction <= 0.0:
        return list(range(n)), []
    if n < 2:
        raise DataError(f"{source_name}: {n} example(s), but a held-out split needs at least 2 "
                        f"(one for training, one held out); add data or set heldout_fraction=0")
    n_heldout = min(max(int(n * fraction + 0.5), 1), n - 1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_heldout:]), sorted(perm[:n_heldout])
