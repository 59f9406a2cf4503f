"""T1M1 (seeds/000): gpu vs ckpt vs slide on a 28-layer Qwen3-1.7B shape, seq 256, batch 1.

Measures step time (mean, std, 95% t CI), tokens/s, TFLOPS, the time breakdown (forward,
head, backward, recompute, optimizer, transfer, GPU idle), peak GPU allocated/reserved and
CPU RSS, the memory timeline across the step, and per-layer forward/backward/recompute/
optimizer times. Each mode runs in its own process.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from . import common

NAME = "modes"
DEFAULTS = dict(model="qwen3-1.7b", seq_len=256, batch_size=1, steps=10, warmup=3)


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.ensure_common_arguments(p, DEFAULTS)
    p.add_argument("--modes", default="gpu,ckpt,slide", help="comma list of gpu, ckpt, slide")
    p.add_argument("--recompute", default="all", help="ckpt mode's layer selection")
    p.add_argument("--head-impl", default="chunked", help="output layer: full | chunked | fused")


def specs(args) -> list:
    b = common.base(args)
    out = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        rt = dict(mode=mode, head_impl=args.head_impl)
        if mode == "slide":
            rt["cache_units"] = 3      # the memory-saving configuration the seed report measured
        if mode == "ckpt":
            rt["recompute"] = args.recompute
        out.append(common.make_spec(mode, b, args, rt))
    return out


def run(args: argparse.Namespace) -> Path:
    out = common.out_dir(args, NAME)
    results = common.run_specs(specs(args), NAME)
    return common.finish(out, NAME, args, results, {"baseline": results[0]["spec"]["name"] if results else None})
