"""`slidetune bench techniques`: the memory-optimization study (seeds/003) on its model shape.

Each technique is applied to an unchanged HF model (bench.baselines.hf_train) and runs
  (a) at the same batch: the FP32 baseline's largest batch, as in the study (or --batch-size), and
  (b) at its own largest batch: doubling from the same-batch run (or --max-batch-start) until a
      probe fails, then bisection between the last success and the first failure; EVERY probe is
      its own process, OOM caught and reported with the size the allocator asked for.
Outputs (CSV, JSON, report, plots) are rewritten after every process: a run stopped by a time
limit (or --time-budget) leaves valid partial results, and --resume runs only what is missing.
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
import json
import os
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from .. import output as O
from ..baselines.hf_train import TechniqueSpec
from ..baselines.proc import run_worker
from ..plots import bar_plot, pareto_front, pareto_plot
from ..tables import config_name
from ..workload import BenchWorkload
from . import add_common_arguments, common

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
            failed = [k for k, v in known.items() if not v and lo < k <= nb]
            if failed:               # a known failure ends the doubling without probing past it
                hi = min(failed)
                break
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
    p.add_argument("--max-batch-start", type=int, default=1,
                   help="first size of the doubling when no run is known to fit yet (the FP32 search)")
    p.add_argument("--probe-steps", type=int, default=3,
                   help="steps per largest-batch probe, at least 2 (>= --steps: the probes are the full runs)")
    p.add_argument("--no-max-batch", action="store_true", help="only the same-batch runs")
    p.add_argument("--max-batch-tolerance", type=float, default=0.0,
                   help="stop the bisection when the gap is below this fraction of the best batch (0: exact)")
    p.add_argument("--eval-batches", type=int, default=None, help="cap held-out batches (default: all)")
    p.add_argument("--jobs", type=int, default=None, help="parallel processes (CPU only; CUDA always 1)")
    p.add_argument("--probe-jobs", type=int, default=1,
                   help="CUDA: largest-batch probes at a time, each capped at --gpu-memory-limit, allowed only "
                        "when jobs x (limit + 1 GiB) fits the card; timed runs always run alone")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--timeout", type=float, default=7200, help="seconds per process")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no process after this many seconds; the outputs list what is still pending")
    p.add_argument("--resume", action="store_true",
                   help="reuse the finished processes in OUT/techniques.json (same settings); run the rest")
    p.add_argument("--dataset", type=Path, default=None,
                   help="tokenized corpus, a .safetensors file: read if it exists, else written there. The GPU "
                        "host has no tokenizer: tokenize here, carry the file (old torch.save'd .pt files are "
                        "refused: pass a new .safetensors path to regenerate)")


# settings a finished process's result depends on: --resume refuses results made with others
RESULT_SETTINGS = ("model", "num_layers", "seq_len", "steps", "warmup", "eval_batches", "device",
                   "lr", "lr_warmup", "gpu_memory_limit_gib")
# settings only the probes depend on: --resume drops the probes made with others (they run again)
PROBE_SETTINGS = ("probe_steps", "probe_data")
# Probes train on the runs' data (real text, padded rows and all) for at least two optimizer
# steps: AdamW allocates its state (8 B/param) in the first step, so a one-step probe sees
# a smaller peak than every later step and overstates the largest batch.
PROBE_DATA = "corpus"
MIN_PROBE_STEPS = 2


def _settings(args) -> dict:
    cuda = torch.cuda.is_available() and args.device != "cpu"
    s = dict(model=args.model, num_layers=args.num_layers, seq_len=args.seq_len, batch=args.batch_size,
             steps=args.steps, warmup=args.warmup, cap=args.max_batch_cap, start=args.max_batch_start,
             probe_steps=args.probe_steps, probe_data=PROBE_DATA, tolerance=args.max_batch_tolerance,
             windows=[int(x) for x in args.windows.split(",")], eval_batches=args.eval_batches,
             device="cuda" if cuda else "cpu", jobs=1 if cuda else (args.jobs or max(1, (os.cpu_count() or 2) // 1)),
             probe_jobs=max(1, args.probe_jobs), lr=args.lr, lr_warmup=min(20, args.steps),
             gpu_memory_limit_gib=args.gpu_memory_limit, no_max_batch=args.no_max_batch)
    if args.smoke:
        # tiny-llama: hidden 64, the same 49152 vocabulary, so real text still trains in milliseconds
        s.update(model="tiny-llama" if args.model == "study-12x768" else args.model,
                 num_layers=args.num_layers or 2, seq_len=32, batch=args.batch_size or 1, steps=2, warmup=1,
                 cap=min(args.max_batch_cap, 2), start=1, probe_steps=2, windows=[8, 16], eval_batches=2,
                 device="cpu", jobs=args.jobs or min(2, os.cpu_count() or 1), lr_warmup=2)
    if s["probe_steps"] < MIN_PROBE_STEPS:
        raise SystemExit(f"--probe-steps {s['probe_steps']}: a probe needs at least {MIN_PROBE_STEPS} steps "
                         "(AdamW's state appears in the first step, so one step misses part of the steady-state "
                         f"peak and overstates the largest batch); use --probe-steps {MIN_PROBE_STEPS}")
    s["threads"] = max(1, (os.cpu_count() or 1) // s["jobs"]) if s["device"] == "cpu" else None
    return s


def _dataset(out: Path, S: dict, given: Path | None) -> tuple[Path, bool]:
    """(tokenized corpus file, whether it is ours to delete): tokenized once, loaded by every run.

    A .safetensors file (hf_train.save_datasets); a pickle-era .pt file is refused, not loaded."""
    from ..baselines.hf_train import DatasetFileError, check_dataset_path, corpus_datasets, load_datasets, \
        save_datasets
    try:
        if given is not None:
            check_dataset_path(given)
        if given is not None and given.exists():
            train = load_datasets(given)[0]
            if train.seq_len != S["seq_len"]:
                raise SystemExit(f"{given} holds seq {train.seq_len}, not {S['seq_len']}")
            return given, False
        path = given or out / f".corpus-s{S['seq_len']}.safetensors"
        save_datasets(path, *corpus_datasets(S["seq_len"]))
    except DatasetFileError as e:
        raise SystemExit(str(e)) from None
    return path, given is None


class OutOfTime(Exception):
    """--time-budget is spent: no new process starts."""


class ProbeFailed(Exception):
    """A probe ended neither trained nor out of memory, so whether its batch fits is unknown."""


class Study:
    """Every finished process (by technique, batch and kind), the largest-batch searches, and
    `save()`, which rewrites all outputs from them: called after every process, so a scenario
    stopped at any point (time limit, kill) leaves valid, complete-as-far-as-it-got files."""

    def __init__(self, out: Path, S: dict, names: list[str], data_path: Path,
                 timeout_s: float, budget_s: float | None):
        self.out, self.S, self.names, self.data_path = out, S, names, data_path
        self.timeout_s, self.budget_s = timeout_s, budget_s
        self.table = technique_table(*S["windows"])
        self.results: dict[tuple[str, int, str], dict] = {}
        self.searches: dict[str, dict] = {}
        self.same: int | None = S["batch"] or None
        self.state = "running"
        self.t0 = time.monotonic()
        self.lock = threading.RLock()          # the pools' threads share results, searches and the files

    # -------------------------------------------------------------- processes

    def kind(self, probe: bool) -> str:
        # probes with as many steps as a run are runs (same spec, so one process serves both)
        return "run" if not probe or self.S["probe_steps"] >= self.S["steps"] else "probe"

    def spec(self, name: str, batch: int, kind: str) -> dict:
        S = self.S
        steps = S["steps"] if kind == "run" else S["probe_steps"]
        workload = BenchWorkload(S["model"], num_layers=S["num_layers"], seq_len=S["seq_len"], batch_size=batch,
                                 steps=steps, warmup=min(S["warmup"], max(0, steps - 1)), lr=S["lr"],
                                 gpu_memory_limit_gib=S["gpu_memory_limit_gib"])
        return TechniqueSpec(
            name=name, workload=workload, lr_warmup_steps=S["lr_warmup"],
            data="corpus" if kind == "run" else S["probe_data"], eval=kind == "run",
            # the same-batch runs also record per-layer spans and memory points (per_run/ plots)
            per_layer=kind == "run" and batch == self.same,
            max_eval_batches=S["eval_batches"],
            dataset_path=str(self.data_path), threads=S["threads"], device=S["device"],
            **self.table[name]).to_dict()

    def launch(self, name: str, batch: int, probe: bool) -> dict:
        """The result for (name, batch, kind): from this or a resumed run, else from a new process."""
        key = (name, batch, self.kind(probe))
        with self.lock:
            if key in self.results:
                return self.results[key]
        if self.budget_s is not None and time.monotonic() - self.t0 > self.budget_s:
            raise OutOfTime
        r = run_worker(WORKER, self.spec(*key), timeout_s=self.timeout_s)
        print(f"[techniques] {name} b={batch} {key[2]}: {r.get('status')} "
              f"{O.fmt(r.get('step_s_mean'), 3)} s/step ppl {O.fmt(r.get('perplexity'))} "
              f"({time.monotonic() - self.t0:.0f} s)", flush=True)
        with self.lock:
            self.results[key] = r
        return r

    def search(self, name: str) -> None:
        """The largest batch of `name`; the search's record is saved after every probe."""
        with self.lock:   # a full run at a batch settles that batch, whatever a probe there said
            known = {b: r["status"] == "ok" for (n, b, k), r in self.results.items()
                     if n == name and k == "run" and r.get("status") in ("ok", "oom")}
        rec = dict(max_batch=None, capped=None, probes=[], error=None)
        with self.lock:
            self.searches[name] = rec

        def probe(b: int) -> bool:
            r = self.launch(name, b, probe=True)
            with self.lock:
                rec["probes"].append(dict(
                    technique=name, batch_size=b, ok=r.get("status") == "ok", status=r.get("status"),
                    oom_requested_gib=r.get("oom_requested_gib"), gpu_peak_alloc_gib=r.get("gpu_peak_alloc_gib"),
                    error=(r.get("error") or "")[:200] or None))
                self.save()
            if r.get("status") not in ("ok", "oom"):
                raise ProbeFailed(f"b={b}: {r.get('status')}: {(r.get('error') or '')[:200]}")
            return r["status"] == "ok"
        # the doubling starts where it always did (so a resumed search replays the same probes);
        # the other runs only add what they settled
        start = self.same if self.same and known.get(self.same) else self.S["start"]
        try:
            best, _ = find_max_batch(probe, start=start, cap=self.S["cap"], known=known, rel_tol=self.S["tolerance"])
        except ProbeFailed as e:      # an error is no OOM: report it rather than a wrong largest batch
            with self.lock:
                rec["error"] = str(e)
                self.save()
            return
        with self.lock:
            rec.update(max_batch=best, capped=best == self.S["cap"])
            self.save()

    def run_at(self, name: str, batch: int | None) -> None:
        if batch:
            self.launch(name, batch, probe=False)
            with self.lock:
                self.save(plots=True)

    def run_largest(self, name: str) -> None:
        """The timed run at `name`'s largest batch. The run is the last word: if it runs out of
        memory where the (shorter) probe fitted, its batch counts as a failure and the search
        goes on below it (fragmentation over many steps, or the held-out evaluation)."""
        tried: set[int] = set()
        while True:
            batch = self.searches.get(name, {}).get("max_batch")
            if not batch or batch in tried:
                return
            tried.add(batch)
            self.run_at(name, batch)
            if self.results.get((name, batch, "run"), {}).get("status") != "oom":
                return
            print(f"[techniques] {name}: the run at b={batch} ran out of memory; searching below it", flush=True)
            self.search(name)

    def guarded(self, fn: Callable, *a) -> None:
        try:
            fn(*a)
        except OutOfTime:
            self.state = "stopped: time budget spent"

    def probe_jobs(self) -> int:
        S = self.S
        if S["device"] == "cpu":
            return S["jobs"]
        n, lim = S["probe_jobs"], S["gpu_memory_limit_gib"]
        total = self.machine().get("gpu_memory_gib")
        # each process also holds ~0.5 GiB of CUDA context outside its allocator cap
        if n > 1 and not (lim and total and n * (lim + 1.0) <= float(total)):
            print(f"[techniques] --probe-jobs {n} needs {n} x (limit + 1 GiB) <= {total} GiB: probing one at a time",
                  flush=True)
            return 1
        return n

    def execute(self) -> None:
        S, names = self.S, self.names
        if not self.same:     # the FP32 baseline's largest batch (on --resume, replayed from the results)
            self.guarded(self.search, "fp32")
            best = self.searches.get("fp32", {}).get("max_batch")
            if best is None:
                self.state = self.state if self.state != "running" else "stopped: the FP32 search failed"
                return
            self.same = max(1, best)
        with ThreadPoolExecutor(S["jobs"]) as pool:
            list(pool.map(lambda n: self.guarded(self.run_at, n, self.same), names))
        if not S["no_max_batch"]:
            todo = [n for n in names if self.searches.get(n, {}).get("max_batch") is None
                    and not self.searches.get(n, {}).get("error")]
            with ThreadPoolExecutor(self.probe_jobs()) as pool:
                list(pool.map(lambda n: self.guarded(self.search, n), todo))
            for n in names:                                # timed: one at a time
                self.guarded(self.run_largest, n)
        if self.state == "running":
            self.state = "complete"

    # -------------------------------------------------------------- outputs

    def machine(self) -> dict:
        # never machine_info() here: on CUDA it would open a context in this (parent) process
        m = next((r["machine"] for r in self.results.values() if r.get("machine")), None)
        return m or {"hostname": platform.node(), "torch": torch.__version__, "note": "no process finished yet"}

    def doc(self) -> dict:
        results = [dict(technique=n, batch=b, kind=k, **{x: v for x, v in r.items() if x != "machine"})
                   for (n, b, k), r in self.results.items()]
        doc = {"machine": self.machine(), "settings": self.S, "names": self.names, "same_batch": self.same,
               "state": self.state, "elapsed_s": time.monotonic() - self.t0, "searches": self.searches,
               "results": results}
        doc["rows"], doc["probes"] = _tables(doc)
        return doc

    def save(self, plots: bool = False) -> None:
        with self.lock:
            doc = self.doc()
            O.write_json(self.out / "techniques.json", doc)
            render(self.out, doc, plots=plots)

    def resume(self) -> int:
        """Load the finished processes of a previous run; `execute` then replays the same decisions
        (searches included) and launches only what they lack. Returns how many were loaded."""
        path = self.out / "techniques.json"
        if not path.exists():
            return 0
        prev = json.loads(path.read_text())
        diff = {k: (prev["settings"].get(k), self.S.get(k)) for k in RESULT_SETTINGS
                if prev["settings"].get(k) != self.S.get(k)}
        if diff:
            raise SystemExit(f"--resume: {path} was made with other settings {diff}")
        probes_stale = any(prev["settings"].get(k) != self.S.get(k) for k in PROBE_SETTINGS)
        for r in prev.get("results", []):
            if probes_stale and r.get("kind") == "probe":
                continue
            if r.get("status") in ("ok", "oom"):           # errors, crashes and timeouts run again
                key = (r.pop("technique"), int(r.pop("batch")), r.pop("kind"))
                self.results[key] = {**r, "machine": prev.get("machine")}
        return len(self.results)


