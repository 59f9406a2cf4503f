"""Data sources read through HuggingFace `datasets`: what a TRL or torchtune user hands over.

* a file of ``.parquet``, ``.csv``/``.tsv``, ``.json`` or ``.arrow`` records;
* a directory of such files (``load_dataset(dir)``: the split names come from the file names, or
  from the README's ``configs``, as on the Hub);
* a ``save_to_disk`` directory (``load_from_disk``);
* a Hub dataset id ``org/name``: its snapshot in the local HF cache (models/hub.py), downloaded first
  when not cached and the Hub may be reached, then read as a directory.

Each record is read like a JSONL line (formats.parse_record: ``messages``, ShareGPT's
``conversations``, ``instruction``/``output``, ``prompt``/``completion`` or ``text``); messages name ``<source> row <i>`` (1-based). ``.jsonl`` and
``.txt`` files keep their own readers (formats.py: errors name the file and line) unless streamed.

Streaming (`open_streaming`): ``load_dataset(..., streaming=True)`` gives records one at a time;
`StreamingSource.chunks` hands them on `STREAM_CHUNK_RECORDS` at a time, so the reader never holds the
corpus (streaming.py tokenizes each chunk into a token file). `should_stream` decides "auto".

`datasets` is imported inside the functions that use it (about a second of import time).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..models.hub import HubIdNotCached, datasets_cache_dir, looks_like_hub_id, snapshot_dir
from .errors import DataError
from .formats import JSONL_SUFFIXES, TEXT_SUFFIXES, ColumnMap, Example, Source, check_one_format, parse_record

# file ending -> the `datasets` packaged builder that reads it
BUILDERS = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv", ".json": "json", ".arrow": "arrow",
            ".jsonl": "json", ".ndjson": "json", ".txt": "text", ".text": "text", ".md": "text"}
# what a directory of data files may hold (load_dataset infers the builder from them)
DIRECTORY_SUFFIXES = (".parquet", ".csv", ".tsv", ".json", ".jsonl", ".ndjson", ".arrow")
# Records per chunk of a streamed source: its examples and their tokens are what the reader holds
# (a few MB of text for chat records of a few KB); large enough that a fast tokenizer's batched call
# keeps its threads busy.
STREAM_CHUNK_RECORDS = 4096
# "auto" streams a source whose files exceed this share of the available RAM. Read whole, the build's
# peak is ~44x the file's bytes (a 4.6 MB JSONL of the built-in corpus x4, SmolLM2 tokenizer: +203 MB
# RSS; the str, the Example and the token lists of Python ints): 1/100 keeps it under half the RAM.
STREAM_RAM_SHARE = 1 / 100


def is_save_to_disk_dir(path: str) -> bool:
    p = Path(path)
    return (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file()
                                                   and (p / "dataset_info.json").is_file())


def is_datasets_path(path: str) -> bool:
    """Read through `datasets` (this module) rather than formats.py's own readers."""
    if os.path.isdir(path):
        return True
    if os.path.isfile(path):
        return path.lower().endswith(tuple(BUILDERS)) and not path.lower().endswith(JSONL_SUFFIXES + TEXT_SUFFIXES)
    return looks_like_hub_id(path)


@dataclass
class _Located:
    """Where a source's records are: a save_to_disk directory, or load_dataset arguments."""

    name: str                       # what the user gave
    local: str                      # the file or directory read (a Hub id's snapshot directory)
    from_disk: bool                 # a save_to_disk directory
    builder: str | None = None      # a single file's packaged builder ("parquet", ...)


def _locate(path: str) -> _Located:
    if os.path.isdir(path):
        return _Located(path, path, is_save_to_disk_dir(path))
    if os.path.isfile(path):
        return _Located(path, path, False, BUILDERS[Path(path).suffix.lower()])
    try:
        local = str(snapshot_dir(path, "dataset"))
    except HubIdNotCached as e:
        raise DataError(f"data path {path} does not exist, and as a Hub dataset id: {e}") from None
    return _Located(path, local, is_save_to_disk_dir(local))


# the split read when none is named: the training data's, and an evaluation set's (--eval-data)
TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("validation", "valid", "val", "test", "eval", "train")


