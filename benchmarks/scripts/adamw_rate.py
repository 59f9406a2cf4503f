"""Why the roofline's AdamW probe reads slower than the engine's own AdamW (LOG.md 2026-11-23 "Compiled layers; updates earliest-deadline-first" to 2026-11-23 "Correction: a step is the interval between returns").

Times torch's fused CPU AdamW (engine.adamw.FlatAdamW) several ways and writes one JSON:
  probe        bench.roofline.probe_adamw as the floor uses it (one 128M-element tensor, median of 11 steps)
  probe10      the same, 10 steps
  units        as the slide engine runs it: several layer-sized units, each its own FlatAdamW,
               updated in 64M-element chunks (--tuning.chunk_mb=256) from a BF16 pinned-like
               buffer copied into one FP32 scratch chunk (transfer.GradDrain.consume)
  units_nocast the same without the BF16 -> FP32 copy
  threads=T    the probe at T intra-op threads
Usage: python benchmarks/scripts/adamw_rate.py OUT.json [--layer-params 218e6 --units 4]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from slidetune.bench.floor_probes import probe_adamw
from slidetune.engine.adamw import AdamWConfig, FlatAdamW
from slidetune.telemetry.machine import machine_info


def units_rate(layer_params: int, units: int, chunk: int, cast: bool, steps: int = 3) -> float:
    """Parameters per second, the engine's way: per unit, per chunk, (BF16 -> FP32 scratch) + AdamW."""
    opts = [FlatAdamW(torch.randn(layer_params), layer_params * 9 // 10, AdamWConfig(weight_decay=0.1))
            for _ in range(units)]
    ring = torch.randn(chunk).to(torch.bfloat16)        # [chunk] the gradient as it comes down
    scratch = torch.empty(chunk)                         # [chunk] FP32
    fp32_grad = torch.randn(chunk)

    def one_step():
        for opt in opts:
            opt.begin_step()
            for lo in range(0, layer_params, chunk):
                hi = min(layer_params, lo + chunk)
                if cast:
                    g = scratch[: hi - lo]
                    g.copy_(ring[: hi - lo])
                else:
                    g = fp32_grad[: hi - lo]
                opt.update(g, 1e-5, lo)
    one_step()                                           # warm-up: pages touched, threads up
    t = time.perf_counter()
    for _ in range(steps):
        one_step()
    return units * layer_params * steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layer-params", type=float, default=218e6)    # one Qwen3-8B decoder layer
    ap.add_argument("--units", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=64 * 2**20)
    a = ap.parse_args()
    n = int(a.layer_params)
    rates: dict[str, float] = {}
    rates["probe"] = probe_adamw()["adamw_params_per_s"]
    rates["probe10"] = probe_adamw(steps=10)["adamw_params_per_s"]
    rates["units"] = units_rate(n, a.units, a.chunk, cast=True)
    rates["units_nocast"] = units_rate(n, a.units, a.chunk, cast=False)
    rates["probe_again"] = probe_adamw()["adamw_params_per_s"]     # order effects (page cache, THP)
    full = torch.get_num_threads()
    for t in sorted({max(1, full // 2), max(1, full - 2)}):
        torch.set_num_threads(t)
        rates[f"threads={t}"] = probe_adamw()["adamw_params_per_s"]
    torch.set_num_threads(full)
    doc = {"machine": machine_info(), "threads": full, "layer_params": n, "units": a.units, "chunk": a.chunk,
           "params_per_s": rates}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for k, v in rates.items():
        print(f"{k:14s} {v / 1e9:6.2f} G params/s")


if __name__ == "__main__":
    main()
