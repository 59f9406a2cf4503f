"""What every scenario shares: sizes, isolated runs, and the result files.

Files written into a scenario's output directory (machine details in every one: JSON
under "machine", CSVs as leading `# machine.<key>: <value>` comment lines, read them
with `read_csv`):
  results.json          scenario, args, machine, every raw result (per step, per span, per memory point)
  steps.csv             config, step, warmup, wall_s, loss, GC pauses, allocator events
  layers.csv            config, phase, layer, mean_ms, std_ms, ci95_ms, n (measured steps only)
  memory_timeline.csv   config, point, phase, layer, allocated/reserved/rss mean and std (GiB)
  summary.csv           per config: step time, throughput, peaks, time breakdown

Statistics are over measured (steady-state) steps only; warm-up steps are excluded;
CIs are 95% Student-t intervals of the mean (telemetry.stats.summarize).
"""
from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from ..measure import MeasureSpec
from ..runner import run_isolated
from ...telemetry.stats import summarize

GIB = 2**30

# Smoke sizes: a 3-layer tiny Qwen3 on the CPU, 2 measured steps after 1 warm-up step.
SMOKE = dict(model="tiny-qwen3", seq_len=32, batch_size=1, steps=2, warmup=1, device="cpu")

# Time breakdown categories -> timer phases (GPU stream spans; CPU wall clock on the CPU).
# "optimizer" and "transfer" of slide come from the host timeline (worker threads), so
# they can overlap GPU work; GPU idle = wall - union of all timer spans.
FORWARD_PHASES = ("embed", "forward")
HEAD_PHASES = ("head", "head_backward")          # slide: "head" is the head's forward + backward
BACKWARD_PHASES = ("backward", "embed_backward", "grad_copy")
RECOMPUTE_PHASES = ("recompute",)
TRANSFER_HOST_KEYS = ("upload.upload", "d2h.issue", "host.d2h_wait")
OPTIMIZER_HOST_KEYS = ("host.adamw",)
OPTIMIZER_DEVICE_PHASES = ("optimizer_device",)   # slide, vocab_update=device: on the compute stream
BREAKDOWN = ("forward", "head", "backward", "recompute", "optimizer", "transfer", "gpu_idle")

SUMMARY_COLUMNS = (["config", "status", "error", "model", "mode", "recompute", "head_impl", "num_layers",
                    "seq_len", "batch_size", "n_steps", "step_s_mean", "step_s_std", "step_s_ci95",
                    "tokens_per_s", "model_tflops", "gpu_peak_alloc_gib", "gpu_peak_reserved_gib",
                    "cpu_peak_rss_gib", "head_fwd_ms", "head_bwd_ms"] + [f"t_{k}_s" for k in BREAKDOWN])


# ---------------------------------------------------------------- arguments and specs
def out_dir(args, name: str) -> Path:
    d = Path(args.out) if getattr(args, "out", None) else Path("benchmarks/results") / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def ensure_common_arguments(parser, defaults: dict) -> None:
    """Add the common flags with this scenario's defaults unless the caller already did."""
    from . import add_common_arguments
    if "--out" not in parser._option_string_actions:       # noqa: SLF001 - argparse has no public query
        add_common_arguments(parser, **defaults)


def base(args) -> dict:
    """Sizes for MeasureSpec and the runtime device, with --smoke applied."""
    if getattr(args, "smoke", False):
        return dict(SMOKE)
    return dict(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps,
                warmup=args.warmup, device=getattr(args, "device", "auto"))


def make_spec(name: str, b: dict, args, runtime: dict, **over) -> MeasureSpec:
    kw = dict(model=b["model"], seq_len=b["seq_len"], batch_size=b["batch_size"], steps=b["steps"],
              warmup=b["warmup"], num_layers=getattr(args, "num_layers", None),
              gpu_memory_limit_gib=getattr(args, "gpu_memory_limit", None))
    kw.update(over)
    return MeasureSpec(name=name, runtime=dict(device=b["device"], **runtime), **kw)


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
    return {"spec": asdict(spec), "status": "unavailable", "error": why}


# ---------------------------------------------------------------- derived tables
def measured_steps(r: dict) -> list[dict]:
    return [s for s in r.get("steps", []) if not s.get("warmup")]


def config_name(r: dict) -> str:
    return r.get("spec", {}).get("name", "?")


