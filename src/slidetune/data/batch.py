"""`Batch` and `collate`: rows -> shifted, padded model inputs and labels."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .dataset import TokenDataset

IGNORE_INDEX = -100  # the label that cross-entropy skips (torch and HF default)


@dataclass
class Batch:
    input_ids: torch.Tensor              # [B, S] int64
    labels: torch.Tensor                 # [B, S] int64, ALREADY SHIFTED: labels[b, t] is the
                                         #   target for position t (row token t+1); -100 = ignored
    attention_mask: torch.Tensor | None  # [B, S] int64, 1 = real token; None: nothing padded

    def num_target_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        mask = self.attention_mask
        return Batch(self.input_ids.to(device, non_blocking=non_blocking),
                     self.labels.to(device, non_blocking=non_blocking),
                     None if mask is None else mask.to(device, non_blocking=non_blocking))


def collate(dataset: TokenDataset, rows: Sequence[int], pad_id: int) -> Batch:
    """Rows ``rows`` of ``dataset`` -> a `Batch` of width S = dataset.seq_len.

    Each row w (L <= S+1 tokens) is right-padded to S+1 with ``pad_id``; then
    ``input_ids = w[:-1]``, ``labels = w[1:]`` where the token is a target, else -100.
    Padding is always to S (not to the longest row): every batch has the same shape, which
    keeps memory peaks, benchmark numbers and compiled graphs stable.
    """
    S = dataset.seq_len
    B = len(rows)
    window = torch.full((B, S + 1), pad_id, dtype=torch.int64)   # [B, S+1]
    is_target = torch.zeros((B, S + 1), dtype=torch.bool)         # [B, S+1], False on padding
    real = torch.zeros((B, S + 1), dtype=torch.bool)              # [B, S+1]
    for b, r in enumerate(rows):
        start, length = int(dataset.starts[r]), int(dataset.lengths[r])
        window[b, :length] = dataset.tokens[start:start + length]
        is_target[b, :length] = dataset.targets[start:start + length]
        real[b, :length] = True
    input_ids = window[:, :-1]                                                    # [B, S]
    labels = torch.where(is_target[:, 1:], window[:, 1:], IGNORE_INDEX)           # [B, S]
    real_in = real[:, :-1]                                                        # [B, S]
    attention_mask = None if bool(real_in.all()) else real_in.to(torch.int64)
    return Batch(input_ids.contiguous(), labels.contiguous(), attention_mask)