def run(args: argparse.Namespace) -> Path:
    out = Path(args.out or "benchmarks/results/techniques")
    out.mkdir(parents=True, exist_ok=True)
    S = _settings(args)
    table = technique_table(*S["windows"])
    names = list(table) if args.techniques == "all" else [t.strip() for t in args.techniques.split(",")]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown techniques {unknown}; choose from {list(table)}")
    data_path, temporary = _dataset(out, S, args.dataset)
    study = Study(out, S, names, data_path, args.timeout, args.time_budget)
    if args.resume:
        print(f"[techniques] resumed {study.resume()} finished processes from {out / 'techniques.json'}", flush=True)
    study.save()
    try:
        study.execute()
    finally:
        if study.state == "running":
            study.state = "stopped: interrupted"
        study.save(plots=True)
        if temporary:
            data_path.unlink(missing_ok=True)
    return out


# ------------------------------------------------------------------ tables, report, plots

COLUMNS = ["technique", "regime", "batch_size", "status", "step_s_mean", "step_s_std", "tokens_per_s",
           "gpu_peak_alloc_gib", "gpu_peak_reserved_gib", "cpu_peak_rss_gib", "peak_gib", "perplexity",
           "final_loss", "speedup_vs_fp32", "step_time_ratio_vs_fp32", "batch_ratio_vs_fp32",
           "memory_reduction_vs_fp32", "ppl_change_vs_fp32", "max_batch_capped", "oom_requested_gib", "error"]


