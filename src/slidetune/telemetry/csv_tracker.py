"""metrics.csv, appended row by row, and text.jsonl beside it (the run's own record of its metrics).

Each flush appends the rows logged since the previous one (the cost of a logging step is its own
rows, not the whole file again), and rows already written stay byte for byte as they are. A failed
append (a full disk) cuts the file back to what it held before, so it never ends in half a row, and
the rows stay pending for the next flush. On a resume the file is cut back to the rows up to the
checkpoint's step: a killed run may have logged past its last checkpoint, and the resumed run
logs those steps again. A row cut short by a kill (no end of line) is dropped the same way.
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Callable, Collection, Sequence

from ..atomic_write import write_atomically
from .tracker import Tracker


class CsvTracker(Tracker):
    """`path` (metrics.csv) with `columns`; text goes to text.jsonl in the same directory.

    `resume_step` None starts both files afresh; an int keeps the rows with step <= resume_step
    (and text entries with step <= resume_step), less the rows `drop_at_resume` names. Floats are
    written with 9 significant digits in the `precise` columns (an FP32 value round-trips), 6 elsewhere.
    """

    name = "csv"

    def __init__(self, path: Path, columns: Sequence[str], precise: Collection[str] = (),
                 resume_step: int | None = None, drop_at_resume: Callable[[dict[str, str]], bool] | None = None):
        self.path, self.columns, self.precise = Path(path), list(columns), frozenset(precise)
        self.text_path = self.path.with_name("text.jsonl")
        self._rows: list[str] = []          # formatted rows not yet appended
        self._texts: list[str] = []         # JSON lines not yet appended
        if resume_step is None:
            write_atomically(self.path, lambda tmp: tmp.write_text(self._header(), newline=""))
            self.text_path.unlink(missing_ok=True)
        else:
            self._keep_rows(resume_step, drop_at_resume or (lambda row: False))
            self._keep_texts(resume_step)

    # ------------------------------------------------------------------ logging
    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        unknown = sorted(set(scalars) - set(self.columns))
        if unknown:
            raise ValueError(f"{self.path} has no column for {', '.join(unknown)} (its columns: "
                             f"{', '.join(self.columns)})")
        values = {"step": step, **scalars}
        self._rows.append(self._line([self._fmt(c, values.get(c)) for c in self.columns]))

    def log_text(self, step: int, tag: str, text: str) -> None:
        self._texts.append(json.dumps({"step": step, "tag": tag, "text": text}) + "\n")

    def flush(self) -> None:
        if self._rows:
            _append(self.path, "".join(self._rows))
            self._rows.clear()
        if self._texts:
            _append(self.text_path, "".join(self._texts))
            self._texts.clear()

    def close(self) -> None:
        self.flush()

    # ------------------------------------------------------------------ formatting
    def _header(self) -> str:
        return self._line(self.columns)

    @staticmethod
    def _line(values: list) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\r\n").writerow(values)     # csv's own line end, as DictWriter wrote
        return buf.getvalue()

    def _fmt(self, column: str, value) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:.9g}" if column in self.precise else f"{value:.6g}"
        return str(value)

    # ------------------------------------------------------------------ resume
    def _keep_rows(self, resume_step: int, drop: Callable[[dict[str, str]], bool]) -> None:
        """Cut metrics.csv back to the rows a resume at `resume_step` keeps (see the module docstring)."""
        if not self.path.exists():
            write_atomically(self.path, lambda tmp: tmp.write_text(self._header(), newline=""))
            return
        lines = _whole_lines(self.path)
        header = self._header().encode()
        if not lines or lines[0] != header:
            # an empty file, or one of other columns (an older slidetune): the kept rows under today's header
            rows = [r for r in _dict_rows(self.path, lines) if _step(r, self.path) <= resume_step and not drop(r)]
            text = self._header() + "".join(self._line([r.get(c) or "" for c in self.columns]) for r in rows)
            write_atomically(self.path, lambda tmp: tmp.write_text(text, newline=""))
            return
        kept = [lines[0]]
        for line, row in zip(lines[1:], _dict_rows(self.path, lines)):
            if _step(row, self.path) <= resume_step and not drop(row):
                kept.append(line)
        _cut_back(self.path, lines, kept)

    def _keep_texts(self, resume_step: int) -> None:
        if not self.text_path.exists():
            return
        lines = _whole_lines(self.text_path)
        kept = []
        for i, line in enumerate(lines, 1):
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{self.text_path}: line {i} is not a text entry ({e}); move the file aside "
                                 f"to resume") from None
            if step <= resume_step:
                kept.append(line)
        _cut_back(self.text_path, lines, kept)


def _append(path: Path, text: str) -> None:
    """`text` at the end of `path`; on an OSError the file is cut back to its size before, and the
    error is raised again naming it."""
    size = path.stat().st_size if path.exists() else 0
    try:
        with path.open("a", newline="") as f:
            f.write(text)
    except OSError as e:
        try:
            os.truncate(path, size)
        except OSError:
            pass
        raise OSError(e.errno, f"could not write {path}: {e.strerror or e} (the rows written before are "
                               f"unchanged)") from e


def _whole_lines(path: Path) -> list[bytes]:
    """The lines of `path` with their ends; a last line without one (cut short by a kill) is left out."""
    lines = path.read_bytes().splitlines(keepends=True)
    if lines and not lines[-1].endswith(b"\n"):
        lines.pop()
    return lines


def _dict_rows(path: Path, lines: list[bytes]) -> list[dict[str, str]]:
    """The rows of a CSV file's lines (the first is the header) as dicts, one per line after the header
    (a blank line gives an empty dict: a row with no step)."""
    if not lines:
        return []
    try:
        header, *rows = [next(csv.reader([line.decode("utf-8")]), []) for line in lines]
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path} cannot be read as CSV ({e}); move it aside to resume") from None
    return [dict(zip(header, values)) for values in rows]


def _step(row: dict[str, str], path: Path) -> float:
    try:
        return int(float(row.get("step") or "")) if row.get("step") else float("inf")
    except ValueError:
        raise ValueError(f"{path}: a row's step is {row.get('step')!r}, not a number; move the file aside "
                         f"to resume") from None


def _cut_back(path: Path, lines: list[bytes], kept: list[bytes]) -> None:
    """`path` holding only the `kept` lines: truncated where they are its first lines (the usual case:
    the rows to drop are the last ones), else rewritten as one operation."""
    if kept == lines[:len(kept)]:
        os.truncate(path, sum(len(line) for line in kept))
    else:
        data = b"".join(kept)
        write_atomically(path, lambda tmp: tmp.write_bytes(data))
