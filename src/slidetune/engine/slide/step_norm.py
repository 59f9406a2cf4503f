"""The step's global gradient norm, summed on the GPU as each unit's gradient completes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...device import Device


@dataclass
class CopiedNorm:
    """The step's squared norm on its way to the host: read by the host worker, so neither the
    compute thread nor the worker's queue waits for it early."""

    host: torch.Tensor      # [1] FP32, page-locked
    ready: object           # event after which `host` holds it

    def squared(self) -> float:
        self.ready.synchronize()
        return float(self.host[0])


class StepNorm:
    def __init__(self, device: Device):
        self.device = device
        self.sq: torch.Tensor | None = None      # [] FP32 on the device: the step's sum so far

    def reset(self) -> None:
        self.sq = torch.zeros((), dtype=torch.float32, device=self.device.device)

    def add(self, flat: torch.Tensor) -> None:
        """Add the squared L2 norm of one unit's gradient slot to the step's GPU accumulator.

        On the compute stream, right after the slot was written: reading 2 bytes/param at HBM
        speed is ~0.1 ms per 8B layer, where the host worker took ~5 ms per 64 MB chunk (a
        single-threaded reduction on the critical path of every chunk's AdamW). The slot
        holds exactly the values AdamW reads (widened to FP32), so this is the same norm.
        """
        (norm,) = torch._foreach_norm([flat], 2, dtype=torch.float32)
        self.sq.add_(norm.square())

    def copy_out(self) -> CopiedNorm:
        """The squared norm, complete once the last unit's is added, copied out on the compute stream."""
        host = self.device.host_empty(1, torch.float32)
        host.copy_(self.sq.view(1), non_blocking=True)
        return CopiedNorm(host, self.device.record())

    def clip_coefficient_on_device(self, max_grad_norm: float | None) -> torch.Tensor:
        """clip_grad_norm_'s coefficient from the step's squared norm, as a 0-dim FP32 tensor on the
        device (no host sync): min(1, max_norm / (norm + 1e-6)); 1 when the norm is not finite
        (as transfer.clip_coefficient, which the host uses)."""
        norm = self.sq.sqrt()
        if max_grad_norm is None or max_grad_norm <= 0:       # deferred without clipping
            return torch.ones_like(norm)
        coef = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
