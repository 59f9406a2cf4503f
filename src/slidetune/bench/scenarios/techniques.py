"""`slidetune bench techniques`: the memory-optimization study (seeds/003) on its model shape.

Each technique is applied to an unchanged HF model (bench.baselines.hf_train) and runs
  (a) at the same batch: the FP32 baseline's largest batch, as in the study (or --batch-size), and
  (b) at its own largest batch: doubling from 1 until a probe fails, then bisection between the
      last success and the first failure; EVERY probe is its own process, OOM caught and
      reported with the size the allocator asked for.
Perplexity is measured on the held-out split of the built-in English corpus (embedded
SmolLM2 tokenizer, vocab 49152) after the same number of optimizer steps for every run.

Technique definitions (each differs from bf16-amp by one thing, except fp32 and the combos):
  fp32            FP32 weights and compute, HF eager ("math") attention  -- the study's baseline
  bf16-amp        torch.autocast(bf16) over FP32 weights, eager attention
  flash           + SDPA (the flash kernel on CUDA for bf16 causal attention)
  local-w128/256  + banded sliding-window attention (ops.attention: flex block-sparse on CUDA)
  recompute       + gradient checkpointing of every decoder layer, eager attention
  flash+recompute SDPA + checkpointing
  chunked-ce      SDPA + chunked linear-cross-entropy (no B x S x V logits)
  slide           slidetune slide mode (bf16 compute, FP32 master + AdamW on the host)
"""
from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from ..baselines import outputs as O
from ..baselines.hf_train import TechniqueSpec
from ..baselines.proc import run_worker
from . import add_common_arguments

NAME = "techniques"
WORKER = "slidetune.bench.baselines.hf_train"


def technique_table(w_small: int = 128, w_large: int = 256) -> dict[str, dict]:
    amp = dict(precision="bf16")
    return {
        "fp32": dict(precision="fp32", attention="eager"),
        "bf16-amp": dict(amp, attention="eager"),
        "flash": dict(amp, attention="sdpa"),
        f"local-w{w_small}": dict(amp, attention="local", window=w_small),
        f"local-w{w_large}": dict(amp, attention="local", window=w_large),
        "recompute": dict(amp, attention="eager", recompute=True),
        "flash+recompute": dict(amp, attention="sdpa", recompute=True),
        "chunked-ce": dict(amp, attention="sdpa", head="chunked"),
        "slide": dict(amp, attention="sdpa", engine="slide", head="chunked"),
    }


# ------------------------------------------------------------------ largest batch search

def find_max_batch(probe: Callable[[int], bool], start: int = 1, cap: int | None = None,
                   known: dict[int, bool] | None = None,
                   rel_tol: float = 0.0) -> tuple[int, list[tuple[int, bool]]]:
    """Largest b in [1, cap] with probe(b) True, assuming success is monotone in b.

    Doubling from `start` until the first failure (or the cap), then bisection between the
    last success and the first failure, down to a gap of 1 or, with `rel_tol`, of
    rel_tol x the last success (each probe is a process: 5% saves about half of them).
    `known` holds results already measured (not re-probed).
    Returns (largest batch, 0 if even batch 1 fails; the probes in the order they ran).
    """
    known = dict(known or {})
    history: list[tuple[int, bool]] = []

    def ok(b: int) -> bool:
        if b not in known:
            known[b] = bool(probe(b))
            history.append((b, known[b]))
        return known[b]

    b = max(1, start)
    if cap is not None:
        b = min(b, cap)
    if not ok(b):
        hi = b                       # first failure; search below it
        lo = 0
        while b > 1:                 # halve until something fits
            b //= 2
            if ok(b):
                lo = b
                break
            hi = b
        if lo == 0:
            return 0, history
    else:
        lo = b
        hi = None
        while cap is None or lo < cap:
            nb = lo * 2 if cap is None else min(lo * 2, cap)
            if ok(nb):
                lo = nb
            else:
                hi = nb
                break
        if hi is None:
            return lo, history
    while hi - lo > max(1, int(rel_tol * lo)):
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, history


# ------------------------------------------------------------------ CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, model="study-12x768", seq_len=1024, batch_size=0, steps=200, warmup=3)
    p.add_argument("--techniques", default="all", help="comma list of technique names, or 'all'")
    p.add_argument("--windows", default="128,256", help="the two local-attention windows")
    p.add_argument("--max-batch-cap", type=int, default=4096, help="stop the largest-batch search here")
    p.add_argument("--probe-steps", type=int, default=3,
                   help="steps per largest-batch probe (>= --steps: the probes are the full runs)")
    p.add_argument("--no-max-batch", action="store_true", help="only the same-batch runs")
    p.add_argument("--max-batch-tolerance", type=float, default=0.0,
                   help="stop the bisection when the gap is below this fraction of the best batch (0: exact)")
    p.add_argument("--eval-batches", type=int, default=None, help="cap held-out batches (default: all)")
    p.add_argument("--jobs", type=int, default=None, help="parallel processes (CPU only; CUDA always 1)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--timeout", type=float, default=7200, help="seconds per process")


