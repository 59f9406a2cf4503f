"""Layer-input checkpoints: kept on the GPU, or offloaded to pinned host memory.

Offload: after layer i's input is produced, it is copied D2H on its own stream into
host slot i (one slot per layer, grown to the largest micro-batch seen); in the
backward pass it is prefetched H2D one layer ahead, so the copy hides under the
previous layer's recompute + backward.
"""
from __future__ import annotations

import torch

from ...device import Device


class ActivationStore:
    def __init__(self, device: Device, num_layers: int, offload: bool):
        self.device = device
        self.offload = offload
        self.gpu: dict[int, torch.Tensor] = {}
        self.host: list[torch.Tensor | None] = [None] * num_layers
        self.meta: dict[int, tuple] = {}
        self.saved: dict[int, object] = {}        # layer -> event of its D2H copy
        self.fetched: dict[int, tuple] = {}       # layer -> (gpu tensor, event of its H2D copy)
        self.d2h = device.new_stream() if offload else None
        self.h2d = device.new_stream() if offload else None
        self.bytes_d2h = 0

    def save(self, i: int, x: torch.Tensor) -> None:
        """x: [B, S, d], the input of layer i."""
        if not self.offload:
            self.gpu[i] = x
            return
        n = x.numel()
        if self.host[i] is None or self.host[i].numel() < n or self.host[i].dtype != x.dtype:
            self.host[i] = self.device.host_empty(n, x.dtype)
        self.meta[i] = (x.shape, x.dtype)
        ready = self.device.record()
        with self.device.stream_ctx(self.d2h):
            self.d2h.wait_event(ready)
            self.host[i][:n].copy_(x.reshape(-1), non_blocking=True)
            if self.device.is_cuda:
                x.record_stream(self.d2h)    # keep x's memory until the copy has read it
            self.saved[i] = self.device.record(self.d2h)
        self.bytes_d2h += n * x.element_size()

    def prefetch(self, i: int) -> None:
        if not self.offload or i < 0 or i in self.fetched or i not in self.saved:
            return
        shape, dtype = self.meta[i]
        n = torch.Size(shape).numel()
        with self.device.stream_ctx(self.h2d):
            self.h2d.wait_event(self.saved[i])
            t = torch.empty(n, dtype=dtype, device=self.device.device)
            t.copy_(self.host[i][:n], non_blocking=True)
            self.fetched[i] = (t.view(shape), self.device.record(self.h2d))

    def load(self, i: int) -> torch.Tensor:
        if not self.offload:
            return self.gpu.pop(i)
        self.prefetch(i)
        t, ev = self.fetched.pop(i)
        self.device.current_stream().wait_event(ev)
        if self.device.is_cuda:
            t.record_stream(self.device.current_stream())
        del self.saved[i]
        return t

    def clear(self) -> None:
        self.gpu.clear()
        self.fetched.clear()
        self.saved.clear()

    def pinned_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host if h is not None)
