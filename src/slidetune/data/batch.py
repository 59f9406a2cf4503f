"""`Batch` and `collate`: rows -> shifted, padded model inputs and labels."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .dataset import TokenDataset

if TYPE_CHECKING:
    from ..objectives.preference import PairTokens
    from .token_arrays import TokenArrayDataset

IGNORE_INDEX = -100  # the label that cross-entropy skips (torch and HF default)


@dataclass
class Batch:
    input_ids: torch.Tensor              # [B, S] int64
    labels: torch.Tensor                 # [B, S] int64, ALREADY SHIFTED: labels[b, t] is the
                                         #   target for position t (row token t+1); -100 = ignored
    attention_mask: torch.Tensor | None  # [B, S] int64, 1 = real token; None: nothing padded
    # [B, S] int64, packing "masked" only: restarting at 0 at each document, so the model's rotary
    # sees each document from position 0 and transformers' packed-sequence mask (document t's
    # tokens attend only to document t, masking_utils.find_packed_sequence_indices) applies.
    # None: positions 0..S-1 (causal packing, padded rows).
    position_ids: torch.Tensor | None = None
    # a preference objective's micro-batch of whole pairs (objectives/preference.py): which tokens
    # sum into which sequence's log-probability, the reference's sums, the step's normalization
    pairs: "PairTokens | None" = None

    def num_target_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def document_ids(self) -> torch.Tensor:
        """[B, S] int64: the document of each position within its row (0, 1, ...)."""
        if self.position_ids is None:
            return torch.zeros_like(self.input_ids)
        return (self.position_ids == 0).cumsum(-1) - 1

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)
        return Batch(move(self.input_ids), move(self.labels), move(self.attention_mask),
                     move(self.position_ids), self.pairs.to(device, non_blocking) if self.pairs is not None else None)


def document_positions(doc_starts: torch.Tensor) -> torch.Tensor:
    """[B, S] bool document starts -> [B, S] int64 positions restarting at 0 at each start;
    position 0 of every row starts a document (the row may begin mid-document)."""
    starts = doc_starts.clone()
    starts[:, 0] = True
    idx = torch.arange(starts.shape[1]).expand_as(starts)                       # [B, S]
    last_start = torch.where(starts, idx, 0).cummax(-1).values                  # [B, S]
    return idx - last_start


def collate(dataset: "TokenDataset | TokenArrayDataset", rows: Sequence[int], pad_id: int) -> Batch:
    """Rows ``rows`` of ``dataset`` -> a `Batch` of width S = dataset.seq_len.

    Each row w (L <= S+1 tokens) is right-padded to S+1 with ``pad_id``; then
    ``input_ids = w[:-1]``, ``labels = w[1:]`` where the token is a target, else -100.
    Padding is always to S (not to the longest row): every batch has the same shape, which
    keeps memory peaks, benchmark numbers and compiled graphs stable.

    With ``dataset.document_mask`` (packing "masked") the batch also gets ``position_ids`` that
    restart at each document, and the label that would predict a document's first token from
    the previous document's last one is -100: each document trains exactly as if alone.

    Packed rows shorter than S+1 (whole-example packing) are padded on the right without an
    attention mask: under the causal mask no real token attends to the padding after it, and the
    padding's labels are -100. With the document mask the padding is a document of its own.
    """
    S = dataset.seq_len
    B = len(rows)
    window = torch.full((B, S + 1), pad_id, dtype=torch.int64)   # [B, S+1]
    is_target = torch.zeros((B, S + 1), dtype=torch.bool)         # [B, S+1], False on padding
    real = torch.zeros((B, S + 1), dtype=torch.bool)              # [B, S+1]
    doc_start = torch.zeros((B, S + 1), dtype=torch.bool)         # [B, S+1]
    masked = dataset.document_mask
    for b, r in enumerate(rows):
        ids, targets, starts = dataset.window(r)
        length = ids.numel()
        window[b, :length] = ids
        is_target[b, :length] = targets
        real[b, :length] = True
        if masked and starts is not None:
            doc_start[b, :length] = starts
            if length <= S:
                doc_start[b, length] = True   # the padding: a document of its own
    if masked:
        is_target &= ~doc_start          # no label across a document boundary
    input_ids = window[:, :-1]                                                    # [B, S]
    labels = torch.where(is_target[:, 1:], window[:, 1:], IGNORE_INDEX)           # [B, S]
    real_in = real[:, :-1]                                                        # [B, S]
    attention_mask = None if dataset.packed or bool(real_in.all()) else real_in.to(torch.int64)
    position_ids = None
    if masked and attention_mask is None and bool(doc_start[:, 1:-1].any()):
        position_ids = document_positions(doc_start[:, :-1])                      # [B, S]
    return Batch(input_ids.contiguous(), labels.contiguous(), attention_mask, position_ids)
