"""Pre-tokenized corpora read memory-mapped: windows of seq_len+1 tokens, never the whole file.

Accepted sources (``DataConfig.path``), the layouts nanoGPT, litgpt and `datasets` write:

* ``.bin``: raw token ids back to back, no header; the dtype is ``DataConfig.token_dtype``
  (uint16 by default, as nanoGPT's prepare.py writes; uint32 for vocabularies over 65536).
* ``.npy``: a 1-D integer array (numpy's header gives the dtype and length).
* a `datasets.save_to_disk` directory whose features include ``input_ids`` (one document per
  row): its Arrow files are memory-mapped with pyarrow; each row is one document.

The file is opened with ``np.memmap`` / ``np.load(mmap_mode="r")`` / ``pyarrow.memory_map``:
the OS pages in what a batch touches and may drop it again, so host RSS does not grow with
the corpus (benchmarks/scripts/large_corpus_check.py: a 5 GB corpus, a few hundred batches).
Row r is ``stream[r*S : r*S + S + 1]`` (stride S, as `packing.pack`), so every token but the
first is a label once. Documents: in .bin/.npy a token following EOS starts a document (the
format has no other marker); in an Arrow directory each row is one. With packing "masked"
`batch.collate` restarts positions there and masks attention per document.

Every token id is checked against the model's vocabulary when the corpus is opened (`check_ids`):
an id the embedding has no row for would otherwise end the run with an IndexError whenever a
batch first reached it, perhaps hours in. The check reads the file once, in chunks, as unsigned
integers (a negative id becomes a huge one, so one max per chunk finds both kinds).

The held-out split is the last ``heldout_fraction`` of the windows (a contiguous tail:
documents of a token stream cannot be picked without reading it); from
`split.MIN_HELDOUT_EXAMPLES` windows up. Batch k is a pure function of (seed, k) as for
every dataset (sampler.py), so a resumed run lands on the same batch.
"""
from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import DataError
from .split import MIN_HELDOUT_EXAMPLES

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
ARRAY_SUFFIXES = (".bin", ".npy")
TOKEN_COLUMN = "input_ids"


# A read fault maps the whole page-cache folio around it into the process (up to 2 MiB on
# current kernels): without releasing it, RSS grew ~0.8 MiB per 257-token window read, 1 GB over
# 1200 random windows of a 5 GB .bin (kernel 6.18). The pages stay in the page cache.
# Arrow buffers (pyarrow's own memory map) cannot be released this way: there the mapped pages
# count in RSS as the run touches them (file-backed and clean: the kernel reclaims them first).
UNMAP_ALIGN = 2 * 2**20


# Tokens per chunk of the id check: 64 MiB of uint32, a few hundred of them for a 1 B-token
# corpus; small enough that the chunk's pages are released as the scan moves on (_unmap).
CHECK_CHUNK_TOKENS = 2**24


