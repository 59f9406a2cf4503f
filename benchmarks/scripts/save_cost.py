"""What each checkpoint cost the step loop, read from training runs' metrics.csv and saves.jsonl.

    python benchmarks/scripts/save_cost.py RUN_DIR [RUN_DIR ...]

For every save in a run's saves.jsonl (periodic and end-of-run): its mode and timings (save_s,
blocked_s, written_s, held_s: checkpoint/saver.py), and its cost to the steps, the sum of
(step_s - the run's median step_s) over the steps from the save's step to the step before the
next save (a blocking save's wait lands in the step after it; an asynchronous save's in the
updates of the steps that follow it). The median is over steps 2 and later (step 1 compiles and
warms up). With several runs, whether their losses and gradient norms match in every digit (an
A/B of --async-save must train the same model).
"""
from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path


def step_rows(run: Path) -> dict[int, dict]:
    with open(run / "metrics.csv") as f:
        return {int(r["step"]): r for r in csv.DictReader(f) if r.get("loss")}


def saves(run: Path) -> list[dict]:
    path = run / "saves.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def save_costs(run: Path) -> tuple[float, list[dict]]:
    """(median step_s, one dict a save with its timings and `extra_s` over its window of steps)."""
    rows = step_rows(run)
    step_s = {s: float(r["step_s"]) for s, r in rows.items()}
    median = statistics.median(v for s, v in step_s.items() if s >= 2)
    out, records = [], saves(run)
    for k, rec in enumerate(records):
        start = rec["step"]
        stop = records[k + 1]["step"] if k + 1 < len(records) else max(step_s) + 1
        window = [s for s in step_s if start <= s < stop]
        extra = sum(step_s[s] - median for s in window)
        at_end = start >= max(step_s)         # the end-of-run save: after the last step, in no step's time
        out.append({**rec, "window": "end of run" if at_end else f"{min(window)}-{max(window)}",
                    "extra_s": None if at_end else extra})
    return median, out


def fmt(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def streams(record: dict) -> str:
    """Each tensor stream's seconds to its last byte (saves.jsonl's streams_s), or '-'."""
    times = record.get("streams_s") or {}
    return ", ".join(f"{name.removesuffix('.safetensors')} {s:.1f}" for name, s in times.items()) or "-"


def report(runs: list[Path]) -> str:
    lines = ["| run | save at step | mode | save_s | blocked_s | written_s | held_s | steps | extra step_s "
             "| streams (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    medians = []
    for run in runs:
        median, costs = save_costs(run)
        medians.append(f"{run.name}: median step_s {median:.3f} s")
        for c in costs:
            lines.append(f"| {run.name} | {c['step']} | {c['mode']} | {fmt(c['save_s'])} | {fmt(c['blocked_s'], 2)} "
                         f"| {fmt(c.get('written_s'))} | {fmt(c.get('held_s'))} | {c['window']} | {fmt(c['extra_s'])} "
                         f"| {streams(c)} |")
    lines += ["", *medians]
    if len(runs) > 1:
        tables = [step_rows(r) for r in runs]
        common = sorted(set.intersection(*(set(t) for t in tables)))
        same = all(len({(t[s]["loss"], t[s]["grad_norm"]) for t in tables}) == 1 for s in common)
        lines.append(f"losses and grad norms of {len(common)} common steps identical in every digit: "
                     f"{same and bool(common)}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(report([Path(a) for a in sys.argv[1:]]))
