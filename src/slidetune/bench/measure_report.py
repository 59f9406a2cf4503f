"""report.md and the PNG plots of a directory of runs in bench.measure's result form: the modes,
recompute, head and pipeline scenarios, and the per_run/ directories of throughput and techniques.

Made from results.json and the CSVs bench.tables derives from it (derived again where missing;
summary.csv and its siblings may stand alone); the plots are always redrawn. `slidetune report`
(bench.report) checks a directory and comes here for this kind.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from . import plots
from .output import fmt, machine_of, md_table, number, read_csv, read_csv_machine
from .scenarios import SMOKE
from .seeds import SEEDS, compare, seed_table_markdown
from .tables import BREAKDOWN, config_name, pipeline_rows, write_tables


def _cell(v, digits: int = 3) -> str:
    """A report.md cell: values come back from the CSVs as text ("n/a" where there is none)."""
    return fmt(v, digits, missing="n/a", parse=True)


def load(out_dir: Path) -> dict:
    """A directory's results.json ("doc", {} where absent), its machine details and each CSV's rows
    (key: the file's stem); the CSVs are first derived from results.json where one is missing."""
    out_dir = Path(out_dir)
    doc = json.loads((out_dir / "results.json").read_text()) if (out_dir / "results.json").exists() else {}
    names = ("steps.csv", "layers.csv", "memory_timeline.csv", "summary.csv")
    if doc.get("results") is not None and not all((out_dir / n).exists() for n in names):
        write_tables(out_dir, doc["results"], doc.get("machine") or machine_of(doc["results"]))
    names += ("step_timeline.csv",)     # only runs with a host timeline (slide) write it
    tables = {n[:-4]: read_csv(out_dir / n) if (out_dir / n).exists() else [] for n in names}
    machine = doc.get("machine") or (read_csv_machine(out_dir / "summary.csv")
                                     if (out_dir / "summary.csv").exists() else {})
    return {"doc": doc, "machine": machine, **tables}


def draw(out_dir: Path, data: dict) -> list[Path]:
    """The plots of `load`'s tables into `out_dir`; their paths."""
    out_dir = Path(out_dir)
    summary, baseline = data["summary"], data["doc"].get("baseline")
    ok = [r["config"] for r in summary if r.get("status") == "ok"]
    if baseline not in ok:
        baseline = ok[0] if ok else None
    paths = [plots.plot_breakdown(summary, out_dir / "time_breakdown.png"),
             plots.plot_peaks(summary, out_dir / "peak_memory.png"),
             plots.plot_memory_timeline(data["memory_timeline"], out_dir / "memory_timeline.png"),
             plots.plot_layers(data["layers"], out_dir / "per_layer_times.png"),
             plots.plot_step_times(data["steps"], baseline, out_dir / "step_times.png"),
             plots.plot_pareto(summary, out_dir / "pareto.png")]
    if baseline and len(ok) > 1:
        paths.append(plots.plot_layer_delta(data["layers"], baseline, out_dir / "per_layer_delta.png"))
    if data["doc"].get("scenario") == "head":
        paths.append(plots.plot_head(summary, out_dir / "head_time.png"))
    by_config: dict[str, list[dict]] = {}
    for row in data.get("step_timeline") or []:
        by_config.setdefault(row["config"], []).append(row)
    for name, rows in by_config.items():
        paths.append(plots.plot_step_timeline(rows, out_dir / f"step_timeline_{name}.png",
                                              f"{name}: step {rows[0]['step']}, GPU and host threads"))
    for r in data["doc"].get("results") or []:
        lanes = (r.get("trace_summary") or {}).get("lanes")
        if lanes:
            name = config_name(r)
            paths.append(plots.plot_pipeline_lanes(lanes, out_dir / f"pipeline_{name}.png",
                                                   f"{name}: one profiled step per stream and thread"))
    return paths


def top_layers(layers: list[dict], baseline: str, k: int) -> dict[str, list[tuple[int, float]]]:
    """Per config: the k layers with the largest (forward + backward + recompute) delta vs baseline."""
    tot: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r in layers:
        if r["phase"] in ("forward", "backward", "recompute") and int(r["layer"]) >= 0:
            tot[r["config"]][int(r["layer"])] += number(r["mean_ms"])
    base = tot.get(baseline, {})
    out = {}
    for name, per in tot.items():
        if name != baseline:
            d = sorted(((i, v - base.get(i, 0.0)) for i, v in per.items()), key=lambda t: -t[1])
            out[name] = d[:k]
    return out


def _method_lines(args: dict, ok: list[dict]) -> list[str]:
    """How the runs were measured: processes, warm-up, statistics, the spans and the memory points."""
    n_steps = sorted({r.get("n_steps") for r in ok})
    return ["## Method", "",
            f"- Each configuration ran in its own process (clean peaks). Warm-up steps "
            f"({SMOKE['warmup'] if args.get('smoke') else args.get('warmup', 'see results.json')}) are excluded; "
            f"statistics use the measured steps (n = {', '.join(map(str, n_steps)) or 'n/a'}).",
            "- Confidence intervals are 95% two-sided Student-t intervals of the mean over the steady-state "
            "(measured) steps: mean +- t(0.975, n-1) * std / sqrt(n).",
            "- Per-layer times come from events recorded on the compute stream and read once per step "
            "(wall clock on the CPU); no per-layer synchronize. Profilers are off during measured steps.",
            "- Time breakdown: forward = embed + layer forward spans; head = output layer (plain engine: "
            "head forward + head backward; slide: the head's one fwd+bwd span); backward = per-layer backward "
            "+ embedding backward + gradient copy; recompute = checkpointed layers re-running in backward (cut out "
            "of backward); optimizer = the update span (slide: host AdamW thread); transfer = slide's upload + "
            "D2H spans (host threads, overlapping GPU work); GPU idle = step wall - union of compute spans.",
            "- Memory timeline: allocator state (GPU) and process RSS sampled at defined points of the step "
            "(after each layer's forward/backward, head, optimizer), mean +- std over measured steps.", ""]


def _versus_lines(ok: list[dict], baseline: str, doc: dict, layers: list[dict], scenario: str) -> list[str]:
    """Each configuration's step time and peaks against the baseline's, and (recompute, modes) the
    layers whose time moved most."""
    base = next(r for r in ok if r["config"] == baseline)
    rows = []
    for r in ok:
        d = number(r["step_s_mean"]) - number(base["step_s_mean"])
        rows.append([r["config"], _cell(d * 1e3, 2), _cell(100 * d / number(base["step_s_mean"]), 1),
                     _cell(number(r["gpu_peak_reserved_gib"]) / number(base["gpu_peak_reserved_gib"])
                           if number(base["gpu_peak_reserved_gib"]) > 0 else math.nan),
                     _cell(number(r["cpu_peak_rss_gib"]) / number(base["cpu_peak_rss_gib"])
                           if number(base["cpu_peak_rss_gib"]) > 0 else math.nan)])
    L = [f"## Versus `{baseline}`", ""] + md_table(
        rows, ["config", "step delta ms", "step delta %", "peak reserved ratio", "peak RSS ratio"]) + [""]
    k = int(doc.get("top_k", 3))
    tops = top_layers(layers, baseline, k)
    if tops and scenario in ("recompute", "modes"):
        L += [f"### Top {k} layers by per-layer total (forward + backward + recompute) delta vs `{baseline}`", ""]
        L += md_table([[n, ", ".join(f"{i} ({_cell(v, 3)})" for i, v in t)] for n, t in tops.items()],
                      ["config", "layers (delta ms)"]) + [""]
    return L


def write_measure_report(out_dir: Path, data: dict, compare_seeds: bool = False) -> Path:
    """report.md (and the plots) of `out_dir` from its tables (`load`); its path."""
    out_dir = Path(out_dir)
    doc, machine, summary = data["doc"], data["machine"], data["summary"]
    scenario = doc.get("scenario", out_dir.name)
    pngs = draw(out_dir, data)
    ok = [r for r in summary if r.get("status") == "ok"]
    baseline = doc.get("baseline")
    if baseline not in [r["config"] for r in ok]:
        baseline = ok[0]["config"] if ok else None
    args = doc.get("args", {})
    L: list[str] = [f"# Benchmark `{scenario}`", ""]
    L += ["## Machine", ""] + md_table([[k, v] for k, v in machine.items()], ["key", "value"]) + [""]
    L += _method_lines(args, ok)
    rows = []
    for r in summary:
        rows.append([r["config"], r["status"], r.get("mode", ""), r.get("recompute", ""), r.get("head_impl", ""),
                     r.get("seq_len", ""), r.get("batch_size", ""),
                     f"{_cell(r.get('step_s_mean'), 4)} +- {_cell(r.get('step_s_std'), 4)} (CI +-{_cell(r.get('step_s_ci95'), 4)})"
                     if r.get("status") == "ok" else "",
                     _cell(r.get("tokens_per_s"), 1), _cell(r.get("model_tflops")), _cell(r.get("gpu_peak_alloc_gib")),
                     _cell(r.get("gpu_peak_reserved_gib")), _cell(r.get("cpu_peak_rss_gib"))])
    L += ["## Summary", ""] + md_table(rows, ["config", "status", "mode", "recompute", "head", "seq", "batch",
                                              "step s (mean +- std, 95% CI)", "tokens/s", "TFLOPS", "peak alloc GiB",
                                              "peak reserved GiB", "peak RSS GiB"]) + [""]
    L += ["TFLOPS = tokens/step x model FLOPs per token (telemetry.flops.train_flops_per_token: 6 x params "
          "+ attention, forward + backward, recompute not counted) / step time.", ""]
    L += ["## Time breakdown (seconds per step, mean)", ""] + md_table(
        [[r["config"]] + [_cell(r.get(f"t_{k}_s"), 4) for k in BREAKDOWN] + [_cell(r.get("step_s_mean"), 4)]
         for r in ok],
        ["config"] + list(BREAKDOWN) + ["wall"]) + [""]
    if baseline and len(ok) > 1:
        L += _versus_lines(ok, baseline, doc, data["layers"], scenario)
    if doc.get("selections"):
        L += ["Recompute selections: " + "; ".join(f"`{k}` = {v}" for k, v in doc["selections"].items()), ""]
    if scenario == "head":
        L += ["## Output layer", "",
              f"Engine mode: `{doc.get('head_mode', 'slide')}` "
              "(slide: the 'head' span is the head's forward and backward together; ckpt/gpu: split).", ""]
        L += md_table([[r["config"], r["status"], _cell(r.get("head_fwd_ms")), _cell(r.get("head_bwd_ms")),
                        _cell(r.get("gpu_peak_alloc_gib")), _cell(r.get("gpu_peak_reserved_gib")),
                        _cell(r.get("step_s_mean"), 4)] for r in summary],
                      ["config", "status", "head fwd ms", "head bwd ms", "peak alloc GiB", "peak reserved GiB",
                       "step s"]) + [""]
    prow = pipeline_rows(doc.get("results") or [])
    if prow:
        L += ["## Pipeline (torch.profiler over 3 extra steps, after the measured ones)", "",
              "Fractions are of the profiled steps' wall time; *overlap* = share of that activity's busy time "
              "during which a kernel ran on the GPU. Side kernels = kernels off the compute stream (the GPU casts "
              "on the copy streams); they compete with the compute stream's GEMMs for SMs, so their duration "
              "shows how long the copies queued behind them wait. Host columns: seconds per measured step that "
              "each pipeline thread spent in that activity (host timeline, mean over measured steps).", ""]
        cols = list(prow[0])
        L += md_table([[_cell(r.get(c), 3) if c != "config" else r[c] for c in cols] for r in prow], cols) + [""]
    bad = [r for r in summary if r.get("status") != "ok"]
    if bad:
        L += ["## Configurations that did not run", ""] + md_table(
            [[r["config"], r["status"], r.get("error", "")] for r in bad], ["config", "status", "why"]) + [""]
    if compare_seeds and scenario in SEEDS:
        L += ["## Compared with the seed report", "",
              "The seed ran on different hardware, so only ratios are compared.", ""]
        L += seed_table_markdown(scenario) + [""]
        L += md_table([[c["ratio"], _cell(c["seed"]), _cell(c["ours"]), _cell(c["ours_over_seed"]), c["ours_configs"]]
                       for c in compare(scenario, summary)],
                      ["ratio", "seed", "ours", "ours / seed", "our configs"]) + [""]
        if not machine.get("gpu"):
            L += ["No GPU in this run: GPU-memory ratios are n/a.", ""]
    elif compare_seeds:
        L += ["## Compared with the seed report", "", f"No seed table for scenario `{scenario}`.", ""]
    L += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs] + [""]
    L += ["Files: results.json (raw, per step/span/memory point), steps.csv, layers.csv, memory_timeline.csv, "
          "summary.csv (machine details as `# machine.*` comment lines).", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(L))
    return path
