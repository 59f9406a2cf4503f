"""`bench throughput`'s result files: throughput.csv and .json, report.md with its sections (the
table, the hardware floor's inputs, the A/B, the planned limits, scaling, the host timeline, the
disk tier, per-run files, the longest sequence) and the plots; and `slidetune report`'s rewrite of
a throughput directory from its throughput.json."""
from __future__ import annotations

import json
from pathlib import Path

from ...telemetry.flops import StepFlops
from .. import output as O
from ..plots import bar_plot, pareto_plot
from ..hardware_floor import hardware_compute
from ..tables import config_name, pipeline_rows
from . import common
from .throughput_floor import _floor_key, _layer_ran, _state_of
from .throughput_recipe import parse_recipe
from .throughput_rows import COLUMNS, HOST_COLUMNS, _row, add_scaling


def rewrite_report(out: Path) -> Path:
    """`slidetune report DIR` for a throughput directory: rows, CSV, JSON, report and plots again
    from throughput.json's runs and floors, with the current row logic (e.g. each slide run's
    floor for the placement it resolved to). per_run/ is kept as the run wrote it."""
    out = Path(out)
    doc = json.loads((out / "throughput.json").read_text())
    raw, floors, collectives = doc["runs"], doc.get("floors") or {}, doc.get("collectives") or {}
    # rows and runs were appended together, in the same order (the max-seq probes after them);
    # a run's own "system" may be the worker's longer name, so the row's is kept
    runs = [r for r in raw if not str(r.get("key", "")).endswith("/max-seq")]
    rows, overrides = [], ""
    for old, r in zip(doc["rows"], runs):
        system, model, batch, seq = old["system"], old["model"], int(old["batch_size"]), int(old["seq_len"])
        fpt = r.get("flops_per_token") or (old["model_tflops"] * 1e12 / old["tokens_per_s"]
                                           if old.get("model_tflops") and old.get("tokens_per_s") else None)
        n = int(old.get("gpus") or 1)
        # a directory written before the floor probed one layer has one floor per workload (both layers)
        fl = (floors.get(_floor_key(model, batch, seq, _layer_ran(system, r), _state_of(system, r)))
              or floors.get(_floor_key(model, batch, seq, _layer_ran(system, r))) or floors.get(f"{model}/b{batch}/s{seq}"))
        rows.append(_row(system, model, batch, seq, r, fpt, fl,
                         recipe=parse_recipe(old.get("recipe") or "plain"), collective=collectives.get(f"{model}/n{n}"),
                         ranks=n, variant=old.get("variant") or "", round_=int(old.get("round") or 1),
                         chosen_by=old.get("chosen_by")))
        if system == "slide" and not overrides:
            given = {k: v for k, v in ((r.get("spec") or {}).get("runtime") or {}).items()
                     if k not in ("mode", "device", "head_impl", "dtype")}
            overrides = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in given.items())
    add_scaling(rows)
    _write(out, rows, raw, floors, cuda=doc.get("machine", {}).get("gpu") is not None, slide_runtime=overrides,
           collectives=collectives, limits=doc.get("limits"))
    return out / "report.md"