def _row(name: str, regime: str, batch: int | None, r: dict | None, capped: bool | None = None,
         status: str | None = None, error: str | None = None) -> dict:
    r = r or {}
    peak = r.get("gpu_peak_alloc_gib")
    if peak is None:
        peak = r.get("cpu_peak_rss_gib")
    return dict(technique=name, regime=regime, batch_size=batch, status=status or r.get("status"),
                step_s_mean=r.get("step_s_mean"), step_s_std=r.get("step_s_std"),
                tokens_per_s=r.get("tokens_per_s"), gpu_peak_alloc_gib=r.get("gpu_peak_alloc_gib"),
                gpu_peak_reserved_gib=r.get("gpu_peak_reserved_gib"), cpu_peak_rss_gib=r.get("cpu_peak_rss_gib"),
                peak_gib=peak, perplexity=r.get("perplexity"), final_loss=r.get("final_loss"),
                max_batch_capped=capped, oom_requested_gib=r.get("oom_requested_gib"),
                error=(error or r.get("error") or "")[:200] or None)


def _tables(doc: dict) -> tuple[list[dict], list[dict]]:
    """(rows: one per technique and regime, 'pending' where not run yet; probes in the order they ran)."""
    runs = {(r["technique"], r["batch"]): r for r in doc["results"] if r["kind"] == "run"}
    same, searches = doc["same_batch"], doc["searches"]
    rows = [_row(n, "same", same, runs.get((n, same)), status=None if (n, same) in runs else "pending")
            for n in doc["names"]]
    if not doc["settings"].get("no_max_batch"):
        for n in doc["names"]:
            s = searches.get(n) or {}
            b = s.get("max_batch")
            if s.get("error"):
                rows.append(_row(n, "max", None, None, status="error", error="largest-batch search: " + s["error"]))
            elif b == 0:
                rows.append(_row(n, "max", 0, None, status="oom", error="batch 1 does not fit"))
            else:
                rows.append(_row(n, "max", b, runs.get((n, b)), s.get("capped"),
                                 status=None if (n, b) in runs else "pending"))
    base = next((r for r in rows if r["technique"] == "fp32" and r["regime"] == "same" and r["status"] == "ok"), None)
    for r in rows:
        if base and r["status"] == "ok":
            r["speedup_vs_fp32"] = r["tokens_per_s"] / base["tokens_per_s"]     # = step ratio at the same batch
            r["step_time_ratio_vs_fp32"] = base["step_s_mean"] / r["step_s_mean"]  # the study's "speedup"
            r["batch_ratio_vs_fp32"] = r["batch_size"] / base["batch_size"]
            if base["peak_gib"]:
                r["memory_reduction_vs_fp32"] = 1 - r["peak_gib"] / base["peak_gib"]
            if r["perplexity"] and base["perplexity"]:
                r["ppl_change_vs_fp32"] = r["perplexity"] / base["perplexity"] - 1
    probes = [p for n in doc["names"] for p in (searches.get(n) or {}).get("probes", [])]
    return rows, probes


