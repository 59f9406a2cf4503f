"""`read_source`: a data path -> its untokenized `Source`, by kind.

Local ``.jsonl`` and ``.txt`` files go through formats.py's own readers (errors name the file and
line); every other file, a directory or a Hub dataset id goes through `datasets` (hf_datasets.py).
"""
from __future__ import annotations

import os

from .errors import DataError
from .formats import JSONL_SUFFIXES, TEXT_SUFFIXES, ColumnMap, Source, read_jsonl, read_text
from .hf_datasets import BUILDERS, EVAL_SPLITS, TRAIN_SPLITS, is_datasets_path, read_datasets_source


def read_source(path: str, split: str | None = None, subset: str | None = None,
                for_eval: bool = False, columns: ColumnMap | None = None) -> Source:
    """Read ``path`` (a file, a directory or a Hub dataset id) into a `Source`. ``split`` /
    ``subset``: of a directory or Hub id; without a split, ``for_eval`` prefers a validation or
    test split to train. ``columns``: the records' own column names (formats.ColumnMap)."""
    lower = path.lower()
    if os.path.isfile(path) and lower.endswith(JSONL_SUFFIXES):
        return read_jsonl(path, columns)
    if os.path.isfile(path) and lower.endswith(TEXT_SUFFIXES):
        return read_text(path)
    if is_datasets_path(path):
        return read_datasets_source(path, split, subset, EVAL_SPLITS if for_eval else TRAIN_SPLITS, columns)
    if not os.path.exists(path):
        raise DataError(f"data path {path} does not exist")
    others = sorted(set(BUILDERS) - set(TEXT_SUFFIXES + JSONL_SUFFIXES))
    raise DataError(f"{path}: unknown data file type; expected {', '.join(TEXT_SUFFIXES)} "
                    f"(plain text), {', '.join(JSONL_SUFFIXES)} (JSON lines), {', '.join(others)} (read "
                    f"with datasets), a directory of those or a datasets save_to_disk directory, or a Hub "
                    f"dataset id org/name")
