"""`BatchSampler`: batch k is a pure function of (seed, k), for exact resume."""
from __future__ import annotations

from typing import Iterator

import torch

from .batch import Batch, collate
from .dataset import TokenDataset


class BatchSampler:
    """Shuffled batches of a `TokenDataset`, addressed by a global batch index.

    Epoch e visits the rows in the order ``torch.randperm(N, generator=Generator().manual_seed(
    seed + e))``; batch ``index`` is batch ``index % len(self)`` of epoch ``index // len(self)``.
    No state is carried between calls, so the same index gives the same batch in any process:
    step k's micro-batch j is ``batch(k * grad_accum + j)``, before and after a resume. The
    last incomplete batch of an epoch is dropped (every batch has B rows).

    A mixture of sources (`dataset.parts`, mixture.py): epoch e's order is position j's source by
    `mixture.interleave` (the same every epoch), taking that source's next row in its own order,
    ``randperm(n_s)`` seeded by (seed, source, round), the source's rows going round as often as its
    share asks. A pure function of (seed, index) as well.
    """

    def __init__(self, dataset: TokenDataset, batch_size: int, seed: int, pad_id: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) < batch_size:
            rows = (f"rows of seq_len+1 = {dataset.seq_len + 1} tokens" if dataset.packed
                    else "rows (one example each)")
            fix = ("use more data, a smaller seq_len or a smaller batch" if dataset.packed
                   else "add examples or use a smaller batch")
            raise ValueError(
                f"the {dataset.split} split of {dataset.source or 'the data'} has {len(dataset)} "
                f"{rows}, fewer than batch_size={batch_size}; {fix}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = pad_id
        self._perm_epoch: int | None = None
        self._perm: torch.Tensor | None = None  # [N] int64, cached for one epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.dataset) // self.batch_size

    def epoch_of(self, index: int) -> int:
        return index // len(self)

    def permutation(self, epoch: int) -> torch.Tensor:
        """[N] int64: the row order of ``epoch``."""
        if self._perm_epoch != epoch:
            if self.dataset.parts:
                self._perm = self._mixture_order(epoch)
            else:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(len(self.dataset), generator=g)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def _mixture_order(self, epoch: int) -> torch.Tensor:
        """[N] int64 the rows of a mixture epoch (the class docstring)."""
        from .mixture import epoch_counts, interleave
        parts = self.dataset.parts
        counts = epoch_counts([w for _, _, w in parts], len(self.dataset))
        labels = interleave(counts)                                   # [N] the source at each position
        order = torch.empty(len(self.dataset), dtype=torch.int64)
        for s, ((start, n, _), c) in enumerate(zip(parts, counts)):
            k = epoch * c + torch.arange(c, dtype=torch.int64)         # the source's draws this epoch
            rows = torch.empty(c, dtype=torch.int64)
            for q in torch.unique(k // n).tolist():                   # the source's rounds they fall in
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + 104_729 * (s + 1) + q)
                take = (k // n) == q
                rows[take] = start + torch.randperm(n, generator=g)[k[take] % n]
            order[labels == s] = rows
        return order

    def rows(self, index: int) -> list[int]:
        """The dataset rows of batch ``index``."""
        if index < 0:
            raise IndexError(f"batch index must be >= 0, got {index}")
        epoch, pos = divmod(index, len(self))
        perm = self.permutation(epoch)
        return perm[pos * self.batch_size:(pos + 1) * self.batch_size].tolist()

    def batch(self, index: int) -> Batch:
        return collate(self.dataset, self.rows(index), self.pad_id)


def eval_batches(dataset: TokenDataset, batch_size: int, pad_id: int) -> Iterator[Batch]:
    """Every row once, in order, for evaluation (the last batch may be smaller)."""
    for start in range(0, len(dataset), batch_size):
        yield collate(dataset, range(start, min(start + batch_size, len(dataset))), pad_id)
