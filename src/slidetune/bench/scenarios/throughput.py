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
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

from ...engine.placement import resolved_disk_buffers
from ...objectives.preference import OBJECTIVES
from ...telemetry.flops import StepFlops
from .. import output as O
from ..baselines.deepspeed_zero3 import availability as ds_availability
from ..baselines.fsdp2 import FSDP2Spec
from ..baselines.proc import parse_oom, run_worker
from ..measure import MeasureSpec, lane_busy_fraction
from ..plots import bar_plot, pareto_plot
from ..roofline import compute_of_run, floor_terms, hardware_compute, plan_of_runtime
from ..runner import run_isolated
from ..tables import config_name, pipeline_rows
from ..workload import BenchWorkload
from . import add_common_arguments, common
from .roofline import measure_floor

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


DEFAULT_CLIP = 1.0      # TrainConfig.max_grad_norm's default: the recipe users run


def parse_recipe(text: str) -> dict:
    """'clip+accum4' -> {"name": "clip+accum4", "max_grad_norm": 1.0, "grad_accum": 4, "objective": "sft"};
    a preference objective as a part ('clip+dpo': batches of pairs, the two-pass head)."""
    out = {"name": text.strip(), "max_grad_norm": None, "grad_accum": 1, "objective": "sft"}
    for part in (p.strip() for p in text.split("+")):
        if part == "plain":
            continue
        if part in OBJECTIVES[1:]:
            out["objective"] = part
            continue
        if part.startswith("clip"):
            out["max_grad_norm"] = float(part[4:]) if part[4:] else DEFAULT_CLIP
        elif part.startswith("accum") and part[5:].isdigit() and int(part[5:]) >= 1:
            out["grad_accum"] = int(part[5:])
        else:
            raise ValueError(f"unknown recipe part {part!r} in {text!r}: plain, clip[X], accumN, "
                             f"{'|'.join(OBJECTIVES[1:])}, joined by +")
    return out