def _write(out: Path, rows, raw, floors, cuda: bool, slide_runtime: str = "", per_run: list[dict] | None = None,
           collectives: dict | None = None, limits: dict | None = None) -> None:
    machine = next((r["machine"] for r in raw if "machine" in r), {})
    collectives = collectives or {}
    O.write_csv(out / "throughput.csv", rows, COLUMNS, machine)
    O.write_json(out / "throughput.json", {"machine": machine, "rows": rows, "floors": floors, "runs": raw,
                                           "collectives": collectives, "limits": limits or {}})
    labels, keys, scaled = _write_plots(out, rows)
    lines = _method_lines(machine, cuda, slide_runtime)
    ab = any(r.get("variant") for r in rows)
    ref = any(r.get("reference_s") is not None for r in rows)     # a preference objective with a reference
    lines += O.md_table(rows, ["model", "seq_len", "batch_size", "system", "recipe"] + (["variant", "round"] if ab else [])
                        + ["gpus", "status", "step_s_mean"] + (["reference_s"] if ref else []) + ["tokens_per_s"]
                        + (["reference_tokens_per_s"] if ref else [])
                        + ["model_tflops", "gpu_peak_alloc_gib", "cpu_peak_rss_gib", "step_over_floor",
                           "floor_bound_by", "step_over_hw_floor", "hw_floor_bound_by", "oom_requested_gib"],
                        {"step_s_mean": 3, "reference_s": 3, "tokens_per_s": 0, "reference_tokens_per_s": 0,
                         "model_tflops": 1})
    if ref:
        lines += REFERENCE_LINES
    lines += _hardware_lines(floors)
    if ab:
        lines += ab_lines(rows)
    if limits:
        lines += _limits_lines(rows, limits)
    if scaled:
        lines += _scaling_lines(rows, collectives)
        _write_scaling_plot(out, rows, labels, keys)
    lines += _host_timeline_lines(rows)
    lines += _disk_tier_lines(rows)
    lines += ["", "Plots: tokens_per_s.png, model_tflops.png, gpu_peak.png, cpu_peak.png, step_over_floor.png, "
              "pareto.png" + (", scaling.png" if scaled else ""), ""]
    lines += _per_run_lines(out, per_run, machine)
    lines += _max_seq_lines(out, raw, machine)
    if not cuda:
        lines += ["**Not yet:** CPU run. FSDP2 / DeepSpeed rows need CUDA; slide and gpu rows are tiny shapes in "
                  "FP32 on the CPU and say nothing about the GPU targets of issue 5.", ""]
    (out / "report.md").write_text("\n".join(lines))


# what the reference columns mean, under the table that has them
REFERENCE_LINES = ["", "reference_s: the reference pass of a preference objective with a reference (dpo, ipo), "
                   "seconds per step's pairs, beside the step it precedes: a run computes the reference's "
                   "log-probabilities of every pair once before training, a forward-only pass of the same engine "
                   "(objectives/reference.py); timed on the step's micro-batches after the measured steps "
                   "(bench.measure.reference_pass), the mean of a few passes. reference_tokens_per_s: the step's "
                   "tokens over it. A run of P pairs spends reference_s x P / (pairs a step) on it once.", ""]


def _write_plots(out: Path, rows: list[dict]) -> tuple[list[str], list[str], bool]:
    """The comparison plots (a bar per series and workload, the memory/throughput Pareto); returns
    each row's workload label, the workloads in order, and whether several rank counts ran."""
    labels = [f"{r['model']} b{r['batch_size']} s{r['seq_len']}" for r in rows]
    keys = list(dict.fromkeys(labels))
    # a series per system, and per recipe where a system ran several, and per rank count where several
    several = {s for s in {r["system"] for r in rows}
               if len({r.get("recipe", "plain") for r in rows if r["system"] == s}) > 1}
    scaled = len({int(r.get("gpus") or 1) for r in rows}) > 1
    # an A/B's variants are series of their own (several rounds: the plots show the last)
    series = [r["system"] + (f" {r.get('recipe', 'plain')}" if r["system"] in several else "")
              + (f" {r['variant']}" if r.get("variant") else "")
              + (f" x{r.get('gpus') or 1}" if scaled else "") for r in rows]
    systems = list(dict.fromkeys(series))
    by = {(lab, s): r for lab, s, r in zip(labels, series, rows)}
    ser = lambda k: {s: [by.get((lab, s), {}).get(k) for lab in keys] for s in systems}  # noqa: E731
    bar_plot(out / "tokens_per_s.png", keys, ser("tokens_per_s"), "tokens/s", "Throughput (x = OOM / not run)")
    bar_plot(out / "model_tflops.png", keys, ser("model_tflops"), "model TFLOPS", "Model TFLOPS (6N + attention)")
    bar_plot(out / "gpu_peak.png", keys, ser("gpu_peak_alloc_gib"), "GiB", "Peak GPU allocated")
    bar_plot(out / "cpu_peak.png", keys, ser("cpu_peak_rss_gib"), "GiB", "Peak host RSS")
    bar_plot(out / "step_over_floor.png", keys, ser("step_over_floor"), "step time / floor", "Step time over the floor")
    pareto_plot(out / "pareto.png", [(f"{s} {lab}", by[(lab, s)].get("gpu_peak_alloc_gib") or by[(lab, s)].get(
      "cpu_peak_rss_gib"), by[(lab, s)].get("tokens_per_s")) for (lab, s) in by], "peak memory GiB", "tokens/s",
      "Memory vs throughput", lower_y_better=False)
    return labels, keys, scaled


