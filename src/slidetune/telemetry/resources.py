"""What a long run holds, sampled once per step, and how fast each series grows.

The resources users of offloading trainers see run out over hundreds of steps: host RSS
(the kernel's OOM killer), page-locked memory, GPU memory (allocated by tensors, reserved
by the caching allocator), open file descriptors and threads. `sample_resources` reads
them in ~0.1 ms (psutil and the allocators' counters; no GPU synchronization), and
`growth_per_100_steps` fits each series' least-squares slope after warm-up: a leak shows
as a steady slope, while a one-off allocation or noise does not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from ..device import Device, cuda_host_cache_bytes, pinned_bytes
from .stats import t_quantile_975

# The series sampled each step (bytes or counts) and the unit each is reported in.
SERIES = {
    "rss_bytes": "host resident memory",
    "pinned_bytes": "page-locked host memory the engine holds (device.PINNED)",
    "pinned_cache_bytes": "CUDA caching host allocator: its blocks, in use or cached (pin_memory() anywhere)",
    "gpu_allocated_bytes": "GPU memory in tensors",
    "gpu_reserved_bytes": "GPU memory reserved by the caching allocator",
    "open_fds": "open file descriptors",
    "threads": "threads of the process",
    "step_s": "step time (s)",
}


# Context sampled beside them, not held to a growth target: what the machine did during the step.
# A step-time drift with flat resources is the machine's (a VM's stolen CPU, I/O waits) or the
# engine's; these tell which.
CONTEXT = {
    "cpu_busy_pct": "every core's non-idle time during the step, % of all cores",
    "cpu_steal_pct": "time the hypervisor gave this VM's cores to others during the step, % of all cores",
    "cpu_iowait_pct": "cores idle waiting on I/O during the step, % of all cores",
}


class CpuTimesSampler:
    """System-wide CPU time shares between successive calls (psutil.cpu_times deltas, /proc/stat):
    busy, stolen and I/O-wait, each in % of all cores' time. ~0.05 ms a call."""

    def __init__(self):
        self.last = psutil.cpu_times()

    def sample(self) -> dict[str, float]:
        now = psutil.cpu_times()
        d = {k: getattr(now, k) - getattr(self.last, k) for k in now._fields}
        self.last = now
        total = sum(d.values()) or 1.0
        idle = d.get("idle", 0.0) + d.get("iowait", 0.0)
        return {"cpu_busy_pct": 100.0 * (total - idle) / total,
                "cpu_steal_pct": 100.0 * d.get("steal", 0.0) / total,
                "cpu_iowait_pct": 100.0 * d.get("iowait", 0.0) / total}


def sample_resources(device: Device, proc: psutil.Process | None = None) -> dict[str, float]:
    """The process's resources now (every key of SERIES but step_s)."""
    proc = proc or psutil.Process()
    out = {"rss_bytes": proc.memory_info().rss, "pinned_bytes": pinned_bytes(),
           "pinned_cache_bytes": 0, "gpu_allocated_bytes": 0, "gpu_reserved_bytes": 0,
           "open_fds": proc.num_fds(), "threads": proc.num_threads()}
    if device.is_cuda:
        out["gpu_allocated_bytes"] = torch.cuda.memory_allocated(device.device)
        out["gpu_reserved_bytes"] = torch.cuda.memory_reserved(device.device)
        out["pinned_cache_bytes"] = cuda_host_cache_bytes()
    return out


GROWTH_BLOCK = 10      # steps a block: the interval on the slope is fitted to block means (below)


@dataclass
class Growth:
    series: str
    n: int                   # samples fitted (after warm-up)
    mean: float              # the series' mean over them
    slope_per_step: float    # least squares, units per step
    growth_pct_per_100: float  # 100 steps' growth as a % of the mean (0 for an all-zero series)
    first: float
    last: float
    # the 95% interval of growth_pct_per_100 (bounds equal to it where the series is exactly linear
    # or too short for blocks): least squares on the means of GROWTH_BLOCK-step blocks, whose
    # residuals give the slope's standard error with Student's t at (blocks - 2) degrees of freedom.
    # Blocks, not steps: a step time wanders (a host-bound step follows the host's memory rate for
    # tens of steps), so neighbouring steps are not independent and a per-step error would be far
    # too narrow. A wander longer than the blocks still narrows it: on the H100 (NOTES.md "Soak") two
    # variants of one call read intervals on opposite sides of zero, so a step time's verdict is
    # read beside another variant's, or over a longer run.
    ci_low_pct: float = 0.0
    ci_high_pct: float = 0.0

    def within(self, target_pct: float) -> bool:
        """Growth ruled out: the interval's upper end at or below the target."""
        return self.ci_high_pct <= target_pct

    def verdict(self, target_pct: float) -> str:
        """'yes' (growth above the target ruled out at 95%), 'no' (growth above it shown: the interval's
        lower end above the target) or 'unresolved' (the series' noise allows either over this run)."""
        if self.within(target_pct):
            return "yes"
        return "no" if self.ci_low_pct > target_pct else "unresolved"


def _pct_per_100(slope: float, mean: float) -> float:
    return 100.0 * slope * 100.0 / mean if mean else 0.0


def growth_per_100_steps(series: str, steps: list[int], values: list[float], block: int = GROWTH_BLOCK) -> Growth:
    """Least-squares slope of `values` over `steps`, as % of their mean per 100 steps, with its 95%
    interval from block means (Growth.ci_low_pct / ci_high_pct).

    Growth only: a shrinking series (memory given back) reads negative and passes any target.
    """
    if len(steps) < 2:
        raise ValueError(f"{series}: {len(steps)} sample(s) after warm-up; a slope needs 2 or more "
                         f"(more --steps or a shorter --warmup)")
    x = np.asarray(steps, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    slope = float(np.polyfit(x, y, 1)[0])
    mean = float(y.mean())
    pct = _pct_per_100(slope, mean)
    lo = hi = pct
    nb = len(y) // block
    if nb >= 4:                        # at least 2 degrees of freedom for the residuals
        xb = x[: nb * block].reshape(nb, block).mean(axis=1)
        yb = y[: nb * block].reshape(nb, block).mean(axis=1)
        b_slope, b_icpt = np.polyfit(xb, yb, 1)
        resid = yb - (b_slope * xb + b_icpt)
        sxx = float(((xb - xb.mean()) ** 2).sum())
        se = math.sqrt(float((resid ** 2).sum()) / (nb - 2) / sxx) if sxx > 0 else 0.0
        half = abs(_pct_per_100(t_quantile_975(nb - 2) * se, mean))
        lo, hi = min(pct, pct - half), max(pct, pct + half)
    return Growth(series, len(y), mean, slope, pct, float(y[0]), float(y[-1]), lo, hi)
