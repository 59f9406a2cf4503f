"""`build_datasets`: config + tokenizer -> (train, held-out) `TokenDataset`s.

Pipeline: read the source (formats.py) -> held-out split over examples (split.py) ->
tokenize each split (tokenization.py) -> pack or pad (packing.py) -> check non-empty.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

from .config import DataConfig
from .corpus import builtin_corpus
from .dataset import TokenDataset
from .errors import DataError
from .formats import Example, Source, read_source, texts_source
from .packing import pack, pad_rows
from .split import heldout_split
from .tokenization import special_ids, tokenize_examples

log = logging.getLogger(__name__)

BUILTIN_NAME = "<builtin corpus>"


def load_source(cfg: DataConfig) -> Source:
    """The untokenized examples of ``cfg.path`` (or of the built-in corpus)."""
    if cfg.path is None:
        return texts_source(builtin_corpus(), BUILTIN_NAME)
    return read_source(cfg.path)


def _build_split(name: str, examples: list[Example], source: Source, cfg: DataConfig,
                 tokenizer: Any) -> TokenDataset:
    info = dict(split=name, source=source.name, format=source.format,
                num_examples=len(examples))
    tokenized = tokenize_examples(examples, tokenizer, cfg.mask_prompt, source.name)
    rows = pack(tokenized, cfg.seq_len) if cfg.packing else pad_rows(tokenized, cfg.seq_len)
    if rows.num_truncated:
        warnings.warn(f"{source.name}: {rows.num_truncated} of {len(examples)} {name} examples are "
                      f"longer than seq_len+1 = {cfg.seq_len + 1} tokens and were truncated (their "
                      f"ends, EOS included, are not trained on)", stacklevel=3)
    if rows.num_dropped and rows.starts.numel():
        warnings.warn(f"{source.name}: {rows.num_dropped} {name} rows have no target token "
                      f"(e.g. a prompt longer than seq_len) and were dropped", stacklevel=3)
    if rows.starts.numel() == 0:
        if cfg.packing:
            detail = (f"{rows.num_stream_tokens} tokens were found, fewer than one sequence of "
                      f"seq_len+1 = {cfg.seq_len + 1} tokens")
            if rows.num_stream_tokens >= cfg.seq_len + 1:
                detail = (f"all {rows.num_dropped} windows of seq_len+1 = {cfg.seq_len + 1} tokens "
                          f"have no target token")
        else:
            detail = (f"{len(examples)} examples ({rows.num_stream_tokens} tokens) were found, and "
                      f"{rows.num_dropped} of them have no target token within seq_len+1 = "
                      f"{cfg.seq_len + 1} tokens")
        hint = "use more data or a smaller seq_len"
        if name == "heldout":
            hint += ", a larger heldout_fraction, or heldout_fraction=0 to skip evaluation"
        raise DataError(f"{source.name}: the {name} split is empty after tokenization: {detail}; "
                        f"{hint}")
    return TokenDataset.from_rows(rows, cfg.seq_len, cfg.packing, **info)


def build_datasets(cfg: DataConfig, tokenizer: Any) -> tuple[TokenDataset, TokenDataset]:
    """(train, heldout) for ``cfg``. The held-out split is empty when heldout_fraction == 0.

    Raises `DataError` (naming the file and 1-based line where it applies) for missing or
    malformed data, and ImportError for a datasets directory without ``datasets`` installed.
    """
    source = load_source(cfg)
    special_ids(tokenizer, source.name)  # fail on a tokenizer without EOS before any work
    train_idx, heldout_idx = heldout_split(len(source.examples), cfg.heldout_fraction, cfg.seed,
                                           source.name)
    train = _build_split("train", [source.examples[i] for i in train_idx], source, cfg, tokenizer)
    if heldout_idx:
        heldout = _build_split("heldout", [source.examples[i] for i in heldout_idx], source, cfg,
                               tokenizer)
    else:
        heldout = TokenDataset.empty(cfg.seq_len, cfg.packing, split="heldout",
                                     source=source.name, format=source.format)
    log.info("data: %r; %r", train, heldout)
    return train, heldout
