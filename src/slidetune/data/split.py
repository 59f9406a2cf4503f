"""The held-out split, at the document/example level (before packing)."""
from __future__ import annotations

import torch

from .errors import DataError

# A held-out split is made only from this many examples up: below it, holding one or two
# examples out costs a large share of the training data and gives a meaningless loss.
MIN_HELDOUT_EXAMPLES = 10


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


def plan_heldout(n: int, fraction: float, seed: int,
                 source_name: str) -> tuple[list[int], list[int], str | None]:
    """`heldout_split` for `build_datasets`, never refusing: (train, held-out, note).

    From `MIN_HELDOUT_EXAMPLES` examples up it is `heldout_split` (at least one example held
    out, at least one left to train on). A smaller data set with ``fraction > 0`` is trained on
    whole, without a held-out split, and ``note`` says so (None otherwise).
    """
    if fraction <= 0.0:
        return list(range(n)), [], None
    if n < MIN_HELDOUT_EXAMPLES:
        return list(range(n)), [], (
            f"{source_name}: {n} example(s) are too few to hold some out for evaluation (that "
            f"takes at least {MIN_HELDOUT_EXAMPLES}): training on all of them, without a held-out "
            f"evaluation (heldout_fraction=0, --heldout-fraction 0, turns this note off)")
    train, heldout = heldout_split(n, fraction, seed, source_name)
    return train, heldout, None
