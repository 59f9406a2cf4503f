"""`slidetune report DIR [--compare-seeds]`: a results directory -> report.md + PNG plots.

Works on any scenario directory written by bench.scenarios.common (results.json and the
CSVs); missing CSVs are derived again from results.json, the plots are always redrawn.
A techniques directory (techniques.json) is redrawn by scenarios.techniques.rewrite_report, a
throughput directory (throughput.json) by scenarios.throughput.rewrite_report.

A directory that cannot be reported raises `ReportError` naming the file (or the directory and
what it lacks): one that does not exist or holds none of these files, a file that is not a JSON
object or lacks what its kind needs, a results list that is empty, and any entry the rendering
cannot read. Nothing is written for a directory refused before rendering.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from . import plots
from .scenarios import common
from .seeds import SEEDS, compare, seed_table_markdown


class ReportError(ValueError):
    """A results directory `slidetune report` cannot turn into a report; the message names the file
    (or the directory) and what is wrong with it."""


# What a report is made from, in this order: throughput.json, a soak's results.json (refitted from
# its samples), techniques.json, then any other results.json and the CSVs derived from it (which
# may stand alone). What each JSON document must hold at its top level: key -> its JSON type
# ("object", "array", "array of objects", "number"); a plain results.json needs no key (its CSVs
# may hold the tables), but what it has must be of these types.
REPORT_FILES = ("throughput.json", "results.json", "techniques.json", "summary.csv")
_REQUIRED = {
    "throughput.json": {"runs": "array of objects", "rows": "array of objects"},
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


def _report_source(out_dir: Path) -> tuple[Path, dict | None]:
    """The file the report of `out_dir` is made from and its checked document (None: the CSVs)."""
    if not out_dir.exists():
        raise ReportError(f"{out_dir}: no such directory")
    if not out_dir.is_dir():
        raise ReportError(f"{out_dir}: not a directory (slidetune report takes the directory a `slidetune bench` "
                          f"scenario wrote)")
    if (out_dir / "throughput.json").exists():
        return out_dir / "throughput.json", read_document(out_dir / "throughput.json", _REQUIRED["throughput.json"])
    results = read_document(out_dir / "results.json", optional=_OPTIONAL) if (out_dir / "results.json").exists() \
        else None
    if results is not None and results.get("scenario") == "soak":
        return out_dir / "results.json", read_document(out_dir / "results.json", _REQUIRED["soak"])
    if (out_dir / "techniques.json").exists():
        return out_dir / "techniques.json", read_document(out_dir / "techniques.json", _REQUIRED["techniques.json"])
    if results is not None:
        return out_dir / "results.json", results
    if (out_dir / "summary.csv").exists():
        return out_dir / "summary.csv", None
    raise ReportError(f"{out_dir}: no benchmark results in it: none of {', '.join(REPORT_FILES)} (what "
                      f"`slidetune bench SCENARIO --out {out_dir}` writes)")


def _f(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _fmt(v, nd: int = 3) -> str:
    x = _f(v)
    if math.isnan(x):
        return "n/a" if v is None or isinstance(v, float) or v in ("", "nan") else str(v)
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 10 ** -nd):
        return f"{x:.3g}"
    return f"{x:.{nd}f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def load(out_dir: Path) -> dict:
    out_dir = Path(out_dir)
    doc = json.loads((out_dir / "results.json").read_text()) if (out_dir / "results.json").exists() else {}
    names = ("steps.csv", "layers.csv", "memory_timeline.csv", "summary.csv")
    if doc.get("results") is not None and not all((out_dir / n).exists() for n in names):
        common.write_tables(out_dir, doc["results"], doc.get("machine") or common.machine_of(doc["results"]))
    names += ("step_timeline.csv",)     # only runs with a host timeline (slide) write it
    tables = {n[:-4]: common.read_csv(out_dir / n) if (out_dir / n).exists() else [] for n in names}
    machine = doc.get("machine") or (common.read_csv_machine(out_dir / "summary.csv")
                                     if (out_dir / "summary.csv").exists() else {})
    return {"doc": doc, "machine": machine, **tables}


def draw(out_dir: Path, data: dict) -> list[Path]:
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
            name = common.config_name(r)
            paths.append(plots.plot_pipeline_lanes(lanes, out_dir / f"pipeline_{name}.png",
                                                   f"{name}: one profiled step per stream and thread"))
    return paths


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
        row = {"config": common.config_name(r), "step_s": r.get("step_s_mean"),
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


def top_layers(layers: list[dict], baseline: str, k: int) -> dict[str, list[tuple[int, float]]]:
    """Per config: the k layers with the largest (forward + backward + recompute) delta vs baseline."""
    tot: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r in layers:
        if r["phase"] in ("forward", "backward", "recompute") and int(r["layer"]) >= 0:
            tot[r["config"]][int(r["layer"])] += _f(r["mean_ms"])
    base = tot.get(baseline, {})
    out = {}
    for name, per in tot.items():
        if name != baseline:
            d = sorted(((i, v - base.get(i, 0.0)) for i, v in per.items()), key=lambda t: -t[1])
            out[name] = d[:k]
    return out


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
        from .scenarios.throughput import rewrite_report as rewrite_throughput
        return rewrite_throughput(out_dir)
    if source.name == "results.json" and doc.get("scenario") == "soak":
        from .scenarios.soak import rewrite_report as rewrite_soak      # its own format: refit its samples
        return rewrite_soak(out_dir)
    if source.name == "techniques.json":             # its own format: rows per technique and regime
        from .scenarios.techniques import rewrite_report
        return rewrite_report(out_dir, compare_seeds=compare_seeds)
    data = load(out_dir)
    if not data["summary"]:
        raise ReportError(f"{source}: no configuration to report: "
                          + ("no rows" if source.suffix == ".csv" else
                             "its 'results' are empty or absent, and there is no summary.csv beside it"))
    doc, machine, summary = data["doc"], data["machine"], data["summary"]
    scenario = doc.get("scenario", out_dir.name)
    pngs = draw(out_dir, data)
    ok = [r for r in summary if r.get("status") == "ok"]
    baseline = doc.get("baseline")
    if baseline not in [r["config"] for r in ok]:
        baseline = ok[0]["config"] if ok else None
    args = doc.get("args", {})
    L: list[str] = [f"# Benchmark `{scenario}`", ""]
    L += ["## Machine", ""] + _table(["key", "value"], [[k, v] for k, v in machine.items()]) + [""]
    n_steps = sorted({r.get("n_steps") for r in ok})
    L += ["## Method", "",
          f"- Each configuration ran in its own process (clean peaks). Warm-up steps "
          f"({common.SMOKE['warmup'] if args.get('smoke') else args.get('warmup', 'see results.json')}) are excluded; "
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
    rows = []
    for r in summary:
        rows.append([r["config"], r["status"], r.get("mode", ""), r.get("recompute", ""), r.get("head_impl", ""),
                     r.get("seq_len", ""), r.get("batch_size", ""),
                     f"{_fmt(r.get('step_s_mean'), 4)} +- {_fmt(r.get('step_s_std'), 4)} (CI +-{_fmt(r.get('step_s_ci95'), 4)})"
                     if r.get("status") == "ok" else "",
                     _fmt(r.get("tokens_per_s"), 1), _fmt(r.get("model_tflops")), _fmt(r.get("gpu_peak_alloc_gib")),
                     _fmt(r.get("gpu_peak_reserved_gib")), _fmt(r.get("cpu_peak_rss_gib"))])
    L += ["## Summary", ""] + _table(["config", "status", "mode", "recompute", "head", "seq", "batch",
                                      "step s (mean +- std, 95% CI)", "tokens/s", "TFLOPS", "peak alloc GiB",
                                      "peak reserved GiB", "peak RSS GiB"], rows) + [""]
    L += ["TFLOPS = tokens/step x model FLOPs per token (telemetry.flops.train_flops_per_token: 6 x params "
          "+ attention, forward + backward, recompute not counted) / step time.", ""]
    L += ["## Time breakdown (seconds per step, mean)", ""] + _table(
        ["config"] + list(common.BREAKDOWN) + ["wall"],
        [[r["config"]] + [_fmt(r.get(f"t_{k}_s"), 4) for k in common.BREAKDOWN] + [_fmt(r.get("step_s_mean"), 4)]
         for r in ok]) + [""]
    if baseline and len(ok) > 1:
        base = next(r for r in ok if r["config"] == baseline)
        rows = []
        for r in ok:
            d = _f(r["step_s_mean"]) - _f(base["step_s_mean"])
            rows.append([r["config"], _fmt(d * 1e3, 2), _fmt(100 * d / _f(base["step_s_mean"]), 1),
                         _fmt(_f(r["gpu_peak_reserved_gib"]) / _f(base["gpu_peak_reserved_gib"])
                              if _f(base["gpu_peak_reserved_gib"]) > 0 else math.nan),
                         _fmt(_f(r["cpu_peak_rss_gib"]) / _f(base["cpu_peak_rss_gib"])
                              if _f(base["cpu_peak_rss_gib"]) > 0 else math.nan)])
        L += [f"## Versus `{baseline}`", ""] + _table(
            ["config", "step delta ms", "step delta %", "peak reserved ratio", "peak RSS ratio"], rows) + [""]
        k = int(doc.get("top_k", 3))
        tops = top_layers(data["layers"], baseline, k)
        if tops and scenario in ("recompute", "modes"):
            L += [f"### Top {k} layers by per-layer total (forward + backward + recompute) delta vs `{baseline}`", ""]
            L += _table(["config", "layers (delta ms)"],
                        [[n, ", ".join(f"{i} ({_fmt(v, 3)})" for i, v in t)] for n, t in tops.items()]) + [""]
    if doc.get("selections"):
        L += ["Recompute selections: " + "; ".join(f"`{k}` = {v}" for k, v in doc["selections"].items()), ""]
    if scenario == "head":
        L += ["## Output layer", "",
              f"Engine mode: `{doc.get('head_mode', 'slide')}` "
              "(slide: the 'head' span is the head's forward and backward together; ckpt/gpu: split).", ""]
        L += _table(["config", "status", "head fwd ms", "head bwd ms", "peak alloc GiB", "peak reserved GiB", "step s"],
                    [[r["config"], r["status"], _fmt(r.get("head_fwd_ms")), _fmt(r.get("head_bwd_ms")),
                      _fmt(r.get("gpu_peak_alloc_gib")), _fmt(r.get("gpu_peak_reserved_gib")),
                      _fmt(r.get("step_s_mean"), 4)] for r in summary]) + [""]
    prow = pipeline_rows(doc.get("results") or [])
    if prow:
        L += ["## Pipeline (torch.profiler over 3 extra steps, after the measured ones)", "",
              "Fractions are of the profiled steps' wall time; *overlap* = share of that activity's busy time "
              "during which a kernel ran on the GPU. Side kernels = kernels off the compute stream (the GPU casts "
              "on the copy streams); they compete with the compute stream's GEMMs for SMs, so their duration "
              "shows how long the copies queued behind them wait. Host columns: seconds per measured step that "
              "each pipeline thread spent in that activity (host timeline, mean over measured steps).", ""]
        cols = list(prow[0])
        L += _table(cols, [[_fmt(r.get(c), 3) if c != "config" else r[c] for c in cols] for r in prow]) + [""]
    bad = [r for r in summary if r.get("status") != "ok"]
    if bad:
        L += ["## Configurations that did not run", ""] + _table(
            ["config", "status", "why"], [[r["config"], r["status"], r.get("error", "")] for r in bad]) + [""]
    if compare_seeds and scenario in SEEDS:
        L += ["## Compared with the seed report", "",
              "The seed ran on different hardware, so only ratios are compared.", ""]
        L += seed_table_markdown(scenario) + [""]
        L += _table(["ratio", "seed", "ours", "ours / seed", "our configs"],
                    [[c["ratio"], _fmt(c["seed"]), _fmt(c["ours"]), _fmt(c["ours_over_seed"]), c["ours_configs"]]
                     for c in compare(scenario, summary)]) + [""]
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


def main_report(dir: Path, compare_seeds: bool = False) -> int:  # noqa: A002 - the CLI's name
    path = write_report(Path(dir), compare_seeds=compare_seeds)
    print(path)
    return 0
