"""The benchmark suite's result files and table cells, shared by every scenario and the report.

One CSV format (machine details as leading `# machine.<key>: <value>` comment lines, then the
table; `read_csv` skips them, `read_csv_machine` reads them), JSON documents, one number parser,
one cell formatter and one Markdown table builder. Below the scenarios and the report: this module
imports nothing of `bench` (tests/test_imports.py checks the graph).
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path


# ---------------------------------------------------------------- numbers and Markdown
def number(v) -> float:
    """`v` as a float (numbers and numeric text, as CSVs read back); NaN for None, "" or anything else."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def fmt(v, digits: int = 2, *, missing: str = "-", parse: bool = False) -> str:
    """One table cell. By default: None is `missing`; a float has `digits` decimals (NaN and inf as
    "nan" and "inf"); anything else is str(v) (an int stays whole).
    parse=True, for cells whose values were read back from a CSV (text) or may be NaN: whatever
    `number` reads as a number is one (an int gets `digits` decimals too, "1.5" is 1.5), NaN, None, ""
    and "nan" are `missing`, other text is itself; a magnitude of 1e5 or more, or under 10**-digits,
    is given to 3 significant digits (1.23e+06, 4.5e-05) so it keeps its size in a narrow column."""
    if not parse:
        if v is None:
            return missing
        if isinstance(v, float):
            return f"{v:.{digits}f}" if math.isfinite(v) else str(v)
        return str(v)
    x = number(v)
    if math.isnan(x):
        return missing if v is None or isinstance(v, float) or v in ("", "nan") else str(v)
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 10 ** -digits):
        return f"{x:.3g}"
    return f"{x:.{digits}f}"


def md_table(rows: list, columns: list[str], digits: dict[str, int] | None = None) -> list[str]:
    """A Markdown table's lines: a header of `columns`, then one line per row. A row is a dict (its
    cells are fmt(row[column], digits.get(column, 2)), a missing key "-") or a list of cells already
    written (each str()'d, in `columns`' order)."""
    digits = digits or {}

    def cells(r) -> list[str]:
        if isinstance(r, dict):
            return [fmt(r.get(c), digits.get(c, 2)) for c in columns]
        return [str(c) for c in r]

    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + \
           ["| " + " | ".join(cells(r)) + " |" for r in rows]


def machine_lines(machine: dict) -> list[str]:
    """The machine's main details as a two-column Markdown table."""
    keys = ["gpu", "gpu_count", "gpu_memory_gib", "driver", "cuda_runtime", "torch", "transformers", "cpu",
            "cpu_cores_physical", "cpu_cores_logical", "ram_total_gib", "torch_threads", "hostname"]
    return ["| machine | |", "|---|---|"] + [f"| {k} | {machine.get(k)} |" for k in keys if k in machine]


# ---------------------------------------------------------------- files
def machine_of(results: list[dict]) -> dict:
    """The machine details the first result carries; this machine's where none does."""
    return next((r["machine"] for r in results if r.get("machine")), {}) or _local_machine()


def _local_machine() -> dict:
    from ..telemetry.machine import machine_info         # nvidia-smi and /proc: only when a file needs it
    return machine_info()


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, default=float))


def write_csv(path: Path, rows: list[dict], columns: list[str] | None = None, machine: dict | None = None) -> Path:
    """`rows` under `columns` (default: every key of the rows, in first-seen order; keys not in
    `columns` are left out, None is an empty cell), after `machine`'s details (default or empty:
    this machine's) as `# machine.<key>: <value>` lines."""
    path = Path(path)
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    machine = machine or _local_machine()
    with path.open("w", newline="") as fh:
        for k, v in machine.items():      # one line each: a value with line breaks would end the comments
            fh.write(f"# machine.{k}: {' / '.join(str(v).splitlines())}\n")
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return path


def read_csv(path: Path) -> list[dict]:
    """A CSV `write_csv` wrote, as rows of text (the machine lines skipped)."""
    with Path(path).open(newline="") as fh:
        return list(csv.DictReader(line for line in fh if not line.startswith("#")))


def read_csv_machine(path: Path) -> dict:
    """The machine details at the head of a CSV `write_csv` wrote."""
    out = {}
    with Path(path).open() as fh:
        for line in fh:
            if not line.startswith("# machine."):
                break
            k, _, v = line[len("# machine."):].rstrip("\n").partition(": ")
            out[k] = v
    return out