def _check_recipes(recipes: list[dict], batches: list[int]) -> None:
    """Each batch splits into the recipe's micro-batches, each of whole pairs where it trains pairs."""
    for rec in recipes:
        if any(b % rec["grad_accum"] for b in batches):
            raise ValueError(f"recipe {rec['name']}: every batch must divide into {rec['grad_accum']} micro-batches")
        if rec["objective"] != "sft" and any((b // rec["grad_accum"]) % 2 for b in batches):
            raise ValueError(f"recipe {rec['name']}: a micro-batch holds whole pairs (2 rows each): every batch / "
                             f"{rec['grad_accum']} must be even")


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
            from ..roofline import probe_adamw
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


def _floor_key(model: str, batch: int, seq: int, layer: str, state: tuple[str, str] = ("fp32", "fp32")) -> str:
    """floors' key: the workload, /lean where the floor timed the lean layer, and the host state
    format where its AdamW probe kept a compact one ("/master-bf16-moments-8bit")."""
    return (f"{model}/b{batch}/s{seq}" + ("/lean" if layer == "lean" else "")
            + ("" if state == ("fp32", "fp32") else f"/master-{state[0]}-moments-{state[1]}"))


def _state_of(system: str, r: dict) -> tuple[str, str]:
    """(master, moments) a run kept its host state in (slide's runtime; FP32 for the others)."""
    rt = (r.get("runtime") or {}) if system == "slide" else {}
    return str(rt.get("master", "fp32")), str(rt.get("moments", "fp32"))


def _layer_ran(system: str, r: dict) -> str:
    """The decoder layer a run ran, for its floor's compute probe: "lean" where slide resolved
    lean_layer on, else HF's ("hf": the baselines, and a run that ended before it resolved)."""
    rt = r.get("runtime") or {}
    return "lean" if system == "slide" and rt.get("lean_layer") == "on" else "hf"


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
    from ... import launch
    counts = list(dict.fromkeys(int(g) for g in str(text).split(",") if g.strip()))
    if not counts:
        raise ValueError("--gpus: give at least one rank count, e.g. 1,2")
    visible = launch.visible_gpus() if device != "cpu" else 0
    for n in counts:
        if n != 1:
            launch.check_gpus(n, device, visible)
    return counts


def _grad_bytes(runtime: dict | None, default: int) -> int:
    """Bytes per parameter of a slide run's gradient slots, what its all-reduce moves: FP32 slots
    (grad_slot_dtype=fp32) or FP32 compute 4, else the compute dtype's 2; `default` without a runtime."""
    if runtime:
        return 4 if runtime.get("grad_slot_dtype") == "fp32" or runtime.get("dtype") == "fp32" else 2
    return default


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


def add_scaling(rows: list[dict]) -> None:
    """Each row's scaling efficiency: its per-GPU tokens/s over that of the one-rank row of the same
    system, model, batch (per GPU), sequence and recipe in the same call (None without one)."""
    def key(r):
        return (r["model"], int(r["seq_len"]), int(r["batch_size"]), r["system"], r.get("recipe"), r.get("variant"))
    base = {key(r): r["tokens_per_s"] for r in rows if int(r.get("gpus") or 1) == 1 and r.get("tokens_per_s")}
    for r in rows:
        one = base.get(key(r))
        per_gpu = r.get("tokens_per_s_per_gpu")
        r["scaling_efficiency"] = per_gpu / one if one and per_gpu else None


def _host_rss_gib(r: dict) -> float | None:
    """The host's peak RSS of a run: one process's, or a data-parallel run's over its ranks with the
    shared state file counted once (telemetry.machine.host_peak_rss), recounted from the ranks'
    parts where the run recorded the file's size (runs before that undercounted it)."""
    from ...telemetry.machine import host_peak_rss
    parts, shared = r.get("rank_results"), r.get("shared_state_gib")
    if parts and shared is not None:
        return host_peak_rss(parts, int(shared * 2**30)) / 2**30
    return r.get("host_rss_gib", r.get("cpu_peak_rss_gib"))


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


def _placement(r: dict) -> dict:
    """Where a slide run's auto settings put things (its resolved runtime): layer slots (0: one
    per layer; with a window, the resident layers beside it), vocabulary updates, device layers,
    and with offload the checkpoints kept on the GPU."""
    rt = r.get("runtime") or {}
    if rt.get("mode") != "slide":
        return {}
    out = {"cache_units": rt.get("cache_units")}
    if rt.get("cache_units"):      # a window: the layers with a slot of their own beside it
        out["resident_layers"] = max(0, int(rt.get("resident_layers") or 0))
    out.update({k: rt.get(k) for k in ("vocab_update", "device_layers")})
    if rt.get("disk_dir"):
        out["disk_units"] = max(0, int(rt.get("disk_units") or 0))
    if rt.get("offload_activations") in (True, "on"):
        out["gpu_checkpoints"] = max(0, int(rt.get("gpu_checkpoints") or 0))
    return out


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


COLUMNS = ["model", "seq_len", "batch_size", "system", "recipe", "variant", "round", "gpus", "chosen_by", "status",
           "step_s_mean", "step_s_std",
           "tokens_per_s", "tokens_per_s_per_gpu", "scaling_efficiency", "model_tflops", "gpu_peak_alloc_gib",
           "gpu_peak_reserved_gib", "cpu_peak_rss_gib", "host_rss_gib", "allreduce_s", "allreduce_busbw_gib_s",
           "floor_s",
           "floor_bound_by", "floor_partial", "step_over_floor", "hw_floor_s", "hw_floor_bound_by",
           "step_over_hw_floor", "oom_requested_gib", "call_s_mean",
           "host_adamw_s", "host_wait_d2h_s", "fwd_wait_upload_s", "bwd_wait_grad_slot_s", "device_layers",
           "gpu_checkpoints", "host_threads", "disk_io_gib", "disk_gib_s", "disk_io_ratio", "disk_buffers",
           "disk_busy_frac", "error"]
# slide's host timeline, seconds per step (bench.measure host_s_mean): where a step goes
# (host_adamw_s: AdamW's time; under clipping the weights pass and the moments pass)
HOST_COLUMNS = {"host_adamw_s": ("host.adamw", "host.adamw_moments"),
                "host_wait_d2h_s": "host.d2h_wait",
                "fwd_wait_upload_s": "compute.wait_upload", "bwd_wait_grad_slot_s": "compute.wait_grad_slot"}


def _row(system, model, batch, seq, r, fpt, fl, recipe: dict | None = None, collective: dict | None = None,
         ranks: int = 1, variant: str = "", round_: int = 1, chosen_by: str | None = None) -> dict:
    """One row of throughput.csv. batch is per rank; tokens_per_s the step's over every rank (the
    per-GPU rate beside it); host_rss_gib the host's RSS over its ranks (the shared state once);
    chosen_by: how the workload was chosen where not given (--max-seq, --max-batch)."""
    recipe = recipe or parse_recipe("plain")
    row = dict(model=model, seq_len=seq, batch_size=batch, system=system, recipe=recipe["name"],
               variant=variant or None, round=round_ if variant else None, gpus=ranks, chosen_by=chosen_by,
               status=r.get("status"), step_s_mean=r.get("step_s_mean"), step_s_std=r.get("step_s_std"),
               tokens_per_s=r.get("tokens_per_s"),
               tokens_per_s_per_gpu=r.get("tokens_per_s_per_gpu") or (r["tokens_per_s"] / ranks
                                                                      if r.get("tokens_per_s") else None),
               gpu_peak_alloc_gib=r.get("gpu_peak_alloc_gib"), gpu_peak_reserved_gib=r.get("gpu_peak_reserved_gib"),
               cpu_peak_rss_gib=r.get("cpu_peak_rss_gib"),
               host_rss_gib=_host_rss_gib(r),
               oom_requested_gib=r.get("oom_requested_gib"), error=(r.get("error") or "")[:200] or None)
    if row["tokens_per_s"] and fpt:
        row["model_tflops"] = row["tokens_per_s"] * fpt / 1e12
    row["call_s_mean"] = r.get("call_s_mean")
    if r.get("disk_io_bytes_per_step") and row["step_s_mean"]:
        # the disk tier's reads and writes a step over the step: the rate the run drew from the
        # disk (its floor's disk_s used the probe's mixed rate; a run below it lost time elsewhere)
        row["disk_io_gib"] = r["disk_io_bytes_per_step"] / 2**30
        row["disk_gib_s"] = row["disk_io_gib"] / row["step_s_mean"]
        if r.get("disk_io_bytes_measured"):
            # what the tier moved a step over the plan's bytes: ~1 when each block is read and
            # written once a step (a block a later entry took from a buffer is not read again; a
            # unit's last block is padded to a whole one)
            row["disk_io_ratio"] = r["disk_io_bytes_measured"] / r["disk_io_bytes_per_step"]
        # the tier's block buffers as the run resolved them (its read-ahead; auto left unresolved: 8)
        row["disk_buffers"] = resolved_disk_buffers(int((r.get("runtime") or {}).get("disk_buffers", -1)))
        # the share of the timed step the tier's I/O threads had a read or write open (the Gantt
        # chart's disk lanes): ~1 where the disk binds the step
        row["disk_busy_frac"] = lane_busy_fraction(r.get("step_timeline"), "disk")
    # slide: decoder layers whose state stayed on the GPU, and the host AdamW's threads (resolved autos)
    row["device_layers"], row["host_threads"] = r.get("device_layers"), r.get("host_threads")
    row["gpu_checkpoints"] = _placement(r).get("gpu_checkpoints")
    host = r.get("host_s_mean") or {}
    for col, keys in HOST_COLUMNS.items():
        found = [host[k] for k in ((keys,) if isinstance(keys, str) else keys) if host.get(k) is not None]
        row[col] = sum(found) if found else None
    usable = collective if collective and collective.get("status") == "ok" and ranks > 1 else None
    if usable:
        from ..collective import allreduce_busbw
        numels = usable["sizes_from"].get("unit_numels") or [0]
        layer_bytes = max(numels[1:-1] or numels) * _grad_bytes(r.get("runtime"),           # a decoder layer's
                                                                usable["sizes_from"].get("grad_bytes", 2))
        row["allreduce_busbw_gib_s"] = allreduce_busbw(layer_bytes, usable) if layer_bytes else None
    if fl and fl.get("status") == "ok":
        floor_s, bound, terms = _floor(system, r, fl, recipe, usable, ranks)
        row.update(floor_s=floor_s, floor_bound_by=bound, floor_partial=fl.get("partial"),
                   allreduce_s=terms.get("allreduce_s"), gather_s=terms.get("gather_s"))
        if row["step_s_mean"] and floor_s:
            row["step_over_floor"] = row["step_s_mean"] / floor_s
        hw_s, hw_bound, _ = _hardware_floor(system, r, fl, recipe, usable, ranks)
        row.update(hw_floor_s=hw_s, hw_floor_bound_by=hw_bound)
        if row["step_s_mean"] and hw_s:
            row["step_over_hw_floor"] = row["step_s_mean"] / hw_s
    return row


def recomputed_layers_of(system: str, r: dict, num_layers: int) -> set[int]:
    """The decoder layers a run recomputed in its backward. slide and gpu-ckpt: as their runtime
    resolves it (RuntimeConfig.recomputed_layers; the spec's where the run recorded none). The
    baselines: their spec's `recompute` (HF gradient checkpointing of every decoder layer, or of
    none); a result without one (a worker that failed before writing its spec) as this scenario runs
    them, FSDP2Spec's default."""
    from ...engine.config import RuntimeConfig
    from ..baselines.fsdp2 import FSDP2Spec
    spec = r.get("spec") or {}
    if system in ("slide", "gpu-ckpt"):
        rt = r.get("runtime") or spec.get("runtime") or {}
        mode = rt.get("mode") or ("slide" if system == "slide" else "ckpt")
        return RuntimeConfig(mode=mode, recompute=str(rt.get("recompute", "all"))).recomputed_layers(num_layers)
    return set(range(num_layers)) if spec.get("recompute", FSDP2Spec.recompute) else set()


def _hardware_floor(system: str, r: dict, fl: dict, recipe: dict, collective: dict | None, ranks: int
                    ) -> tuple[float | None, str | None, dict]:
    """(hardware floor seconds, its largest term, the terms) of one run: _floor's terms with the
    compute probe replaced by the step's FLOPs at the probed GEMM and SDPA rates
    (bench.roofline.hardware_compute, the run's own recomputation), its GPU AdamW and all-reduce
    kept. (None, None, {}) without the probes: a CPU floor (partial) or a floor recorded before them."""
    hw = fl.get("hardware")
    if not hw or fl.get("partial") or not fl.get("compute"):
        return None, None, {}
    rc = recomputed_layers_of(system, r, len(hw["flops"]["layer_matmul"]))
    # the GPU's rates in place of any layer's timing (the lean layer's too: compute_of_run leaves it)
    probed = {k: v for k, v in fl["compute"].items() if not k.startswith("lean_layer_")}
    comp = {**probed, **hardware_compute(hw, rc)}
    if system == "slide" and r.get("runtime"):
        return _floor(system, r, {**fl, "compute": comp}, recipe, collective, ranks)
    # the probe's own placement (every unit on the host): its compute term, replaced
    terms = {k: v for k, v in (fl.get("terms") or {}).items() if v is not None}
    terms["compute_s"] = comp["compute_s"]
    bound = max(terms, key=terms.get)
    return terms[bound], bound, terms


def _floor(system: str, r: dict, fl: dict, recipe: dict, collective: dict | None, ranks: int
           ) -> tuple[float | None, str | None, dict]:
    """(floor seconds, its largest term, the terms) of one run. A slide run: the floor of the placement
    it resolved to (units updated on the GPU cost the host neither AdamW nor copies; the probe's floor
    assumes every unit on the host), on `ranks` data-parallel ranks with the all-reduce term from
    `collective` (bench.roofline.floor_terms). Without CUDA the floor is partial (the AdamW term):
    the all-reduce term joins it, at the units' sizes the probe recorded."""
    floor_s, bound, terms = fl.get("floor_s"), fl.get("bound_by"), dict(fl.get("terms") or {})
    rt = r.get("runtime")
    if system == "slide" and rt and not fl.get("partial"):
        comp = compute_of_run(fl["compute"], rt)          # the layer the run ran: HF's or the lean one
        plan = plan_of_runtime(comp, rt, clipped=bool(recipe["max_grad_norm"]))
        terms = floor_terms(comp, fl["copy"], fl["adamw"], plan, device_adamw=fl.get("device_adamw"),
                            disk=fl.get("disk"), split_sweep=rt.get("clip_sweep") != "whole",
                            collective=collective, ranks=ranks,
                            # a run recorded before dp_weights existed uploaded from every rank
                            grad_bytes=_grad_bytes(rt, 2), dp_weights=rt.get("dp_weights", "upload"))
    elif system == "slide" and collective and collective.get("sizes_from", {}).get("unit_numels"):
        from ..collective import allreduce_term
        terms = {k: v for k, v in terms.items() if v is not None}
        terms["allreduce_s"] = allreduce_term(collective["sizes_from"]["unit_numels"], collective,
                                              _grad_bytes(rt, collective["sizes_from"].get("grad_bytes", 4)))
    else:
        return floor_s, bound, terms
    known = {k: v for k, v in terms.items() if v is not None}
    bound = max(known, key=known.get)
    return known[bound], bound, terms


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


def hardware_table(floors: dict) -> list[dict]:
    """Per workload, the hardware floor's inputs as its floor probe recorded them: the GEMM and SDPA
    rates (TFLOP/s, forward and backward) and the step's FLOPs with every layer recomputed (slide's
    recomputation; TFLOP a step), enough to redo compute_s (bench.roofline.hardware_compute)."""
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
    lines += O.md_table(rows, ["model", "seq_len", "batch_size", "system", "recipe"] + (["variant", "round"] if ab else [])
                        + ["gpus", "status", "step_s_mean", "tokens_per_s",
                           "model_tflops", "gpu_peak_alloc_gib", "cpu_peak_rss_gib", "step_over_floor",
                           "floor_bound_by", "step_over_hw_floor", "hw_floor_bound_by", "oom_requested_gib"],
                        {"step_s_mean": 3, "tokens_per_s": 0, "model_tflops": 1})
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