def _pick_split(splits: list[str], wanted: str | None, name: str, prefer: tuple[str, ...]) -> str:
    if wanted is not None:
        if wanted not in splits:
            raise DataError(f"{name}: no split {wanted!r} (splits: {', '.join(splits)}); choose one with --data-split")
        return wanted
    for candidate in prefer:
        if candidate in splits:
            return candidate
    if len(splits) == 1:
        return splits[0]
    raise DataError(f"{name}: no {' or '.join(repr(p) for p in prefer)} split and several others "
                    f"({', '.join(splits)}); choose one with --data-split")


def _load(loc: _Located, split: str | None, subset: str | None, streaming: bool,
          prefer: tuple[str, ...] = TRAIN_SPLITS) -> Any:
    """The chosen split as a `datasets.Dataset` (or `IterableDataset` when streaming)."""
    import datasets
    try:
        if loc.from_disk:
            ds = datasets.load_from_disk(loc.local)
        elif loc.builder is not None:
            extra = {"sample_by": "paragraph"} if loc.builder == "text" else {}   # documents at blank lines
            ds = datasets.load_dataset(loc.builder, data_files=loc.local, streaming=streaming,
                                       cache_dir=str(datasets_cache_dir()), **extra)
        else:
            ds = datasets.load_dataset(loc.local, name=subset, streaming=streaming,
                                       cache_dir=str(datasets_cache_dir()))
    except DataError:
        raise
    except Exception as e:    # no data files, a corrupt file, an unknown subset: many types
        how = "datasets.load_from_disk" if loc.from_disk else "datasets.load_dataset"
        raise DataError(f"{loc.name}: cannot read it with {how}: {type(e).__name__}: {e}") from e
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        ds = ds[_pick_split(list(ds.keys()), split, loc.name, prefer)]
    if loc.from_disk and streaming:
        ds = ds.to_iterable_dataset()
    return ds


def datasets_records(path: str, split: str | None = None, subset: str | None = None,
                     prefer: tuple[str, ...] = TRAIN_SPLITS) -> Iterator[tuple[str, dict]]:
    """(where, record) of each row of ``path``'s split (read with `datasets`), where = "path row i"."""
    ds = _load(_locate(path), split, subset, streaming=False, prefer=prefer)
    for i, row in enumerate(ds, start=1):
        yield f"{path} row {i}", dict(row)


def read_datasets_source(path: str, split: str | None = None, subset: str | None = None,
                         prefer: tuple[str, ...] = TRAIN_SPLITS, columns: ColumnMap | None = None) -> Source:
    """All records of ``path``'s split as a `Source` (they are in RAM: see `open_streaming` otherwise).
    Without ``split``: the first of ``prefer`` the data has, else its only split. ``columns``: the
    data's column names (formats.ColumnMap)."""
    loc = _locate(path)
    ds = _load(loc, split, subset, streaming=False, prefer=prefer)
    examples: list[Example] = []
    for i, row in enumerate(ds, start=1):
        examples.append(parse_record(dict(row), f"{path} row {i}", columns))
        if examples[-1].format != examples[0].format:
            check_one_format(examples, path)  # raises, naming both rows
    return Source(path, check_one_format(examples, path), examples)


def is_iterable_dataset(records: Any) -> bool:
    """A `datasets.IterableDataset` (read a chunk at a time through the streaming path)."""
    return type(records).__name__ == "IterableDataset" and hasattr(records, "_ex_iterable")


def in_memory_records(records: Any) -> tuple[str, Iterator[tuple[str, dict]]]:
    """(the source's name, (where, record) of each row) of records handed over in Python
    (`slidetune.train(cfg, train_dataset=...)`): a `datasets.Dataset`, a list of record dicts, or a
    `datasets.IterableDataset` read whole (an evaluation set, preference pairs: both held in RAM);
    messages name the source and the row. A generator is refused: it cannot be read twice."""
    if is_iterable_dataset(records):
        return "<datasets.IterableDataset given in Python>", (
            (f"<datasets.IterableDataset given in Python> row {i}", dict(row)) for i, row in enumerate(records, start=1))
    if not hasattr(records, "__len__"):
        raise DataError(f"train_dataset / eval_dataset: a {type(records).__name__} can be read only once; pass a "
                        f"datasets.Dataset, a datasets.IterableDataset (Dataset.from_generator / "
                        f"IterableDataset.from_generator), a list of records, or files through --data")
    fingerprint = getattr(records, "_fingerprint", None)      # a datasets.Dataset's content hash
    name = (f"<datasets.Dataset of {len(records)} rows, fingerprint {fingerprint}>" if fingerprint
            else f"<{len(records)} records given in Python>")
    return name, ((f"{name} row {i}", dict(row) if not isinstance(row, dict) else row)
                  for i, row in enumerate(records, start=1))


