"""The runtime's GPU acceptance checks (memory ratios, depth scaling, 8B on one GPU).

Every configuration runs in its own process. Writes results.json, results.csv and
report.md into the output directory, with the machine's details; `slidetune report DIR`
writes results.csv and report.md again from results.json (`rewrite_report`).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from .measure import MeasureSpec
from .output import fmt, md_table, write_csv
from .runner import run_isolated
from .workload import BenchWorkload

SUMMARY_COLUMNS = ["name", "status", "model", "num_layers", "mode", "batch_size", "seq_len", "offload",
                   "step_s_mean", "step_s_std", "tokens_per_s", "model_tflops", "gpu_peak_alloc_gib",
                   "gpu_peak_reserved_gib", "cpu_peak_rss_gib", "params"]


def memory_specs(smoke: bool) -> list[MeasureSpec]:
    if smoke:
        model, seq, batch, layers, dev = "tiny-qwen3", 32, 2, (2, 4), "cpu"
    else:
        model, seq, batch, layers, dev = "qwen3-1.7b", 1024, 8, (14, 28), "cuda"
    work = BenchWorkload(model, seq_len=seq, batch_size=batch, steps=3, warmup=1)
    # cache_units=3: the memory checks are about the small-window configuration (auto would keep
    # every layer resident on a GPU this large, which grows with depth by design)
    rt = dict(device=dev, head_chunk_tokens=2048, cache_units=3)
    return [
        MeasureSpec(name="gpu", workload=work, runtime=dict(rt, mode="gpu")),
        MeasureSpec(name="ckpt", workload=work, runtime=dict(rt, mode="ckpt")),
        MeasureSpec(name="slide", workload=work, runtime=dict(rt, mode="slide")),
        MeasureSpec(name=f"slide-offload-{layers[0]}L", workload=replace(work, num_layers=layers[0]),
                    runtime=dict(rt, mode="slide", offload_activations=True)),
        MeasureSpec(name=f"slide-offload-{layers[1]}L", workload=replace(work, num_layers=layers[1]),
                    runtime=dict(rt, mode="slide", offload_activations=True)),
    ]


def big_specs(model: str, batch: int, smoke: bool) -> list[MeasureSpec]:
    if smoke:
        return [MeasureSpec(name="big-slide", workload=BenchWorkload("tiny-llama", seq_len=32, batch_size=2, steps=2,
                                                                     warmup=1),
                            profile=True, runtime=dict(device="cpu", mode="slide"))]
    return [MeasureSpec(name=f"{model}-slide-b{batch}", workload=BenchWorkload(model, seq_len=1024, batch_size=batch,
                                                                               steps=3, warmup=2),
                        profile=True, runtime=dict(device="cuda", mode="slide", head_chunk_tokens=4096))]


def _flat(r: dict) -> dict:
    spec = r.get("spec", {})
    rt = spec.get("runtime", {})
    return {"name": spec.get("name"), "status": r.get("status"), "model": spec.get("model"),
            "num_layers": r.get("num_layers", spec.get("num_layers")), "mode": rt.get("mode"),
            "batch_size": spec.get("batch_size"), "seq_len": spec.get("seq_len"),
            "offload": rt.get("offload_activations", False),
            **{k: r.get(k) for k in SUMMARY_COLUMNS if k not in ("name", "status", "model", "num_layers", "mode",
                                                                 "batch_size", "seq_len", "offload")}}


def run(out_dir: Path, smoke: bool = False, big_model: str = "qwen3-8b", big_batch: int = 16,
        parts: tuple[str, ...] = ("memory", "big")) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = []
    if "memory" in parts:
        specs += memory_specs(smoke)
    elif "slide" in parts:
        specs += [s for s in memory_specs(smoke) if s.name == "slide"]
    if "big" in parts:
        specs += big_specs(big_model, big_batch, smoke)
    results = []
    for spec in specs:
        print(f"[runtime] {spec.name} ...", flush=True)
        r = run_isolated(spec)
        results.append(r)
        f = _flat(r)
        print(f"[runtime] {spec.name}: {f['status']} step {f['step_s_mean']} s, gpu peak "
              f"{f['gpu_peak_alloc_gib']} GiB, rss {f['cpu_peak_rss_gib']} GiB", flush=True)
        if r.get("status") != "ok":
            print(r.get("error"), flush=True)
    checks = evaluate_checks(results, smoke)
    if "big" in parts and not smoke:
        from .roofline import floor
        try:
            big = next(r for r in results if r["spec"]["name"].startswith(big_model))
            fl = floor(big_model, big_batch, 1024)
            checks["floor"] = fl
            if big.get("status") == "ok":
                checks["big_step_over_floor"] = big["step_s_mean"] / fl["floor_s"]
        except Exception as e:  # noqa: BLE001 - reported, the other results still count
            checks["floor_error"] = repr(e)
    machine = next((r["machine"] for r in results if "machine" in r), {})
    # "scenario": what `slidetune report` tells this directory's results.json by (bench.report)
    (out_dir / "results.json").write_text(json.dumps({"scenario": "runtime", "machine": machine, "checks": checks,
                                                      "results": results}, indent=1, default=float))
    _write_outputs(out_dir, machine, results, checks)
    return checks


def rewrite_report(out_dir: Path) -> Path:
    """results.csv, the Gantt charts and report.md (with the checks) again from results.json:
    `slidetune report DIR`."""
    doc = json.loads((Path(out_dir) / "results.json").read_text())
    _write_outputs(Path(out_dir), doc.get("machine") or {}, doc["results"], doc.get("checks") or {})
    return Path(out_dir) / "report.md"


def _write_outputs(out_dir: Path, machine: dict, results: list[dict], checks: dict) -> None:
    write_csv(out_dir / "results.csv", [_flat(r) for r in results], SUMMARY_COLUMNS, machine)
    from .plots import plot_pipeline_lanes
    for r in results:
        lanes = r.get("trace_summary", {}).get("lanes")
        if lanes:
            plot_pipeline_lanes(lanes, out_dir / f"pipeline_{r['spec']['name']}.png",
                                f"{r['spec']['name']}: one step per stream and thread")
    (out_dir / "report.md").write_text(_report(machine, results, checks))


def evaluate_checks(results: list[dict], smoke: bool) -> dict:
    by = {r["spec"]["name"]: r for r in results}
    checks: dict = {}
    g, s = by.get("gpu"), by.get("slide")
    if g and s and g.get("status") == "ok" and s.get("status") == "ok" and g["gpu_peak_alloc_gib"] > 0:
        checks["slide_over_gpu_peak_alloc"] = s["gpu_peak_alloc_gib"] / g["gpu_peak_alloc_gib"]
        checks["slide_peak_le_quarter_of_gpu"] = checks["slide_over_gpu_peak_alloc"] <= 0.25
    off = sorted((r for r in results if r["spec"]["name"].startswith("slide-offload-") and r.get("status") == "ok"),
                 key=lambda r: r["num_layers"])
    if len(off) == 2 and off[0]["gpu_peak_alloc_gib"] > 0:
        growth = off[1]["gpu_peak_alloc_gib"] / off[0]["gpu_peak_alloc_gib"] - 1
        checks["offload_peak_growth_doubling_depth"] = growth
        checks["offload_growth_lt_10pct"] = growth < 0.10
    for r in results:
        if r["spec"]["name"].startswith(("big", "qwen3-8b", "llama-3.1-8b")) and r.get("status") == "ok":
            budget = 12.5 * r["params"] / 2**30 + 8
            checks["big_rss_gib"] = r["cpu_peak_rss_gib"]
            checks["big_rss_budget_gib"] = budget
            checks["big_rss_within_budget"] = r["cpu_peak_rss_gib"] <= budget
    return checks


def _report(machine: dict, results: list[dict], checks: dict) -> str:
    def cell(v, digits: int = 2) -> str:
        return fmt(v, digits, missing="")

    rows = [[f["name"], f["status"], cell(f["num_layers"]), f["mode"], f["offload"],
             f"{cell(f['step_s_mean'], 3)} ± {cell(f['step_s_std'], 3)}", cell(f["tokens_per_s"], 0),
             cell(f["model_tflops"], 1), cell(f["gpu_peak_alloc_gib"]), cell(f["gpu_peak_reserved_gib"]),
             cell(f["cpu_peak_rss_gib"])] for f in map(_flat, results)]
    lines = ["# Runtime checks", "", "Machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()), ""]
    lines += md_table(rows, ["config", "status", "layers", "mode", "offload", "step s (mean ± std)", "tokens/s",
                             "model TFLOPS", "GPU peak alloc GiB", "GPU peak reserved GiB", "host peak RSS GiB"])
    lines += ["", "Statistics exclude warm-up steps; each configuration ran in its own process.", "",
              "## Checks", "", "```json", json.dumps(checks, indent=1, default=float), "```", ""]
    ov_rows = [(r["spec"]["name"], r["overlap_mean"]) for r in results if r.get("overlap_mean")]
    if ov_rows:
        lines += ["## Overlap from the host timeline and anchored GPU events (mean over measured steps)", "",
                  "GPU compute = union of the forward / recompute / backward / head / embedding spans (CUDA "
                  "events on the compute stream, mapped to the host clock by one anchor before the measured "
                  "steps); each host activity's busy time and the share of it during which the GPU computed.",
                  "", "| config | metric | value |", "|---|---|---|"]
        for name, o in ov_rows:
            for k, v in o.items():
                lines.append(f"| {name} | {k} | {v:.3f} |")
        lines.append("")
    for r in results:
        if "trace_summary" in r:
            summary = {k: v for k, v in r["trace_summary"].items() if k != "lanes"}
            lines += [f"## Overlap ({r['spec']['name']}, torch.profiler, 3 steps)", "", "```json",
                      json.dumps(summary, indent=1), "```", "",
                      f"Gantt chart of the middle profiled step: `pipeline_{r['spec']['name']}.png`.", ""]
    return "\n".join(lines)
