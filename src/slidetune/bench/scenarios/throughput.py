"""`slidetune bench throughput`: the SlideFormer evaluation, slide mode beside what a user
would pick instead, on the same machine in the same run, same batch / seq / precision (bf16
compute, FP32 master + AdamW) / recomputation (every decoder layer):
  slide     slidetune slide mode (bench.measure, one process per configuration)
  gpu-ckpt  slidetune ckpt mode: everything on the GPU, checkpointed layers (where it fits)
  fsdp2     PyTorch FSDP2 + CPUOffloadPolicy on a one-rank NCCL group (bench.baselines.fsdp2)
  deepspeed DeepSpeed ZeRO-3 with CPU offload, when `import deepspeed` works
An OOM is a result: the row says so, with the size the allocator asked for.
Recipes (--recipes, slide and gpu-ckpt): what the step does besides forward and backward,
side by side in one call: "plain" (no clipping, one micro-batch), "clip" (global-norm
clipping at 1.0, the default recipe of `slidetune train`), "accumN" (N micro-batches of
b/N each, the same sequences per step), combined with "+" (e.g. clip+accum4); "clipX"
clips at X. FSDP2 and DeepSpeed rows run their plain step once per workload.
Model TFLOPS use telemetry/flops.py: 6 N_matmul + 6 L S d_att per token (causal half of
attention), recomputation not counted. step/floor uses bench.roofline.floor for the same
workload (one probe process per workload); step/hw-floor the same floor with its GPU compute at
the step's FLOPs (each run's recomputation counted) over the GEMM and SDPA rates that probe
measured on this GPU (bench.roofline.hardware_compute): how far the layer itself is from the GPU.
Scaling (--gpus 1,2,...): each count N runs slide on N data-parallel ranks of this host (one
process per rank under torchrun, bench.measure with ranks=N; docs/data_parallel.md), the batch
per GPU fixed: global and per-GPU tokens/s, scaling efficiency against the N=1 row of the same
call, the host's RSS over its ranks (the shared host state once). Each N > 1 row's floor adds
the gradient all-reduce at the bus bandwidth bench.collective probed on N ranks in the same call
(bench.roofline.floor_terms, `ranks`). The other systems run at N=1 only.
A/B (--variants 'a:;b:key=value', --rounds N): slide runs each variant's RuntimeConfig overrides
on top of --runtime, alternating (a b a b ...) for N rounds against one floor probe, and the
report pairs each run with its neighbour of the first variant: a VM's memory bandwidth can move
by a quarter between two invocations minutes apart (NOTES.md "Measuring a step"), which a pair of separate
calls cannot tell from the change under test.
This module runs the sweep; its parts: throughput_recipe.py (the recipes), throughput_rows.py (a
run's row), throughput_floor.py (the floors a row is held to), throughput_report.py (the result files,
the report and `slidetune report`'s rewrite).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

from ...objectives.preference import OBJECTIVES
from .. import output as O
from ..baselines.deepspeed_zero3 import availability as ds_availability
from ..baselines.fsdp2 import FSDP2Spec
from ..baselines.proc import parse_oom, run_worker
from ..measure import MeasureSpec
from ..runner import run_isolated
from ..workload import BenchWorkload
from . import add_common_arguments
from .roofline import measure_floor
from .throughput_floor import _floor_key, _layer_ran, _state_of
from .throughput_recipe import _check_recipes, parse_recipe
from .throughput_report import _write
from .throughput_rows import _placement, _row, add_scaling

NAME = "throughput"
SYSTEMS = ("slide", "gpu-ckpt", "fsdp2", "deepspeed")
DEFAULT_BATCHES = "8,16,32,64"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, model="qwen3-8b", seq_len=1024, batch_size=16, steps=5, warmup=2)
    p.add_argument("--models", default="qwen3-8b,llama-3.1-8b")
    p.add_argument("--batches", default=None,
                   help=f"comma list (default: {DEFAULT_BATCHES}; with --max-seq or --max-batch, none: the "
                        f"planned workloads alone)")
    p.add_argument("--seq-lens", default=None, help="comma list (default: --seq-len)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--runtime", default="", help="slide's RuntimeConfig overrides, e.g. "
                   "'cache_units=0,chunk_mb=256' (bench pipeline's variant syntax without the name)")
    p.add_argument("--recipes", default="clip",
                   help="comma list of recipes for slide and gpu-ckpt: plain | clip[X] | accumN | clip+accumN "
                        "(clip: max_grad_norm 1.0, the default recipe; accumN: N micro-batches of batch/N)")
    p.add_argument("--objective", choices=OBJECTIVES, default="sft",
                   help="the loss every recipe trains: sft, or a preference objective (batches of pairs, 2 rows "
                        "each; the two-pass head; random reference sums), as `train --objective`")
    p.add_argument("--variants", default="",
                   help="slide only: 'name:key=value,...;name2:...' RuntimeConfig overrides on top of --runtime, "
                        "run side by side in one call (an A/B), e.g. 'split:;copy:clip_sweep=weights'")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --variants: run every variant this many times, alternating (A B A B ...), so a "
                        "change in the machine between runs hits each variant alike; the report pairs them")
    p.add_argument("--gpus", default="1",
                   help="comma list of data-parallel rank counts for slide, e.g. 1,2 (the batch is per GPU; "
                        "each N > 1 also probes the all-reduce on N ranks for its floor); with --device cpu, "
                        "N CPU processes over gloo (testing)")
    p.add_argument("--no-floor", action="store_true")
    p.add_argument("--max-seq", action="store_true",
                   help="slide (--runtime) at batch 1 and the longest sequence that fits this machine, per recipe: "
                        "the limit `slidetune plan` states, found by the same search (engine.limits) on the budget "
                        "a run reads here (--gpu-memory-limit, the host's available RAM); the row says so")
    p.add_argument("--max-batch", action="store_true",
                   help="slide (--runtime) at the largest batch that fits this machine at each --seq-lens, per "
                        "recipe, as --max-seq plans it")
    p.add_argument("--max-seq-search", action="store_true",
                   help="find the longest sequence that trains at batch 1 by running it (slide with --runtime): "
                        "doubling then bisection over multiples of --seq-granule, each probe its own process, OOM "
                        "caught (a run the fit check refuses counts as one that does not train)")
    p.add_argument("--seq-granule", type=int, default=1024)
    p.add_argument("--max-seq-known", default=None,
                   help="max_seq_probes.jsonl of an earlier search (e.g. a device call that ran out of time): "
                        "its probes are taken as measured and not run again")
    p.add_argument("--max-seq-start", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--profile", action="store_true",
                   help="slide runs of the sweep (not the longest-sequence probes): three more steps under "
                        "torch.profiler after the measured ones, all threads: where the step goes between the "
                        "GPU's streams and the host threads, and a Gantt chart of one step "
                        "(per_run/pipeline_<run>.png); the measured steps run without it")


def _flops_per_token(model: str, num_layers: int | None, seq: int) -> float | None:
    try:
        from ...models.load import load_model
        from ...telemetry.flops import train_flops_per_token
        return train_flops_per_token(load_model(model, num_layers=num_layers, with_tokenizer=False).split, seq)
    except Exception:  # noqa: BLE001
        return None


def run(args: argparse.Namespace) -> Path:
    out = Path(args.out or "benchmarks/results/throughput")
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    models = [m.strip() for m in args.models.split(",")]
    # --max-seq / --max-batch without --batches: the planned workloads alone
    planned_only = args.batches is None and (args.max_seq or args.max_batch)
    batches = [] if planned_only else [int(b) for b in (args.batches or DEFAULT_BATCHES).split(",")]
    seqs = [int(s) for s in (args.seq_lens or str(args.seq_len)).split(",")]
    systems = [s.strip() for s in args.systems.split(",")]
    objective = getattr(args, "objective", "sft")
    recipes = [parse_recipe(t + (f"+{objective}" if objective != "sft" else ""))
               for t in getattr(args, "recipes", "plain").split(",") if t.strip()]
    steps, warmup, layers, dev = args.steps, args.warmup, args.num_layers, "cuda" if cuda else "cpu"
    if args.smoke:
        models = ["tiny-qwen3", "tiny-llama"] if args.models == "qwen3-8b,llama-3.1-8b" else models
        batches, seqs, steps, warmup, dev = ([] if planned_only else [2]), [32], 2, 1, "cpu"
        cuda = False
    _check_recipes(recipes, batches)
    gpus = parse_gpus(getattr(args, "gpus", "1"), "cpu" if args.smoke else args.device)
    # The floor times the layers as slide runs them (compiled or not).
    slide_over = _runtime_overrides(args.runtime)
    variants = parse_ab_variants(getattr(args, "variants", ""), slide_over)
    rounds = max(1, int(getattr(args, "rounds", 1)))
    runs = _ThroughputRuns(args, cuda=cuda, dev=dev, layers=layers, steps=steps, warmup=warmup, recipes=recipes,
                           rounds=rounds, slide_over=slide_over)
    flops: dict[tuple[str, int], float | None] = {}
    for c in sweep(models, seqs, batches, gpus, systems, recipes, variants, rounds):
        # the collective probe runs before the first run on its ranks, the floor after its layer's first run
        if (c.model, c.seq) not in flops:
            flops[c.model, c.seq] = _flops_per_token(c.model, layers, c.seq)
        runs.measure_one(c.system, c.model, c.batch, c.seq, flops[c.model, c.seq], c.recipe, c.gpus,
                         runs.collective_of(c.model, c.gpus), c.variant, c.overrides, c.round)
    if args.max_seq or args.max_batch:
        runs.run_planned(models, seqs)
    if args.max_seq_search:
        runs.search_max_seq(models, out)
    add_scaling(runs.rows)
    _write(out, runs.rows, runs.raw, runs.floors, cuda, slide_runtime=args.runtime, per_run=runs.per_run,
           collectives=runs.collectives, limits=runs.limits)
    return out


class _ThroughputRuns:
    """One throughput call's runs and what they recorded: the rows, the raw results, every run in
    bench.measure's form (per_run, for the common tables and plots), and the floor and collective
    probes, each run once: the collective before the first run on its ranks, the floor (of the layer
    the run resolved) just after it."""

    def __init__(self, args: argparse.Namespace, *, cuda: bool, dev: str, layers: int | None, steps: int,
                 warmup: int, recipes: list[dict], rounds: int, slide_over: dict):
        self.args, self.cuda, self.dev, self.layers = args, cuda, dev, layers
        self.steps, self.warmup, self.recipes, self.rounds, self.slide_over = steps, warmup, recipes, rounds, slide_over
        self.rows: list[dict] = []
        self.raw: list[dict] = []
        self.floors: dict = {}
        self.collectives: dict = {}
        self.limits: dict = {}
        self.per_run: list[dict] = []
        self.adamw_probe = None

    def floor_of(self, model: str, batch: int, seq: int, layer: str = "hf",
                 state: tuple[str, str] = ("fp32", "fp32")) -> dict | None:
        """The floor probe of a workload with the decoder layer a run ran (hf or lean: one probe per
        workload, layer and call; probed after the run, which resolves the layer), its host AdamW
        probed in the run's state format (master, moments): an A/B variant with --moments or
        --master takes the workload's floor with the AdamW probe of its own format."""
        args, slide_over = self.args, self.slide_over
        if args.no_floor:
            return None
        base_state = (str(slide_over.get("master", "fp32")), str(slide_over.get("moments", "fp32")))
        fl = self._floor(model, batch, seq, layer, base_state)
        key = _floor_key(model, batch, seq, layer, state)
        if state == base_state or fl.get("status") != "ok":
            return fl
        if key not in self.floors:
            from ..floor_probes import probe_adamw
            probe = probe_adamw(n=4 * 2**20 if args.smoke else 128 * 2**20, master=state[0], moments=state[1],
                                host_adamw=str(slide_over.get("host_adamw", "dynamic")),
                                grad_download=str(slide_over.get("grad_download", "compute")))
            # the workload's GPU and copy probes, this format's AdamW (a slide row's floor is
            # recomputed from these; a partial floor, the CPU's, is its AdamW term alone: rescaled)
            self.floors[key] = dict(fl, adamw=probe, adamw_state=list(state))
            terms = dict(fl.get("terms") or {})
            if fl.get("partial") and terms.get("adamw_s") and probe.get("adamw_params_per_s"):
                terms["adamw_s"] *= fl["adamw"]["adamw_params_per_s"] / probe["adamw_params_per_s"]
                known = {k: v for k, v in terms.items() if v is not None}
                self.floors[key].update(terms=terms, floor_s=max(known.values()), bound_by=max(known, key=known.get))
        return self.floors[key]

    def _floor(self, model: str, batch: int, seq: int, layer: str, state: tuple[str, str]) -> dict:
        """The workload's floor probe in --runtime's state format `state` (measure_floor, once a call)."""
        args, slide_over, dev, floors = self.args, self.slide_over, self.dev, self.floors
        key = _floor_key(model, batch, seq, layer, state)
        if key not in floors:
            floors[key] = measure_floor(model, batch, seq, self.layers, dev,
                                        adamw_n=(4 * 2**20 if args.smoke else 128 * 2**20),
                                        # (one host AdamW probe a call, for the state format it measured)
                                        adamw=(self.adamw_probe if all((self.adamw_probe or {}).get(k, "fp32")
                                                                       == slide_over.get(k, "fp32")
                                                                       for k in ("moments", "master")) else None),
                                        timeout_s=args.timeout,
                                        compile_layers=_compiles(slide_over, dev),
                                        head_impl=_head_impl(slide_over, dev),
                                        grad_download=str(slide_over.get("grad_download", "compute")),
                                        host_adamw=str(slide_over.get("host_adamw", "dynamic")),
                                        disk_dir=slide_over.get("disk_dir"),
                                        disk_block_mb=int(slide_over.get("disk_block_mb", 64)),
                                        disk_io_threads=int(slide_over.get("disk_io_threads", 4)),
                                        layer=layer, moments=str(slide_over.get("moments", "fp32")),
                                        master=str(slide_over.get("master", "fp32")))
            if floors[key].get("status") == "ok":
                self.adamw_probe = floors[key].get("adamw")
        return floors[key]

    def measure_one(self, system, model, batch, seq, fpt, rec, n=1, coll=None, vname="", vover=None, rnd=1,
                    planned: Planned | None = None) -> None:
        """Run one configuration, then the floor of the layer it ran, and record it (per_run, raw, rows)
        and a line on stdout."""
        args, rows = self.args, self.rows
        key = f"{model}/b{batch}/s{seq}"
        chosen_by = planned.chosen_by if planned else None
        r = _run_system(system, model, self.layers, batch, seq, self.steps, self.warmup, self.dev, self.cuda, args,
                        profile=args.profile, recipe=rec, ranks=n, variant=vover)
        fl = self.floor_of(model, batch, seq, _layer_ran(system, r), _state_of(system, r))
        tag = "-".join(t for t in (rec["name"] if len(self.recipes) > 1 else "", vname,
                                   f"r{rnd}" if self.rounds > 1 else "", planned.kind if planned else "") if t)
        self.per_run.append(_as_measured(r, system, model, batch, seq, self.warmup, tag, gpus=n))
        self.raw.append({"key": key, "system": system, "recipe": rec["name"], "gpus": n,
                         "variant": vname or None, "round": rnd if vname else None, "chosen_by": chosen_by,
                         **{k: v for k, v in r.items() if k != "steps"}})
        rows.append(_row(system, model, batch, seq, r, fpt, fl, recipe=rec, collective=coll, ranks=n,
                         variant=vname, round_=rnd, chosen_by=chosen_by))
        print(f"[throughput] {key} {system} {rec['name']}" + (f" {vname} round {rnd}" if vname else "")
              + f" x{n}" + (f" ({chosen_by})" if chosen_by else "") + f": {rows[-1]['status']} "
              f"{O.fmt(rows[-1].get('tokens_per_s'), 0)} tok/s step/floor {O.fmt(rows[-1].get('step_over_floor'))} "
              f"step/hw-floor {O.fmt(rows[-1].get('step_over_hw_floor'))}", flush=True)

    def collective_of(self, model: str, n: int) -> dict | None:
        """The collective probe of `n` ranks (one per model and rank count), None on one rank."""
        if n == 1 or self.args.no_floor:
            return None
        ckey = f"{model}/n{n}"
        if ckey not in self.collectives:
            self.collectives[ckey] = probe_collective_for(model, self.layers, n, self.dev, self.args.timeout)
            _print_collective(ckey, self.collectives[ckey])
        return self.collectives[ckey]

    def run_planned(self, models: list[str], seqs: list[int]) -> None:
        """slide at the limits the fit check allows on this machine's budget (engine.limits), per recipe."""
        layers = self.layers
        for model in models:
            for p in planned_workloads(model, layers, self.dev, self.args, self.recipes, seqs):
                self.limits.setdefault(model, []).append({"chosen_by": p.chosen_by, **p.record})
                if p.workload is None:
                    print(f"[throughput] {model} {p.recipe['name']}: {p.chosen_by}: nothing fits", flush=True)
                    continue
                batch, seq = p.workload
                self.measure_one("slide", model, batch, seq, _flops_per_token(model, layers, seq),
                                 p.recipe, planned=p)

    def search_max_seq(self, models: list[str], out: Path) -> None:
        """The longest trainable sequence at batch 1 of each model (longest_sequence), into raw."""
        args = self.args
        granule, start = (16, 32) if args.smoke else (args.seq_granule, args.max_seq_start)
        for model in models:
            # the sweep's own slide runs at batch 1 answer the search's question for their lengths
            measured = {int(row["seq_len"]): run for row, run in zip(self.rows, self.raw)
                        if row["model"] == model and row["system"] == "slide" and int(row["batch_size"]) == 1
                        and row.get("gpus", 1) == 1}
            found = longest_sequence(model, self.layers, self.dev, args, granule, start,
                                     probe_log=out / "max_seq_probes.jsonl",
                                     known_log=Path(args.max_seq_known) if args.max_seq_known else None,
                                     measured=measured)
            self.raw.append({"key": f"{model}/max-seq", "system": "slide", **found})
            print(f"[throughput] {model} longest trainable sequence at batch 1: {found['max_seq']} tokens "
                  f"(probes: {found['probes']})", flush=True)


