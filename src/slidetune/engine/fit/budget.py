"""The budget: the GPU's free memory and the host's available RAM an estimate is checked against,
this machine's or given, and what of an estimate does not fit in them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..config import RuntimeConfig
from .estimate import MemoryEstimate

# The share of the GPU's free memory and of the host's available RAM a run plans to use (the rest:
# fragmentation, the allocator's caching, other processes' growth). Against the H200's runs of
# Qwen3-8B under a 24 GiB budget (NOTES.md "Memory fit margins"): the GPU estimate, which carries its own margins
# (CUDA_OVERHEAD_BYTES, ACTIVATION_MARGIN, HEAD_MARGIN), was 1.17x the allocator's reserved peak at
# b16 (21.46 vs 18.38 GiB); the host estimate was within 1% of the process's RSS (b16 110.1 vs
# 110.0 GiB; b32 with the lean layer 114.3 vs 115.5). 0.95 leaves 6 GiB of a 123 GiB host and
# 1.2 GiB of a 24 GiB GPU for what the estimate misses.
FIT_SAFETY = 0.95


def free_memory_needed(estimate_bytes: int, safety: float = FIT_SAFETY) -> float:
    """The free memory (GPU or host) an estimate of `estimate_bytes` fits in: check_fit lets a run
    use `safety` of what is free (Budget.shortfalls)."""
    return estimate_bytes / safety


ENV_HOST_MEMORY = "SLIDETUNE_HOST_MEMORY_BYTES"


# ----------------------------------------------------------------------------- availability


def _parse_bytes(text: str) -> int:
    """'137438953472', '128G', '128GiB', '1.5T' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(float(t))


def query_host_available_bytes() -> int:
    """psutil's available RAM, or SLIDETUNE_HOST_MEMORY_BYTES where the host grows its RAM
    lazily (some VMs report far less than they can give)."""
    env = os.environ.get(ENV_HOST_MEMORY)
    if env:
        try:
            return _parse_bytes(env)
        except ValueError as e:
            raise ValueError(f"{ENV_HOST_MEMORY}={env!r} is not a byte count (e.g. 137438953472 or 128G)") from e
    import psutil
    return int(psutil.virtual_memory().available)


def query_gpu_free_bytes(rt: RuntimeConfig) -> int:
    if not torch.cuda.is_available():
        raise RuntimeError("cannot check GPU memory: CUDA is not available (pass gpu_free_bytes to plan "
                           "for a GPU from this machine)")
    dev = torch.device(rt.device) if rt.device not in (None, "auto") else torch.device("cuda")
    return int(torch.cuda.mem_get_info(dev)[0])


# ----------------------------------------------------------------------------- the budget


@dataclass
class Budget:
    device_type: str
    gpu_free: int | None
    host_avail: int
    safety: float
    ranks_per_host: int = 1          # data parallel: the host's ranks share one state (host_bytes_per_host)

    def shortfalls(self, est: MemoryEstimate) -> list[tuple[str, int, int, int, dict[str, int]]]:
        """[(what, needed, usable, available, parts)] for each memory that does not fit."""
        out = []
        if est.device_type == "cuda" and self.gpu_free is not None:
            usable = int(self.safety * self.gpu_free)
            if est.gpu_bytes > usable:
                out.append(("GPU memory", est.gpu_bytes, usable, self.gpu_free, est.gpu_parts))
        usable = int(self.safety * self.host_avail)
        need = est.host_bytes_per_host(self.ranks_per_host)
        if need > usable:
            parts = dict(est.host_parts)
            if est.device_type == "cpu":
                parts.update({f"device: {k}": v for k, v in est.gpu_parts.items()})
            if self.ranks_per_host > 1:
                parts[f"the host's {self.ranks_per_host - 1} other ranks' own buffers"] = need - est.host_total_bytes
            out.append(("host RAM", need, usable, self.host_avail, parts))
        return out

    def fits(self, est: MemoryEstimate) -> bool:
        return not self.shortfalls(est)

def budget_for(est: MemoryEstimate, rt: RuntimeConfig, gpu_free_bytes: int | None,
               host_available_bytes: int | None, safety: float, ranks_per_host: int) -> Budget:
    """The memory an estimate is checked against: the given sizes, else this machine's free GPU
    memory (on CUDA) and available host RAM."""
    if est.device_type == "cuda" and gpu_free_bytes is None:
        gpu_free_bytes = query_gpu_free_bytes(rt)
    host = query_host_available_bytes() if host_available_bytes is None else host_available_bytes
    return Budget(est.device_type, gpu_free_bytes, int(host), safety, ranks_per_host)
