"""Benchmark scenarios: `slidetune bench SCENARIO [options]`.

Every scenario module exposes
    NAME: str
    def add_arguments(parser: argparse.ArgumentParser) -> None   # scenario-specific flags
    def run(args: argparse.Namespace) -> Path                      # writes results, returns the output dir
and follows docs/contract.md's measurement rules: one process per configuration (bench.runner.run_isolated),
warm-up excluded, CSV + JSON per step and per layer with machine details in every file,
PNG plots and a Markdown report (bench.report), and a --smoke size that runs on the CPU
in under a minute.

Common flags (added by `add_common_arguments`): --out, --smoke, --model, --num-layers,
--seq-len, --batch-size, --steps, --warmup, --gpu-memory-limit (e.g. 24GiB).
"""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

# --smoke's sizes: a 3-layer tiny Qwen3 on the CPU, 2 measured steps after 1 warm-up step
SMOKE = dict(model="tiny-qwen3", seq_len=32, batch_size=1, steps=2, warmup=1, device="cpu")

# scenario name -> module (relative to this package)
SCENARIOS = {
    "runtime": None,          # handled by bench.runtime_check (the runtime's acceptance checks)
    "modes": "modes",
    "recompute": "recompute",
    "head": "head",
    "techniques": "techniques",
    "throughput": "throughput",
    "roofline": "roofline",
    "pipeline": "pipeline",
    "soak": "soak",
}

# one line each for `slidetune bench --help` (each scenario's own --help has its whole docstring)
SCENARIO_HELP = {
    "modes": "gpu vs ckpt vs slide mode: time and memory per layer, a memory timeline (Qwen3-1.7B shape)",
    "recompute": "activation recomputation in ckpt mode: off, all, a list of layers, every k-th",
    "head": "the output layer's cross-entropy: full, chunked or fused, seq 1024 and longer",
    "techniques": "the memory-technique study: FP32, AMP, flash and local attention, ... layer by layer",
    "throughput": "slide mode's tokens/s beside gpu mode, FSDP2 CPU offload and DeepSpeed ZeRO-3",
    "roofline": "the floor of a slide step and each of its terms, probed on this machine",
    "pipeline": "A/B the slide pipeline's tuning knobs on one workload, profiled (busy time per stream, a Gantt)",
    "soak": "a long run's host and GPU memory, descriptors, threads and step time: does anything grow?",
}


def parse_gib(text: str | None) -> float | None:
    """'24GiB' / '24G' / '24' -> 24.0 (GiB)."""
    if text is None:
        return None
    t = text.strip().lower().removesuffix("ib").removesuffix("b").removesuffix("g")
    return float(t)


def add_common_arguments(p: argparse.ArgumentParser, *, model: str, seq_len: int, batch_size: int,
                         steps: int = 10, warmup: int = 3) -> None:
    p.add_argument("--out", type=Path, default=None, help="output directory (default benchmarks/results/<scenario>)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes that run on the CPU in under a minute")
    p.add_argument("--model", default=model)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--steps", type=int, default=steps, help="measured steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=warmup, help="warm-up steps, excluded from statistics")
    p.add_argument("--gpu-memory-limit", type=parse_gib, default=None, metavar="GiB",
                   help="emulate a smaller GPU, e.g. 24GiB (torch.cuda.set_per_process_memory_fraction)")
    p.add_argument("--device", default="auto")


def scenario_module(name: str):
    if name not in SCENARIOS or SCENARIOS[name] is None:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{SCENARIOS[name]}")