def _unmap(seg: np.ndarray, lo: int, hi: int) -> None:
    """Drop this process's mapping of the folios that held seg[lo:hi] (MADV_DONTNEED on a shared
    file mapping: a later read faults them back from the page cache; nothing is written)."""
    mm = getattr(seg, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return                                        # not an np.memmap (Arrow buffers)
    base = seg.offset % mmap.ALLOCATIONGRANULARITY     # where np.memmap's data starts in its map
    a = (base + lo * seg.itemsize) // UNMAP_ALIGN * UNMAP_ALIGN
    b = min(len(mm), -(-(base + hi * seg.itemsize) // UNMAP_ALIGN) * UNMAP_ALIGN)
    mm.madvise(mmap.MADV_DONTNEED, a, b - a)


@dataclass
class TokenStream:
    """A corpus as one virtual 1-D token array over memory-mapped segments (Arrow chunks are
    several; .bin/.npy one)."""

    segments: list[np.ndarray]           # each [n_i], an integer memmap / zero-copy Arrow view
    name: str
    doc_offsets: np.ndarray | None = None  # [D] int64 token index of each document's start
                                           #   (Arrow rows); None: documents end at EOS
    segment_files: list[str] | None = None  # the file each segment was read from (None: `name`)

    def __post_init__(self) -> None:
        sizes = np.array([s.shape[0] for s in self.segments], dtype=np.int64)
        self.seg_starts = np.concatenate([[0], np.cumsum(sizes)])   # [n_segments + 1]

    def __len__(self) -> int:
        return int(self.seg_starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as int64 (a copy of that range only)."""
        first = int(np.searchsorted(self.seg_starts, start, side="right")) - 1
        parts = []
        while start < stop:
            seg, base = self.segments[first], int(self.seg_starts[first])
            end = min(stop, base + seg.shape[0])
            parts.append(np.asarray(seg[start - base:end - base], dtype=np.int64))
            _unmap(seg, start - base, end - base)
            start, first = end, first + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def check_ids(self, vocab_size: int) -> None:
        """Raise `DataError` at the first token id outside [0, vocab_size): its file, position and
        value. One pass over the memory map in chunks of `CHECK_CHUNK_TOKENS` (nothing of the size
        of the corpus in RAM); benchmarks/NOTES.md "Token-id check" has its rate."""
        for i, seg in enumerate(self.segments):
            # as unsigned integers of the same width a negative id reads as >= 2**(bits-1): above any
            # vocabulary for int32/int64; int8/int16 ids may wrap below a large one, so their min too
            as_unsigned = seg.view(np.dtype(f"u{seg.dtype.itemsize}"))
            wraps = seg.dtype.kind == "i" and 2 ** (8 * seg.dtype.itemsize - 1) <= vocab_size
            for lo in range(0, seg.shape[0], CHECK_CHUNK_TOKENS):
                hi = min(seg.shape[0], lo + CHECK_CHUNK_TOKENS)
                if int(as_unsigned[lo:hi].max()) >= vocab_size or (wraps and int(seg[lo:hi].min()) < 0):
                    chunk = seg[lo:hi]
                    at = lo + int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
                    raise self._bad_id(i, at, int(seg[at]), vocab_size)
                _unmap(seg, lo, hi)

    def _bad_id(self, segment: int, at: int, value: int, vocab_size: int) -> DataError:
        index = int(self.seg_starts[segment]) + at
        file = self.segment_files[segment] if self.segment_files else self.name
        where = f"token {index:,} (0-based) of {len(self):,}"
        if self.doc_offsets is not None:
            row = int(np.searchsorted(self.doc_offsets, index, side="right")) - 1
            where += f", row {row} token {index - int(self.doc_offsets[row])}"
        what = "negative" if value < 0 else f"not below the model's vocabulary size {vocab_size}"
        return DataError(f"{file}: token id {value} at {where} is {what}: the model has ids 0..{vocab_size - 1}; "
                         f"was the corpus tokenized for another model"
                         + (f", or written with another --token-dtype than {self.segments[0].dtype}?"
                            if file.lower().endswith(".bin") else "?"))

    def doc_starts(self, start: int, ids: np.ndarray, eos_id: int | None) -> np.ndarray | None:
        """[L] bool for tokens [start, start+L): True where a document begins (None: unknown)."""
        if self.doc_offsets is not None:
            first = np.zeros(ids.shape[0], dtype=bool)
            lo, hi = np.searchsorted(self.doc_offsets, [start, start + ids.shape[0]])
            first[self.doc_offsets[lo:hi] - start] = True
            return first
        if eos_id is None:
            return None
        first = np.zeros(ids.shape[0], dtype=bool)
        first[1:] = ids[:-1] == eos_id
        return first


@dataclass
class TokenArrayDataset:
    """Windows ``first_window .. first_window + num_windows - 1`` of a `TokenStream`: the
    `TokenDataset` interface that `batch.collate` and `BatchSampler` use, without the tokens
    in RAM."""

    stream: TokenStream
    first_window: int
    num_windows: int
    seq_len: int
    eos_id: int | None
    document_mask: bool
    split: str = "train"
    packed: bool = True
    format: str = "tokens"
    parts: tuple = ()           # one source: a mixture (mixture.py) mixes record sources only

    @property
    def source(self) -> str:
        return self.stream.name

    def __len__(self) -> int:
        return self.num_windows

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row ``index`` as (ids [S+1] int64, targets [S+1] bool (all), doc_starts [S+1] or None)."""
        if not 0 <= index < self.num_windows:
            raise IndexError(f"row {index} out of range for the {self.split} split of {self.num_windows} rows")
        start = (self.first_window + index) * self.seq_len
        ids = self.stream.read(start, start + self.seq_len + 1)
        starts = self.stream.doc_starts(start, ids, self.eos_id)
        return (torch.from_numpy(ids), torch.ones(ids.shape[0], dtype=torch.bool),
                None if starts is None else torch.from_numpy(starts))

    @property
    def num_input_tokens(self) -> int:
        return self.num_windows * self.seq_len

    def __repr__(self) -> str:
        return (f"TokenArrayDataset(split={self.split!r}, rows={len(self)}, seq_len={self.seq_len}, "
                f"document_mask={self.document_mask}, tokens={len(self.stream)}, source={self.source!r})")


# ------------------------------------------------------------------ opening the formats

def is_token_source(path: str | None) -> bool:
    """A .bin/.npy file, or a save_to_disk directory with an ``input_ids`` feature."""
    if path is None:
        return False
    if os.path.isfile(path):
        return path.lower().endswith(ARRAY_SUFFIXES)
    return os.path.isdir(path) and _arrow_dir(Path(path)) is not None


def _arrow_dir(path: Path) -> Path | None:
    """The split directory holding Arrow files with an input_ids feature (a DatasetDict's
    ``train`` split or its only split), or None for another kind of directory."""
    candidates = [path]
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():
        splits = json.loads(dict_file.read_text()).get("splits", [])
        candidates = [path / s for s in (["train"] if "train" in splits else splits[:1])]
    for d in candidates:
        info = d / "dataset_info.json"
        if info.is_file() and TOKEN_COLUMN in (json.loads(info.read_text()).get("features") or {}):
            return d
    return None


def _open_bin(path: str, token_dtype: str) -> TokenStream:
    dtype = np.dtype(TOKEN_DTYPES[token_dtype])
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {token_dtype} tokens; "
                        f"check --token-dtype (uint16 or uint32, what the file was written with)")
    if size < 2 * dtype.itemsize:
        raise DataError(f"{path}: fewer than 2 tokens; a .bin corpus is token ids back to back")
    return TokenStream([np.memmap(path, dtype=dtype, mode="r")], path)


def _open_npy(path: str) -> TokenStream:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise DataError(f"{path}: not a plain .npy array ({e}); save token ids with np.save") from e
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise DataError(f"{path}: a .npy corpus must be a 1-D integer array of token ids, got shape "
                        f"{arr.shape} dtype {arr.dtype}; flatten it (arr.reshape(-1)) before saving")
    return TokenStream([arr], path)


def _open_arrow(path: str) -> TokenStream:
    try:
        import pyarrow as pa
    except ImportError as e:
        raise DataError(f"{path}: a datasets save_to_disk directory of {TOKEN_COLUMN} is read memory-mapped "
                        f"with pyarrow, which is not installed: pip install pyarrow (or write the token ids "
                        f"as a .bin/.npy file)") from e
    split_dir = _arrow_dir(Path(path))
    state = json.loads((split_dir / "state.json").read_text())
    segments, doc_offsets, files, total = [], [], [], 0
    for entry in state["_data_files"]:
        # save_to_disk writes Arrow IPC streams; a memory map makes the buffers views of the file
        file = str(split_dir / entry["filename"])
        table = pa.ipc.open_stream(pa.memory_map(file)).read_all()
        for chunk in table.column(TOKEN_COLUMN).chunks:
            offsets = chunk.offsets.to_numpy().astype(np.int64)       # [rows + 1]
            values = chunk.flatten().to_numpy(zero_copy_only=True)    # [tokens of this chunk]
            doc_offsets.append(offsets[:-1] - offsets[0] + total)
            segments.append(values)
            files.append(file)
            total += values.shape[0]
    if not segments:
        raise DataError(f"{path}: no rows in its {TOKEN_COLUMN} column")
    return TokenStream(segments, path, np.concatenate(doc_offsets), segment_files=files)


def open_token_stream(path: str, token_dtype: str) -> TokenStream:
    lower = path.lower()
    if lower.endswith(".bin"):
        return _open_bin(path, token_dtype)
    if lower.endswith(".npy"):
        return _open_npy(path)
    return _open_arrow(path)


def build_token_datasets(path: str, seq_len: int, token_dtype: str, heldout_fraction: float,
                         eos_id: int | None, document_mask: bool, min_rows: int = 1,
                         vocab_size: int | None = None) -> tuple[TokenArrayDataset, TokenArrayDataset]:
    """(train, heldout) windows of a pre-tokenized corpus; the held-out split is the tail.
    vocab_size: every id is checked to be below it (`TokenStream.check_ids`); None: not checked."""
    stream = open_token_stream(path, token_dtype)
    # rows overlap by one token (stride seq_len): k rows take k*seq_len + 1 tokens
    need = min_rows * seq_len + 1
    if len(stream) == 0:      # an empty .npy, or Arrow rows without a token (a .bin is refused on opening)
        raise DataError(f"{path}: holds no tokens; a pre-tokenized corpus needs at least seq_len+1 = "
                        f"{seq_len + 1} tokens for one row, {need:,} for one batch (batch_size={min_rows})")
    n = (len(stream) - 1) // seq_len
    if n < min_rows:
        raise DataError(f"{path}: {len(stream):,} tokens make {n} rows of seq_len+1 = {seq_len + 1} tokens, "
                        f"fewer than batch_size={min_rows} (which needs {need:,} tokens); use a smaller "
                        f"--seq-len or --batch-size")
    if vocab_size is not None:
        stream.check_ids(vocab_size)
    n_heldout = 0
    if heldout_fraction > 0 and n >= MIN_HELDOUT_EXAMPLES:
        n_heldout = min(max(int(n * heldout_fraction + 0.5), 1), n - min_rows)
    info = dict(seq_len=seq_len, eos_id=eos_id, document_mask=document_mask)
    train = TokenArrayDataset(stream, 0, n - n_heldout, split="train", **info)
    heldout = TokenArrayDataset(stream, n - n_heldout, n_heldout, split="heldout", **info)
    return train, heldout
