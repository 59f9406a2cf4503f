"""A preference run's data (issue 47): records read into pairs, tokenized, split into training and
held-out pairs, and a step's pairs drawn from them.

The records come from where an SFT run's come from (a JSONL file, anything `datasets` reads, a
Hub dataset id, or records given in Python), each read into a `PreferencePair` (data/preference.py,
TRL's formats) with its place named in errors; pairs are tokenized as TRL's DPOTrainer does and cut
to `seq_len` tokens a sequence (TRL's max_length; a pair whose prompt fills it is left out, said
once). The held-out pairs are the same permutation an SFT run holds out examples by
(split.plan_heldout), so two runs on one file evaluate on the same pairs. A pair is never split
across rows or micro-batches: a step's pairs are collated whole (collate_pairs) and cut into
micro-batches of whole pairs (pair_micro_batches).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch

from .batch import Batch
from .config import DataConfig
from .errors import DataError
from .formats import JSONL_SUFFIXES, ColumnMap, jsonl_records
from .hf_datasets import EVAL_SPLITS, TRAIN_SPLITS, datasets_records, in_memory_records, is_datasets_path
from .preference import (PreferencePair, TokenizedPair, collate_pairs, drop_unscored, pair_micro_batches, parse_pair,
                         tokenize_pair)
from .split import plan_heldout

if TYPE_CHECKING:
    from ..objectives.preference import PreferenceConfig


def _records(path: str, split: str | None, subset: str | None, for_eval: bool) -> Iterator[tuple[str, Any]]:
    if os.path.isfile(path) and path.lower().endswith(JSONL_SUFFIXES):
        return jsonl_records(path)
    if is_datasets_path(path):
        return datasets_records(path, split, subset, EVAL_SPLITS if for_eval else TRAIN_SPLITS)
    if not os.path.exists(path):
        raise DataError(f"data path {path} does not exist")
    raise DataError(f"{path}: preference pairs are records (prompt, chosen, rejected): a JSON lines file, a "
                    f"file or directory `datasets` reads, or a Hub dataset id; not plain text")


def read_pairs(path: str, split: str | None = None, subset: str | None = None, columns: ColumnMap | None = None,
               for_eval: bool = False) -> list[PreferencePair]:
    """Every record of `path` as a pair; a record that is not one is refused naming its place."""
    pairs = [parse_pair(record, where, columns) for where, record in _records(path, split, subset, for_eval)]
    if not pairs:
        raise DataError(f"{path}: no preference pairs found (the source is empty)")
    return pairs


def pairs_in_memory(records: Any, columns: ColumnMap | None = None) -> list[PreferencePair]:
    """Records given in Python (hf_datasets.in_memory_records), each read like a JSONL line."""
    _, rows = in_memory_records(records)
    return [parse_pair(row, where, columns) for where, row in rows]


@dataclass
class PairData:
    """A preference run's tokenized pairs."""
    source: str
    train: list[TokenizedPair]
    heldout: list[TokenizedPair]
    max_length: int                  # each sequence's cut (TRL's max_length): seq_len
    note: str | None = None          # why nothing is held out, where that is so


@dataclass
class PairRecords:
    """A preference run's records read and parsed, before the tokenizer is known (a bad record is
    refused before the model loads)."""
    source: str
    train: list[PreferencePair]              # every pair of the source (the held-out ones drawn later)
    evaluation: list[PreferencePair] | None  # a separate evaluation set (--eval-data), else None
    eval_source: str | None = None


def read_pair_records(cfg: DataConfig, records: Any = None, eval_records: Any = None) -> PairRecords:
    """`cfg.path`'s (or `records`') pairs and `cfg.eval_path`'s (or `eval_records'`), parsed."""
    columns = cfg.column_map
    if records is not None:
        name, pairs = "<records given in Python>", pairs_in_memory(records, columns)
    elif cfg.path is None:
        raise DataError("a preference objective needs preference data: --data FILE with prompt, chosen and "
                        "rejected fields (the built-in corpus is plain text)")
    else:
        name, pairs = cfg.path, read_pairs(cfg.path, cfg.split, cfg.subset, columns)
    if eval_records is not None:
        return PairRecords(name, pairs, pairs_in_memory(eval_records, columns), "<eval records given in Python>")
    if cfg.eval_path is not None:
        return PairRecords(name, pairs, read_pairs(cfg.eval_path, subset=cfg.subset, columns=columns, for_eval=True),
                           cfg.eval_path)
    return PairRecords(name, pairs, None)