class SweepRun(NamedTuple):
    """One run of the sweep: a system at a workload, on `gpus` ranks, in one recipe, A/B variant and round."""
    model: str
    seq: int
    batch: int
    gpus: int
    system: str
    round: int
    recipe: dict                 # parse_recipe's
    variant: str                 # the A/B variant's name; "" outside an A/B
    overrides: dict              # its RuntimeConfig overrides


def sweep(models: list[str], seqs: list[int], batches: list[int], gpus: list[int], systems: list[str],
          recipes: list[dict], variants: list[tuple[str, dict]], rounds: int) -> list[SweepRun]:
    """The sweep's runs in the order they run: per model, sequence length, batch and rank count, each
    system; on more than one rank slide alone. The baselines run a plain step once per workload; slide
    and gpu-ckpt run every recipe; an A/B (slide only) runs every recipe's variants back to back, each
    round in turn."""
    plain = [parse_recipe("plain")]
    return [SweepRun(model, seq, batch, n, system, rnd, rec, vname, vover)
            for model in models for seq in seqs for batch in batches for n in gpus
            for system in (systems if n == 1 else [s for s in systems if s == "slide"])
            for rnd in range(1, (rounds if system == "slide" else 1) + 1)
            for rec in (recipes if system in ("slide", "gpu-ckpt") else plain)
            for vname, vover in (variants if system == "slide" else [("", {})])]


