"""`slidetune bench soak`: a long run's resources, step by step: does anything grow?

Each variant (default: slide mode as `slidetune train` resolves it, with the default recipe,
clipping at 1.0) runs --steps steps in its own process (bench/soak.py), sampling after every
step: host RSS, page-locked bytes the engine holds (device.PINNED) and the CUDA caching host
allocator's, GPU allocated and reserved, open file descriptors, threads, step time; and, as
context held to no target, the machine's CPU time during the step (busy, stolen by the
hypervisor, waiting on I/O: telemetry.resources.CONTEXT), which tells a step-time drift of the
machine's from one of the engine's. After
--warmup steps each series' least-squares slope is its growth, reported in % of its mean
per 100 steps against --target-pct (0.5: a run of 10,000 steps would grow by 50%), with its 95%
interval from 10-step block means (telemetry.resources.growth_per_100_steps). The verdict: yes
(growth above the target ruled out), no (growth above it shown) or unresolved (the series wanders
too much over this run to tell: a host-bound step time does; NOTES.md "Soak").

Files: samples.csv (every step), growth.csv (per variant and series), results.json (args,
machine, raw samples), soak.png (each series over the steps, the fit after warm-up) and
report.md; `slidetune report DIR` fits and renders a soak directory again from its results.json.
Variants: --variants "name:key=value,...;name2:..." (RuntimeConfig fields, as `bench pipeline`);
--disk-dir and --offload-activations apply to every variant.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from ...telemetry.resources import CONTEXT, GROWTH_BLOCK, SERIES, Growth, growth_per_100_steps
from ..baselines.proc import run_worker
from ..output import machine_of, write_csv
from ..soak import SoakSpec
from . import common, parse_gib
from .pipeline import parse_variants

NAME = "soak"
TARGET_PCT = 0.5          # issue 22: no resource grows by more than 0.5% per 100 steps after warm-up
SMOKE = dict(model="tiny-qwen3", seq_len=32, batch_size=1, steps=30, warmup=5, device="cpu")
SAMPLE_COLUMNS = ["variant", "step", "time", "step_s", "loss", *[k for k in SERIES if k != "step_s"], *CONTEXT]
GROWTH_COLUMNS = ["variant", "series", "what", "n", "mean", "first", "last", "slope_per_step",
                  "growth_pct_per_100", "ci_low_pct", "ci_high_pct", "target_pct", "verdict", "within_target"]
# plotted per panel: (title, series, scale to the plotted unit)
PANELS = [("host RSS (GiB)", ("rss_bytes",), 2**-30),
          ("page-locked host (GiB)", ("pinned_bytes", "pinned_cache_bytes"), 2**-30),
          ("GPU (GiB)", ("gpu_allocated_bytes", "gpu_reserved_bytes"), 2**-30),
          ("open file descriptors", ("open_fds",), 1.0),
          ("threads", ("threads",), 1.0),
          ("step time (s)", ("step_s",), 1.0),
          ("CPU time during the step (% of all cores)", tuple(CONTEXT), 1.0)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results/soak)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes that run on the CPU in under a minute")
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=250, help="steps of each variant, warm-up included")
    p.add_argument("--warmup", type=int, default=20, help="first steps left out of the slope fits")
    p.add_argument("--gpu-memory-limit", type=parse_gib, default=None, metavar="GiB",
                   help="emulate a smaller GPU, e.g. 24GiB (torch.cuda.set_per_process_memory_fraction)")
    p.add_argument("--device", default="auto")
    p.add_argument("--variants", default="default:", help="'name:key=value,...;name2:...' (RuntimeConfig fields)")
    p.add_argument("--disk-dir", default=None, help="every variant: AdamW moments of the units that do not fit "
                                                     "host RAM in files here (the disk tier)")
    p.add_argument("--offload-activations", action="store_true",
                   help="every variant: layer-input checkpoints in page-locked host memory")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="each variant stops after this long, keeping and fitting the steps done (a device call's "
                        "deadline); samples are also written as they are taken, so a run cut short leaves them")
    p.add_argument("--target-pct", type=float, default=TARGET_PCT, help="growth allowed, %% per 100 steps")


def specs(args) -> list[SoakSpec]:
    sizes = dict(SMOKE) if args.smoke else dict(model=args.model, seq_len=args.seq_len, batch_size=args.batch_size,
                                                steps=args.steps, warmup=args.warmup, device=args.device)
    if sizes["warmup"] + 2 > sizes["steps"]:
        raise ValueError(f"--steps {sizes['steps']} leaves fewer than 2 steps after --warmup {sizes['warmup']}: "
                         f"a slope needs more steps (or a shorter warm-up)")
    shared = {"device": sizes.pop("device")}
    if args.disk_dir:
        shared["disk_dir"] = args.disk_dir
    if args.offload_activations:
        shared["offload_activations"] = True
    workload = replace(SoakSpec().workload, num_layers=None if args.smoke else args.num_layers,
                       gpu_memory_limit_gib=args.gpu_memory_limit, **sizes)
    return [SoakSpec(name=name, workload=workload, runtime={**shared, **over},
                     max_minutes=getattr(args, "max_minutes", None))
            for name, over in parse_variants(args.variants)]


def recover_partial(result: dict, samples_path: Path, warmup: int) -> dict:
    """A worker that timed out or crashed leaves no result, but its samples file holds every step
    it finished: with enough steps past the warm-up to fit, the run is reported as "partial"."""
    if result.get("status") in ("ok", "refused") or not samples_path.exists():
        return result
    samples = [json.loads(line) for line in samples_path.read_text().splitlines() if line.strip()]
    if sum(1 for s in samples if s["step"] > warmup) < 2:
        return result
    spec = result["spec"]
    return {**result, "status": "partial", "samples": samples, "steps_done": samples[-1]["step"],
            "num_layers": spec.get("num_layers"), "params": None,
            "error": f"{result.get('status')}: {result.get('error', '')} (the {samples[-1]['step']} steps done "
                     f"are fitted)"}


def fit_growth(result: dict, warmup: int, target_pct: float) -> list[dict]:
    """growth.csv rows of one variant's result: each series' slope after warm-up."""
    fitted = [s for s in result["samples"] if s["step"] > warmup]
    rows = []
    for series, what in SERIES.items():
        g: Growth = growth_per_100_steps(series, [s["step"] for s in fitted], [s[series] for s in fitted])
        rows.append({"variant": result["spec"]["name"], "series": series, "what": what, **asdict(g),
                     "target_pct": target_pct, "verdict": g.verdict(target_pct),
                     "within_target": g.within(target_pct)})
    return rows


def plot(path: Path, results: list[dict], growth: list[dict], warmup: int) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 3, figsize=(15, 11))
    fits = {(g["variant"], g["series"]): g for g in growth}
    for ax, (title, names, scale) in zip(axes.flat, PANELS):
        for r in results:
            steps = [s["step"] for s in r["samples"] if s["step"] > 0]
            for name in names:
                if name in CONTEXT:           # context: plotted as is, no fit (older samples lack it)
                    pts = [(s["step"], s[name]) for s in r["samples"] if s["step"] > 0 and s.get(name) is not None]
                    if pts:
                        ax.plot(*zip(*pts), lw=1, alpha=0.8, label=f"{r['spec']['name']} {name}")
                    continue
                ys = [s[name] * scale for s in r["samples"] if s["step"] > 0]
                g = fits[(r["spec"]["name"], name)]
                line, = ax.plot(steps, ys, lw=1, alpha=0.8,
                                label=f"{r['spec']['name']} {name}: {g['growth_pct_per_100']:+.3f}%/100")
                x0, x1 = warmup + 1, steps[-1]
                mid = sum(s["step"] for s in r["samples"] if s["step"] > warmup) / g["n"]
                y_at = lambda x: (g["mean"] + g["slope_per_step"] * (x - mid)) * scale   # noqa: E731
                ax.plot([x0, x1], [y_at(x0), y_at(x1)], "--", color=line.get_color(), lw=1.5)
        ax.axvline(warmup + 0.5, color="gray", lw=0.8, ls=":")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(PANELS):]:
        ax.axis("off")
    fig.suptitle(f"soak: each series per step; dashed: least-squares fit after {warmup} warm-up steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(out: Path, args, results: list[dict], growth: list[dict], machine: dict, warmup: int) -> Path:
    lines = [f"# Soak: {results[0]['spec']['model'] if results else args.model}", ""]
    for r in results:
        sp = r["spec"]
        lines.append(f"- **{sp['name']}**: {r.get('status')}"
                     + (f": {str(r.get('error'))[:400]}" if r.get("status") != "ok" else
                        f": {r['samples'][-1]['step']} of {sp['steps']} steps of batch {sp['batch_size']} x seq "
                        f"{sp['seq_len']}, "
                        f"{r['num_layers']} layers, {r['params'] / 1e9:.3f} B params, clip {sp['max_grad_norm']}, "
                        f"runtime {json.dumps(sp['runtime'])}"))
    lines += ["", f"Growth after {warmup} warm-up steps, least squares, in % of the mean per 100 steps "
                  f"(target: at most {args.target_pct}%), with its 95% interval (least squares on "
                  f"{GROWTH_BLOCK}-step block means, Student's t). within: yes where the interval rules out "
                  f"growth above the target, **no** where it shows it, unresolved where the series wanders "
                  f"too much over this run to tell.", "",
              "| variant | series | mean | first -> last | %/100 steps | 95% interval | within |",
              "|---|---|---|---|---|---|---|"]
    for g in growth:
        unit, scale = ("GiB", 2**-30) if g["series"].endswith("bytes") else ("", 1.0)
        lines.append(f"| {g['variant']} | {g['series']} | {g['mean'] * scale:.4g} {unit} | "
                     f"{g['first'] * scale:.4g} -> {g['last'] * scale:.4g} | {g['growth_pct_per_100']:+.4f} | "
                     f"{g['ci_low_pct']:+.3f} .. {g['ci_high_pct']:+.3f} | "
                     f"{'**no**' if g['verdict'] == 'no' else g['verdict']} |")
    context = [(r["spec"]["name"], k, [s[k] for s in r["samples"] if s["step"] > warmup and s.get(k) is not None])
               for r in results if r.get("status") in ("ok", "partial") for k in CONTEXT]
    if any(v for _, _, v in context):
        lines += ["", f"Context after {warmup} warm-up steps (the machine's CPUs during each step; no target):", "",
                  "| variant | series | mean | max |", "|---|---|---|---|"]
        lines += [f"| {name} | {k} | {sum(v) / len(v):.2f} | {max(v):.2f} |" for name, k, v in context if v]
    lines += ["", "![soak](soak.png)", "", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items())]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(args: argparse.Namespace) -> Path:
    out = common.out_dir(args, NAME)
    todo = specs(args)
    results = []
    for spec in todo:
        print(f"[{NAME}] {spec.name}: {spec.workload.steps} steps ...", flush=True)
        spec.samples_path = str(out / f"samples_{spec.name}.jsonl")
        results.append(recover_partial(run_worker("slidetune.bench.soak", spec.to_dict(), timeout_s=6 * 3600),
                                       Path(spec.samples_path), spec.workload.warmup))
        if results[-1].get("status") != "ok":
            print(f"[{NAME}] {spec.name}: {results[-1].get('status')}: {str(results[-1].get('error'))[:500]}")
    write_outputs(out, args, results, todo[0].workload.warmup)
    return out


def write_outputs(out: Path, args: argparse.Namespace, results: list[dict], warmup: int) -> list[dict]:
    """samples.csv, growth.csv, results.json, soak.png and report.md of the variants' results; the
    growth rows, whose verdicts are printed where a series is not within the target."""
    ok = [r for r in results if r.get("status") in ("ok", "partial")]
    growth = [row for r in ok for row in fit_growth(r, warmup, args.target_pct)]
    machine = machine_of(results)
    write_csv(out / "samples.csv", [{"variant": r["spec"]["name"], **s} for r in ok for s in r["samples"]],
                     SAMPLE_COLUMNS, machine)
    write_csv(out / "growth.csv", growth, GROWTH_COLUMNS, machine)
    argd = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if isinstance(v, (str, int, float, bool, type(None), Path))}
    (out / "results.json").write_text(json.dumps({"scenario": NAME, "machine": machine, "args": argd,
                                                  "target_pct": args.target_pct, "growth": growth,
                                                  "results": results}, indent=1, default=float))
    if ok:
        plot(out / "soak.png", ok, growth, warmup)
    report(out, args, results, growth, machine, warmup)
    for g in growth:
        if g["verdict"] != "yes":
            print(f"[{NAME}] {g['variant']}: {g['series']} {g['growth_pct_per_100']:+.3f}% per 100 steps "
                  f"(95% interval {g['ci_low_pct']:+.3f} .. {g['ci_high_pct']:+.3f}; target {args.target_pct}%): "
                  f"{'grows' if g['verdict'] == 'no' else 'unresolved over this run'}")
    return growth


def rewrite_report(out: Path) -> Path:
    """Fit and render a soak directory again from its results.json (its raw samples), with this code's
    fit: `slidetune report DIR`."""
    out = Path(out)
    doc = json.loads((out / "results.json").read_text())
    args = argparse.Namespace(**{**doc["args"], "target_pct": doc["target_pct"]})
    results = doc["results"]
    warmup = results[0]["spec"]["warmup"] if results else int(doc["args"]["warmup"])
    write_outputs(out, args, results, warmup)
    return out / "report.md"
