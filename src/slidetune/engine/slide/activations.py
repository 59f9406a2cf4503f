"""Layer-input checkpoints: kept on the GPU, or offloaded to pinned host memory.

Offload: after layer i's input is produced, it is copied D2H on its own stream into
host slot (i, m) (one slot per layer and micro-batch m: the slide engine runs a step's
micro-batches layer by layer, so every micro-batch's checkpoint of a layer is alive at
once); in the backward pass it is prefetched H2D one visit ahead, so the copy hides under
the previous recompute + backward. The last `keep_on_gpu` layers are not offloaded
(--tuning.gpu_checkpoints): the backward needs them first, when no earlier layer's
compute could hide their prefetch.

Borrowed held buffers (--tuning.checkpoints_in_held, a `lender`): layer i's offloaded
checkpoints go first into layer i's held gradient buffer (the clipped schedule's), which is
idle from the sweep's read of it until layer i's backward, and only what exceeds it into a
slot of their own. The order that makes it safe: the forward writes the checkpoint after
the lender's wait (the sweep has read the buffer); the backward reads it back (H2D) before
layer i's recompute, on the compute stream's order, and layer i's gradient is copied into
the buffer after that recompute and backward (deferred.DeferredSweep.hold).
"""
from __future__ import annotations

from typing import Callable

import torch

from ...device import Device

# lender(layer) -> (the layer's held gradient buffer [numel], a wait until the clipped sweep has
# read it), or None where the layer lends none
Lender = Callable[[int], "tuple[torch.Tensor, Callable[[], None]] | None"]


class ActivationStore:
    def __init__(self, device: Device, num_layers: int, offload: bool, keep_on_gpu: int = 0,
                 lender: Lender | None = None):
        self.device = device
        self.lender = lender
        self.borrowed: dict[tuple, torch.Tensor] = {}   # key -> its leading part, in its layer's held buffer
        self.lent_at: dict[int, int] = {}               # layer -> elements of its held buffer taken this step
        self.offload = offload
        # layers >= this index keep their checkpoint on the GPU (all of them without offload)
        self.first_kept = num_layers - keep_on_gpu if offload else 0
        # keys: (layer, micro-batch)
        self.gpu: dict[tuple, torch.Tensor] = {}
        self.host: dict[tuple, torch.Tensor] = {}
        self.registered: set[tuple] = set()       # slots page-locked in place (unregistered on free)
        self.meta: dict[tuple, tuple] = {}
        self.saved: dict[tuple, object] = {}      # key -> event of its D2H copy
        self.fetched: dict[tuple, tuple] = {}     # key -> (gpu tensor, event of its H2D copy)
        self.d2h = device.new_stream() if offload else None
        self.h2d = device.new_stream() if offload else None
        self.bytes_d2h = 0

    def save(self, i: int, x: torch.Tensor, m: int = 0) -> None:
        """x: [B, S, d], the input of layer i for micro-batch m."""
        key = (i, m)
        if i >= self.first_kept:
            self.gpu[key] = x
            return
        n = x.numel()
        part = self._borrow(i, n, x.dtype)
        b = 0 if part is None else part.numel()      # elements in the borrowed buffer; the rest own
        i = key
        if b < n and (self.host.get(i) is None or self.host[i].numel() < n - b or self.host[i].dtype != x.dtype):
            self._grow(i, n - b, x.dtype)
        if part is not None:
            self.borrowed[i] = part
        self.meta[i] = (x.shape, x.dtype)
        ready = self.device.record()
        with self.device.stream_ctx(self.d2h):
            self.d2h.wait_event(ready)
            flat = x.reshape(-1)        # on this stream, as x's copy would be were x not contiguous
            if b:
                part.copy_(flat[:b], non_blocking=True)
            if b < n:
                self.host[i][:n - b].copy_(flat[b:], non_blocking=True)
            if self.device.is_cuda:
                x.record_stream(self.d2h)    # keep x's memory until the copy has read it
            self.saved[i] = self.device.record(self.d2h)
        self.bytes_d2h += n * x.element_size()

    def _borrow(self, layer: int, n: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The part of `layer`'s held gradient buffer its next checkpoint of n elements takes (all of
        it, or what the step's earlier micro-batches left), once the clipped sweep has read the
        buffer; None where the layer lends none or nothing is left."""
        lent = None if self.lender is None else self.lender(layer)
        if lent is None:
            return None
        buffer, wait_until_read = lent
        start = self.lent_at.get(layer, 0)
        if buffer.dtype != dtype or start >= buffer.numel():
            return None
        wait_until_read()
        part = buffer[start:start + n]
        self.lent_at[layer] = start + part.numel()
        return part

    # Slots of at least this size are page-locked in place at exactly their size: torch's pinned
    # allocator rounds every request up to a power of two (a 768 MiB checkpoint of a 96K-token
    # sequence would take 1 GiB: 8 GiB more host RAM over 32 layers than engine.fit counts).
    # Smaller ones come from that allocator: registering memory in place needs pages of its
    # own, which glibc guarantees only for blocks it maps apart (always above 32 MiB), and two
    # registrations of one page fail.
    EXACT_PIN_BYTES = 64 * 2**20

    def _grow(self, i: tuple, n: int, dtype: torch.dtype) -> None:
        """Host slot i (layer, micro-batch) for n elements of `dtype`."""
        if self.host.get(i) is not None:
            # a smaller micro-batch came first (rare): no copy may still read the old slot
            self.device.synchronize()
            self._free(i)
        if n * dtype.itemsize >= self.EXACT_PIN_BYTES:
            self.host[i] = torch.empty(n, dtype=dtype)
            self.device.register_host(self.host[i])
            self.registered.add(i)
        else:
            self.host[i] = self.device.host_empty(n, dtype)

    def _free(self, i: tuple) -> None:
        if i in self.registered:
            self.device.unregister_host(self.host[i])
            self.registered.discard(i)
        self.host.pop(i, None)

    def close(self) -> None:
        """Unlock the host slots (the caller has synchronized: no copy is in flight)."""
        for i in list(self.host):
            self._free(i)

    def prefetch(self, i: int, m: int = 0) -> None:
        i = (i, m)
        if not self.offload or i[0] < 0 or i in self.fetched or i not in self.saved:
            return
        shape, dtype = self.meta[i]
        n = torch.Size(shape).numel()
        part = self.borrowed.get(i)
        b = 0 if part is None else part.numel()
        with self.device.stream_ctx(self.h2d):
            self.h2d.wait_event(self.saved[i])
            t = torch.empty(n, dtype=dtype, device=self.device.device)
            if b:
                t[:b].copy_(part, non_blocking=True)
            if b < n:
                t[b:].copy_(self.host[i][:n - b], non_blocking=True)
            self.fetched[i] = (t.view(shape), self.device.record(self.h2d))

    def load(self, i: int, m: int = 0) -> torch.Tensor:
        if i >= self.first_kept:
            return self.gpu.pop((i, m))
        self.prefetch(i, m)
        i = (i, m)
        t, ev = self.fetched.pop(i)
        self.device.current_stream().wait_event(ev)
        if self.device.is_cuda:
            t.record_stream(self.device.current_stream())
        del self.saved[i]
        self.borrowed.pop(i, None)
        return t

    def clear(self) -> None:
        self.gpu.clear()
        self.fetched.clear()
        self.saved.clear()
        self.borrowed.clear()
        self.lent_at.clear()

    def pinned_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host.values())