class Planned(NamedTuple):
    """A workload --max-seq or --max-batch chose."""
    recipe: dict                         # parse_recipe's
    workload: tuple[int, int] | None     # (batch, seq); None where nothing fits
    kind: str                            # max-seq | max-batch
    chosen_by: str                       # the row's words: which limit, on what budget
    record: dict                         # the limit (engine.limits' Limit.to_dict) and the budget


def planned_workloads(model: str, layers: int | None, dev: str, args, recipes: list[dict],
                      seqs: list[int]) -> list[Planned]:
    """The workloads of --max-seq (batch 1 and the longest sequence) and --max-batch (the largest batch
    at each of `seqs`), each
    recipe's own: engine.limits' search with slide's runtime (--runtime) on the budget a run's own
    process reads here (bench.budget: the GPU's free memory under --gpu-memory-limit, the host's
    available RAM), for synthetic rows (unpadded) and the recipe's clipping and micro-batches (a limit
    counts micro-batches; the step's batch is that times the recipe's accumN)."""
    from ...engine.config import RuntimeConfig
    from ...engine.limits import Recipe, find_limits
    from ...models.load import load_model
    from ..budget import run_budget
    split = load_model(model, num_layers=layers, with_tokenizer=False).split
    rt = RuntimeConfig(**_slide_runtime(dev, args))
    budget = run_budget(model, layers, dev, args.gpu_memory_limit, timeout_s=args.timeout)
    gib = 2**30
    where = (f"GPU {budget.gpu_free_bytes / gib:.1f} GiB, " if budget.gpu_free_bytes is not None else "") + \
        f"host {budget.host_available_bytes / gib:.1f} GiB"
    out = []
    for rec in recipes:
        accum = rec["grad_accum"]
        for i, seq in enumerate(seqs):
            found = find_limits(split, rt, budget, seq_len=seq, grad_accum=accum, padded=False,
                                recipes=(Recipe(rec["name"], rec["max_grad_norm"]),)).recipes
            if not found:             # a recipe the runtime cannot run (clipping under schedule=eager)
                continue
            (lim,) = found
            record = {"recipe": rec["name"], "budget": where, "grad_accum": accum}
            if args.max_seq and i == 0:       # the longest sequence is the same at every --seq-lens
                value = lim.longest_seq.value
                out.append(Planned(rec, (accum, value) if value else None, "max-seq",
                                   f"longest sequence at batch 1 (plan: {where})",
                                   {**record, "limit": lim.longest_seq.to_dict()}))
            if args.max_batch:
                value = lim.largest_batch.value
                out.append(Planned(rec, (value * accum, seq) if value else None, "max-batch",
                                   f"largest batch at seq {seq} (plan: {where})",
                                   {**record, "limit": lim.largest_batch.to_dict()}))
    return out


