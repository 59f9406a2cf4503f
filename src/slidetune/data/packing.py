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
* `pack_whole`: whole examples, best-fit decreasing (the longest first, each into the row whose
  free room fits it most tightly, else a new row): rows of at most seq_len+1 tokens, each example's
  tokens contiguous in exactly one row, so a reply is never cut from its prompt. Rows are padded
  per batch (a few percent: ``fill_ratio``). An example longer than seq_len+1 tokens is truncated
  to a row of its own (counted in ``num_truncated``); one without a target token within that is
  dropped (``num_dropped``). Deterministic: ties go to the earlier example and row.
* `pad_rows`: one example per row, truncated to its first seq_len+1 tokens (the end,
  including EOS, is lost; counted in ``num_truncated``); padding happens per batch.

Rows without a single target token among their labels (e.g. a prompt that fills the whole
window) are dropped (``num_dropped``): a batch of such rows would make the mean loss 0/0.
"""
from __future__ import annotations

import bisect
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
    num_truncated: int = 0  # examples cut to seq_len+1 tokens (pad_rows, pack_whole)
    num_dropped: int = 0    # rows (pack_whole: examples) dropped for having no target token


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


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each bin's lengths summing to <= ``capacity`` (every length must be
    <= capacity). Items go longest first (ties: lower index first) into the fullest bin they fit
    (of bins with equal room, the one that reached it last), else into a new bin; bins come in the
    order they were opened, items in the order they were placed. O(n log n) plus O(capacity) per
    distinct room: the rooms are integers <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    rooms: list[int] = []                    # sorted free rooms that some bin has
    by_room: dict[int, list[int]] = {}       # free room -> bins with it (a stack)
    for i in order:
        length = lengths[i]
        k = bisect.bisect_left(rooms, length)
        if k < len(rooms):                   # the tightest room that fits
            room = rooms[k]
            b = by_room[room].pop()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - length
        if left > 0:
            if left not in by_room:
                bisect.insort(rooms, left)
                by_room[left] = []
            by_room[left].append(b)
    return bins


def pack_whole(examples: list[TokenizedExample], seq_len: int) -> Rows:
    """Whole examples packed best-fit decreasing into rows of at most seq_len+1 tokens."""
    width = seq_len + 1
    clipped = [TokenizedExample(e.ids[:width], e.targets[:width], e.where) for e in examples]
    # an example without a target among its labels (positions 1.. of it) trains nothing
    usable = [e for e in clipped if any(e.targets[1:])]
    bins = best_fit_decreasing([len(e.ids) for e in usable], width)
    ordered = [usable[i] for row in bins for i in row]
    tokens, targets, doc_starts = _flat(ordered)                                # [T] each
    lengths = torch.tensor([sum(len(usable[i].ids) for i in row) for row in bins],
                           dtype=torch.int64)                                    # [N]
    starts = torch.cumsum(lengths, 0) - lengths                                  # [N]
    return Rows(tokens, targets, starts, lengths, num_stream_tokens=sum(len(e.ids) for e in examples),
                doc_starts=doc_starts, num_truncated=sum(len(e.ids) > width for e in examples),
                num_dropped=len(clipped) - len(usable))


def fill_ratio(rows: Rows, seq_len: int) -> float:
    """Fraction of the rows' seq_len+1 token slots that hold a real token (1.0: no padding)."""
    n = rows.lengths.numel()
    return float(rows.lengths.sum()) / (n * (seq_len + 1)) if n else 0.0


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
