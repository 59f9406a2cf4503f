"""The one exception the data module raises for bad input data."""
from __future__ import annotations


class DataError(ValueError):
    """A problem with the training data.

    The message always names the source (a file path, or ``<builtin corpus>``) and, where
    the problem sits on one record, its 1-based line (``train.jsonl:12: ...``) or row.
    Subclasses ``ValueError`` so that callers that only know "bad value" still catch it.
    """