def parse_gpus(text: str, device: str) -> list[int]:
    """'1,2' -> [1, 2], each count checked against this machine (launch.check_gpus: more ranks than
    visible GPUs is refused, naming the fix; --device cpu starts CPU processes over gloo)."""
    from ...parallel import launch
    counts = list(dict.fromkeys(int(g) for g in str(text).split(",") if g.strip()))
    if not counts:
        raise ValueError("--gpus: give at least one rank count, e.g. 1,2")
    visible = launch.visible_gpus() if device != "cpu" else 0
    for n in counts:
        if n != 1:
            launch.check_gpus(n, device, visible)
    return counts


def probe_collective_for(model: str, layers: int | None, n: int, dev: str, timeout_s: float) -> dict:
    """bench.collective's probe on n ranks at this model's message sizes (each unit's gradient, in the
    gradient slots' default dtype, and the latency size), its units recorded for the floor."""
    from ...models.load import load_model
    from ..collective import measure_collective, message_sizes
    split = load_model(model, num_layers=layers, with_tokenizer=False).split
    numels = [u.numel for u in split.units]
    grad_bytes = 2 if dev == "cuda" else 4         # the slots' default: BF16 on the GPU, FP32 on the CPU
    return measure_collective(n, message_sizes(numels, grad_bytes), device=dev, timeout_s=timeout_s,
                              sizes_from={"model": model, "unit_numels": numels, "grad_bytes": grad_bytes})