def render(out: Path, doc: dict, plots: bool = True, compare_seeds: bool = False) -> None:
    """CSVs and report.md (and the PNGs when `plots`) from a techniques.json document."""
    S, names, rows, probes, machine = doc["settings"], doc["names"], doc["rows"], doc["probes"], doc["machine"]
    O.write_csv(out / "techniques.csv", rows, COLUMNS, machine)
    O.write_csv(out / "probes.csv", probes, PROBE_COLUMNS, machine)
    max_batch = {n: (doc["searches"].get(n) or {}).get("max_batch") for n in names}
    front = _write_plots(out, doc, max_batch, plots)
    lines = _state_lines(doc)
    lines += _method_lines(doc)
    lines += _results_lines(rows, probes, front)
    lines += _per_layer_lines(out, doc, plots)
    if compare_seeds:
        from ..seeds import techniques_comparison_markdown
        lines += techniques_comparison_markdown(rows, max_batch) + [""]
    if S["device"] == "cpu":
        lines += ["**Not yet:** this is a CPU run (smoke or no CUDA); the study's numbers need the GPU run "
                  "(`slidetune bench techniques` on the H100 host).", ""]
    (out / "report.md").write_text("\n".join(lines))


def _memory_label(S: dict) -> str:
    return "peak GPU allocated GiB" if S["device"] == "cuda" else "peak host RSS GiB (CPU run)"


