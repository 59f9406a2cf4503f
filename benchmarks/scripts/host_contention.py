"""Why the slide engine's host AdamW runs slower than the roofline's AdamW probe (LOG.md 2026-11-23 "The host's AdamW ran 25-50% below its probe").

In the 8B step the host's AdamW took 2.0-2.3 s where the probe predicts 1.54 s (same call,
same machine). Two suspects, each timed here against AdamW alone:
  DMA      the PCIe copies read and write the same host DRAM AdamW streams through
           (8B step: ~32 GB up, ~32 GB down, ~225 GB of AdamW traffic);
  spinning CUDA waits (the default for non-blocking events and for .item()) keep a
           core busy; 16 OpenMP AdamW threads on 16 cores then run as slow as the thread
           that shares its core.
After the 2026-11-23 "The host's AdamW ran 25-50% below its probe" entry's fix the engine still ran AdamW at 0.66-0.82 of its probe (LOG.md 2026-11-23 "The host's AdamW ran 25-50% below its probe"),
so three more suspects are timed too (hypotheses a-c there):
  registered  the FP32 masters page-locked with cudaHostRegister, as cast_on=gpu does;
  launch      a thread launching small kernels non-stop, as the compute thread does;
  dma_into    each gradient chunk written by a D2H copy right before AdamW reads it;
  python      a thread busy in pure Python: AdamW's loop waits for the GIL after each call
              (hypothesis d), at the engine's 0.5 ms switch interval and at 0.2 ms.
Each variant runs AdamW the engine's way (layer-sized units, 64M-element chunks, FP32
gradients from a pinned ring) while background threads apply a load, and reports AdamW's
parameters/s and the DMA's achieved GB/s. Variants named *_bf16 feed AdamW BF16 gradients
(grad_download=compute, LOG.md 2026-11-23 "Gradients cross PCIe in BF16") instead of FP32 ones. The kernel is torch's fused one
(BF16 gradients widened into a scratch chunk first; until 2026-11-23 an inductor-compiled
kernel, which held the GIL) unless the name has _dynamic or _static in it:
native_adamw's loop with that OpenMP schedule (LOG.md 2026-11-23 "The host's AdamW in C"), beside the same loads:
  launch  the compute thread's kind of load (a thread launching small kernels non-stop),
  python  a thread busy in pure Python,
  engine  copies at the engine's rate (blocking waits) plus a launching thread.
Writes one JSON.
Usage: python benchmarks/scripts/host_contention.py OUT.json [--units 8 --dma-gbs 15 --only alone,alone_bf16]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch

from slidetune.engine import native_adamw
from slidetune.engine.adamw import AdamWConfig, FlatAdamW
from slidetune.telemetry.machine import machine_info

CHUNK = 64 * 2**20                      # elements: --tuning.chunk_mb=256 of FP32


class Load(threading.Thread):
    """A background load that runs until stop(); `gbs` is the DMA rate it achieved."""

    def __init__(self, kind: str, dma_gbs: float, blocking: bool):
        super().__init__(daemon=True)
        self.kind = kind                  # "h2d" | "d2h" | "both" | "spin" | "launch" | "python"
        self.dma_gbs = dma_gbs            # target rate per direction (0: as fast as it goes)
        self.blocking = blocking          # blocking events yield the core while waiting
        self.halt = threading.Event()
        self.bytes = 0
        self.seconds = 0.0
        n = CHUNK // 4                    # 64 MB of FP32 per copy
        self.host = torch.empty(n, dtype=torch.float32).pin_memory()
        self.host_down = torch.empty(n, dtype=torch.float32).pin_memory()
        self.dev = torch.randn(n, device="cuda")
        self.dev_up = torch.empty(n, device="cuda")
        self.stream = torch.cuda.Stream()

    def run(self) -> None:
        t0 = time.perf_counter()
        if self.kind == "python":             # pure Python: holds the GIL but for the switch interval
            x = 0
            while not self.halt.is_set():
                x += 1
            self.seconds = time.perf_counter() - t0
            return
        with torch.cuda.stream(self.stream):
            while not self.halt.is_set():
                t = time.perf_counter()
                moved = 0
                if self.kind == "spin":
                    torch.cuda._sleep(50_000_000)          # ~25 ms of GPU time; the wait spins on a core
                elif self.kind == "launch":
                    small = self.dev_up[:1024]
                    for _ in range(500):                   # Python + driver time per launch, as a compute thread
                        small.add_(1.0)
                else:
                    if self.kind in ("h2d", "both"):
                        self.dev_up.copy_(self.host, non_blocking=True)
                        moved += self.host.numel() * 4
                    if self.kind in ("d2h", "both"):
                        self.host_down.copy_(self.dev, non_blocking=True)
                        moved += self.dev.numel() * 4
                ev = torch.cuda.Event(blocking=self.blocking)
                ev.record()
                ev.synchronize()
                self.bytes += moved
                if self.dma_gbs > 0 and moved:
                    per_dir = moved / (2 if self.kind == "both" else 1)
                    rest = per_dir / (self.dma_gbs * 1e9) - (time.perf_counter() - t)
                    if rest > 0:
                        time.sleep(rest)
        self.seconds = time.perf_counter() - t0

    def stop(self) -> float:
        self.halt.set()
        self.join()
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def adamw_rate(opts: list[FlatAdamW], grad: torch.Tensor, steps: int, dma_from: torch.Tensor | None = None) -> float:
    """Parameters per second over `steps` passes of every unit, chunk by chunk (the engine's loop).

    dma_from: a GPU tensor copied into `grad` (D2H, waited on with a blocking event) before each
    chunk's AdamW, so AdamW reads memory a DMA has just written; the copy's time is excluded."""
    copy_s = 0.0

    def one_step():
        nonlocal copy_s
        for opt in opts:
            opt.begin_step()
            n = opt.master.numel()
            for lo in range(0, n, CHUNK):
                hi = min(n, lo + CHUNK)
                if dma_from is not None:
                    t = time.perf_counter()
                    grad[: hi - lo].copy_(dma_from[: hi - lo], non_blocking=True)
                    ev = torch.cuda.Event(blocking=True)
                    ev.record()
                    ev.synchronize()
                    copy_s += time.perf_counter() - t
                opt.update(grad[: hi - lo], 1e-5, lo)
    t = time.perf_counter()
    for _ in range(steps):
        one_step()
    return sum(o.master.numel() for o in opts) * steps / (time.perf_counter() - t - copy_s)


def copy_bandwidth(n: int = 2**29) -> float:
    """Host DRAM GB/s of a large FP32 copy (read + write bytes), all intra-op threads."""
    a, b = torch.randn(n), torch.empty(n)
    b.copy_(a)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    return 5 * 2 * n * 4 / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layer-params", type=float, default=218e6)   # one Llama-3.1-8B decoder layer
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dma-gbs", type=float, default=15.0, help="per direction; the 8B step's average is ~13")
    ap.add_argument("--only", default="", help="comma list of variant names to run (default: all)")
    a = ap.parse_args()
    n = int(a.layer_params)
    opts = [FlatAdamW(torch.randn(n), n * 9 // 10, AdamWConfig(weight_decay=0.1)) for _ in range(a.units)]
    grad = torch.randn(CHUNK).pin_memory()              # the pinned FP32 ring chunk AdamW reads
    grad_bf16 = torch.randn(CHUNK).to(torch.bfloat16).pin_memory()   # grad_download=compute's ring chunk
    full = torch.get_num_threads()
    assert native_adamw.load() is not None, "the native AdamW kernel did not build"
    adamw_rate(opts, grad, 1)                           # warm-up: pages touched, threads up

    variants = [   # name, loads [(kind, dma_gbs, blocking)], AdamW threads
        ("alone", [], full),
        ("dma_both_15", [("both", a.dma_gbs, False)], full),
        ("dma_both_full", [("both", 0.0, False)], full),
        ("spin", [("spin", 0.0, False)], full),
        ("spin_blocking", [("spin", 0.0, True)], full),
        ("engine_like", [("both", a.dma_gbs, False), ("spin", 0.0, False)], full),
        ("engine_like_blocking", [("both", a.dma_gbs, True), ("spin", 0.0, True)], full),
        (f"engine_like_threads={full - 1}", [("both", a.dma_gbs, False), ("spin", 0.0, False)], full - 1),
        ("launch_blocking", [("launch", 0.0, True)], full),
        ("dma_into_grad", [], full),
        ("copies_and_launches_blocking", [("both", a.dma_gbs, True), ("launch", 0.0, True)], full),
        ("python_busy_switch_0.5ms", [("python", 0.0, True)], full),
        ("python_busy_switch_0.2ms", [("python", 0.0, True)], full),
        ("registered", [], full),
        ("registered_copies_and_launches", [("both", a.dma_gbs, True), ("launch", 0.0, True)], full),
        ("alone_again", [], full),
        ("alone_bf16", [], full),
        ("dma_both_15_bf16", [("both", a.dma_gbs, True)], full),
        ("dma_both_full_bf16", [("both", 0.0, True)], full),
        ("alone_fp32_again", [], full),
    ]
    # the schedule A/B (LOG.md 2026-11-23 "The host's AdamW in C"): each load with torch's kernel, then the native loop both ways
    for base, loads in [("alone", []), ("launch", [("launch", 0.0, True)]), ("python", [("python", 0.0, True)]),
                        ("engine", [("both", a.dma_gbs, True), ("launch", 0.0, True)])]:
        for kernel in ("", "_static", "_dynamic"):
            variants.append((f"sched_{base}_bf16{kernel}", loads, full))
    variants += [("sched_alone_fp32_dynamic", [], full), ("sched_launch_fp32_dynamic", [("launch", 0.0, True)], full),
                 (f"sched_launch_bf16_dynamic_threads={full - 1}", [("launch", 0.0, True)], full - 1)]
    if a.only:
        wanted = a.only.split(",")
        unknown = sorted(set(wanted) - {v[0] for v in variants})
        if unknown:
            raise SystemExit(f"unknown variants {unknown}")
        variants = [v for v in variants if v[0] in wanted]
    dma_src = torch.randn(CHUNK, device="cuda")
    out: dict[str, dict] = {}
    for name, loads, threads in variants:
        torch.set_num_threads(threads)
        sys.setswitchinterval(2e-4 if "switch_0.2ms" in name else 5e-4)   # the engine sets 0.5 ms
        if name == "registered":                       # from here on the masters stay page-locked
            for o in opts:
                err = int(torch.cuda.cudart().cudaHostRegister(o.master.data_ptr(), o.master.numel() * 4, 0))
                assert err == 0, f"cudaHostRegister failed ({err})"
        if name == "alone_again":
            for o in opts:
                torch.cuda.cudart().cudaHostUnregister(o.master.data_ptr())
        threads_ = [Load(*spec) for spec in loads]
        for t in threads_:
            t.start()
        time.sleep(0.2)
        kernel = next((k for k in ("dynamic", "static") if f"_{k}" in name), "torch")
        for o in opts:
            o.kernel = kernel
        bf16 = "_bf16" in name
        rate = adamw_rate(opts, grad_bf16 if bf16 else grad, a.steps,
                          dma_from=dma_src if name == "dma_into_grad" else None)
        dma = [t.stop() for t in threads_]
        out[name] = {"adamw_params_per_s": rate, "threads": threads, "kernel": kernel,
                     "grad_dtype": "bf16" if bf16 else "fp32",
                     "loads": [{"kind": s[0], "target_gbs": s[1], "blocking": s[2], "achieved_gbs": g}
                               for s, g in zip(loads, dma)]}
        print(f"{name:28s} AdamW {rate / 1e9:5.2f} G params/s  dma {[round(g, 1) for g in dma]} GB/s", flush=True)
    torch.set_num_threads(full)
    # the DMA alone, for its rate without AdamW
    for kind in ("h2d", "d2h", "both"):
        t = Load(kind, 0.0, True)
        t.start()
        time.sleep(2.0)
        out[f"dma_{kind}_alone"] = {"achieved_gbs": t.stop()}
        print(f"dma_{kind}_alone {out[f'dma_{kind}_alone']['achieved_gbs']:.1f} GB/s", flush=True)
    out["copy_bandwidth_gbs"] = copy_bandwidth()
    print(f"host copy bandwidth {out['copy_bandwidth_gbs']:.1f} GB/s (read + write)")
    doc = {"machine": machine_info(), "layer_params": n, "units": a.units, "chunk": CHUNK,
           "adamw_bytes_per_param": {"fp32 gradients": 28, "bf16 gradients (*_bf16)": 26}, "variants": out}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
