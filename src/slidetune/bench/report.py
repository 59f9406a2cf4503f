"""`slidetune report DIR [--compare-seeds]`: a results directory -> report.md + PNG plots.

Checks the directory and hands it to the writer of its kind: a throughput directory
(throughput.json) to scenarios.throughput_report.rewrite_report, a roofline's roofline.json to
scenarios.roofline.rewrite_report, a soak's results.json to scenarios.soak.rewrite_report, the
runtime checks' results.json to runtime_check.rewrite_report, a techniques directory
(techniques.json) to scenarios.techniques.rewrite_report, and any other results.json or
summary.csv (the runs of bench.measure: modes, recompute, head, pipeline) to bench.measure_report:
each scenario's output, `--smoke` or not (tests/test_bench*.py report each smoke run's). The
scenarios are imported here, above them: nothing below report.py imports it.

A directory that cannot be reported raises `ReportError` naming the file (or the directory and
what it lacks): one that does not exist or holds none of these files, a file that is not a JSON
object or lacks what its kind needs, a results list that is empty, and any entry the rendering
cannot read. Nothing is written for a directory refused before rendering.
"""
from __future__ import annotations

import json
from pathlib import Path

from .measure_report import load, write_measure_report


class ReportError(ValueError):
    """A results directory `slidetune report` cannot turn into a report; the message names the file
    (or the directory) and what is wrong with it."""


# What a report is made from, in this order: throughput.json, roofline.json, a soak's results.json
# (refitted from its samples), the runtime checks' results.json, techniques.json, then any other
# results.json and the CSVs derived from it (which may stand alone). What each JSON document must
# hold at its top level: key -> its JSON type ("object", "array", "array of objects", "number"); a
# plain results.json needs no key (its CSVs may hold the tables), but what it has must be of these
# types.
REPORT_FILES = ("throughput.json", "roofline.json", "results.json", "techniques.json", "summary.csv")
_REQUIRED = {
    "throughput.json": {"runs": "array of objects", "rows": "array of objects"},
    "roofline.json": {"spec": "object"},
    "runtime": {"results": "array of objects", "checks": "object"},
    "techniques.json": {"settings": "object", "names": "array", "rows": "array of objects", "probes": "array of objects",
                        "machine": "object", "searches": "object", "same_batch": "number"},
    "soak": {"args": "object", "target_pct": "number", "results": "array of objects"},
}
_OPTIONAL = {"results": "array of objects", "machine": "object", "args": "object"}


def _json_type(v) -> str:
    if isinstance(v, dict):
        return "object"
    if isinstance(v, list):
        return "array of objects" if all(isinstance(x, dict) for x in v) else "array"
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    return "number" if isinstance(v, (int, float)) else "string"


def _is(v, kind: str) -> bool:
    found = _json_type(v)
    return found == kind or (kind == "array" and found == "array of objects")


def read_document(path: Path, required: dict[str, str] | None = None,
                  optional: dict[str, str] | None = None) -> dict:
    """A results JSON file as a dict, checked: valid UTF-8 JSON, an object, the `required` keys
    present and these and the `optional` ones of their type; else `ReportError` naming the file."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ReportError(f"{path}: cannot be read: {e.strerror or e}") from e
    except ValueError as e:                      # invalid JSON, or not UTF-8
        raise ReportError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise ReportError(f"{path}: expected a JSON object, as `slidetune bench` writes it, got a JSON "
                          f"{_json_type(doc).split(' ')[0]}")
    missing = [k for k in required or {} if k not in doc]
    if missing:
        raise ReportError(f"{path}: lacks {', '.join(repr(k) for k in missing)} (a {path.name} as `slidetune bench` "
                          f"writes it has {', '.join(repr(k) for k in required)})")
    for key, kind in {**(optional or {}), **(required or {})}.items():
        if key in doc and not _is(doc[key], kind):
            raise ReportError(f"{path}: {key!r} must be a JSON {kind}, got a JSON {_json_type(doc[key])}")
    return doc


def _scenario(results: dict) -> str | None:
    """The scenario that wrote a results.json: its "scenario" key, or "runtime" for the runtime
    checks' (whose older files have none, but "checks")."""
    return results.get("scenario") or ("runtime" if "checks" in results else None)