def _write_plots(out: Path, doc: dict, max_batch: dict, plots: bool) -> list[str]:
    """The bar plots and the memory/perplexity Pareto plot (when `plots`); returns the Pareto front."""
    S, names, rows = doc["settings"], doc["names"], doc["rows"]
    mem_label = _memory_label(S)
    if plots:
        by = {(r["technique"], r["regime"]): r for r in rows}
        regimes = [g for g in ("same", "max") if any((n, g) in by for n in names)]
        series = lambda key: {g: [by.get((n, g), {}).get(key) for n in names] for g in regimes}  # noqa: E731
        bar_plot(out / "peak_memory.png", names, series("peak_gib"), mem_label, "Peak memory per technique")
        bar_plot(out / "throughput.png", names, series("tokens_per_s"), "tokens/s", "Training throughput")
        bar_plot(out / "perplexity.png", names, series("perplexity"), "held-out perplexity",
                 f"Perplexity after {S['steps']} steps")
        bar_plot(out / "max_batch.png", names, {"largest batch": [max_batch[n] for n in names]},
                 "batch size", "Largest batch (doubling + bisection, one process per probe)")
    points = [(f"{r['technique']} ({r['regime']})", r["peak_gib"], r["perplexity"]) for r in rows
              if r["status"] == "ok"]
    front = pareto_plot(out / "pareto.png", points, mem_label, "held-out perplexity",
                        "Memory vs quality (lower-left is better)") if plots else \
        pareto_front(points)
    return front