def step_phase_ms(step: dict) -> dict[tuple[str, int], float]:
    """Sum of span ms per (phase, layer) in one step (a layer may have several spans)."""
    agg: dict[tuple[str, int], float] = defaultdict(float)
    for phase, layer, ms in step.get("spans", []):
        agg[(phase, int(layer))] += ms
    return agg


def layer_rows(r: dict) -> list[dict]:
    steps = measured_steps(r)
    per: dict[tuple[str, int], list[float]] = defaultdict(list)
    for s in steps:
        for (phase, layer), ms in step_phase_ms(s).items():
            if phase == "optimizer_unit":
                phase = "optimizer"                    # per-layer update; layer -1 "optimizer" is the total
            per[(phase, layer)].append(ms)
    rows = []
    for (phase, layer), vals in sorted(per.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        st = summarize(vals)
        rows.append({"config": config_name(r), "phase": phase, "layer": layer, "mean_ms": st.mean,
                     "std_ms": st.std, "ci95_ms": st.ci95, "n": st.n})
    return rows


def memory_rows(r: dict) -> list[dict]:
    steps = [s for s in measured_steps(r) if s.get("memory")]
    if not steps:
        return []
    n = min(len(s["memory"]) for s in steps)
    rows = []
    for k in range(n):
        pts = [s["memory"][k] for s in steps]
        phase, layer = pts[0][0], pts[0][1]
        row = {"config": config_name(r), "point": k, "phase": phase, "layer": layer}
        for j, key in ((2, "allocated"), (3, "reserved"), (4, "rss")):
            st = summarize([p[j] / GIB for p in pts])
            row[f"{key}_gib_mean"] = st.mean
            row[f"{key}_gib_std"] = st.std
        rows.append(row)
    return rows


def breakdown_step(step: dict) -> dict[str, float]:
    """Seconds per category for one step (see BREAKDOWN)."""
    ph = step_phase_ms(step)
    tot = lambda names: sum(ms for (p, _), ms in ph.items() if p in names) / 1e3   # noqa: E731
    host = step.get("host_s") or {}
    out = {"forward": tot(FORWARD_PHASES), "head": tot(HEAD_PHASES), "backward": tot(BACKWARD_PHASES),
           "recompute": tot(RECOMPUTE_PHASES),
           "transfer": sum(host.get(k, 0.0) for k in TRANSFER_HOST_KEYS)}
    host_opt = sum(host.get(k, 0.0) for k in OPTIMIZER_HOST_KEYS)
    out["optimizer"] = ((host_opt if host_opt > 0 else ph.get(("optimizer", -1), 0.0) / 1e3)
                        + tot(OPTIMIZER_DEVICE_PHASES))
    frac = (step.get("overlap") or {}).get("gpu_compute_fraction_of_step")
    wall = step["wall_s"]
    out["gpu_idle"] = wall * (1.0 - frac) if frac is not None else max(0.0, wall - sum(
        out[k] for k in ("forward", "head", "backward", "recompute")))
    return out


def summary_row(r: dict) -> dict:
    spec = r.get("spec", {})
    rt = spec.get("runtime", {})
    row = {c: "" for c in SUMMARY_COLUMNS}
    row.update(config=spec.get("name"), status=r.get("status"), error=(str(r.get("error") or ""))[:200],
               model=spec.get("model"), mode=rt.get("mode"),
               recompute=rt.get("recompute", "all") if rt.get("mode") == "ckpt" else "",
               head_impl=rt.get("head_impl", "chunked"), num_layers=r.get("num_layers", spec.get("num_layers")),
               seq_len=spec.get("seq_len"), batch_size=spec.get("batch_size"))
    if r.get("status") != "ok":
        for k in ("gpu_peak_alloc_gib",):
            if k in r:
                row[k] = r[k]
        return row
    steps = measured_steps(r)
    st = summarize([s["wall_s"] for s in steps])
    row.update(n_steps=st.n, step_s_mean=st.mean, step_s_std=st.std, step_s_ci95=st.ci95,
               tokens_per_s=r.get("tokens_per_s"), model_tflops=r.get("model_tflops"),
               gpu_peak_alloc_gib=r.get("gpu_peak_alloc_gib"), gpu_peak_reserved_gib=r.get("gpu_peak_reserved_gib"),
               cpu_peak_rss_gib=r.get("cpu_peak_rss_gib"))
    bds = [breakdown_step(s) for s in steps]
    for k in BREAKDOWN:
        row[f"t_{k}_s"] = sum(b[k] for b in bds) / len(bds) if bds else ""
    heads = [step_phase_ms(s) for s in steps]
    if heads:
        row["head_fwd_ms"] = sum(h.get(("head", -1), 0.0) for h in heads) / len(heads)
        if any(("head_backward", -1) in h for h in heads):
            row["head_bwd_ms"] = sum(h.get(("head_backward", -1), 0.0) for h in heads) / len(heads)
    return row


STEP_COLUMNS = ["config", "step", "warmup", "wall_s", "loss", "gc_s", "gc_gen2", "alloc_retries", "cuda_mallocs"]


def step_rows(r: dict) -> list[dict]:
    """One row per step; gc_s / gc_gen2: Python's collections inside it (bench.measure.GCPauses),
    alloc_retries / cuda_mallocs: the caching allocator's events in it (empty where not recorded)."""
    return [{"config": config_name(r), "step": s["step"], "warmup": int(bool(s["warmup"])), "wall_s": s["wall_s"],
             "loss": s["loss"], "gc_s": s.get("gc_s"), "gc_gen2": s.get("gc_gen2"),
             "alloc_retries": (s.get("alloc") or {}).get("num_alloc_retries"),
             "cuda_mallocs": (s.get("alloc") or {}).get("num_device_alloc")} for s in r.get("steps", [])]


# ---------------------------------------------------------------- files
def machine_of(results: list[dict]) -> dict:
    return next((r["machine"] for r in results if r.get("machine")), {}) or _local_machine()


def _local_machine() -> dict:
    from ...telemetry.machine import machine_info
    return machine_info()


def write_csv(path: Path, rows: list[dict], columns: list[str], machine: dict) -> Path:
    with path.open("w", newline="") as fh:
        for k, v in machine.items():      # one line each: a value with line breaks would end the comments
            fh.write(f"# machine.{k}: {' / '.join(str(v).splitlines())}\n")
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return path


def read_csv(path: Path) -> list[dict]:
    with Path(path).open(newline="") as fh:
        return list(csv.DictReader(line for line in fh if not line.startswith("#")))


def read_csv_machine(path: Path) -> dict:
    out = {}
    with Path(path).open() as fh:
        for line in fh:
            if not line.startswith("# machine."):
                break
            k, _, v = line[len("# machine."):].rstrip("\n").partition(": ")
            out[k] = v
    return out


def write_tables(out: Path, results: list[dict], machine: dict) -> None:
    """The four CSVs, derived from the raw results (also used to regenerate them)."""
    write_csv(out / "steps.csv", [row for r in results for row in step_rows(r)], STEP_COLUMNS, machine)
    write_csv(out / "layers.csv", [row for r in results for row in layer_rows(r)],
              ["config", "phase", "layer", "mean_ms", "std_ms", "ci95_ms", "n"], machine)
    write_csv(out / "memory_timeline.csv", [row for r in results for row in memory_rows(r)],
              ["config", "point", "phase", "layer", "allocated_gib_mean", "allocated_gib_std",
               "reserved_gib_mean", "reserved_gib_std", "rss_gib_mean", "rss_gib_std"], machine)
    write_csv(out / "summary.csv", [summary_row(r) for r in results], SUMMARY_COLUMNS, machine)
    timeline = [row for r in results for row in timeline_rows(r)]
    if timeline:
        write_csv(out / "step_timeline.csv", timeline, ["config", "step", "lane", "what", "unit", "start_ms", "end_ms"],
                  machine)


def timeline_rows(r: dict) -> list[dict]:
    """The last measured step's Gantt rows (bench.measure.step_timeline), if recorded."""
    tl = r.get("step_timeline") or {}
    return [{"config": config_name(r), "step": tl["step"], "lane": lane, "what": what, "unit": unit,
             "start_ms": round(s, 3), "end_ms": round(e, 3)} for lane, what, unit, s, e in tl.get("rows", [])]


def write_per_run(d: Path, results: list[dict], machine: dict, baseline: str | None, scenario: str) -> list[Path]:
    """The common CSVs and plots (time breakdown, peaks, memory timeline, per-layer times
    with 95% CIs, step curves and deltas, Pareto, and the Gantt chart of profiled runs) of runs
    in bench.measure's result form, in directory `d`, for scenarios whose own files are other
    tables (throughput, techniques). Returns the PNGs."""
    from ..report import draw, load
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
    from ..report import write_report
    write_report(out, compare_seeds=getattr(args, "compare_seeds", False))
    return out


def fnum(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan
