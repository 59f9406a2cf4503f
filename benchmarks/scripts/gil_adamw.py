"""Does the GIL slow the host's AdamW loop? (LOG.md 2026-11-23 "The host's AdamW ran 25-50% below its probe", hypothesis d; runs on any CPU machine.)

The slide engine's host worker runs AdamW chunk by chunk from Python: every torch call
releases the GIL while it computes and must take it back to return. When another Python
thread is busy (the compute thread launching kernels, the copy issuers), taking it back can
wait up to sys.getswitchinterval() (the engine sets 0.5 ms). This times FlatAdamW's chunk
loop alone and beside a pure-Python busy thread, for chunk sizes and switch intervals, with
AdamW on one intra-op thread so the busy thread has a core of its own (the GIL is the only
thing they share). Writes one JSON.
Usage: python benchmarks/scripts/gil_adamw.py OUT.json [--params 64e6]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch

from slidetune.engine.adamw import AdamWConfig, FlatAdamW
from slidetune.telemetry.machine import machine_info


def adamw_rate(opt: FlatAdamW, chunk: int, steps: int = 2) -> float:
    n = opt.master.numel()
    grad = torch.randn(chunk)
    t = time.perf_counter()
    for _ in range(steps):
        opt.begin_step()
        for lo in range(0, n, chunk):
            opt.update(grad[: min(chunk, n - lo)], 1e-5, lo)
    return n * steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--params", type=float, default=64e6)
    ap.add_argument("--chunks", default="4,16,64", help="chunk sizes in M elements")
    ap.add_argument("--switch-ms", default="0.5,0.2,0.1")
    a = ap.parse_args()
    torch.set_num_threads(1)
    n = int(a.params)
    opt = FlatAdamW(torch.randn(n), n * 9 // 10, AdamWConfig(weight_decay=0.1))
    adamw_rate(opt, 4 * 2**20, 1)                       # pages touched
    rows = []
    for chunk_m in [int(x) for x in a.chunks.split(",")]:
        for ms in [float(x) for x in a.switch_ms.split(",")]:
            sys.setswitchinterval(ms / 1e3)
            alone = adamw_rate(opt, chunk_m * 2**20)
            stop, count = threading.Event(), [0]

            def busy():
                x = 0
                while not stop.is_set():
                    x += 1
                count[0] = x
            th = threading.Thread(target=busy)
            th.start()
            t = time.perf_counter()
            beside = adamw_rate(opt, chunk_m * 2**20)
            dt = time.perf_counter() - t
            stop.set()
            th.join()
            rows.append(dict(chunk_m=chunk_m, switch_ms=ms, alone_params_per_s=alone, beside_busy_params_per_s=beside,
                             ratio=beside / alone, busy_thread_iters_per_s=count[0] / dt))
            print(f"chunk {chunk_m:3d}M switch {ms:.2f} ms: alone {alone / 1e9:.3f}, beside a busy Python thread "
                  f"{beside / 1e9:.3f} G params/s ({beside / alone:.2f}x)", flush=True)
    with open(a.out, "w") as f:
        json.dump({"machine": machine_info(), "params": n, "adamw_threads": 1, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