def _method_lines(machine: dict, cuda: bool, slide_runtime: str) -> list[str]:
    """The report's head: the machine, how each column is measured, the recipes."""
    lines = ["# Throughput: slide mode vs the alternatives", "", *O.machine_lines(machine), "",
             "Model TFLOPS = tokens/s x (6 N_matmul + 6 L S d_att) / 1e12 per token (telemetry/flops.py: the "
             "weights' 6N plus the causal half of attention; recomputation not counted). Every row ran in its own "
             "process; warm-up steps excluded. All systems: bf16 compute, FP32 master + AdamW, every decoder layer "
             "recomputed, chunked cross-entropy head, synthetic token ids. slide runtime: defaults"
             + (f" with `{slide_runtime}`" if slide_runtime else "") + ".", "",
             "step/floor: bench.roofline.floor for the same workload (max of GPU compute, H2D, D2H and CPU AdamW "
             "terms, each probed on this machine), with the terms of the placement the slide run resolved to "
             "(bench.roofline.floor_terms: layers and vocabulary updated on the GPU cost the host neither AdamW "
             "nor copies; floor_bound_by names the largest term)" + ("" if cuda else "; CPU run: only the AdamW term is measurable, "
                                                       "so the floor is partial") + ".", "",
             "step/hw-floor: the same floor with the GPU's work at what this GPU can do instead of slidetune's "
             "layer timed: the step's FLOPs, each run's recomputation counted, matmuls at the BF16 GEMM rate "
             "probed on the layer's own shapes and attention at SDPA's rate probed at the workload's shape "
             "(bench.roofline.hardware_compute; the rates and FLOPs below); the GPU's AdamW and the all-reduce "
             "kept (hw_floor_bound_by names its largest term). step/floor near 1 with step/hw-floor well above "
             "it is a slow layer, not a saturated machine" + ("" if cuda else "; CPU run: none (no GPU rates)")
             + ".", ""]
    lines += ["Recipes: plain = no clipping, one micro-batch; clip = global-norm clipping at 1.0 (the default "
              "recipe of `slidetune train`); accumN = N micro-batches of batch/N (batch_size is the sequences per "
              "step). A clipped slide step updates only once its backward has ended, so its floor gains the term "
              "clip_sweep_s (bench.roofline.floor_terms).", ""]
    return lines


def _write_scaling_plot(out: Path, rows: list[dict], labels: list[str], keys: list[str]) -> None:
    """slide's tokens/s (all GPUs) per workload, a series per rank count."""
    bar_plot(out / "scaling.png", keys, {f"x{n}": [next((r.get("tokens_per_s") for r, lab in zip(rows, labels)
                                                         if lab == k and r["system"] == "slide"
                                                         and int(r.get("gpus") or 1) == n), None) for k in keys]
                                         for n in sorted({int(r.get("gpus") or 1) for r in rows})},
             "tokens/s (all GPUs)", "slide on N GPUs of one host (batch per GPU fixed)")