def _state_lines(doc: dict) -> list[str]:
    """The report's head: how far the run got, and what is pending."""
    rows = doc["rows"]
    done = [r for r in rows if r["status"] != "pending"]
    pending = [f"{r['technique']} {r['regime']}" + (f" (b={r['batch_size']})" if r["batch_size"] else
                                                    " (largest-batch search)") for r in rows
               if r["status"] == "pending"]
    lines = ["# Memory-optimization techniques", "",
             f"**State: {doc['state']}** after {doc['elapsed_s']:.0f} s; {len(done)} of {len(rows)} rows "
             f"finished, {len(doc['results'])} processes' results kept. This file, the CSVs and the JSON are "
             "rewritten after every process, so a stopped run leaves what it finished; "
             "`--resume` runs only the rest.", ""]
    if pending:
        lines += ["Pending: " + ", ".join(pending) + ".", ""]
    return lines


def _method_lines(doc: dict) -> list[str]:
    """The settings, the machine, and how runs, peaks, the largest batch and perplexity are measured."""
    S, machine, same = doc["settings"], doc["machine"], doc["same_batch"]
    lim = S.get("gpu_memory_limit_gib")
    lines: list[str] = []
    lines += [f"Model `{S['model']}`" + (f" ({S['num_layers']} layers)" if S["num_layers"] else "") +
              f", seq {S['seq_len']}, {S['steps']} optimizer steps per run (AdamW lr {S['lr']}, linear warm-up "
              f"{S['lr_warmup']} steps, clip 1.0), same batch = {same}"
              + (" (the FP32 baseline's largest batch, as in the study)" if not S["batch"] else "") + "."
              + (f" GPU memory capped at {lim:g} GiB per process (torch.cuda.set_per_process_memory_fraction)."
                 if lim and S["device"] == "cuda" else ""), "",
              *O.machine_lines(machine), "",
              "Each run and each largest-batch probe ran in its own process. Step times exclude the first "
              f"{S['warmup']} steps; one device synchronize per step (whole-step wall time). Peaks: "
              + ("torch.cuda max allocated/reserved after the warm-up." if S["device"] == "cuda"
                 else "CPU run: no GPU, so the memory column is the process's peak RSS (VmHWM), which includes "
                      "the Python/torch baseline and is not comparable to GPU peaks."), "",
              f"Largest batch: doubling from {S.get('start', 1)} (or from the same-batch run when it trained) until "
              f"a probe fails (OOM) or the cap ({S['cap']}), then bisection"
              + (f" until the gap is below {S['tolerance']:.0%} of the best batch" if S["tolerance"] else "")
              + f"; probes train on the runs' data "
              f"({'the probes are full runs' if S['probe_steps'] >= S['steps'] else str(S['probe_steps']) + ' steps each'}"
              + (f", up to {S['probe_jobs']} at a time, each under its own memory cap" if S.get("probe_jobs", 1) > 1
                 else "") + "). A timed run that runs out of memory counts as a failed probe, and the search "
              "goes on below it. A probe that fails otherwise than by OOM stops its search (reported as an error, "
              "not as a largest batch). Perplexity: held-out 5% of the built-in English corpus (CPython docs), "
              "embedded SmolLM2 tokenizer (vocab 49152); training batches drawn with replacement.", "",
              "Differences from seeds/003: Llama-family block (RMSNorm, SwiGLU, rotary; the study's model had "
              "24.8M params with a 30k vocabulary), no dropout, AdamW weight decay 0.1. Local attention is a real "
              "band (ops.attention; block-sparse flex_attention on CUDA), not relabelled full attention.", "",
              "## Results", ""]
    return lines


