"""What the scenarios of bench.measure runs share: sizes, isolated runs, and the result files.

Files written into a scenario's output directory (machine details in every one: JSON
under "machine", CSVs as leading `# machine.<key>: <value>` comment lines, read them
with bench.output.read_csv):
  results.json          scenario, args, machine, every raw result (per step, per span, per memory point)
  steps.csv, layers.csv, memory_timeline.csv, summary.csv, step_timeline.csv: bench.tables
  report.md and the PNGs: bench.measure_report
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..measure import MeasureSpec
from ..measure_report import draw, load, write_measure_report
from ..output import machine_of
from ..runner import run_isolated
from ..tables import write_tables
from ..workload import WORKLOAD_FIELDS, BenchWorkload
from . import SMOKE, add_common_arguments


# ---------------------------------------------------------------- arguments and specs
def out_dir(args, name: str) -> Path:
    d = Path(args.out) if getattr(args, "out", None) else Path("benchmarks/results") / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def ensure_common_arguments(parser, defaults: dict) -> None:
    """Add the common flags with this scenario's defaults unless the caller already did."""
    if "--out" not in parser._option_string_actions:       # noqa: SLF001 - argparse has no public query
        add_common_arguments(parser, **defaults)


def base(args) -> dict:
    """Sizes for MeasureSpec and the runtime device, with --smoke applied."""
    if getattr(args, "smoke", False):
        return dict(SMOKE)
    return dict(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps,
                warmup=args.warmup, device=getattr(args, "device", "auto"))


def make_spec(name: str, b: dict, args, runtime: dict, **over) -> MeasureSpec:
    """A run of the sizes `b` (`base`) and the common flags; `over` sets any workload or MeasureSpec field."""
    workload = BenchWorkload(b["model"], seq_len=b["seq_len"], batch_size=b["batch_size"], steps=b["steps"],
                             warmup=b["warmup"], num_layers=getattr(args, "num_layers", None),
                             gpu_memory_limit_gib=getattr(args, "gpu_memory_limit", None))
    workload = replace(workload, **{k: over.pop(k) for k in WORKLOAD_FIELDS if k in over})
    return MeasureSpec(name=name, workload=workload, runtime=dict(device=b["device"], **runtime), **over)


def run_specs(specs: list[MeasureSpec], tag: str) -> list[dict]:
    results = []
    for spec in specs:
        print(f"[{tag}] {spec.name} ...", flush=True)
        r = run_isolated(spec)
        results.append(r)
        if r.get("status") == "ok":
            print(f"[{tag}] {spec.name}: step {r.get('step_s_mean', float('nan')):.4f} s, gpu peak reserved "
                  f"{r.get('gpu_peak_reserved_gib', 0):.2f} GiB, rss {r.get('cpu_peak_rss_gib', 0):.2f} GiB", flush=True)
        else:
            print(f"[{tag}] {spec.name}: {r.get('status')}: {str(r.get('error'))[:500]}", flush=True)
    return results


def unavailable(spec: MeasureSpec, why: str) -> dict:
    return {"spec": spec.to_dict(), "status": "unavailable", "error": why}


# ---------------------------------------------------------------- files
def write_per_run(d: Path, results: list[dict], machine: dict, baseline: str | None, scenario: str) -> list[Path]:
    """The common CSVs and plots (time breakdown, peaks, memory timeline, per-layer times
    with 95% CIs, step curves and deltas, Pareto, and the Gantt chart of profiled runs) of runs
    in bench.measure's result form, in directory `d`, for scenarios whose own files are other
    tables (throughput, techniques). Returns the PNGs."""
    d.mkdir(parents=True, exist_ok=True)
    write_tables(d, results, machine)
    data = load(d)                      # the tables just written (no results.json here)
    profiled = [r for r in results if r.get("trace_summary")]
    return draw(d, {**data, "doc": {"scenario": scenario, "baseline": baseline, "results": profiled},
                    "machine": machine})


def write_results(out: Path, scenario: str, args, results: list[dict], extra: dict | None = None) -> Path:
    machine = machine_of(results)
    argd = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if isinstance(v, (str, int, float, bool, type(None), Path, list))}
    doc = {"scenario": scenario, "machine": machine, "args": argd, **(extra or {}), "results": results}
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=float))
    write_tables(out, results, machine)
    return out


def finish(out: Path, scenario: str, args, results: list[dict], extra: dict | None = None) -> Path:
    """results.json + CSVs, then report.md + PNGs."""
    write_results(out, scenario, args, results, extra)
    write_measure_report(out, load(out), compare_seeds=getattr(args, "compare_seeds", False))
    return out
