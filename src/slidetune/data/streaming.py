"""A streamed source -> a token file in the cache -> memory-mapped windows (token_arrays.py).

The records come a chunk at a time (`StreamingSource.chunks`); each chunk is tokenized
(tokenization.py, EOS after every document) and its ids appended to ``stream-<key>.bin`` (uint32).
Once complete the file is renamed into place and trained on like any pre-tokenized ``.bin``: windows
of seq_len+1 tokens, documents ending at EOS, the held-out split the tail, batch k a function of
(seed, k). RAM holds one chunk, never the corpus. The file is also the cache: its key (tokenizer,
data files, mask_prompt) finds it on the next run, which then reads no record.

A token file stores no target mask, so every token is trained on: prompts cannot be masked here.
Streaming prompt/completion, alpaca or chat data therefore asks for ``--mask-prompt false``.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .config import DataConfig
from .errors import DataError
from .hf_datasets import StreamingSource
from .token_arrays import TokenArrayDataset, build_token_datasets
from .token_cache import cache_root, examples_key, tokenizer_fingerprint
from .tokenization import special_ids, tokenize_examples

log = logging.getLogger(__name__)


def token_file(source: StreamingSource, tokenizer: Any, cfg: DataConfig) -> Path:
    """The token file of ``source`` under ``cfg``'s cache (written on the first run)."""
    root = cache_root(cfg.cache_dir)
    if root is None:
        raise DataError(f"{source.name}: streaming writes its tokens to a file in the cache; --data-cache-dir "
                        f"off leaves it nowhere to go: give a directory (--data-cache-dir DIR)")
    key, _ = examples_key([], f"{tokenizer_fingerprint(tokenizer)}\x00{source.fingerprint}", cfg.mask_prompt)
    file = root / f"stream-{key}.bin"
    if file.is_file():
        log.info("%s: tokens read from the cache %s", source.name, file)
        return file
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f"{file.stem}.{os.getpid()}.tmp")
    n_examples = n_tokens = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in source.chunks():
                for ex in tokenize_examples(chunk, tokenizer, cfg.mask_prompt, source.name):
                    np.asarray(ex.ids, dtype=np.uint32).tofile(f)
                    n_tokens += len(ex.ids)
                n_examples += len(chunk)
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)      # a bad record or an interrupt leaves no partial file
    print(f"note: {source.name}: streamed {n_examples:,} examples ({n_tokens:,} tokens) into {file}; a "
          f"later run with the same data and tokenizer reads it instead", file=sys.stderr)
    return file


def build_streaming(source: StreamingSource, cfg: DataConfig, tokenizer: Any, min_rows: int,
                    vocab_size: int | None) -> tuple[TokenArrayDataset, TokenArrayDataset]:
    """(train, heldout) windows of a streamed source; with ``source.eval_source`` the held-out split
    is empty here and the caller evaluates that instead."""
    if cfg.mask_prompt and source.format != "text":
        raise DataError(f"{source.name}: streamed '{source.format}' data is tokenized into a token file, which "
                        f"keeps no prompt mask; train on the prompts too (--mask-prompt false) or read it "
                        f"whole (--data-streaming off)")
    _, eos = special_ids(tokenizer, source.name)
    file = token_file(source, tokenizer, cfg)
    fraction = 0.0 if source.eval_source is not None else cfg.heldout_fraction
    return build_token_datasets(str(file), cfg.seq_len, "uint32", fraction, eos_id=eos,
                                document_mask=cfg.packing == "masked", min_rows=min_rows, vocab_size=vocab_size)
