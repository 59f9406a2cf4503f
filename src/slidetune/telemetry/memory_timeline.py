"""Memory sampled at defined points of a step (per layer and phase), not by a free-running thread.

The CUDA caching allocator does its bookkeeping when an operation is enqueued, so
reading memory_allocated()/memory_reserved() on the compute thread at a point of the
program gives the allocator state of that point without synchronizing. On the CPU the
GPU columns are 0 and the process RSS is recorded instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch


@dataclass
class MemoryPoint:
    index: int          # order within the step
    phase: str          # e.g. forward, backward, head, embed, step_end
    layer: int          # -1 for non-layer points
    allocated: int      # bytes
    reserved: int
    rss: int

    def row(self) -> tuple[str, int, int, int, int]:
        """(phase, layer, allocated, reserved, rss): the form a step record keeps."""
        return (self.phase, self.layer, self.allocated, self.reserved, self.rss)


class MemoryTimeline:
    def __init__(self, device, enabled: bool = False):
        self.device = device
        self.enabled = enabled
        self.points: list[MemoryPoint] = []
        self._proc = psutil.Process()

    def mark(self, phase: str, layer: int = -1) -> None:
        if not self.enabled:
            return
        if self.device.is_cuda:
            alloc = torch.cuda.memory_allocated(self.device.device)
            res = torch.cuda.memory_reserved(self.device.device)
        else:
            alloc = res = 0
        self.points.append(MemoryPoint(len(self.points), phase, layer, alloc, res, self._proc.memory_info().rss))

    def take(self) -> list[MemoryPoint]:
        out, self.points = self.points, []
        return out
