"""Host<->device movement of one unit, chunked so casts, copies and updates pipeline.

Upload (uploader thread): FP32 master chunk -> cast into a pinned compute-dtype ring
buffer (CPU threads) -> H2D on the upload stream into the unit's GPU slot. The ring
holds a few chunks; a ring buffer is rewritten only after the event of the H2D copy
that last read it.

Drain (host worker thread): the unit's compute-dtype gradient slot on the GPU ->
D2H chunk by chunk into a pinned ring -> on the CPU, either the AdamW update of that
chunk (eager schedule) or FP32 accumulation into the unit's host gradient (deferred).
The GPU gradient slot is handed back (an event) as soon as its last chunk is copied.
"""
from __future__ import annotations

import math
from concurrent.futures import Future

import torch
from torch.profiler import record_function

from ...device import Device
from .host_store import HostUnit


class Uploader:
    def __init__(self, device: Device, dtype: torch.dtype, chunk_elems: int, ring: int):
        self.device = device
        self.stream = device.new_stream()
        self.chunk = chunk_elems
        self.ring = [device.host_empty(chunk_elems, dtype) for _ in range(ring)]
        self.ring_free = [None] * ring       # event of the H2D copy that last read each buffer
        self.next = 0
        self.bytes = 0

    def upload(self, unit: HostUnit, dst: torch.Tensor, version: int, after: Future | None):
        """Copy unit.master (after its `version`-th update) into `dst` once `after`'s event passed.

        Runs on the uploader thread; returns the event that marks `dst` ready.
        """
        unit.wait_version(version)
        src = unit.master
        n = src.numel()
        slot_free = after.result() if after is not None else None
        with self.device.stream_ctx(self.stream):
            if slot_free is not None:
                self.stream.wait_event(slot_free)
            for lo in range(0, n, self.chunk):
                hi = min(n, lo + self.chunk)
                k = self.next
                self.next = (k + 1) % len(self.ring)
                if self.ring_free[k] is not None:
                    self.ring_free[k].synchronize()
                buf = self.ring[k][: hi - lo]
                with record_function("slidetune.cast"):
                    buf.copy_(src[lo:hi])                      # FP32 -> compute dtype, CPU threads
                dst[lo:hi].copy_(buf, non_blocking=True)       # H2D on the upload stream
                self.ring_free[k] = self.device.record(self.stream)
            self.bytes += n * dst.element_size()
            return self.device.record(self.stream)


class GradDrain:
    def __init__(self, device: Device, dtype: torch.dtype, chunk_elems: int, ring: int):
        self.device = device
        self.stream = device.new_stream()
        self.chunk = chunk_elems
        self.ring = [device.host_empty(chunk_elems, dtype) for _ in range(ring)]
        self.scratch = torch.empty(chunk_elems, dtype=torch.float32)   # one chunk of FP32 grads
        self.bytes = 0

    def drain(self, unit: HostUnit, src: torch.Tensor, ready, slot_free: Future, *, mode: str,
              lr: float = 0.0, want_norm: bool = False) -> float:
        """Move unit's gradient out of `src` (GPU slot) and consume it on the CPU.

        mode: "update" (eager AdamW per chunk), "copy" (first micro-batch), "add" (later ones).
        Resolves `slot_free` with the event after which `src` may be overwritten.
        Returns the squared norm of the FP32 gradient when `want_norm` (else 0).
        """
        n = unit.spec.numel
        starts = list(range(0, n, self.chunk))
        events: list = [None] * len(starts)
        sq = 0.0
        ring = len(self.ring)
        with self.device.stream_ctx(self.stream):
            self.stream.wait_event(ready)

            def issue(c: int) -> None:
                lo = starts[c]
                hi = min(n, lo + self.chunk)
                self.ring[c % ring][: hi - lo].copy_(src[lo:hi], non_blocking=True)
                events[c] = self.device.record(self.stream)
                if c == len(starts) - 1:
                    slot_free.set_result(events[c])

            for c in range(min(ring, len(starts))):
                issue(c)
            if mode == "update":
                unit.opt.begin_step()
            for c, lo in enumerate(starts):
                hi = min(n, lo + self.chunk)
                with record_function("slidetune.d2h_wait"):
                    events[c].synchronize()
                buf = self.ring[c % ring][: hi - lo]
                if mode == "update":
                    g = self.scratch[: hi - lo]
                    g.copy_(buf)                                  # compute dtype -> FP32
                    if want_norm:
                        sq += float(torch.linalg.vector_norm(g)) ** 2
                    with record_function("slidetune.adamw"):
                        unit.opt.update(g, lr, lo)
                else:
                    dst = unit.grad[lo:hi]
                    if mode == "copy":
                        dst.copy_(buf)
                    else:
                        dst.add_(buf)                             # FP32 accumulation across micro-batches
                    if want_norm:
                        sq += float(torch.linalg.vector_norm(dst)) ** 2
                if c + ring < len(starts):
                    issue(c + ring)
        if len(starts) == 0:
            slot_free.set_result(None)
        self.bytes += n * src.element_size()
        if mode == "update":
            unit.bump_version()
        return sq

    @staticmethod
    def deferred_update(unit: HostUnit, lr: float, clip_coef: float, chunk: int) -> None:
        """Apply the step's (clipped) FP32 gradient to the unit, chunk by chunk."""
        unit.opt.begin_step()
        n = unit.spec.numel
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            with record_function("slidetune.adamw"):
                unit.opt.update(unit.grad[lo:hi], lr, lo, grad_scale=clip_coef)
        unit.bump_version()


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6) when that is < 1."""
    if max_norm is None or max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
