"""The host AdamW kernels' rates for each state format (issue 46; engine/adamw.py OPTIMIZER_STATES):
params/s of one update over one range far larger than the caches, BF16 gradients, at each thread
count, beside the FP32 kernel (native_adamw.update). Prints a table and writes one JSON with the
machine's details and each format's B/param stored and moved (GB/s moved = rate x moved).
--parts all,params,moments adds the clipped sweep's split pair (clip_sweep=split: the master first,
the moments later), each with its own bytes moved (OptimizerState.update_bytes' part).
--builds native,scalar times the 8-bit passes of two builds of the compact library, alternated over
--rounds: load_compact()'s (AVX-512 where the CPU has it: engine/q8_avx512.py) and the portable
one (-DQ8_SCALAR); each row names its build, and the summary gives each build's best rate.
Usage: python benchmarks/scripts/compact_adamw_rate.py [OUT.json] [--params 16e6] [--threads 1,2] [--parts all]
       [--formats fp32/8bit,bf16/8bit] [--builds native,scalar --rounds 2]; SLIDETUNE_NATIVE_CFLAGS adds
       compiler flags (a code-generation A/B)
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from slidetune.engine import blockwise8, native_adamw
from slidetune.engine.adamw import OPTIMIZER_STATES, OptimizerState
from slidetune.telemetry.machine import machine_info

KW = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _state(fmt: OptimizerState, n: int) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
    """Master and moments in the format, first-touched (and moved away from zero by one step)."""
    master = torch.randn(n).to(fmt.master_dtype)
    moments = [torch.zeros(n, dtype=fmt.moment_dtype) for _ in fmt.moment_names]
    scales = tuple(torch.zeros(blockwise8.num_blocks(n)) for _ in fmt.moment_names) if fmt.moment_block else None
    return [master, *moments], scales


def rate(fmt: OptimizerState, n: int, threads: int, steps: int = 5, part: str = "all",
         kernel: native_adamw.Kernel | None = None) -> float:
    """Parameters per second: the best of `steps` updates after one untimed one (the best: other
    work on a shared machine only slows a call). One thread: the calling thread's CPU time
    (OpenMP runs a one-thread region on the caller), which another process's load does not
    inflate; more: wall time."""
    tensors, scales = _state(fmt, n)
    grad = torch.randn(n).to(torch.bfloat16)

    def one(step: int) -> None:
        if fmt.master == "fp32" and fmt.moments == "fp32":
            native_adamw.update(*tensors, grad, step=step, threads=threads, part=part, **KW)
        else:
            native_adamw.update_compact(*tensors, grad, step=step, threads=threads, scales=scales, part=part,
                                        kernel=kernel, **KW)
    one(1)
    clock = time.thread_time if threads == 1 else time.perf_counter
    times = []
    for step in range(2, steps + 2):
        t = clock()
        one(step)
        times.append(clock() - t)
    return n / min(times)


BUILDS = {"native": lambda: native_adamw.load_compact(), "scalar": lambda: native_adamw.build_compact(("-DQ8_SCALAR",))}


def _summary(rows: list[dict]) -> list[dict]:
    """Each format, part and build's best rate over the rounds (at each thread count)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["master"], r["moments"], r["part"], r["build"])
        got = best.setdefault(key, dict(master=r["master"], moments=r["moments"], part=r["part"], build=r["build"],
                                        q8_avx512=r["q8_avx512"], params_per_s={}))
        for t, x in r["params_per_s"].items():
            got["params_per_s"][t] = max(x, got["params_per_s"].get(t, 0.0))
    return list(best.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--params", type=float, default=16e6)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--parts", default="all", help="comma-separated: all, params, moments")
    ap.add_argument("--formats", default="", help="comma-separated master/moments pairs, e.g. fp32/8bit (default: all)")
    ap.add_argument("--builds", default="native", help="comma-separated: native (load_compact), scalar (-DQ8_SCALAR)")
    ap.add_argument("--rounds", type=int, default=1, help="the builds alternated this many times")
    a = ap.parse_args()
    n, threads, parts = int(a.params), [int(t) for t in a.threads.split(",")], a.parts.split(",")
    kernels = {b: BUILDS[b]() for b in a.builds.split(",")}         # compiled outside the timing
    rows = []
    print(f"{'build':>6} {'master':>6} {'moments':>7} {'part':>7} {'stored':>8} {'moved':>8}  " +
          "  ".join(f"{t:>2} thr G/s (GB/s)" for t in threads))
    wanted = {tuple(f.split("/")) for f in a.formats.split(",") if f}
    for rnd in range(a.rounds):
        for build, kernel in kernels.items():
            for (master, moments), fmt in OPTIMIZER_STATES.items():
                if wanted and (master, moments) not in wanted:
                    continue
                for part in parts:
                    rates = {t: rate(fmt, n, t, part=part, kernel=kernel) for t in threads}
                    moved = fmt.update_bytes(2, part)
                    rows.append(dict(master=master, moments=moments, part=part, bytes_stored=fmt.bytes_per_param,
                                     bytes_moved=moved, params_per_s={str(t): r for t, r in rates.items()},
                                     build=build, q8_avx512=kernel.q8_avx512, round=rnd))
                    print(f"{build:>6} {master:>6} {moments:>7} {part:>7} {fmt.bytes_per_param:>8} {moved:>8}  " +
                          "  ".join(f"{r / 1e9:>9.3f} ({r * moved / 1e9:>5.1f})" for r in rates.values()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(machine=machine_info(), params=n, grad="bf16", rows=rows, best=_summary(rows),
                           extra_cflags=os.environ.get(native_adamw.EXTRA_FLAGS_VAR, ""),
                           clock="1 thread: the calling thread's CPU time; more: wall time; best of 5"), f, indent=1)


if __name__ == "__main__":
    main()
