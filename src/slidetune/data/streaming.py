"""A streamed source -> token files in the cache -> memory-mapped windows (token_arrays.py).

The records come a chunk at a time (`StreamingSource.chunks`); each chunk is tokenized
(tokenization.py: BOS/EOS and the prompt mask as for data read whole) and appended to
``stream-<key>.bin`` (uint32 ids) and ``stream-<key>.targets`` (uint8, 1 where the token is a
training target). Once complete both are renamed into place and trained on like a pre-tokenized
``.bin``: windows of seq_len+1 tokens, documents ending at EOS, the held-out split the tail, batch k
a function of (seed, k); `MaskedTokenArrayDataset` reads each window's targets from the second
file. RAM holds one chunk, never the corpus. The files are also the cache: their key (tokenizer,
data files, mask_prompt) finds them on the next run, which then reads no record.

A cache is only a cache (as token_cache.py's entries): ``stream-<key>.json`` records the token count
and an xxh3-128 of each file, hashed chunk by chunk as the chunks are written (no second pass). An
entry is checked whole when it is opened; one that is cut, altered, lacks a file or its record, or
cannot be read is deleted with a note naming it and the source streamed and tokenized again.

Windows are not dropped for holding no target (a long prompt filling one): the loss of a step is
normalized by all of its target tokens, so such a window only adds none.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..atomic_write import write_atomically
from .config import DataConfig
from .errors import DataError
from .hf_datasets import StreamingSource
from .token_arrays import TokenArrayDataset, build_token_datasets
from .token_cache import cache_root, discard_entry, examples_key, tokenizer_fingerprint
from .chat_template import load_chat_template
from .tokenization import special_ids, tokenize_examples

log = logging.getLogger(__name__)

# Bytes read at a time by the check on open: bounded RAM (a bytearray reused, no memory map whose
# pages would count in RSS) whatever the corpus' size, and large enough that a read call costs nothing
CHECK_CHUNK_BYTES = 16 * 2**20


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


def _record_path(file: Path) -> Path:
    return file.with_suffix(".json")


def _file_digest(path: Path) -> str:
    """xxh3-128 of a file's bytes, read `CHECK_CHUNK_BYTES` at a time."""
    import xxhash
    h, buf = xxhash.xxh3_128(), bytearray(CHECK_CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _check(file: Path) -> str:
    """An empty string when the entry at ``file`` (its .bin, .targets and .json) checks out, else
    what is wrong.

    The whole entry is hashed here, one pass a run, rather than each chunk lazily as windows read it:
    reading and hashing ran at ~4.9 GB/s from the page cache on this 2-core VM (a cold disk bounds it
    at its read rate, ~1 GB/s), some 1000x (200x) the 5 bytes a token at which the entry was made
    (~0.8M tokens/s tokenized on the same 2 cores with test_hub_ids' tokenizer, before reading the
    records), so the check costs well under 1% of a rebuild. And damage is found before the first
    step, where the entry can still be rebuilt, not hours in at the window that holds it, where the
    run could only stop. The pages it reads are those the token-id check reads next."""
    targets, record_file = file.with_suffix(".targets"), _record_path(file)
    if not record_file.is_file():
        return f"{record_file.name} is missing (an older slidetune wrote it, or it was removed)"
    try:
        record = json.loads(record_file.read_text())
        n, digests = int(record["tokens"]), (record["ids_xxh3_128"], record["targets_xxh3_128"])
    # a garbled or cut record: JSONDecodeError, KeyError, TypeError, ValueError
    except Exception as e:  # noqa: BLE001
        return f"{record_file.name} cannot be read: {type(e).__name__}: {e}"
    try:
        for path, itemsize, digest in ((file, 4, digests[0]), (targets, 1, digests[1])):
            size = path.stat().st_size
            if size != n * itemsize:
                return f"{path.name} holds {size:,} bytes, not the {n * itemsize:,} of its {n:,} tokens"
            if _file_digest(path) != digest:
                return f"{path.name} does not match the digest stored with it"
    # a missing .targets (FileNotFoundError names it), a read error: the entry cannot be trusted either way
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


def _discard(file: Path, problem: str, source_name: str) -> None:
    """Delete a damaged entry with a note naming it: the .bin first, as it marks an entry complete."""
    discard_entry((file, file.with_suffix(".targets"), _record_path(file)),
                  f"streamed token cache entry {file} discarded ({problem}): streaming {source_name} and "
                  f"tokenizing it again")


def _joined(lists: list[list[int]], dtype: type) -> np.ndarray:
    """One chunk's examples as one array: written and hashed in one call each."""
    return np.concatenate([np.asarray(x, dtype=dtype) for x in lists]) if lists else np.zeros(0, dtype=dtype)


def _write(file: Path, source: StreamingSource, tokenizer: Any, cfg: DataConfig, template: str | None) -> None:
    """Tokenize ``source`` a chunk at a time into ``file`` and its .targets, hashing each chunk's bytes
    as they are written, then place the record and the files: the .targets, the .json
    (write_atomically), the .bin last, as it marks completion. The two data files are renamed by hand,
    not through write_atomically: they are filled while the source is read, and an OSError of reading
    it must not be reported as one of writing them."""
    import xxhash
    pid = os.getpid()
    tmp, tmp_targets = file.with_name(f"{file.stem}.{pid}.tmp"), file.with_name(f"{file.stem}.{pid}.targets.tmp")
    ids_hash, targets_hash = xxhash.xxh3_128(), xxhash.xxh3_128()
    n_examples = n_tokens = 0
    try:
        with open(tmp, "wb") as f, open(tmp_targets, "wb") as t:
            for chunk in source.chunks():
                tokenized = tokenize_examples(chunk, tokenizer, cfg.mask_prompt, source.name, template)
                ids = _joined([ex.ids for ex in tokenized], np.uint32)              # [chunk T]
                targets = _joined([ex.targets for ex in tokenized], np.uint8)       # [chunk T]
                ids.tofile(f)
                targets.tofile(t)
                ids_hash.update(ids)
                targets_hash.update(targets)
                n_tokens += ids.shape[0]
                n_examples += len(chunk)
        record = {"tokens": n_tokens, "examples": n_examples, "ids_xxh3_128": ids_hash.hexdigest(),
                  "targets_xxh3_128": targets_hash.hexdigest()}
        os.replace(tmp_targets, file.with_suffix(".targets"))
        write_atomically(_record_path(file), lambda p: p.write_text(json.dumps(record) + "\n"),
                         tmp=file.with_name(f"{file.stem}.{pid}.json.tmp"))
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)      # a bad record or an interrupt leaves no partial file
        tmp_targets.unlink(missing_ok=True)
    print(f"note: {source.name}: streamed {n_examples:,} examples ({n_tokens:,} tokens) into {file}; a "
          f"later run with the same data and tokenizer reads it instead", file=sys.stderr)