def _print_collective(key: str, c: dict) -> None:
    if c.get("status") != "ok":
        print(f"[throughput] collective probe {key}: {c.get('status')}: {str(c.get('error'))[:300]}", flush=True)
        return
    for r in c["allreduce"]:
        print(f"[throughput] collective probe {key}: all-reduce {r['bytes'] / 2**20:.2f} MiB "
              f"{r['time_s'] * 1e3:.2f} ms, algbw {r['algbw_gib_s']:.2f} GiB/s, busbw {r['busbw_gib_s']:.2f} GiB/s",
              flush=True)


def _as_measured(r: dict, system: str, model: str, batch: int, seq: int, warmup: int,
                 recipe: str = "", gpus: int = 1) -> dict:
    """A run in bench.measure's result form (spec, steps, peaks), so the scenarios' common
    tables and plots cover it. slide and gpu-ckpt runs are measure results already (with
    per-layer spans, host timeline and memory points); the FSDP2 and DeepSpeed workers give
    per-step wall times and peaks only, so only their step curves and peaks are drawn."""
    # recipe: where several ran; gpus: data-parallel ranks, where more than one
    name = f"{system}-{model}-b{batch}-s{seq}" + (f"-{recipe}" if recipe else "") + (f"-x{gpus}" if gpus > 1 else "")
    if "steps" in r:
        return {**r, "spec": {**r.get("spec", {}), "name": name}}
    walls = r.get("step_s") or []
    steps = [{"step": k, "warmup": k < warmup, "wall_s": w, "loss": None} for k, w in enumerate(walls)]
    return {"spec": {"name": name, "model": model, "batch_size": batch, "seq_len": seq,
                     "runtime": {"mode": system}},
            "status": r.get("status"), "error": r.get("error"), "steps": steps,
            **{k: r.get(k) for k in ("machine", "tokens_per_s", "gpu_peak_alloc_gib", "gpu_peak_reserved_gib",
                                      "cpu_peak_rss_gib", "num_layers")}}


