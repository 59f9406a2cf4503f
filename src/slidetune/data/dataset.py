"""`TokenDataset`: one tokenized split (train or held-out), a list of rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .packing import Rows


@dataclass(frozen=True)
class Row:
    ids: torch.Tensor      # [L] int64 token ids, L <= seq_len + 1
    targets: torch.Tensor  # [L] bool, True where the token is a training target


@dataclass
class TokenDataset:
    """The rows of one split. Row r holds L_r <= seq_len+1 tokens (exactly seq_len+1 when
    packed in windows); `batch.collate` turns rows into a shifted, padded `Batch` of width seq_len.

    Storage is ragged and flat (no padding stored; packed rows share their boundary token),
    so a split costs ~5 bytes per token of RAM.
    """

    tokens: torch.Tensor    # [T] int32, rows back to back
    targets: torch.Tensor   # [T] bool, True where the token is a training target
    starts: torch.Tensor    # [N] int64, row r = tokens[starts[r] : starts[r] + lengths[r]]
    lengths: torch.Tensor   # [N] int64, each <= seq_len + 1
    seq_len: int            # S: model input length of every batch
    packed: bool
    split: str = "train"    # "train" | "heldout"
    source: str = ""        # the data path, or "<builtin corpus>"
    format: str = "text"    # "text" | "chat" | "prompt_completion" | "alpaca"
    num_examples: int = 0   # documents/examples of this split before packing
    num_truncated: int = 0  # examples cut to seq_len+1 tokens (one per row, or packed whole)
    num_dropped: int = 0    # rows dropped for having no target token
    doc_starts: torch.Tensor | None = None  # [T] bool, True at each document's first token
    # packing "masked": packed rows keep their documents apart (batch.collate gives position ids
    # that restart at each document; the model masks attention per document from them)
    document_mask: bool = False
    # a mixture of sources (mixture.py): per source (first row, rows, weight); () for one source
    parts: tuple[tuple[int, int, float], ...] = ()

    @classmethod
    def from_rows(cls, rows: Rows, seq_len: int, packed: bool, **info: object) -> "TokenDataset":
        return cls(rows.tokens, rows.targets, rows.starts, rows.lengths, seq_len, packed,
                   num_truncated=rows.num_truncated, num_dropped=rows.num_dropped,
                   doc_starts=rows.doc_starts, **info)  # type: ignore[arg-type]

    @classmethod
    def empty(cls, seq_len: int, packed: bool, **info: object) -> "TokenDataset":
        z = torch.zeros(0, dtype=torch.int64)
        return cls(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.bool), z, z,
                   seq_len, packed, **info)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return int(self.starts.numel())

    @classmethod
    def concat(cls, datasets: list["TokenDataset"], weights: list[float] | None = None, **info: object
               ) -> "TokenDataset":
        """The rows of `datasets` one after the other, in new tensors; with `weights`, `parts` records
        each one's rows and weight (a mixture's train split). They must agree on seq_len, packing and
        the document mask."""
        first = datasets[0]
        for ds in datasets[1:]:
            if (ds.seq_len, ds.packed, ds.document_mask) != (first.seq_len, first.packed, first.document_mask):
                raise ValueError(f"{ds.source} is packed {'in rows' if ds.packed else 'one example a row'} where "
                                 f"{first.source} is {'packed in rows' if first.packed else 'one example a row'}")
        sizes = torch.tensor([0] + [int(ds.tokens.numel()) for ds in datasets[:-1]]).cumsum(0)
        docs = None if first.doc_starts is None else torch.cat([ds.doc_starts for ds in datasets])
        rows = [0] + [len(ds) for ds in datasets]
        parts = () if weights is None else tuple((sum(rows[:i + 1]), rows[i + 1], float(w))
                                                 for i, w in enumerate(weights))
        return cls(torch.cat([ds.tokens for ds in datasets]), torch.cat([ds.targets for ds in datasets]),
                   torch.cat([ds.starts + int(off) for ds, off in zip(datasets, sizes)]),
                   torch.cat([ds.lengths for ds in datasets]), first.seq_len, first.packed,
                   num_examples=sum(ds.num_examples for ds in datasets),
                   num_truncated=sum(ds.num_truncated for ds in datasets),
                   num_dropped=sum(ds.num_dropped for ds in datasets), doc_starts=docs,
                   document_mask=first.document_mask, parts=parts, **info)  # type: ignore[arg-type]

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row ``index`` as (ids [L] int64, targets [L] bool, doc_starts [L] bool or None)."""
        start, length = int(self.starts[index]), int(self.lengths[index])
        doc = None if self.doc_starts is None else self.doc_starts[start:start + length]
        return (self.tokens[start:start + length].to(torch.int64),
                self.targets[start:start + length], doc)

    def __getitem__(self, index: int) -> Row:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for the {self.split} split "
                             f"of {len(self)} rows")
        start, length = int(self.starts[index]), int(self.lengths[index])
        return Row(self.tokens[start:start + length].to(torch.int64),
                   self.targets[start:start + length].clone())

    def __iter__(self) -> Iterator[Row]:
        for i in range(len(self)):
            yield self[i]

    @property
    def num_input_tokens(self) -> int:
        """Model input positions holding a real token (rows of L tokens give L-1)."""
        return int((self.lengths - 1).clamp(min=0).sum())

    @property
    def num_target_tokens(self) -> int:
        """Labels that count in the loss, over all rows."""
        if len(self) == 0:
            return 0
        targets = self.targets
        if self.document_mask and self.doc_starts is not None:
            targets = targets & ~self.doc_starts   # no label across a document boundary (collate)
        csum = torch.cat([torch.zeros(1, dtype=torch.int64), targets.to(torch.int64).cumsum(0)])
        return int((csum[self.starts + self.lengths] - csum[self.starts + 1]).sum())

    def __repr__(self) -> str:
        return (f"TokenDataset(split={self.split!r}, rows={len(self)}, seq_len={self.seq_len}, "
                f"packed={self.packed}, document_mask={self.document_mask}, format={self.format!r}, "
                f"examples={self.num_examples}, "
                f"target_tokens={self.num_target_tokens}, source={self.source!r})")
