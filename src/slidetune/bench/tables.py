"""Tables derived from results in bench.measure's form (a dict per run: "spec", "status", "steps"
with spans and memory points, "host_s", "trace_summary", ...) and the CSVs written from them.

Files written into a results directory (machine details in each, bench.output's CSV format):
  steps.csv             config, step, warmup, wall_s, loss, GC pauses, allocator events
  layers.csv            config, phase, layer, mean_ms, std_ms, ci95_ms, n (measured steps only)
  memory_timeline.csv   config, point, phase, layer, allocated/reserved/rss mean and std (GiB)
  summary.csv           per config: step time, throughput, peaks, time breakdown
  step_timeline.csv     the last measured step's Gantt rows (runs with a host timeline: slide)

Statistics are over measured (steady-state) steps only; warm-up steps are excluded;
CIs are 95% Student-t intervals of the mean (telemetry.stats.summarize).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..telemetry.stats import summarize
from .output import write_csv

GIB = 2**30

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


# host-timeline keys (thread.activity, seconds per step) shown in the pipeline table
PIPELINE_HOST_KEYS = ("compute.wait_upload", "compute.wait_grad_slot", "upload.upload", "upload.wait_update",
                      "d2h.issue", "d2h.hold", "host.drain", "host.adamw", "host.adamw_moments", "host.d2h_wait")


def pipeline_rows(results: list[dict]) -> list[dict]:
    """Per profiled configuration: where the step's time goes between the GPU streams and the threads."""
    rows = []
    for r in results:
        t = r.get("trace_summary")
        if not t:
            continue
        ov = r.get("overlap_mean") or {}
        side = (t.get("streams") or {}).get("side_kernels") or {}
        row = {"config": config_name(r), "step_s": r.get("step_s_mean"),
               "gpu_compute_fraction": t.get("gpu_compute_fraction_of_step"),
               "h2d_fraction": t.get("h2d_fraction_of_step"),
               "h2d_overlap": t.get("h2d_overlapped_with_compute_fraction"),
               "d2h_fraction": t.get("d2h_fraction_of_step"),
               "d2h_overlap": t.get("d2h_overlapped_with_compute_fraction"),
               "cpu_adamw_overlap": t.get("cpu_adamw_overlapped_with_compute_fraction"),
               "side_kernel_mean_us": side.get("mean_us"), "side_kernel_max_us": side.get("max_us")}
        for k in PIPELINE_HOST_KEYS:
            row[f"{k}_s"] = ov.get(f"{k}_s")
        rows.append(row)
    return rows