def tokenize_pair_records(recs: PairRecords, cfg: DataConfig, tokenizer: Any) -> PairData:
    """The records tokenized and cut to `cfg.seq_len` tokens a sequence, the held-out pairs the
    evaluation set's or drawn from the records (`cfg.heldout_fraction`, `cfg.seed`)."""
    max_length = cfg.seq_len

    def tokenized(items: list[PreferencePair], source: str) -> list[TokenizedPair]:
        return drop_unscored([tokenize_pair(p, tokenizer, cfg.chat_template) for p in items], max_length, source)
    if recs.evaluation is not None:
        train, heldout, note = tokenized(recs.train, recs.source), tokenized(recs.evaluation, recs.eval_source), None
    else:
        train_idx, held_idx, note = plan_heldout(len(recs.train), cfg.heldout_fraction, cfg.seed, recs.source)
        train = tokenized([recs.train[i] for i in train_idx], recs.source)
        heldout = tokenized([recs.train[i] for i in held_idx], recs.source)
    if not train:
        raise DataError(f"{recs.source}: no pair is left to train on once cut to {max_length} tokens (every prompt "
                        f"fills it); raise --seq-len")
    return PairData(recs.source, train, heldout, max_length, note)


def build_pairs(cfg: DataConfig, tokenizer: Any, records: Any = None, eval_records: Any = None) -> PairData:
    """The run's pairs: `cfg.path`'s (or `records`'), tokenized and cut to `cfg.seq_len` tokens a
    sequence, the held-out ones `cfg.eval_path`'s (or `eval_records'`) or drawn from them
    (`cfg.heldout_fraction`, `cfg.seed`)."""
    return tokenize_pair_records(read_pair_records(cfg, records, eval_records), cfg, tokenizer)


def step_pairs(n_pairs: int, batch_pairs: int, step: int, seed: int) -> list[int]:
    """The pair indices of step `step`: epochs of a seeded permutation, `batch_pairs` a step, the
    last partial batch of an epoch dropped (a step always has whole, equally many pairs)."""
    if batch_pairs > n_pairs:
        raise DataError(f"{n_pairs} training pairs cannot fill a batch of {batch_pairs} pairs; lower --batch-size")
    per_epoch = n_pairs // batch_pairs
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(n_pairs, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    return order[k * batch_pairs:(k + 1) * batch_pairs]


def reference_rows(reference: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """[2P] the reference's sums of pairs `idx` in a collated batch's order (the chosen rows, then the
    rejected rows), from `reference` [pairs, 2] (chosen, rejected)."""
    part = reference[idx]                                        # [P, 2]
    return torch.cat([part[:, 0], part[:, 1]])


@dataclass
class PairSampler:
    """A preference run's steps: step k's pairs (`step_pairs`, a pure function of the seed and k, so
    a resume repeats them), each sequence padded to `seq_len` (every step the same [2P, S] shape, as
    an SFT run's rows: stable memory peaks and compiled graphs), cut into `grad_accum` micro-batches
    of `batch_pairs` whole pairs with the reference's sums (set before step 1 where the objective
    has a reference).

    Data parallel (`world_size` ranks): a step's pairs are the global step's, batch_pairs x
    grad_accum x world_size of them, collated and cut into grad_accum x world_size micro-batches of
    whole pairs, each normalized by the global step's pairs and NLL tokens; rank r takes the r-th
    of every world_size of them (as an SFT rank takes its rows of each global micro-batch,
    Trainer.micro_batch). The ranks' summed gradients are then one rank's at world_size x the batch."""
    data: PairData
    objective: "PreferenceConfig"
    batch_pairs: int                          # pairs a micro-batch (--batch-size)
    grad_accum: int
    seed: int
    pad_id: int
    reference: torch.Tensor | None = None     # [len(data.train), 2] FP32 (chosen, rejected)
    world_size: int = 1                       # data-parallel ranks (each takes batch_pairs a micro-batch)
    rank: int = 0

    def __post_init__(self):
        step = self.batch_pairs * self.grad_accum * self.world_size
        if step > len(self.data.train):
            ranks = f" x {self.world_size} ranks" if self.world_size > 1 else ""
            raise DataError(f"{self.data.source}: {len(self.data.train)} training pairs cannot fill a step of "
                            f"{step} pairs (--batch-size {self.batch_pairs} x --grad-accum {self.grad_accum}"
                            f"{ranks}); lower them or add pairs")

    def __len__(self) -> int:
        """Global micro-batches an epoch (a step takes grad_accum of them)."""
        return len(self.data.train) // (self.batch_pairs * self.world_size)

    def step_batches(self, step: int) -> list[Batch]:
        """This rank's `grad_accum` micro-batches of step `step` (0-based)."""
        parts = self.grad_accum * self.world_size
        idx = step_pairs(len(self.data.train), self.batch_pairs * parts, step, self.seed)
        ref = None
        if self.objective.needs_reference:
            if self.reference is None:
                raise RuntimeError(f"objective {self.objective.objective}: the reference log-probabilities are "
                                   f"computed before step 1")
            ref = reference_rows(self.reference, idx)
        collated = collate_pairs([self.data.train[i] for i in idx], self.pad_id, self.data.max_length,
                                 pad_to=self.data.max_length)
        # every rank collates the global step (its pairs' and NLL tokens' counts are the means'
        # denominators) and keeps its own micro-batches of it
        return pair_micro_batches(collated, self.objective, ref, parts)[self.rank::self.world_size]
