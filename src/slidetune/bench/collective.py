"""The collective probe: all-reduce (and all-gather) bandwidth over the ranks of one host, as
data-parallel slide uses them (engine/distributed.py, docs/data_parallel.md).

Every rank all-reduces each unit's gradient slot as the unit's backward ends (one message per unit:
a decoder layer's gradient, 2 B/param in BF16 on the GPU, e.g. 378 MiB for a Qwen3-8B layer, and
the vocabulary units'); so the probe times `all_reduce` at those sizes, plus a small one whose time
is mostly latency. `all_gather` is the alternative of docs/data_parallel.md for the weights: each
rank uploads a shard of a unit over its own PCIe link and the ranks gather the rest over NVLink.

Bandwidths as nccl-tests defines them (its doc/PERFORMANCE.md), for a message of S bytes over N
ranks taking t seconds:
  all-reduce  algbw = S / t, busbw = algbw x 2 (N - 1) / N   (a ring moves 2 (N - 1) / N x S per rank)
  all-gather  algbw = S / t, busbw = algbw x (N - 1) / N     (S: the gathered output)
busbw is the per-rank link rate the collective achieved, comparable across N; the floor charges
a message of S bytes 2 (N - 1) / N x S / busbw (= S / algbw at the probed size).

Timing: NCCL on CUDA with CUDA events around the call (the rank's current stream, as the engine
issues it), gloo on CPU with perf_counter around the blocking call; warm-up calls excluded; each
rep times `inner` back-to-back calls (small messages: enough to amortize launch and skew), the
median rep per rank, and the slowest rank's median (a step waits for the last rank).

Run it on N ranks with `measure_collective` (torchrun, one process per rank, bench.baselines.proc),
or call `probe_collective` from every rank of an initialized process group.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

GIB = 2**30
LATENCY_BYTES = 4 * 2**10          # a small message: its time is mostly the collective's latency
# One decoder layer's BF16 gradient spans these on the preset models (Qwen3-1.7B 96 MiB,
# Llama-3.1-8B / Qwen3-8B 416 / 378 MiB): the probe's sizes where no model is given.
DEFAULT_SIZES = (LATENCY_BYTES, 64 * 2**20, 128 * 2**20, 256 * 2**20, 512 * 2**20)
INNER_BYTES = 64 * 2**20           # each rep runs back-to-back calls until this many bytes (at most 20)


@dataclass(frozen=True)
class CollectiveSpec:
    """What one probe run measures."""
    sizes: tuple[int, ...] = DEFAULT_SIZES   # message bytes (all-gather: the gathered output)
    dtype: str = "auto"          # auto: bf16 on CUDA (the gradient slots' dtype), fp32 on CPU (gloo)
    reps: int = 7                # timed reps per size; the median is kept
    warmup: int = 2              # untimed calls per size first (NCCL sets up its channels on the first)
    allgather: bool = True
    device: str = "auto"         # auto | cuda | cpu: cuda takes cuda:LOCAL_RANK and NCCL, cpu gloo
    sizes_from: dict = field(default_factory=dict)   # where the sizes came from (a model's units), recorded


def allreduce_bus_factor(n: int) -> float:
    """Bytes each rank sends (and receives) per byte all-reduced, in a ring: 2 (N - 1) / N."""
    return 2 * (n - 1) / n


def allgather_bus_factor(n: int) -> float:
    """Bytes each rank receives per byte of the gathered output: (N - 1) / N."""
    return (n - 1) / n


def _dtype(name: str, cuda: bool) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if cuda else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _time_reps(fn, reps: int, warmup: int, inner: int, cuda: bool) -> float:
    """Median seconds of one call of fn: `warmup` untimed calls, then `reps` reps of `inner` calls."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def _every_rank(seconds: float, group) -> list[float]:
    """Every rank's median, gathered over `group` (a gloo group under NCCL: no device copies)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, seconds, group=group)
    return [float(s) for s in out]


def _row(nbytes: int, rank_s: list[float], bus_factor: float) -> dict:
    t = max(rank_s)
    algbw = nbytes / t / GIB
    return {"bytes": nbytes, "time_s": t, "algbw_gib_s": algbw, "busbw_gib_s": algbw * bus_factor,
            "rank_time_s": rank_s}


def probe_collective(spec: CollectiveSpec, device: torch.device, cpu_group=None) -> dict:
    """All-reduce (and all-gather) times at each size of `spec` over the default process group;
    every rank must call it (collectives). Tensors live on `device` (cuda:LOCAL_RANK with NCCL);
    `cpu_group` (a gloo group of the same ranks, None: the default group) gathers the timings."""
    n = dist.get_world_size()
    cuda = device.type == "cuda"
    dtype = _dtype(spec.dtype, cuda)
    elem = torch.tensor([], dtype=dtype).element_size()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = {"world_size": n, "backend": dist.get_backend(), "device": str(device.type),
           "dtype": str(dtype).removeprefix("torch."), "bytes_per_elem": elem, "spec": asdict(spec),
           "allreduce": [], "allgather": []}
    for nbytes in sorted(set(spec.sizes)):
        numel = max(n, -(-nbytes // (elem * n)) * n)       # whole elements, divisible into N shards
        size = numel * elem
        inner = max(1, min(20, INNER_BYTES // size))
        buf = torch.ones(numel, dtype=dtype, device=device)             # [numel]
        t = _time_reps(lambda: dist.all_reduce(buf), spec.reps, spec.warmup, inner, cuda)
        out["allreduce"].append(_row(size, _every_rank(t, cpu_group), allreduce_bus_factor(n)))
        if spec.allgather:
            shard = buf[: numel // n].clone()                            # [numel / N]: this rank's part
            t = _time_reps(lambda: gather(buf, shard), spec.reps, spec.warmup, inner, cuda)
            out["allgather"].append(_row(size, _every_rank(t, cpu_group), allgather_bus_factor(n)))
            del shard
        del buf
    return out


# ---------------------------------------------------------------- what the floor charges
def _nearest(rows: list[dict], nbytes: int) -> dict:
    """The probed size nearest to `nbytes` on a log scale (bandwidth varies with the size's order)."""
    return min(rows, key=lambda r: abs(math.log(r["bytes"]) - math.log(max(nbytes, 1))))


def allreduce_busbw(nbytes: int, probe: dict) -> float:
    """GiB/s: the all-reduce bus bandwidth probed nearest `nbytes`."""
    return _nearest(probe["allreduce"], nbytes)["busbw_gib_s"]


def allreduce_seconds(nbytes: int, probe: dict) -> float:
    """Seconds to all-reduce one message of `nbytes` over the probe's ranks: 2 (N - 1) / N x nbytes at
    the bus bandwidth probed nearest that size (0 on one rank)."""
    n = probe["world_size"]
    if n < 2 or nbytes <= 0:
        return 0.0
    return allreduce_bus_factor(n) * nbytes / (allreduce_busbw(nbytes, probe) * GIB)


def allgather_seconds(nbytes: int, probe: dict) -> float:
    """Seconds to all-gather `nbytes` of output (each rank contributing nbytes / N) over the probe's
    ranks: (N - 1) / N x nbytes at the all-gather bus bandwidth probed nearest that size."""
    n = probe["world_size"]
    if n < 2 or nbytes <= 0 or not probe.get("allgather"):
        return 0.0
    return allgather_bus_factor(n) * nbytes / (_nearest(probe["allgather"], nbytes)["busbw_gib_s"] * GIB)


def allreduce_term(unit_numels: list[int], probe: dict, grad_bytes: int | None = None) -> float:
    """Seconds a step the gradient all-reduce takes: one message per unit (its gradient slot,
    `grad_bytes` per parameter; default the probe's element size: BF16 on the GPU, FP32 on CPU)."""
    per = grad_bytes or probe["bytes_per_elem"]
    return sum(allreduce_seconds(n * per, probe) for n in unit_numels)


def message_sizes(unit_numels: list[int], grad_bytes: int) -> tuple[int, ...]:
    """The probe's sizes for a model: each distinct unit gradient (a decoder layer's, the
    vocabulary units') and the latency size."""
    return tuple(sorted({LATENCY_BYTES, *(n * grad_bytes for n in unit_numels if n > 0)}))


# ---------------------------------------------------------------- runs on N ranks
def collective_worker(spec: dict) -> dict:
    """One rank of a probe run (under torchrun): joins the process group the way a training rank
    does (ranks.Ranks.start: cuda:LOCAL_RANK and NCCL, or gloo on the CPU), probes, leaves."""
    from ..parallel.ranks import Ranks
    from ..telemetry.machine import machine_info
    cs = CollectiveSpec(**{**spec, "sizes": tuple(spec.get("sizes") or DEFAULT_SIZES)})
    ranks, device = Ranks.start(cs.device, waits="block")
    try:
        if ranks.world_size < 2:
            raise ValueError("the collective probe needs at least 2 ranks (start it with measure_collective)")
        out = probe_collective(cs, device.device, ranks.dp.world_cpu)
    finally:
        ranks.close()
    return {"status": "ok", "machine": machine_info(), **out, "sizes_from": cs.sizes_from}


def measure_collective(ranks: int, sizes: tuple[int, ...] = DEFAULT_SIZES, device: str = "auto",
                       reps: int = 7, warmup: int = 2, allgather: bool = True, timeout_s: float = 900,
                       sizes_from: dict | None = None) -> dict:
    """The probe on `ranks` ranks of this host, each in its own process (torchrun); rank 0's result."""
    spec = CollectiveSpec(sizes=tuple(sizes), device=device, reps=reps, warmup=warmup, allgather=allgather,
                          sizes_from=sizes_from or {})
    from .baselines.proc import run_worker
    return run_worker("slidetune.bench.collective", asdict(spec), timeout_s=timeout_s, ranks=ranks)


if __name__ == "__main__":
    from .baselines.proc import worker_main
    sys.exit(worker_main(collective_worker))