def _settings(args) -> dict:
    cuda = torch.cuda.is_available() and args.device != "cpu"
    s = dict(model=args.model, num_layers=args.num_layers, seq_len=args.seq_len, batch=args.batch_size,
             steps=args.steps, warmup=args.warmup, cap=args.max_batch_cap, probe_steps=args.probe_steps,
             tolerance=args.max_batch_tolerance,
             windows=[int(x) for x in args.windows.split(",")], eval_batches=args.eval_batches,
             device="cuda" if cuda else "cpu", jobs=1 if cuda else (args.jobs or max(1, (os.cpu_count() or 2) // 1)),
             lr=args.lr, lr_warmup=min(20, args.steps))
    if args.smoke:
        # tiny-llama: hidden 64, the same 49152 vocabulary, so real text still trains in milliseconds
        s.update(model="tiny-llama" if args.model == "study-12x768" else args.model,
                 num_layers=args.num_layers or 2, seq_len=32, batch=args.batch_size or 1, steps=2, warmup=1,
                 cap=min(args.max_batch_cap, 2), probe_steps=2, windows=[8, 16], eval_batches=2,
                 device="cpu", jobs=args.jobs or min(2, os.cpu_count() or 1), lr_warmup=2)
    s["threads"] = max(1, (os.cpu_count() or 1) // s["jobs"]) if s["device"] == "cpu" else None
    return s


def run(args: argparse.Namespace) -> Path:
    out = Path(args.out or "benchmarks/results/techniques")
    out.mkdir(parents=True, exist_ok=True)
    S = _settings(args)
    table = technique_table(*S["windows"])
    names = list(table) if args.techniques == "all" else [t.strip() for t in args.techniques.split(",")]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown techniques {unknown}; choose from {list(table)}")
    from ..baselines.hf_train import corpus_datasets
    data_path = out / f".corpus-s{S['seq_len']}.pt"       # tokenized once, loaded by every run
    torch.save(corpus_datasets(S["seq_len"]), data_path)

    def spec(name: str, batch: int, steps: int, probe: bool) -> dict:
        return asdict(TechniqueSpec(
            name=name, model=S["model"], num_layers=S["num_layers"], seq_len=S["seq_len"], batch_size=batch,
            steps=steps, warmup=min(S["warmup"], max(0, steps - 1)), lr=S["lr"], lr_warmup_steps=S["lr_warmup"],
            data="synthetic" if probe else "corpus", eval=not probe, max_eval_batches=S["eval_batches"],
            dataset_path=str(data_path), threads=S["threads"], device=S["device"],
            gpu_memory_limit_gib=args.gpu_memory_limit, **table[name]))

    probes_are_runs = S["probe_steps"] >= S["steps"]

    def launch(name: str, batch: int, probe: bool) -> dict:
        steps = S["steps"] if (not probe or probes_are_runs) else S["probe_steps"]
        r = run_worker(WORKER, spec(name, batch, steps, probe and not probes_are_runs), timeout_s=args.timeout)
        print(f"[techniques] {name} b={batch} {'probe' if probe else 'run'}: {r.get('status')} "
              f"{O.fmt(r.get('step_s_mean'), 3)} s/step ppl {O.fmt(r.get('perplexity'))}", flush=True)
        return r

    runs: dict[tuple[str, str], dict] = {}
    searches: dict[str, dict] = {}

    def search(name: str, seed_results: dict[int, dict]) -> dict:
        results = dict(seed_results)

        def probe(b: int) -> bool:
            results[b] = launch(name, b, probe=True)
            return results[b].get("status") == "ok"
        known = {b: r.get("status") == "ok" for b, r in results.items()}
        # Start doubling from the largest batch already known to train (the same-batch run).
        start = max([b for b, ok in known.items() if ok], default=1)
        best, hist = find_max_batch(probe, start=start, cap=S["cap"], known=known, rel_tol=S["tolerance"])
        probes = [dict(technique=name, batch_size=b, ok=ok, status=results[b].get("status"),
                       oom_requested_gib=results[b].get("oom_requested_gib"),
                       gpu_peak_alloc_gib=results[b].get("gpu_peak_alloc_gib"),
                       error=(results[b].get("error") or "")[:200]) for b, ok in hist]
        return dict(max_batch=best, capped=best == S["cap"], probes=probes, results=results)

    # (1) the same batch: the FP32 baseline's largest batch unless given
    same = S["batch"]
    if not same:
        searches["fp32"] = search("fp32", {})
        same = max(1, searches["fp32"]["max_batch"])
    with ThreadPoolExecutor(S["jobs"]) as pool:
        for name, r in zip(names, pool.map(lambda n: launch(n, same, probe=False), names)):
            runs[(name, "same")] = r
    # (2) each technique at its own largest batch
    if not args.no_max_batch:
        def one(name: str):
            seed = {}
            if probes_are_runs and runs[(name, "same")].get("status") == "ok":
                seed[same] = runs[(name, "same")]
            elif runs[(name, "same")].get("status") == "oom":
                seed[same] = runs[(name, "same")]
            prior = searches.get(name)
            if prior:
                seed.update(prior["results"])
            return name, search(name, seed)
        with ThreadPoolExecutor(S["jobs"]) as pool:
            for name, sr in pool.map(one, names):
                searches[name] = sr
        for name in names:
            sr = searches[name]
            b = sr["max_batch"]
            if b == 0:
                runs[(name, "max")] = {"status": "oom", "spec": {"batch_size": 0}}
            elif b == same and runs[(name, "same")].get("status") == "ok":
                runs[(name, "max")] = runs[(name, "same")]
            elif probes_are_runs and sr["results"].get(b, {}).get("status") == "ok":
                runs[(name, "max")] = sr["results"][b]
            else:
                runs[(name, "max")] = launch(name, b, probe=False)
    _write(out, S, names, same, runs, searches)
    data_path.unlink(missing_ok=True)
    return out


# ------------------------------------------------------------------ outputs

COLUMNS = ["technique", "regime", "batch_size", "status", "step_s_mean", "step_s_std", "tokens_per_s",
           "gpu_peak_alloc_gib", "gpu_peak_reserved_gib", "cpu_peak_rss_gib", "peak_gib", "perplexity",
           "final_loss", "speedup_vs_fp32", "memory_reduction_vs_fp32", "ppl_change_vs_fp32", "max_batch_capped",
           "oom_requested_gib", "error"]


def _row(name: str, regime: str, r: dict, capped: bool | None) -> dict:
    peak = r.get("gpu_peak_alloc_gib")
    if peak is None:
        peak = r.get("cpu_peak_rss_gib")
    return dict(technique=name, regime=regime, batch_size=r.get("spec", {}).get("batch_size"),
                status=r.get("status"), step_s_mean=r.get("step_s_mean"), step_s_std=r.get("step_s_std"),
                tokens_per_s=r.get("tokens_per_s"), gpu_peak_alloc_gib=r.get("gpu_peak_alloc_gib"),
                gpu_peak_reserved_gib=r.get("gpu_peak_reserved_gib"), cpu_peak_rss_gib=r.get("cpu_peak_rss_gib"),
                peak_gib=peak, perplexity=r.get("perplexity"), final_loss=r.get("final_loss"),
                max_batch_capped=capped, oom_requested_gib=r.get("oom_requested_gib"),
                error=(r.get("error") or "")[:200] or None)


def _write(out: Path, S: dict, names: list[str], same: int, runs: dict, searches: dict) -> None:
    rows = []
    for regime in ("same", "max"):
        for n in names:
            if (n, regime) in runs:
                cap = searches[n]["capped"] if (regime == "max" and n in searches) else None
                rows.append(_row(n, regime, runs[(n, regime)], cap))
    base = next((r for r in rows if r["technique"] == "fp32" and r["regime"] == "same" and r["status"] == "ok"), None)
    for r in rows:
        if base and r["status"] == "ok":
            r["speedup_vs_fp32"] = base["step_s_mean"] / r["step_s_mean"] if r["batch_size"] == base["batch_size"] \
                else r["tokens_per_s"] / base["tokens_per_s"]
            if base["peak_gib"]:
                r["memory_reduction_vs_fp32"] = 1 - r["peak_gib"] / base["peak_gib"]
            if r["perplexity"] and base["perplexity"]:
                r["ppl_change_vs_fp32"] = r["perplexity"] / base["perplexity"] - 1
    machine = next((r["machine"] for r in runs.values() if "machine" in r), {})
    probes = [p for n in names if n in searches for p in searches[n]["probes"]]
    O.write_csv(out / "techniques.csv", rows, COLUMNS, machine)
    O.write_csv(out / "probes.csv", probes, None, machine)
    O.write_json(out / "techniques.json", {
        "machine": machine, "settings": S, "same_batch": same, "rows": rows, "probes": probes,
        "runs": [dict(technique=n, regime=g, **{k: v for k, v in r.items() if k != "machine"})
                 for (n, g), r in runs.items()]})
    mem_label = "peak GPU allocated GiB" if S["device"] == "cuda" else "peak host RSS GiB (CPU run)"
    by = {(r["technique"], r["regime"]): r for r in rows}
    regimes = [g for g in ("same", "max") if any((n, g) in by for n in names)]
    series = lambda key: {g: [by.get((n, g), {}).get(key) for n in names] for g in regimes}  # noqa: E731
    O.bar_plot(out / "peak_memory.png", names, series("peak_gib"), mem_label, "Peak memory per technique")
    O.bar_plot(out / "throughput.png", names, series("tokens_per_s"), "tokens/s", "Training throughput")
    O.bar_plot(out / "perplexity.png", names, series("perplexity"), "held-out perplexity",
               f"Perplexity after {S['steps']} steps")
    O.bar_plot(out / "max_batch.png", names, {"largest batch": [searches.get(n, {}).get("max_batch") for n in names]},
               "batch size", "Largest batch (doubling + bisection, one process per probe)")
    front = O.pareto_plot(out / "pareto.png",
                          [(f"{r['technique']} ({r['regime']})", r["peak_gib"], r["perplexity"]) for r in rows
                           if r["status"] == "ok"], mem_label, "held-out perplexity",
                          "Memory vs quality (lower-left is better)")
    lines = ["# Memory-optimization techniques", "",
             f"Model `{S['model']}`" + (f" ({S['num_layers']} layers)" if S["num_layers"] else "") +
             f", seq {S['seq_len']}, {S['steps']} optimizer steps per run (AdamW lr {S['lr']}, linear warm-up "
             f"{S['lr_warmup']} steps, clip 1.0), same batch = {same}"
             + (" (the FP32 baseline's largest batch, as in the study)" if not S["batch"] else "") + ".", "",
             *O.machine_lines(machine), "",
             "Each run and each largest-batch probe ran in its own process. Step times exclude the first "
             f"{S['warmup']} steps; one device synchronize per step (whole-step wall time). Peaks: "
             + ("torch.cuda max allocated/reserved after the warm-up." if S["device"] == "cuda"
                else "CPU run: no GPU, so the memory column is the process's peak RSS (VmHWM), which includes "
                     "the Python/torch baseline and is not comparable to GPU peaks."), "",
             "Largest batch: doubling from 1 until a probe fails (OOM) or the cap "
             f"({S['cap']}), then bisection; probes use synthetic token ids "
             f"({'the probes are full runs' if S['probe_steps'] >= S['steps'] else str(S['probe_steps']) + ' steps each'}). "
             "Perplexity: held-out 5% of the built-in English corpus (CPython docs), embedded SmolLM2 tokenizer "
             "(vocab 49152); training batches drawn with replacement.", "",
             "Differences from seeds/003: Llama-family block (RMSNorm, SwiGLU, rotary; the study's model had "
             "24.8M params with a 30k vocabulary), no dropout, AdamW weight decay 0.1. Local attention is a real "
             "band (ops.attention; block-sparse flex_attention on CUDA), not relabelled full attention.", "",
             "## Results", ""]
    lines += O.md_table(rows, ["technique", "regime", "batch_size", "status", "step_s_mean", "tokens_per_s",
                               "gpu_peak_alloc_gib", "gpu_peak_reserved_gib", "peak_gib", "perplexity",
                               "speedup_vs_fp32", "memory_reduction_vs_fp32", "ppl_change_vs_fp32"],
                        {"step_s_mean": 3, "tokens_per_s": 0, "perplexity": 2})
    lines += ["", "speedup_vs_fp32: step-time ratio at the same batch, tokens/s ratio otherwise.", "",
              "## Largest-batch probes", ""]
    lines += O.md_table(probes, ["technique", "batch_size", "ok", "status", "oom_requested_gib", "gpu_peak_alloc_gib"])
    lines += ["", f"Pareto front (memory vs perplexity): {', '.join(front) or '-'}", "",
              "Plots: peak_memory.png, throughput.png, max_batch.png, perplexity.png, pareto.png", ""]
    if S["device"] == "cpu":
        lines += ["**Not yet:** this is a CPU run (smoke or no CUDA); the study's numbers need the GPU run "
                  "(`slidetune bench techniques` on the H100 host).", ""]
    (out / "report.md").write_text("\n".join(lines))