def _report_source(out_dir: Path) -> tuple[Path, dict | None]:
    """The file the report of `out_dir` is made from and its checked document (None: the CSVs)."""
    if not out_dir.exists():
        raise ReportError(f"{out_dir}: no such directory")
    if not out_dir.is_dir():
        raise ReportError(f"{out_dir}: not a directory (slidetune report takes the directory a `slidetune bench` "
                          f"scenario wrote)")
    for name in ("throughput.json", "roofline.json"):
        if (out_dir / name).exists():
            return out_dir / name, read_document(out_dir / name, _REQUIRED[name])
    results = read_document(out_dir / "results.json", optional=_OPTIONAL) if (out_dir / "results.json").exists() \
        else None
    if results is not None and _scenario(results) in ("soak", "runtime"):
        return out_dir / "results.json", read_document(out_dir / "results.json", _REQUIRED[_scenario(results)])
    if (out_dir / "techniques.json").exists():
        return out_dir / "techniques.json", read_document(out_dir / "techniques.json", _REQUIRED["techniques.json"])
    if results is not None:
        return out_dir / "results.json", results
    if (out_dir / "summary.csv").exists():
        return out_dir / "summary.csv", None
    raise ReportError(f"{out_dir}: no benchmark results in it: none of {', '.join(REPORT_FILES)} (what "
                      f"`slidetune bench SCENARIO --out {out_dir}` writes)")


def write_report(out_dir: Path, compare_seeds: bool = False) -> Path:
    """report.md (and the plots) of a results directory; `ReportError` naming the file when it cannot."""
    out_dir = Path(out_dir)
    source, doc = _report_source(out_dir)
    try:
        return _write_report(out_dir, source, doc, compare_seeds)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
        if isinstance(e, ReportError):
            raise
        # an entry of another shape than this version writes (an older file, or one edited by hand)
        what = f"missing key {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise ReportError(f"{source}: cannot be reported, an entry is not what `slidetune bench` writes "
                          f"({what}); SLIDETUNE_TRACEBACK=1 shows where") from e


def _write_report(out_dir: Path, source: Path, doc: dict | None, compare_seeds: bool) -> Path:
    if source.name == "throughput.json":             # its own format: rows per model, batch and system
        from .scenarios.throughput_report import rewrite_report as rewrite_throughput
        return rewrite_throughput(out_dir)
    if source.name == "roofline.json":               # one floor measurement: its terms
        from .scenarios.roofline import rewrite_report as rewrite_roofline
        return rewrite_roofline(out_dir)
    if source.name == "results.json" and _scenario(doc) == "soak":
        from .scenarios.soak import rewrite_report as rewrite_soak      # its own format: refit its samples
        return rewrite_soak(out_dir)
    if source.name == "results.json" and _scenario(doc) == "runtime":
        from .runtime_check import rewrite_report as rewrite_runtime    # its own table and checks
        return rewrite_runtime(out_dir)
    if source.name == "techniques.json":             # its own format: rows per technique and regime
        from .scenarios.techniques import rewrite_report
        return rewrite_report(out_dir, compare_seeds=compare_seeds)
    data = load(out_dir)
    if not data["summary"]:
        raise ReportError(f"{source}: no configuration to report: "
                          + ("no rows" if source.suffix == ".csv" else
                             "its 'results' are empty or absent, and there is no summary.csv beside it"))
    return write_measure_report(out_dir, data, compare_seeds)


def main_report(dir: Path, compare_seeds: bool = False) -> int:  # noqa: A002 - the CLI's name
    path = write_report(Path(dir), compare_seeds=compare_seeds)
    print(path)
    return 0