def in_memory_source(records: Any, columns: ColumnMap | None = None) -> Source:
    """Records handed over in Python (in_memory_records), each read like a JSONL line."""
    name, rows = in_memory_records(records)
    examples: list[Example] = []
    for where, row in rows:
        examples.append(parse_record(row, where, columns))
        if examples[-1].format != examples[0].format:
            check_one_format(examples, name)  # raises, naming both rows
    return Source(name, check_one_format(examples, name), examples)


@dataclass
class StreamingSource:
    """A source read one chunk of records at a time (never all of it): see streaming.py."""

    name: str
    dataset: Any          # a datasets.IterableDataset
    fingerprint: str      # identifies the data for the token cache: files, sizes, times; a Hub commit
    format: str = ""      # detected from the first record (`probe`)
    eval_source: Source | None = None
    columns: ColumnMap | None = None      # the data's column names (formats.ColumnMap)

    def probe(self) -> None:
        """Read the first record: a source that is empty or of no known format is refused now."""
        first = next(iter(self.dataset), None)
        if first is None:
            raise DataError(f"{self.name}: no examples found (the source is empty)")
        self.format = parse_record(dict(first), f"{self.name} row 1", self.columns).format

    def chunks(self, size: int | None = None) -> Iterator[list[Example]]:
        """The examples, `STREAM_CHUNK_RECORDS` (or ``size``) at a time, all of one format."""
        size = size or STREAM_CHUNK_RECORDS
        chunk: list[Example] = []
        for i, row in enumerate(self.dataset, start=1):
            ex = parse_record(dict(row), f"{self.name} row {i}", self.columns)
            if ex.format != self.format:
                raise DataError(f"{ex.where}: this record is '{ex.format}' data but row 1 is '{self.format}'; all "
                                f"records of a source must share one format")
            chunk.append(ex)
            if len(chunk) == size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def iterable_source(records: Any, columns: ColumnMap | None = None) -> StreamingSource:
    """A `datasets.IterableDataset` given in Python as a streamed source (tokenized a chunk at a time
    into the cache's token files, never held whole). It names no files to key the cache by, so its
    key is its content: one pass reads every record and hashes it (no tokenizing), then the cache's
    token file of that content is read, or written by a second pass. A resumed run streams it again
    and finds the same file."""
    import json

    import xxhash
    digest, rows = xxhash.xxh3_128(), 0
    for row in records:
        digest.update(json.dumps(dict(row), sort_keys=True, default=str).encode())
        rows += 1
    name = f"<datasets.IterableDataset of {rows} rows given in Python>"
    source = StreamingSource(name, records, f"iterable|{rows}|{digest.hexdigest()}{_columns_key(columns)}",
                             columns=columns)
    source.probe()
    return source


def _columns_key(columns: ColumnMap | None) -> str:
    """A streamed source's token-cache key's part for its column map (it changes what is read)."""
    return "" if columns is None else "|" + ",".join(f"{a}={b}" for a, b in columns.renames)


def _files_fingerprint(local: str) -> str:
    """Each file's path, size and modification time: a changed file changes it."""
    root = Path(local)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return ";".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def open_streaming(path: str, split: str | None = None, subset: str | None = None,
                   columns: ColumnMap | None = None) -> StreamingSource:
    loc = _locate(path)
    ds = _load(loc, split, subset, streaming=True)
    source = StreamingSource(path, ds, f"{loc.local}|{split}|{subset}|{_files_fingerprint(loc.local)}"
                             f"{_columns_key(columns)}", columns=columns)
    source.probe()
    return source


def source_bytes(path: str) -> int:
    """The bytes of a local source's files (0 for a Hub id not resolved yet: its size is unknown)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return 0


def should_stream(path: str, mode: str) -> bool:
    """Whether ``path`` is streamed under DataConfig.streaming ``mode`` (auto: `STREAM_RAM_SHARE`)."""
    if mode != "auto":
        return mode == "on"
    import psutil
    size = source_bytes(path)
    if size == 0 and looks_like_hub_id(path):
        try:
            size = source_bytes(str(snapshot_dir(path, "dataset")))
        except HubIdNotCached:
            return False          # the non-streaming read raises the error that explains
    return size > psutil.virtual_memory().available * STREAM_RAM_SHARE
