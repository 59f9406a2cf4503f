"""Tokenized examples -> fixed-width rows of at most seq_len+1 tokens.

A row of L <= seq_len+1 tokens w gives the model ``w[:-1]`` as input and ``w[1:]`` as labels
(batch.py), so seq_len+1 tokens make one full training sequence of seq_len positions.

* `pack`: all examples of a split back to back (each ends with EOS), cut into windows of
  seq_len+1 tokens with stride seq_len: window k is ``stream[k*S : k*S + S + 1]``, so
  consecutive windows share one boundary token (the last label of window k is the first
  input of window k+1). Every token of the stream except the first is a label exactly once
  and no next-token pair is lost at a window edge (a stride of S+1 would skip 1/S of them).
  The tail that does not fill a window (< S tokens) is dropped. ``doc_starts`` marks each
  example's first token, so `batch.collate` can keep documents apart (packing "masked":
  position ids restart at each document and the attention is masked per document) or let
  them attend to the documents before them (packing "causal", the trade of pretraining).
* `pad_rows`: one example per row, truncated to its first seq_len+1 tokens (the end,
  including EOS, is lost; counted in ``num_truncated``); padding happens per batch.

Rows without a single target token among their labels (e.g. a prompt that fills the whole
window) are dropped (``num_dropped``): a batch of such rows would make the mean loss 0/0.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .tokenization import TokenizedExample


@dataclass
class Rows:
    tokens: torch.Tensor    # [T] int32, rows back to back (int32: any vocab fits, half the RAM)
    targets: torch.Tensor   # [T] bool, True where the token is a training target
    starts: torch.Tensor    # [N] int64, row r = tokens[starts[r] : starts[r] + lengths[r]]
    lengths: torch.Tensor   # [N] int64, each <= seq_len + 1
    num_stream_tokens: int  # tokens of all examples before windowing / truncation
    doc_starts: torch.Tensor | None = None  # [T] bool, True at the first token of each example
    num_truncated: int = 0  # examples cut to seq_len+1 tokens (pad_rows only)
    num_dropped: int = 0    # rows dropped for having no target token


def _flat(examples: list[TokenizedExample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.tensor(list(itertools.chain.from_iterable(e.ids for e in examples)),
                          dtype=torch.int32)
    targets = torch.tensor(list(itertools.chain.from_iterable(e.targets for e in examples)),
                           dtype=torch.bool)
    lengths = torch.tensor([len(e.ids) for e in examples], dtype=torch.int64)
    doc_starts = torch.zeros(tokens.numel(), dtype=torch.bool)
    firsts = (torch.cumsum(lengths, 0) - lengths)[lengths > 0]
    doc_starts[firsts] = True
    return tokens, targets, doc_starts  # [T], [T], [T]


def _label_target_counts(targets: torch.Tensor, starts: torch.Tensor,
                         lengths: torch.Tensor) -> torch.Tensor:
    """[N] number of target tokens among each row's labels (positions 1..L-1 of the row)."""
    csum = torch.cat([torch.zeros(1, dtype=torch.int64), targets.to(torch.int64).cumsum(0)])
    return csum[starts + lengths] - csum[starts + 1]


def _keep_trainable(rows: Rows) -> Rows:
    keep = _label_target_counts(rows.targets, rows.starts, rows.lengths) > 0
    rows.num_dropped += int((~keep).sum())
    rows.starts, rows.lengths = rows.starts[keep], rows.lengths[keep]
    return rows


def pack(examples: list[TokenizedExample], seq_len: int) -> Rows:
    """Windows of seq_len+1 tokens with stride seq_len over the concatenated examples."""
    tokens, targets, doc_starts = _flat(examples)  # [T], [T], [T]
    total = tokens.numel()
    n_windows = max(total - 1, 0) // seq_len  # 0 when total < seq_len + 1
    starts = torch.arange(n_windows, dtype=torch.int64) * seq_len            # [N]
    lengths = torch.full((n_windows,), seq_len + 1, dtype=torch.int64)      # [N]
    end = int(starts[-1]) + seq_len + 1 if n_windows else 0
    rows = Rows(tokens[:end], targets[:end], starts, lengths, num_stream_tokens=total,
                doc_starts=doc_starts[:end])
    return _keep_trainable(rows)


def pad_rows(examples: list[TokenizedExample], seq_len: int) -> Rows:
    """One row per example, each truncated to its first seq_len+1 tokens."""
    width = seq_len + 1
    clipped = [TokenizedExample(e.ids[:width], e.targets[:width], e.where) for e in examples]
    tokens, targets, doc_starts = _flat(clipped)
    lengths = torch.tensor([len(e.ids) for e in clipped], dtype=torch.int64)   # [N]
    starts = torch.cumsum(lengths, 0) - lengths                                # [N]
    rows = Rows(tokens, targets, starts, lengths,
                num_stream_tokens=sum(len(e.ids) for e in examples),
                num_truncated=sum(len(e.ids) > width for e in examples), doc_starts=doc_starts)
    return _keep_trainable(rows)
