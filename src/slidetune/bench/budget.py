"""The memory a benchmark's run may use here, read as its own process reads it (bench.measure).

    budget = run_budget("qwen3-8b", None, "cuda", gpu_memory_limit_gib=24)   # engine.limits.MachineBudget

A measured run checks its fit in a fresh process, after its CUDA context exists and its model's
skeleton is built: the GPU's free memory then (capped by --gpu-memory-limit, an emulated smaller
card) and the host's available RAM then (the process's own libraries and context already out of it,
~1-2 GiB that a reading from the scenario's process would count as free). This worker reads both at
that point, so a size planned against them (engine.limits) is checked against the same numbers
when it runs; the scenario's process itself never opens a CUDA context (it would hold the GPU
memory the runs are measuring).
"""
from __future__ import annotations

import sys

GiB = 2**30


def planned_gpu_free(device_free: int, gpu_memory_limit_gib: float | None) -> int:
    """The GPU bytes a run plans with: the device's free memory, or less under --gpu-memory-limit."""
    return device_free if not gpu_memory_limit_gib else min(device_free, int(gpu_memory_limit_gib * GiB))


def run_budget(model: str, num_layers: int | None, device: str, gpu_memory_limit_gib: float | None = None,
               timeout_s: float = 600):
    """engine.limits.MachineBudget for a run of `model` on `device` ("cuda" | "cpu"), read in a worker
    process as the run's own would read it (RuntimeError where the worker fails)."""
    from ..engine.limits import MachineBudget
    from .baselines.proc import run_worker
    r = run_worker("slidetune.bench.budget", {"model": model, "num_layers": num_layers, "device": device,
                                              "gpu_memory_limit_gib": gpu_memory_limit_gib}, timeout_s=timeout_s)
    if r.get("status") != "ok":
        raise RuntimeError(f"reading this machine's memory budget failed: {r.get('status')}: {r.get('error')}")
    return MachineBudget(r["gpu_free_bytes"], r["host_available_bytes"])


def _read(spec: dict) -> dict:
    import torch

    from ..engine.fit import query_host_available_bytes
    from ..models.load import load_model
    free = None
    if spec["device"] == "cuda":
        free = planned_gpu_free(torch.cuda.mem_get_info()[0], spec.get("gpu_memory_limit_gib"))
    load_model(spec["model"], num_layers=spec.get("num_layers"), with_tokenizer=False)
    return {"status": "ok", "gpu_free_bytes": free, "host_available_bytes": query_host_available_bytes()}


def main(argv: list[str] | None = None) -> int:
    from .baselines.proc import worker_main
    return worker_main(_read, argv)


if __name__ == "__main__":
    sys.exit(main())
