"""Host<->device movement of one unit, chunked so casts, copies and updates pipeline.

Two ways to convert between the FP32 host state and the compute dtype:

cast on "cpu" (the original design): FP32 master chunk -> cast into a pinned
  compute-dtype ring buffer on CPU threads -> H2D into the unit's GPU slot; gradients
  come down in the compute dtype and CPU threads convert them to FP32.
cast on "gpu" (default on CUDA): the FP32 master is page-locked in place
  (cudaHostRegister, no extra RAM), chunks go H2D in FP32 into a small GPU staging
  ring and a GPU kernel casts them into the slot; gradients are cast to FP32 on the
  GPU and land in a pinned FP32 ring that AdamW reads directly. Twice the PCIe bytes,
  but on a 16-core host the CPU casts cost as much CPU time as AdamW itself and
  contend with it (benchmarks/NOTES.md), while PCIe has room to spare.

Upload runs on the uploader thread; gradient D2H copies are queued by the D2H issuer
thread (GradDrain.issue) and consumed by the host worker's AdamW (GradDrain.consume); under
the deferred schedule each unit's gradient comes down in one copy into its held buffer
(GradDrain.hold) and waits there for the clipped sweep (GradDrain.deferred_update, then
deferred_moments). Ring buffers are rewritten only after the event of the copy that last read them; a GPU gradient slot is handed back (an event) as soon as its last
chunk has been copied out.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import Future

import torch
from torch.profiler import record_function

from ...device import Device
from ...telemetry.host_timeline import HostTimeline
from .host_store import HostUnit
from .pacing import LinkPacer
from .workers import WorkerError, wait_or_abort


class Uploader:
    def __init__(self, device: Device, dtype: torch.dtype, chunk_elems: int, ring: int, gpu_cast: bool = False,
                 stages: int = 2):
        self.device = device
        self.stream = device.new_stream()
        self.chunk = chunk_elems
        self.gpu_cast = gpu_cast
        if gpu_cast:
            # FP32 staging chunks on the GPU; reuse is ordered by the upload stream.
            self.stage = [torch.empty(chunk_elems, dtype=torch.float32, device=device.device) for _ in range(stages)]
            self.ring = []
        else:
            self.ring = [device.host_empty(chunk_elems, dtype) for _ in range(ring)]
        self.ring_free = [None] * max(1, ring)   # event of the H2D copy that last read each buffer
        self.timeline = HostTimeline()
        self.abort = threading.Event()          # the engine shares its own
        self.next = 0
        self.bytes = 0
        self.pace = LinkPacer(None)             # --tuning.pcie_gbps: the engine sets its h2d pacer

    def upload(self, unit: HostUnit, dst: torch.Tensor, version: int, after: Future | None):
        """Copy the unit's weights (after its `version`-th update) into `dst` once `after`'s event passed:
        its FP32 master, or a disk-master unit's compute-dtype weights (HostUnit.upload_source).

        Runs on the uploader thread; returns the event that marks `dst` ready.
        """
        src = unit.upload_source                     # [numel] fp32 master, or compute-dtype weights
        n = src.numel()
        slot_free = after.result() if after is not None else None
        with self.device.stream_ctx(self.stream):
            if slot_free is not None:
                self.stream.wait_event(slot_free)
            if dst.dtype == src.dtype:
                # An FP32 landing buffer (upload_cast_stream=compute): DMA only, the compute
                # stream casts it; or a disk-master unit's compute-dtype weights straight into its
                # slot (page-locked on CUDA: async). On the CPU this is a plain copy.
                for lo in range(0, n, self.chunk):
                    hi = min(n, lo + self.chunk)
                    self._wait_update(unit, version, hi)
                    self.pace.take((hi - lo) * src.element_size())
                    dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
                self.bytes += n * src.element_size()
                return self.device.record(self.stream)
            if self.gpu_cast:
                for c, lo in enumerate(range(0, n, self.chunk)):
                    hi = min(n, lo + self.chunk)
                    self._wait_update(unit, version, hi)
                    stage = self.stage[c % len(self.stage)][: hi - lo]
                    self.pace.take((hi - lo) * 4)
                    stage.copy_(src[lo:hi], non_blocking=True)     # FP32 H2D from the registered master
                    dst[lo:hi].copy_(stage)                          # cast kernel on the upload stream
                self.bytes += n * 4
                return self.device.record(self.stream)
            for lo in range(0, n, self.chunk):
                hi = min(n, lo + self.chunk)
                self._wait_update(unit, version, hi)
                k = self.next
                self.next = (k + 1) % len(self.ring)
                if self.ring_free[k] is not None:
                    self.ring_free[k].synchronize()
                buf = self.ring[k][: hi - lo]
                with record_function("slidetune.cast"):
                    buf.copy_(src[lo:hi])                      # FP32 -> compute dtype, CPU threads
                self.pace.take((hi - lo) * buf.element_size())
                dst[lo:hi].copy_(buf, non_blocking=True)       # H2D on the upload stream
                self.ring_free[k] = self.device.record(self.stream)
            self.bytes += n * dst.element_size()
            return self.device.record(self.stream)


    def _wait_update(self, unit: HostUnit, version: int, hi: int) -> None:
        """The source's [:hi] must hold the weights after `version` updates before it is copied."""
        if unit.version >= version:
            return
        with self.timeline.span("upload", "wait_update", unit.spec.name):
            unit.wait_version(version, abort=self.abort, upto=hi)


