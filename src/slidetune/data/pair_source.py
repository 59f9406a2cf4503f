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
from typing import Any, Iterator

import torch

from .config import DataConfig
from .errors import DataError
from .formats import JSONL_SUFFIXES, ColumnMap, jsonl_records
from .hf_datasets import EVAL_SPLITS, TRAIN_SPLITS, datasets_records, in_memory_records, is_datasets_path
from .preference import PreferencePair, TokenizedPair, drop_unscored, parse_pair, tokenize_pair
from .split import plan_heldout


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


def build_pairs(cfg: DataConfig, tokenizer: Any, records: Any = None, eval_records: Any = None) -> PairData:
    """The run's pairs: `cfg.path`'s (or `records`'), tokenized and cut to `cfg.seq_len` tokens a
    sequence, the held-out ones `cfg.eval_path`'s (or `eval_records'`) or drawn from them
    (`cfg.heldout_fraction`, `cfg.seed`)."""
    columns = cfg.column_map
    if records is not None:
        name, pairs = "<records given in Python>", pairs_in_memory(records, columns)
    elif cfg.path is None:
        raise DataError("a preference objective needs preference data: --data FILE with prompt, chosen and "
                        "rejected fields (the built-in corpus is plain text)")
    else:
        name, pairs = cfg.path, read_pairs(cfg.path, cfg.split, cfg.subset, columns)
    max_length = cfg.seq_len

    def tokenized(items: list[PreferencePair], source: str) -> list[TokenizedPair]:
        return drop_unscored([tokenize_pair(p, tokenizer, cfg.chat_template) for p in items], max_length, source)
    if eval_records is not None or cfg.eval_path is not None:
        held = (pairs_in_memory(eval_records, columns) if eval_records is not None
                else read_pairs(cfg.eval_path, subset=cfg.subset, columns=columns, for_eval=True))
        train, heldout, note = tokenized(pairs, name), tokenized(held, cfg.eval_path or "eval records"), None
    else:
        train_idx, held_idx, note = plan_heldout(len(pairs), cfg.heldout_fraction, cfg.seed, name)
        train = tokenized([pairs[i] for i in train_idx], name)
        heldout = tokenized([pairs[i] for i in held_idx], name)
    if not train:
        raise DataError(f"{name}: no pair is left to train on once cut to {max_length} tokens (every prompt "
                        f"fills it); raise --seq-len")
    return PairData(name, train, heldout, max_length, note)


def step_pairs(n_pairs: int, batch_pairs: int, step: int, seed: int) -> list[int]:
    """The pair indices of step `step`: epochs of a seeded permutation, `batch_pairs` a step, the
    last partial batch of an epoch dropped (a step always has whole, equally many pairs)."""
    if batch_pairs > n_pairs:
        raise DataError(f"{n_pairs} training pairs cannot fill a batch of {batch_pairs} pairs; lower --batch-size")
    per_epoch = n_pairs // batch_pairs
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(n_pairs, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    return order[k * batch_pairs:(k + 1) * batch_pairs]