def _results_lines(rows: list[dict], probes: list[dict], front: list[str]) -> list[str]:
    """The results and largest-batch probes tables, the failures and the Pareto front."""
    lines: list[str] = []
    lines += O.md_table(rows, ["technique", "regime", "batch_size", "status", "step_s_mean", "tokens_per_s",
                               "gpu_peak_alloc_gib", "gpu_peak_reserved_gib", "peak_gib", "perplexity",
                               "speedup_vs_fp32", "step_time_ratio_vs_fp32", "memory_reduction_vs_fp32",
                               "ppl_change_vs_fp32"],
                        {"step_s_mean": 3, "tokens_per_s": 0, "perplexity": 2})
    lines += ["", "speedup_vs_fp32: tokens/s ratio (the step-time ratio at the same batch); step_time_ratio_vs_fp32: "
              "FP32's step time / this step time, which is what the study's Table 2 calls speedup at the largest "
              "batch. memory_reduction_vs_fp32: 1 - peak / FP32's peak (same batch).", ""]
    errors = [r for r in rows if r["status"] not in ("ok", "pending")]
    if errors:
        lines += ["Not ok: " + "; ".join(f"{r['technique']} {r['regime']}: {r['status']} {r['error'] or ''}".strip()
                                         for r in errors), ""]
    lines += ["## Largest-batch probes", ""]
    lines += O.md_table(probes, ["technique", "batch_size", "ok", "status", "oom_requested_gib", "gpu_peak_alloc_gib"])
    lines += ["", f"Pareto front (memory vs perplexity): {', '.join(front) or '-'}", "",
              "Plots: peak_memory.png, throughput.png, max_batch.png, perplexity.png, pareto.png", ""]
    return lines