class GradDrain:
    def __init__(self, device: Device, dtype: torch.dtype, chunk_elems: int, ring: int, gpu_cast: bool = False,
                 widen_in_adamw: bool = False):
        """dtype: the gradient slots' dtype (FP32 slots need no cast on either side).
        gpu_cast: widen compute-dtype slots to FP32 on the D2H stream (grad_download=fp32).
        widen_in_adamw: compute-dtype gradients go to AdamW as they landed (native_adamw's
        kernel reads them); otherwise the host widens each chunk into an FP32 scratch first.
        ring=0 (the deferred schedule, whose gradients go straight into held buffers): no ring, no
        scratch, no staging: only hold() is used."""
        self.device = device
        self.stream = device.new_stream()
        self.chunk = chunk_elems
        self.gpu_cast = gpu_cast and dtype != torch.float32     # a cast kernel on the D2H stream
        self.fp32_ring = gpu_cast or dtype == torch.float32     # AdamW reads the ring directly
        self.widen_in_adamw = widen_in_adamw and not self.fp32_ring
        ring_dtype = torch.float32 if self.fp32_ring else dtype
        self.ring = [device.host_empty(chunk_elems, ring_dtype) for _ in range(ring)]
        # Free ring buffers, any order: the host may consume units out of release order
        # (earliest deadline first), so buffers come back out of order too.
        self._free = list(range(ring))
        self._free_cond = threading.Condition()
        if self.gpu_cast and ring:
            self.stage = [torch.empty(chunk_elems, dtype=torch.float32, device=device.device) for _ in range(2)]
        if self.fp32_ring or self.widen_in_adamw or not ring:
            self.scratch = None
        else:
            self.scratch = torch.empty(chunk_elems, dtype=torch.float32)   # one chunk of FP32 grads
        self.bytes = 0
        self.pace = LinkPacer(None)             # --tuning.pcie_gbps: the engine sets its d2h pacer
        self.timeline = HostTimeline()
        self.abort = threading.Event()

    def take_buffer(self, what: str = "a free gradient ring buffer") -> int:
        """Block until a ring buffer is free (the host consumed it); back-pressure when AdamW
        falls behind. Gives up if another pipeline thread failed."""
        with self._free_cond:
            while not self._free:
                if not self._free_cond.wait(timeout=0.5) and self.abort.is_set():
                    raise WorkerError(f"gave up waiting for {what}: another pipeline thread failed")
            return self._free.pop(0)

    def has_free_buffer(self) -> bool:
        """Whether a ring buffer is free now, i.e. the issuer is not held up by the host."""
        with self._free_cond:
            return bool(self._free)

    def give_back(self, r: int) -> None:
        with self._free_cond:
            self._free.append(r)
            self._free_cond.notify()

    def issue(self, unit: HostUnit, src: torch.Tensor, ready, futs: list[Future]) -> object:
        """D2H issuer thread: queue the D2H copies of `src` (the unit's GPU gradient slot).

        Resolves `futs` (one per chunk) with (ring index, event of its copy) as soon as each
        copy is queued, so the host worker can consume chunk c while later ones are still
        being issued. Returns the last copy's event. A ring buffer is reused only after the
        host consumed it (take_buffer). The last chunk's event is also the moment the GPU
        slot may be overwritten.
        """
        n = unit.spec.numel
        starts = list(range(0, n, self.chunk))
        assert len(futs) == len(starts)
        last = None
        with self.device.stream_ctx(self.stream):
            self.stream.wait_event(ready)
            for c, lo in enumerate(starts):
                hi = min(n, lo + self.chunk)
                r = self.take_buffer()
                self.pace.take((hi - lo) * self.ring[r].element_size())     # FP32 ring: 4 B
                if self.gpu_cast:
                    stage = self.stage[c % 2][: hi - lo]
                    stage.copy_(src[lo:hi])                           # cast to FP32 on the GPU
                    self.ring[r][: hi - lo].copy_(stage, non_blocking=True)
                else:
                    self.ring[r][: hi - lo].copy_(src[lo:hi], non_blocking=True)
                last = self.device.record(self.stream)
                futs[c].set_result((r, last))
        self.bytes += n * (4 if self.gpu_cast else src.element_size())   # FP32 slots: element_size 4
        return last

    def consume(self, unit: HostUnit, chunks: list[Future], *, lr: float) -> None:
        """Host worker (eager): wait for each chunk's copy and apply AdamW to it."""
        n = unit.spec.numel
        unit.begin_update()
        unit.opt.begin_step()
        for c, lo in enumerate(range(0, n, self.chunk)):
            hi = min(n, lo + self.chunk)
            r, event = wait_or_abort(chunks[c], self.abort, f"gradient chunk {c} of {unit.spec.name}")
            with record_function("slidetune.d2h_wait"), self.timeline.span("host", "d2h_wait", unit.spec.name):
                event.synchronize()
            buf = self.ring[r][: hi - lo]
            if self.fp32_ring or self.widen_in_adamw:
                g = buf                                       # FP32, or widened by AdamW's kernel
            else:
                g = self.scratch[: hi - lo]
                g.copy_(buf)                                  # compute dtype -> FP32
            with record_function("slidetune.adamw"), self.timeline.span("host", "adamw", unit.spec.name):
                unit.update_range(g, lr, lo)
            unit.advance(hi)
            self.give_back(r)
        unit.bump_version()

    def hold(self, held: torch.Tensor, src: torch.Tensor, ready) -> object:
        """D2H issuer (deferred): copy a unit's whole gradient slot `src` into one of its held host
        buffers, `held` (page-locked on CUDA), after `ready`, in one copy, cast on the GPU first
        where the slot is FP32 and the held buffer narrower. Returns the copy's event (the slot is
        free again after it, and the held gradient is there)."""
        with self.device.stream_ctx(self.stream):
            self.stream.wait_event(ready)
            if src.dtype != held.dtype:
                src = src.to(held.dtype)                      # on the D2H stream, a temporary
            self.pace.take(src.numel() * src.element_size())
            held.copy_(src, non_blocking=True)
            event = self.device.record(self.stream)
        self.bytes += src.numel() * src.element_size()
        return event

    @staticmethod
    def deferred_update(unit: HostUnit, held: torch.Tensor, lr: float, clip_coef: float, chunk: int,
                        part: str = "params") -> None:
        """The new weights from the step's held gradient `held` [numel], scaled by the clip coefficient, chunk by
        chunk (the next step's upload trails it chunk by chunk). part="params": only the
        parameters are written (18 of AdamW's 26 B/param of host DRAM), the next forward waits
        for them, and the moments follow in deferred_moments, where nothing waits
        (FlatAdamW.update's split pair); part="weights": only the unit's compute-dtype upload copy
        (16 B/param; master and moments in deferred_moments); part="all": the whole update at once
        (clip_sweep)."""
        unit.begin_update()
        unit.opt.begin_step()
        n = unit.spec.numel
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            with record_function("slidetune.adamw"):
                unit.update_range(held[lo:hi], lr, lo, grad_scale=clip_coef, part=part)
            unit.advance(hi)
        unit.bump_version()

    @staticmethod
    def deferred_moments(unit: HostUnit, held: torch.Tensor, clip_coef: float, chunk: int, lr: float) -> None:
        """The moments of the update deferred_update wrote the weights of (same gradient `held`,
        same coefficient); after it that held buffer may be overwritten. A unit with an upload copy
        (clip_sweep=weights, whose first pass wrote only the compute-dtype weights) gets its master
        here too, with the same `lr` ("rest"; the moments alone do not depend on it)."""
        n = unit.spec.numel
        part = "rest" if unit.upload_copy else "moments"
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            with record_function("slidetune.adamw"):        # AdamW work to the profile summary too
                unit.update_range(held[lo:hi], lr, lo, grad_scale=clip_coef, part=part)


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6) when that is < 1."""
    if max_norm is None or max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