def hardware_table(floors: dict) -> list[dict]:
    """Per workload, the hardware floor's inputs as its floor probe recorded them: the GEMM and SDPA
    rates (TFLOP/s, forward and backward) and the step's FLOPs with every layer recomputed (slide's
    recomputation; TFLOP a step), enough to redo compute_s (bench.hardware_floor.hardware_compute)."""
    out = []
    for key, fl in floors.items():
        hw = (fl or {}).get("hardware")
        if not hw:
            continue
        f = StepFlops.from_dict(hw["flops"])
        every = range(f.num_layers)
        out.append(dict(workload=key, **{k: hw.get(k) for k in ("gemm_forward_tflops", "gemm_backward_tflops",
                                                                "sdpa_forward_tflops", "sdpa_backward_tflops",
                                                                "sdpa_backend")},
                        matmul_fwd_tflop=f.matmul_forward(every) / 1e12, matmul_bwd_tflop=f.matmul_backward() / 1e12,
                        attention_fwd_tflop=f.attention_forward(every) / 1e12,
                        attention_bwd_tflop=f.attention_backward() / 1e12,
                        hw_compute_s=hardware_compute(hw, every)["compute_s"],
                        probe_compute_s=(fl.get("compute") or {}).get("compute_s")))
    return out


def _hardware_lines(floors: dict) -> list[str]:
    table = hardware_table(floors)
    if not table:
        return []
    cols = list(table[0])
    return ["", "The hardware floor's inputs (each workload's floor probe): GEMM rates on the decoder layer's own "
            "shapes (forward y = x W^T; backward dX = dY W and dW = dY^T X), SDPA's causal at the workload's "
            "(batch, heads, seq, head_dim), TFLOP/s, and the kernel SDPA picks there (sdpa_backend); the step's FLOPs with every layer recomputed (slide), TFLOP "
            "(telemetry.flops.StepFlops: attention's backward 2.5x its forward, as flash's five matmuls against "
            "two). hw_compute_s = matmul_fwd / gemm_fwd + matmul_bwd / gemm_bwd + attention_fwd / sdpa_fwd + "
            "attention_bwd / sdpa_bwd; probe_compute_s: slidetune's own layer timed, the floor's compute term.", "",
            *O.md_table(table, cols, {c: 3 for c in cols if c != "workload"}), ""]


def ab_table(rows: list[dict]) -> list[dict]:
    """The A/B of a call with --variants: per workload (model, seq, batch, recipe, gpus) and variant,
    the step of each round, their mean, and the step over the first variant's of the same round
    (paired: a run against its neighbour, not against a run minutes away)."""
    groups: dict[tuple, dict[str, dict[int, dict]]] = {}
    for r in rows:
        if r.get("variant") and r["system"] == "slide":
            w = (r["model"], int(r["seq_len"]), int(r["batch_size"]), r.get("recipe"), int(r.get("gpus") or 1))
            groups.setdefault(w, {}).setdefault(r["variant"], {})[int(r.get("round") or 1)] = r
    out = []
    for (model, seq, batch, recipe, gpus), by_variant in groups.items():
        first = next(iter(by_variant.values()))
        for variant, by_round in by_variant.items():
            steps = {k: r.get("step_s_mean") for k, r in sorted(by_round.items())}
            ratios = [steps[k] / first[k]["step_s_mean"] for k in steps
                      if steps[k] and k in first and first[k].get("step_s_mean")]
            ok = [v for v in steps.values() if v]
            floors = [r.get("step_over_floor") for r in by_round.values() if r.get("step_over_floor")]
            hw = [r.get("step_over_hw_floor") for r in by_round.values() if r.get("step_over_hw_floor")]
            out.append(dict(model=model, seq_len=seq, batch_size=batch, recipe=recipe, gpus=gpus, variant=variant,
                            steps_s=", ".join(O.fmt(v, 3) for v in steps.values()),
                            step_s_mean=sum(ok) / len(ok) if ok else None,
                            step_over_floor_mean=sum(floors) / len(floors) if floors else None,
                            step_over_hw_floor_mean=sum(hw) / len(hw) if hw else None,
                            paired_ratios=", ".join(O.fmt(x, 3) for x in ratios),
                            paired_ratio_mean=sum(ratios) / len(ratios) if ratios else None))
    return out