def longest_sequence(model: str, layers: int | None, dev: str, args, granule: int, start: int,
                     probe_log: Path | None = None, known_log: Path | None = None,
                     measured: dict[int, dict] | None = None) -> dict:
    """Largest multiple of `granule` that trains at batch 1 in slide mode (--runtime options),
    capped by the model's context. Each probe is one step in its own process; an OOM, a
    refused fit check or a killed process counts as "does not train". Probes of this model in
    `known_log` (an earlier search's probe log) count as run: a search split over calls; so do
    `measured` lengths (sequence -> run result: the sweep's own batch-1 runs of this call)."""
    from ...models.presets import preset_config
    from .techniques import find_max_batch
    try:
        cap = preset_config(model, layers).max_position_embeddings // granule
    except Exception:  # noqa: BLE001 - not a preset: no known cap
        cap = None
    runs: dict[int, dict] = {}
    known: dict[int, bool] = {}

    def record(seq: int, run: dict) -> None:
        """A probe's result, logged as soon as it is known (reused ones too: the new log holds the
        whole search), so a search cut short still leaves its probes."""
        runs[seq] = run
        if probe_log is not None:
            with open(probe_log, "a") as f:
                f.write(json.dumps({"model": model, "seq_len": seq, **run}) + "\n")

    if known_log is not None:
        for line in known_log.read_text().splitlines():
            r = json.loads(line) if line.strip() else {}
            if r.get("model") == model and r["seq_len"] % granule == 0:
                known[r["seq_len"] // granule] = r.get("status") == "ok"
                record(r["seq_len"], {**{k: v for k, v in r.items() if k not in ("model", "seq_len")}, "reused": True})

    from_log = dict(known)
    def summary(r: dict) -> dict:
        return {**{key: r.get(key) for key in ("status", "error", "step_s_mean", "tokens_per_s",
                                               "gpu_peak_alloc_gib", "cpu_peak_rss_gib")},
                "placement": _placement(r)}

    for seq, r in (measured or {}).items():
        if seq % granule == 0 and seq // granule not in known:
            known[seq // granule] = r.get("status") == "ok"
            record(seq, {**summary(r), "sweep_row": True})

    def probe(k: int) -> bool:
        seq = k * granule
        r = _run_system("slide", model, layers, 1, seq, 1, 0, dev, dev == "cuda", args)
        record(seq, summary(r))
        print(f"[throughput] {model} b1 s{seq}: {r.get('status')}", flush=True)
        return r.get("status") == "ok"

    best, history = find_max_batch(probe, start=max(1, start // granule), cap=cap, known=known)
    return {"model": model, "max_seq": best * granule, "granule": granule,
            "context_cap": None if cap is None else cap * granule,
            "reused_probes": sorted((k * granule, ok) for k, ok in from_log.items()),
            "sweep_rows": sorted((k * granule, ok) for k, ok in known.items() if k not in from_log),
            "probes": [(k * granule, ok) for k, ok in history], "runs": runs}


def _compiles(overrides: dict, dev: str) -> bool:
    """Whether slide runs with these overrides compile their layers (_slide_runtime's default)."""
    from ...engine.config import RuntimeConfig
    return RuntimeConfig(**_run_defaults(dev, overrides)).compiles_layers()


def _head_impl(overrides: dict, dev: str) -> str:
    """The output layer slide runs with these overrides use (auto resolved on this device)."""
    from ...engine.config import RuntimeConfig
    return RuntimeConfig(device=dev, head_impl=overrides.get("head_impl", "auto")).resolved_head_impl


def _run_defaults(dev: str, overrides: dict) -> dict:
    """compile_layers as `slidetune train` resolves it for the runs a benchmark stands for: a step of a
    long run, which compile_policy compiles on CUDA (the default 8B job earns the compile back ~2.7x);
    the few steps a benchmark times would not, and would measure the eager layer instead (Qwen3-8B
    b16 clipped on the H200: 6,997 eager against 9,074 tokens/s compiled, NOTES.md "Compile")."""
    given = overrides.get("compile_layers", "auto")
    return {"compile_layers": ("on" if dev == "cuda" else "off") if given == "auto" else given}


def _runtime_overrides(text: str) -> dict:
    """'cache_units=0,compile_layers=true' -> RuntimeConfig overrides (checked)."""
    if not text:
        return {}
    from .pipeline import parse_variants
    ((_, over),) = parse_variants("slide:" + text)
    return over


# Settings the floor is probed with (measure_floor's arguments, from --runtime): a variant that
# changed one would be held against another machine's floor, so variants may not.
FLOOR_SETTINGS = ("compile_layers", "grad_download", "host_adamw", "disk_dir", "disk_block_mb", "disk_io_threads")


def parse_ab_variants(text: str, base: dict | None = None) -> list[tuple[str, dict]]:
    """--variants 'a:;b:clip_sweep=weights' -> [("a", {}), ("b", {"clip_sweep": "weights"})]; none
    given: one unnamed variant. Names must differ, and no variant may change a FLOOR_SETTINGS field."""
    if not text.strip():
        return [("", {})]
    from .pipeline import parse_variants
    out = parse_variants(text, base)       # each variant checked with --runtime's settings (base)
    names = [name for name, _ in out]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"--variants: give each variant its own name ('name:key=value,...'), got {names}")
    for name, over in out:
        probed = sorted(set(over) & set(FLOOR_SETTINGS))
        if probed:
            raise ValueError(f"--variants {name}: {', '.join(probed)} also sets how the floor is probed; put it in "
                             f"--runtime (one call per setting), so every variant's floor is its own machine's")
    return out


def _base_runtime(mode: str, dev: str, overrides: dict | None = None) -> dict:
    """A slide or gpu-ckpt run's RuntimeConfig fields: the scenario's, then `overrides`; FP32 on the CPU.
    The output layer is the runtime's default (head_impl auto), as `slidetune train` runs it."""
    return {"mode": mode, "device": dev, **(overrides or {}), **({"dtype": "fp32"} if dev == "cpu" else {})}


def _slide_runtime(dev: str, args, variant: dict | None = None) -> dict:
    """A slide run's RuntimeConfig fields: compile_layers as train resolves it for a long run
    (_run_defaults), then --runtime's overrides, then an A/B variant's."""
    given = {**_runtime_overrides(args.runtime), **(variant or {})}
    return _base_runtime("slide", dev, {**given, **_run_defaults(dev, given)})


def _run_system(system, model, layers, batch, seq, steps, warmup, dev, cuda, args, profile: bool = False,
                recipe: dict | None = None, ranks: int = 1, variant: dict | None = None) -> dict:
    """One run of `system` at `batch` sequences of `seq` tokens a step (per rank); `recipe`
    (parse_recipe; slide and gpu-ckpt) sets clipping and splits the batch into its micro-batches;
    `ranks` (slide): data-parallel ranks of this host; `variant` (slide): an A/B variant's
    RuntimeConfig overrides, on top of --runtime."""
    work = BenchWorkload(model, num_layers=layers, seq_len=seq, batch_size=batch, steps=steps, warmup=warmup,
                         gpu_memory_limit_gib=args.gpu_memory_limit)
    recipe = recipe or parse_recipe("plain")
    if system in ("slide", "gpu-ckpt"):
        rt = _slide_runtime(dev, args, variant) if system == "slide" else _base_runtime("ckpt", dev)
        accum = recipe["grad_accum"]
        spec = MeasureSpec(name=f"{system}-{model}-b{batch}-s{seq}", workload=replace(work, batch_size=batch // accum),
                           grad_accum=accum, max_grad_norm=recipe["max_grad_norm"], runtime=rt, per_layer=True,
                           profile=profile and system == "slide", ranks=ranks, objective=recipe.get("objective", "sft"))
        r = run_isolated(spec, timeout_s=args.timeout)
        if r.get("status") == "oom":
            r.update({f"oom_{k}": v for k, v in parse_oom(r.get("error", "")).items()})
        return r
    if system == "deepspeed" and ds_availability() == "not installed":
        return {"status": "not installed", "error": "deepspeed does not import (optional extra)"}
    if not cuda:
        return {"status": "needs CUDA", "error": "baseline runs only on the GPU machine"}
    if system == "fsdp2":
        spec = FSDP2Spec(workload=work, device="cuda")
        return run_worker("slidetune.bench.baselines.fsdp2", spec.to_dict(), timeout_s=args.timeout)
    if system == "deepspeed":
        why = ds_availability()
        if why:
            return {"status": why, "error": why}
        spec = FSDP2Spec(name="deepspeed-zero3", workload=work, device="cuda")
        return run_worker("slidetune.bench.baselines.deepspeed_zero3", spec.to_dict(), timeout_s=args.timeout)
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