def _per_layer_lines(out: Path, doc: dict, plots: bool) -> list[str]:
    """The same-batch runs' per-layer files (written when `plots`) and their plots' links."""
    lines: list[str] = []
    machine = doc["machine"]
    per_run = _per_run(doc)
    if per_run:
        if plots:
            base = next((config_name(r) for r in per_run if r["spec"]["name"] == "fp32"), None)
            common.write_per_run(out / "per_run", per_run, machine, baseline=base, scenario="techniques")
        lines += ["## Per layer (same-batch runs)", "",
                  "`per_run/`: the scenarios' common CSVs and plots for the same-batch runs: time breakdown, peaks, "
                  "memory across the step (mean +- std over steps), per-layer forward / backward / recompute times "
                  "with 95% CIs, step curves and their deltas against FP32. Spans come from hooks on the "
                  "unmodified HF model (telemetry.module_probe; slide: its engine's own timer). Under HF "
                  "gradient checkpointing torch stops each layer's re-run early, where no hook can see it end, "
                  "so the recompute techniques' recompute time is inside their backward bars.", ""]
        lines += [f"![{n}](per_run/{n}.png)" for n in ("time_breakdown", "peak_memory", "memory_timeline",
                                                          "per_layer_times", "step_times", "per_layer_delta")
                  if (out / "per_run" / f"{n}.png").exists()] + [""]
    return lines


PROBE_COLUMNS = ["technique", "batch_size", "ok", "status", "oom_requested_gib", "gpu_peak_alloc_gib", "error"]


def _per_run(doc: dict) -> list[dict]:
    """The same-batch runs that recorded per-layer steps, in bench.measure's result form."""
    S, out = doc["settings"], []
    for r in doc["results"]:
        if r.get("kind") != "run" or r.get("batch") != doc["same_batch"] or not r.get("steps"):
            continue
        out.append({"spec": {"name": r["technique"], "model": S["model"], "batch_size": r["batch"],
                             "seq_len": S["seq_len"], "runtime": {"mode": r["technique"]}},
                    "status": r.get("status"), "error": r.get("error"), "steps": r["steps"],
                    **{k: r.get(k) for k in ("tokens_per_s", "gpu_peak_alloc_gib", "gpu_peak_reserved_gib",
                                              "cpu_peak_rss_gib")}})
    return out


def rewrite_report(out: Path, compare_seeds: bool = False) -> Path:
    """`slidetune report DIR` for a techniques directory: report.md, CSVs and plots from techniques.json."""
    doc = json.loads((Path(out) / "techniques.json").read_text())
    render(Path(out), doc, plots=True, compare_seeds=compare_seeds)
    return Path(out) / "report.md"