def ab_lines(rows: list[dict]) -> list[str]:
    """The report's A/B section (--variants, --rounds)."""
    table = ab_table(rows)
    if not table:
        return []
    return ["## A/B: variants run alternately in this call", "",
            "Each round runs every variant once, back to back (A B A B ...), against one floor probe per "
            "workload, so a change in the machine between runs (this VM's DRAM rate moved by a quarter "
            "within minutes, benchmarks/NOTES.md \"Measuring a step\") reaches each variant alike. paired_ratios: a variant's step over "
            "the first variant's in the same round; below 1 is faster.", "",
            *O.md_table(table, ["model", "seq_len", "batch_size", "recipe", "gpus", "variant", "steps_s",
                                "step_s_mean", "step_over_floor_mean", "step_over_hw_floor_mean", "paired_ratios",
                                "paired_ratio_mean"],
                        {"step_s_mean": 3, "step_over_floor_mean": 3, "step_over_hw_floor_mean": 3,
                         "paired_ratio_mean": 3}), ""]


def _limits_lines(rows: list[dict], limits: dict) -> list[str]:
    """The report's section on --max-seq / --max-batch: each planned limit beside the run at it."""
    lines = ["## At the planned limits (--max-seq, --max-batch)", "",
             "Each workload is the largest batch (at a given sequence) or the longest sequence (at batch 1) that "
             "fits this machine as `slidetune plan` finds it (engine.limits: every size's auto settings resolved "
             "and checked as a run resolves and checks them, on the budget a run's process reads here), per "
             "recipe; the run then trains at it. planned: what the auto settings chose there and the estimate; "
             "one step past: what the fit check says does not fit there.", "",
             "| model | recipe | workload | batch x seq | planned | one step past | status | tokens/s | GPU peak / "
             "host RSS GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for model, found in limits.items():
        for f in found:
            lim = f["limit"]
            at, over = lim.get("at") or {}, lim.get("over") or {}
            row = next((r for r in rows if r["model"] == model and r.get("recipe") == f["recipe"]
                        and r.get("chosen_by") == f["chosen_by"]), {})
            gpu = f"GPU {O.fmt(at.get('gpu_gib'), 1)}, " if at.get("device_type") == "cuda" else ""
            planned = (f"{at.get('how') or 'the defaults'}; {gpu}host {O.fmt(at.get('host_gib'), 1)} GiB"
                       if at else "nothing fits")
            past = (f"{over.get(lim['axis'])}: {' and '.join(over.get('binds') or [])}" if over
                    else lim.get("capped_by") or "-")
            lines.append(f"| {model} | {f['recipe']} | {f['chosen_by']} | "
                         + (f"{row['batch_size']} x {row['seq_len']}" if row else "-")
                         + f" | {planned} | {past} | {row.get('status', 'not run')} | "
                         f"{O.fmt(row.get('tokens_per_s'), 0)} | {O.fmt(row.get('gpu_peak_alloc_gib'), 1)} / "
                         f"{O.fmt(row.get('cpu_peak_rss_gib'), 1)} |")
    return lines + [""]


def _scaling_lines(rows: list[dict], collectives: dict) -> list[str]:
    """The report's scaling section: slide on N ranks beside N=1, and the collective probes."""
    slide = [r for r in rows if r["system"] == "slide"]
    lines = ["## Scaling: slide on N GPUs of one host (data parallel)", "",
             "batch_size is per GPU; tokens_per_s is every rank's tokens over the step (rank 0's interval "
             "timing), tokens_per_s_per_gpu that over N, scaling_efficiency the per-GPU rate over the N=1 row's. "
             "host_rss_gib: the host's peak RSS over its ranks, the shared host state (one /dev/shm mapping) "
             "and the libraries' file pages (one page-cache copy) counted once. The N > 1 floors add allreduce_s: every unit's gradient all-reduced as its backward "
             "ends, 2 (N-1)/N x its bytes at the bus bandwidth probed on N ranks in this call "
             "(allreduce_busbw_gib_s, at a decoder layer's size), on the compute stream (in compute_s); D2H is "
             "the busiest rank's shard, and host_dram_s counts N uploads of each unit from the shared master "
             "beside AdamW's DRAM traffic (bench.roofline.floor_terms).", ""]
    lines += O.md_table(slide, ["model", "seq_len", "batch_size", "recipe", "gpus", "status", "step_s_mean",
                                "tokens_per_s", "tokens_per_s_per_gpu", "scaling_efficiency", "host_rss_gib",
                                "allreduce_s", "allreduce_busbw_gib_s", "floor_s", "floor_bound_by", "step_over_floor",
                                "hw_floor_s", "step_over_hw_floor"],
                        {"step_s_mean": 3, "tokens_per_s": 0, "tokens_per_s_per_gpu": 0, "allreduce_s": 4,
                         "floor_s": 3, "hw_floor_s": 3})
    probes = [dict(probe=key, op=op, bytes=r["bytes"], time_ms=r["time_s"] * 1e3, algbw_gib_s=r["algbw_gib_s"],
                   busbw_gib_s=r["busbw_gib_s"])
              for key, c in collectives.items() if c.get("status") == "ok"
              for op in ("allreduce", "allgather") for r in c.get(op) or []]
    failed = [f"{key}: {c.get('status')}: {str(c.get('error'))[:200]}" for key, c in collectives.items()
              if c.get("status") != "ok"]
    if probes or failed:
        lines += ["", "Collective probes (bench.collective: NCCL on CUDA, gloo on CPU; median of reps, the slowest "
                  "rank; algbw = bytes / time, busbw = algbw x 2(N-1)/N for all-reduce, x (N-1)/N for all-gather "
                  "of the gathered bytes, as nccl-tests defines them). all-gather is the alternative upload: each "
                  "rank uploads a shard and the ranks gather the rest.", ""]
        lines += O.md_table(probes, ["probe", "op", "bytes", "time_ms", "algbw_gib_s", "busbw_gib_s"],
                            {"time_ms": 3, "algbw_gib_s": 3, "busbw_gib_s": 3})
        lines += [f"- probe failed: {f}" for f in failed]
    return lines + [""]


def _host_timeline_lines(rows: list[dict]) -> list[str]:
    """Where a slide step goes, from the host timeline (rows that have one)."""
    lines: list[str] = []
    timed = [r for r in rows if r.get("host_adamw_s") is not None]
    if timed:
        lines += ["", "Where a slide step goes (host timeline, seconds per step): the host worker's AdamW and its "
                  "wait for gradient copies; the compute thread's waits for updated weights (forward) and for a "
                  "free gradient slot (backward). step_s is the interval between train_step returns; call_s the "
                  "call alone (the rest ran in the background). device_layers: decoder layers whose master and "
                  "AdamW state stayed on the GPU (updated there); gpu_checkpoints (with offload): layers whose "
                  "input checkpoint stayed on the GPU; host_threads: the host AdamW's threads.", ""]
        lines += O.md_table(timed, ["model", "seq_len", "batch_size", "step_s_mean", "call_s_mean", *HOST_COLUMNS,
                                    "device_layers", "gpu_checkpoints", "host_threads"],
                            {k: 3 for k in ["step_s_mean", "call_s_mean", *HOST_COLUMNS]})
    return lines


def _disk_tier_lines(rows: list[dict]) -> list[str]:
    """The disk tier's I/O a step (rows that have one)."""
    lines: list[str] = []
    on_disk = [r for r in rows if r.get("disk_io_gib") is not None]
    if on_disk:
        lines += ["", "The disk tier (per step): disk_io_gib, the plan's reads and writes (each disk unit's block "
                  "once); disk_gib_s, that over the step; disk_io_ratio, what the tier moved over the plan's bytes "
                  "(~1: each block once; below: blocks still in a buffer were not read again); disk_buffers, its "
                  "block buffers (the read-ahead); disk_busy_frac, the share of the timed step with a read or "
                  "write open (the Gantt chart's disk lanes: ~1 where the disk binds).", ""]
        lines += O.md_table(on_disk, ["model", "seq_len", "batch_size", "variant", "step_s_mean", "disk_io_gib",
                                      "disk_gib_s", "disk_io_ratio", "disk_buffers", "disk_busy_frac"],
                            {"step_s_mean": 3, "disk_io_gib": 1, "disk_gib_s": 2, "disk_io_ratio": 3,
                             "disk_busy_frac": 3})
    return lines


def _per_run_lines(out: Path, per_run: list[dict] | None, machine: dict) -> list[str]:
    """The per-run files (written here; a rewritten report lists those already there) and the profiled table."""
    lines: list[str] = []
    if per_run:
        slide = next((config_name(r) for r in per_run if r.get("status") == "ok"
                      and r["spec"].get("runtime", {}).get("mode") == "slide"), None)
        pngs = common.write_per_run(out / "per_run", per_run, machine, baseline=slide, scenario="throughput")
        lines += ["Per run (`per_run/`: steps, per-layer spans, memory timeline, summary CSVs): time breakdown "
                  "(forward, head, backward, recompute from GPU events; optimizer and transfer from the host "
                  "timeline; GPU idle = the step minus GPU compute), peaks, memory across the step (mean +- std "
                  "over steps), per-layer times with 95% CIs, step curves. FSDP2 and DeepSpeed report step times "
                  "and peaks only.", ""]
        lines += [f"![{p.stem}](per_run/{p.name})" for p in pngs] + [""]
        profiled = pipeline_rows(per_run)
        if profiled:
            O.write_csv(out / "per_run" / "profile.csv", profiled, None, machine)
            lines += ["## Profiled (torch.profiler, three steps after the measured ones, all threads)", "",
                      "GPU compute, H2D and D2H as fractions of the step, and how much of each copy ran under "
                      "compute; the host's AdamW under compute; the threads' seconds per step (host timeline). "
                      "`per_run/profile.csv`, Gantt charts `per_run/pipeline_<run>.png`.", ""]
            lines += O.md_table(profiled, list(profiled[0]), {k: 3 for k in profiled[0] if k != "config"})
            lines.append("")
    elif (out / "per_run").is_dir():         # a rewritten report: the per-run files as they were written
        lines += ["Per run: `per_run/` (as the run wrote it).", ""]
        lines += [f"![{p.stem}](per_run/{p.name})" for p in sorted((out / "per_run").glob("*.png"))] + [""]
    return lines


def _max_seq_lines(out: Path, raw: list[dict], machine: dict) -> list[str]:
    """The longest-sequence searches' table (and max_seq.csv), where any ran."""
    lines: list[str] = []
    searches = [r for r in raw if str(r.get("key", "")).endswith("/max-seq")]
    if searches:
        lines += ["## Longest trainable sequence (batch 1, slide)", "",
                  "Doubling, then bisection over multiples of the granule; each probe one step in its own process; "
                  "an OOM or a refused fit check is a failure. Capped by the model's context.", "",
                  "| model | longest sequence | context | at the longest: step s (a probe: one cold step), tokens/s, GPU peak / host RSS "
                  "GiB, placement | probes (sequence: trains?) |", "|---|---|---|---|---|"]
        for r in searches:
            probes = [f"{q}: {'yes' if ok else 'no'} (earlier call)" for q, ok in r.get("reused_probes", [])]
            probes += [f"{q}: {'yes' if ok else 'no'} (sweep row)" for q, ok in r.get("sweep_rows", [])]
            probes += [f"{q}: {'yes' if ok else 'no'}" for q, ok in r["probes"]]
            # JSON keys are strings once a search was read back (report rewrite, --max-seq-known)
            best = (r.get("runs") or {}).get(r["max_seq"]) or (r.get("runs") or {}).get(str(r["max_seq"])) or {}
            at = (f"{O.fmt(best.get('step_s_mean'), 1)} s, {O.fmt(best.get('tokens_per_s'), 0)}, "
                  f"{O.fmt(best.get('gpu_peak_alloc_gib'), 1)} / {O.fmt(best.get('cpu_peak_rss_gib'), 1)}, "
                  + " ".join(f"{k}={v}" for k, v in (best.get("placement") or {}).items())) if best else "-"
            lines.append(f"| {r['model']} | {r['max_seq']} | {r['context_cap']} | {at} | " + ", ".join(probes) + " |")
        lines.append("")
        O.write_csv(out / "max_seq.csv", [{k: r[k] for k in ("model", "max_seq", "granule", "context_cap")}
                                          for r in searches], None, machine)
    return lines
