"""A rank's own host memory, stage by stage (issue 21; LOG.md 2026-11-26 "Data parallel on 4 GPUs"): what a training process
holds beside its share of the state, and which stage brings it.

2026-11-26 measured ~2.3 GiB a data-parallel rank (1.5-1.8 GiB anonymous, 0.5 GiB of mapped
files), ~1 GiB of it appearing only in the first steps, on 2x H200. This script takes the same
snapshot (telemetry.machine.host_memory_snapshot) after each stage a rank goes through, so each
stage's share reads apart:

    import      torch, transformers and slidetune imported
    context     the CUDA context (torch.cuda.init and one allocation)
    matmul      one BF16 matrix product (cuBLAS/cuBLASLt handle and workspace)
    comm        the process group and one all-reduce of 64 MiB (NCCL on CUDA, gloo on CPU;
                more than one rank only)
    layer       one decoder layer of --model, forward and backward at --batch-size x --seq-len
                (SDPA and elementwise kernels, autograd); built on the device a parameter at a
                time, as the engine builds device units
    compiled    the same layer through torch.compile as the engine compiles it (--compile)

One rank:      PYTHONPATH=src python benchmarks/scripts/rank_memory.py OUT.json [--model qwen3-8b]
Several ranks: PYTHONPATH=src torchrun --nproc-per-node N benchmarks/scripts/rank_memory.py OUT.json
Rank 0 writes every rank's stages to OUT.json and prints a table of RssAnon and RssFile, with each
stage's growth over the one before, in MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from slidetune.models.load import RandomInit, fill_on_device, load_model
from slidetune.models.units import run_layer
from slidetune.telemetry.machine import host_memory_snapshot, machine_info

MIB = 2**20


def _stage(stages: list[dict], name: str, t0: float) -> None:
    stages.append({"stage": name, "s": time.perf_counter() - t0, **host_memory_snapshot()})


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    stages: list[dict] = []
    _stage(stages, "import", t0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
        torch.cuda.init()
        torch.empty(1, device=dev)
        _stage(stages, "context", t0)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    (a @ a).sum().item()
    del a
    _stage(stages, "matmul", t0)
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("nccl" if cuda else "gloo", device_id=dev if cuda else None)
        x = torch.ones(16 * MIB, device=dev)                   # 64 MiB of FP32
        dist.all_reduce(x)
        _sync(dev)
        assert float(x[0]) == world
        del x
        _stage(stages, "comm", t0)
    loaded = load_model(args.model, num_layers=1, with_tokenizer=False)
    split = loaded.split
    unit = split.layer_units[0]
    flat = fill_on_device(RandomInit(0), unit, dev).to(torch.bfloat16)      # [numel]
    params = {k: v.requires_grad_(True) for k, v in unit.views(flat).items()}
    kwargs = split.layer_kwargs(args.batch_size, args.seq_len, torch.bfloat16, dev)[0]
    x = torch.randn(args.batch_size, args.seq_len, split.hidden_size, device=dev, dtype=torch.bfloat16)
    template = split.layer_template(0)

    def fwd_bwd(run) -> None:
        xi = x.detach().requires_grad_(True)
        out = run(template, params, xi, kwargs)
        torch.autograd.grad(out, [xi, *params.values()], torch.ones_like(out))
        _sync(dev)

    fwd_bwd(run_layer)
    _stage(stages, "layer", t0)
    if args.compile:
        fwd_bwd(torch.compile(run_layer, dynamic=False))
        _stage(stages, "compiled", t0)
    out = {"rank": rank, "world_size": world, "device": str(dev), "model": args.model,
           "layer_params": unit.numel, "stages": stages}
    if world > 1:
        import torch.distributed as dist
        every: list = [None] * world
        dist.all_gather_object(every, out)
        dist.destroy_process_group()
        return {"machine": machine_info(), "ranks": every}
    return {"machine": machine_info(), "ranks": [out]}


def table(doc: dict) -> str:
    lines = ["| rank | stage | s | RssAnon MiB | +anon | RssFile MiB | +file | page-locked MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["ranks"]:
        prev = None
        for s in r["stages"]:
            d_anon = s["rss_anon"] - prev["rss_anon"] if prev else 0
            d_file = s["rss_file"] - prev["rss_file"] if prev else 0
            lines.append(f"| {r['rank']} | {s['stage']} | {s['s']:.1f} | {s['rss_anon'] / MIB:.0f} | "
                         f"{d_anon / MIB:+.0f} | {s['rss_file'] / MIB:.0f} | {d_file / MIB:+.0f} | "
                         f"{(s['engine_pinned'] + s['cuda_host_cache']) / MIB:.0f} |")
            prev = s
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--compile", action="store_true", help="also the layer through torch.compile")
    args = p.parse_args(argv)
    doc = measure(args)
    if int(os.environ.get("RANK", "0")) == 0:          # rank 0 holds every rank's stages (measure)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
