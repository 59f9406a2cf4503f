"""A streamed source -> token files in the cache -> memory-mapped windows (token_arrays.py).

The records come a chunk at a time (`StreamingSource.chunks`); each chunk is tokenized
(tokenization.py: BOS/EOS and the prompt mask as for data read whole) and appended to
``stream-<key>.bin`` (uint32 ids) and ``stream-<key>.targets`` (uint8, 1 where the token is a
training target). Once complete both are renamed into place and trained on like a pre-tokenized
``.bin``: windows of seq_len+1 tokens, documents ending at EOS, the held-out split the tail, batch k
a function of (seed, k); `MaskedTokenArrayDataset` reads each window's targets from the second
file. RAM holds one chunk, never the corpus. The files are also the cache: their key (tokenizer,
data files, mask_prompt) finds them on the next run, which then reads no record.

Windows are not dropped for holding no target (a long prompt filling one): the loss of a step is
normalized by all of its target tokens, so such a window only adds none.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import DataConfig
from .errors import DataError
from .hf_datasets import StreamingSource
from .token_arrays import TokenArrayDataset, build_token_datasets
from .token_cache import cache_root, examples_key, tokenizer_fingerprint
from .chat_template import load_chat_template
from .tokenization import special_ids, tokenize_examples

log = logging.getLogger(__name__)


@dataclass
class MaskedTokenArrayDataset(TokenArrayDataset):
    """`TokenArrayDataset` windows whose targets come from a memory-mapped mask, not all True."""

    # [T] uint8 memmap, 1 where the token is a training target. Its pages are not released after each
    # read as the ids' are (token_arrays._unmap): 1 B per token touched, clean and file-backed, so the
    # kernel reclaims them first
    targets: np.ndarray | None = None

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row ``index`` as (ids [S+1] int64, targets [S+1] bool, doc_starts [S+1] bool or None)."""
        ids, _, starts = super().window(index)
        assert self.targets is not None
        start = (self.first_window + index) * self.seq_len
        targets = torch.from_numpy(np.array(self.targets[start:start + ids.shape[0]], dtype=bool))
        return ids, targets, starts


def _with_targets(ds: TokenArrayDataset, targets: np.ndarray) -> MaskedTokenArrayDataset:
    return MaskedTokenArrayDataset(**{f.name: getattr(ds, f.name) for f in fields(TokenArrayDataset)},
                                   targets=targets)


def token_file(source: StreamingSource, tokenizer: Any, cfg: DataConfig) -> Path:
    """The token file of ``source`` under ``cfg``'s cache (written on the first run), with its
    targets next to it (``.targets``)."""
    root = cache_root(cfg.cache_dir)
    if root is None:
        raise DataError(f"{source.name}: streaming writes its tokens to a file in the cache; --data-cache-dir "
                        f"off leaves it nowhere to go: give a directory (--data-cache-dir DIR)")
    template = load_chat_template(cfg.chat_template)        # None: the tokenizer's own
    key, _ = examples_key([], f"{tokenizer_fingerprint(tokenizer)}\x00{source.fingerprint}\x00{template or ''}",
                          cfg.mask_prompt)
    file = root / f"stream-{key}.bin"
    if file.is_file() and file.with_suffix(".targets").is_file():
        log.info("%s: tokens read from the cache %s", source.name, file)
        return file
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f"{file.stem}.{os.getpid()}.tmp")
    tmp_targets = file.with_name(f"{file.stem}.{os.getpid()}.targets.tmp")
    n_examples = n_tokens = 0
    try:
        with open(tmp, "wb") as f, open(tmp_targets, "wb") as t:
            for chunk in source.chunks():
                for ex in tokenize_examples(chunk, tokenizer, cfg.mask_prompt, source.name, template):
                    np.asarray(ex.ids, dtype=np.uint32).tofile(f)
                    np.asarray(ex.targets, dtype=np.uint8).tofile(t)
                    n_tokens += len(ex.ids)
                n_examples += len(chunk)
        os.replace(tmp_targets, file.with_suffix(".targets"))   # the targets first: the .bin marks completion
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)      # a bad record or an interrupt leaves no partial file
        tmp_targets.unlink(missing_ok=True)
    print(f"note: {source.name}: streamed {n_examples:,} examples ({n_tokens:,} tokens) into {file}; a "
          f"later run with the same data and tokenizer reads it instead", file=sys.stderr)
    return file


def build_streaming(source: StreamingSource, cfg: DataConfig, tokenizer: Any, min_rows: int,
                    vocab_size: int | None) -> tuple[MaskedTokenArrayDataset, MaskedTokenArrayDataset]:
    """(train, heldout) windows of a streamed source; with ``source.eval_source`` the held-out split
    is empty here and the caller evaluates that instead. A streamed corpus is packed in windows
    (wrapped): best-fit packing of whole examples needs every example's length before the first row."""
    if cfg.packing_strategy == "bfd":
        raise DataError(f"{source.name}: --packing-strategy bfd packs whole examples, which needs them all in "
                        f"memory; a streamed corpus is cut into windows: give --packing-strategy wrapped (or "
                        f"auto), or read it whole with --data-streaming off")
    _, eos = special_ids(tokenizer, source.name)
    file = token_file(source, tokenizer, cfg)
    fraction = 0.0 if source.eval_source is not None else cfg.heldout_fraction
    train, heldout = build_token_datasets(str(file), cfg.seq_len, "uint32", fraction, eos_id=eos,
                                          document_mask=cfg.packing == "masked", min_rows=min_rows,
                                          vocab_size=vocab_size)
    targets = np.memmap(file.with_suffix(".targets"), dtype=np.uint8, mode="r")     # [T]
    if targets.shape[0] != len(train.stream):
        raise DataError(f"{file.with_suffix('.targets')}: {targets.shape[0]} targets for {len(train.stream)} "
                        f"tokens; delete both files to tokenize {source.name} again")
    return _with_targets(train, targets), _with_targets(heldout, targets)