def token_file(source: StreamingSource, tokenizer: Any, cfg: DataConfig) -> Path:
    """The token file of ``source`` under ``cfg``'s cache (written on the first run, and again after
    a damaged one is discarded), with its targets (``.targets``) and record (``.json``) next to it."""
    root = cache_root(cfg.cache_dir)
    if root is None:
        raise DataError(f"{source.name}: streaming writes its tokens to a file in the cache; --data-cache-dir "
                        f"off leaves it nowhere to go: give a directory (--data-cache-dir DIR)")
    template = load_chat_template(cfg.chat_template)        # None: the tokenizer's own
    key, _ = examples_key([], f"{tokenizer_fingerprint(tokenizer)}\x00{source.fingerprint}\x00{template or ''}",
                          cfg.mask_prompt)
    file = root / f"stream-{key}.bin"
    if file.is_file():
        problem = _check(file)
        if not problem:
            log.info("%s: tokens read from the cache %s", source.name, file)
            return file
        _discard(file, problem, source.name)
    file.parent.mkdir(parents=True, exist_ok=True)
    _write(file, source, tokenizer, cfg, template)
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
    # the windows name the source they came from (summary.json, the model card); a segment's own
    # messages still name the token file it is read from
    stream = train.stream
    stream.segment_files = stream.segment_files or [str(file)] * len(stream.segments)
    stream.name = source.name
    # [T]; its length was checked against the ids' with the entry's record (_check)
    targets = np.memmap(file.with_suffix(".targets"), dtype=np.uint8, mode="r")
    return _with_targets(train, targets), _with_targets(heldout, targets)
