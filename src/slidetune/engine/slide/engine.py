"""The layer-sliding engine: FP32 master + AdamW on the host, a window of layers on the GPU.

One step: embed -> layers 0..L-1 forward without autograd (each layer's input saved as
a checkpoint) -> head loss with its gradients -> layers L-1..0: recompute from the
checkpoint and differentiate -> embedding gradient. The step's micro-batches (gradient
accumulation) run layer by layer: a layer, once on the GPU, runs every micro-batch before
the next layer, and sums their gradients on the GPU (in FP32 when the compute dtype is
narrower). Its weights cross PCIe once a step whatever the accumulation, no host buffer
accumulates anything, and every unit's gradient is complete right after its backward;
what it costs is the checkpoints of the whole batch (a micro-batch's working set).

Two update schedules (RuntimeConfig.schedule):
  eager: each unit's AdamW runs as soon as its gradient is complete (no clipping);
  deferred (clipping by the global norm): each unit's squared norm is added on the GPU as
    its gradient completes, and the gradient waits where it is until the norm is known:
    host units' in a host buffer in the compute dtype (one D2H copy, 2 B/param for BF16,
    read by AdamW's kernel with the clip coefficient applied in registers), device units'
    in a GPU buffer of their own. After the backward the GPU computes the coefficient and
    updates its units on the compute stream; the host sweeps its units from the embedding
    up, and each next-step upload trails its unit's update, so the sweep overlaps the
    next forward. Why hold the gradient in the compute dtype: with one micro-batch it is
    exactly what the backward made; with several it is the FP32 sum rounded once (BF16
    noise, as the single micro-batch's own gradient), where an FP32 host copy would cost
    4 B/param of host RAM (a Qwen3-8B no longer fits a 128 GiB host).

Four threads cooperate:
  compute (the caller): issues kernels on the compute stream, waits only on events
    and, when it runs ahead, on a GPU slot coming back;
  uploader: waits for a unit's latest update, then copies it H2D into a GPU cache slot
    (FP32 from the page-locked master and a cast kernel, or a CPU cast into a pinned
    ring; transfer.py);
  d2h issuer: queues each unit's gradient D2H copies into a pinned ring as ring
    buffers free up, and hands the GPU gradient slot back (an event);
  host worker: waits for each chunk's copy and runs AdamW on it (eager), or runs the
    clipped update sweep over the held gradients (deferred).
Resident layers (cache_units=0: all; else the lowest `resident_layers`) have a GPU slot
of their own, uploaded once a step as their update lands; the other host layers share a
window of `cache_units` slots. The compute thread plans window uploads `cache_units - 1`
visits ahead; a slot is
overwritten only after the event of its last reader, a gradient slot only after the
event of the D2H copy that drained it. A failing thread sets an abort flag that every
host-side wait polls, and the compute thread re-raises the first error.
No device-wide synchronize on the hot path.

Data parallel (dist=, engine/distributed.py, docs/data_parallel.md): every rank runs this
pipeline on its own micro-batches; each unit's gradient slot is all-reduced as its backward
ends (each rank scaled by 1 / the step's tokens over all ranks), so the norm and the clip
coefficient are global; the host state is one shared mapping per host, and only a unit's
owner holds its gradient and runs its AdamW, while a fifth thread (follower) waits for the
other owners' versions and releases this rank's uploads of their units. Units updated on the
GPU are every rank's own copy (no owner); the disk tier's units are local rank 0's. With
dp_weights=gather a sixth thread (gather) broadcasts each host unit from its owner, the only
rank that uploads it, in the order the compute thread queued them (the same on every rank).
train_step's loss and token count are the step's over all ranks.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_any
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from ...device import Device
from ...models.load import LoadedModel
from ...models.units import UnitSpec
from ...telemetry.events import EventTimer
from ...telemetry.host_timeline import HostTimeline
from ...telemetry.memory_timeline import MemoryTimeline
from .. import native_adamw
from ..adamw import FP32_ADAMW, AdamWConfig
from ..compile_workers import release_compile_workers
from ..config import RuntimeConfig
from ..distributed import DataParallel, shared_layout
from ..gc_policy import GCFreeze
from ..placement import PlacementPlan, unit_shapes
from ..result import StepResult
from .activations import ActivationStore
from .disk_tier import DiskTier
from . import grad_sum as grad_sum_mod
from .grad_sum import MAX_HELD, GradSum, accumulate
from .host_store import HostStore, HostUnit
from .layer_runner import LayerRunner
from .transfer import GradDrain, Uploader, clip_coefficient
from ...faults import ENV as FAULT_ENV
from ...faults import maybe_fail, maybe_oom, maybe_poison, poison_scale
from .watchdog import Watchdog
from .workers import DeadlineWorker, Worker, WorkerError, done_future, wait_or_abort

log = logging.getLogger(__name__)
_WAIT_S = 1.0   # poll period while waiting on a worker future (to surface worker errors)


def _landed(chunk: Future) -> bool:
    """A gradient chunk's D2H copy has finished (not merely been queued). A failed issue
    counts as landed, so the host job runs and reports the error."""
    if not chunk.done():
        return False
    if chunk.exception() is not None:
        return True
    _, event = chunk.result()
    return bool(event.query())


def _to(t: torch.Tensor | None, dev: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(dev, non_blocking=True)


@dataclass
class _Slot:
    """A GPU buffer holding one unit's weights (or gradients) in the compute dtype."""

    flat: torch.Tensor                 # [numel] compute dtype (FP32 for FP32 gradient slots)
    content: tuple | None = None       # (unit index, version) planned into it
    ready: Future | None = None        # -> event after which the weights are on the GPU
    landing: torch.Tensor | None = None   # [numel] FP32, upload_cast_stream=compute: uploads land here
    cast_pending: bool = False         # landing holds an upload not yet cast into `flat`
    last_use: object = None            # event after the last kernel that read it
    free: Future | None = None         # gradient slots: -> event after its D2H drained it


class SlideEngine:
    def __init__(self, loaded: LoadedModel, rt: RuntimeConfig, optim: AdamWConfig, device: Device,
                 grad_accum: int = 1, max_grad_norm: float | None = None, timer: EventTimer | None = None,
                 dist: DataParallel | None = None):
        """dist: data parallel over several ranks (engine/distributed.py, docs/data_parallel.md); None
        or a world of one rank: this process alone, unchanged."""
        self.split = loaded.split
        self.rt = rt
        self.device = device
        self.dtype = rt.torch_dtype
        self.schedule = rt.resolved_schedule(grad_accum, max_grad_norm)
        # One failing thread must not leave the others blocked forever: every host-side
        # wait polls this flag, set by whichever worker fails first.
        self._abort = threading.Event()
        self._first_error: BaseException | None = None
        self._failed_where = "a pipeline thread failed"
        self._closed = False
        self.max_grad_norm = max_grad_norm
        self.timer = timer or EventTimer(device, enabled=False)
        self.timeline = HostTimeline(enabled=False)
        self.memory = MemoryTimeline(device, enabled=False)
        L = self.split.num_layers
        # Where each unit's state lives and how its weights reach the GPU (engine/placement.py).
        # GPU units (vocab_update=device, device_layers) are updated on the compute stream
        # (_update_on_device), each with a weight slot of their own; their masters and moments are
        # built on the device and never held by the host. Disk units keep their moments in the
        # disk tier's files, and those with master "disk" their FP32 masters too (the host keeps
        # their compute-dtype weights for the uploads).
        self.plan = PlacementPlan.build(unit_shapes(self.split), rt, self.schedule)
        self.vocab_on_device = self.plan.vocab_on_device
        self.device_layers = self.plan.device_layers
        device_units = frozenset(self.plan.indices("gpu"))
        self.deferred = self.schedule == "deferred"
        # the clipped sweep's first pass: "params" (split), "weights" (the units with an upload copy
        # write their compute-dtype weights, clip_sweep=weights) or the whole update (whole)
        self.split_sweep = rt.clip_sweep in ("split", "weights")
        # how a layer's micro-batch gradients are summed (grad_sum.py): fused (Triton) or torch
        self.grad_sum = grad_sum_mod.resolve(rt.grad_sum, self.device.device)
        self._grad_sum_checked = False
        # Data parallel: the host state lives once per host in shared memory; this rank updates the
        # units it owns and follows the others' owners.
        self.dp = dist if dist is not None and dist.world_size > 1 else None
        shared, owned = None, None
        disk_units = self.plan.indices("disk")
        if self.dp is not None and self.plan.master_params("disk"):
            # the other ranks upload a disk unit's weights from the shared mapping, which holds masters
            raise ValueError("data parallel over several ranks does not support --tuning.disk_master yet (the masters "
                             "of disk units on disk); use --tuning.disk_master off, or run on one rank")
        if any(u.upload_copy for u in self.plan.units):
            if self.dp is not None:
                raise ValueError("--tuning.clip_sweep weights runs on one rank for now (the host's other ranks "
                                 "would upload the shared master before its second pass); use split under data "
                                 "parallel")
            if self.dtype != torch.bfloat16:
                raise ValueError(f"--tuning.clip_sweep weights writes BF16 upload copies, but the compute dtype is "
                                 f"{self.dtype}; use split")
        if self.dp is not None:
            # Host-updated units (host and disk) are shared and sharded over the host's ranks. Units
            # updated on the GPU are every rank's own: each rank applies the same all-reduced
            # gradient to its own device copy (GPU memory is per rank anyway), so they have no
            # owner, take no room in the shared mapping and are never followed.
            # The disk units are local rank 0's (distributed.plan_owners says why). Their masters
            # are shared like any other; their moments are not in RAM.
            owners = self.dp.owners(self.plan)
            owned = frozenset(i for i, r in enumerate(owners)
                              if r == self.dp.local_rank or not self.plan.units[i].host_updated)
            numels, no_moments = shared_layout(self.plan)
            shared = self.dp.share_host_state(numels, no_moments=no_moments)
            disk_units = [i for i in disk_units if i in owned]
            self.owner_of = owners          # unit -> the local rank that updates (and, gathering, uploads) it
        self.shared = shared
        # dp_weights=gather: a host unit's owner alone uploads it; a thread of its own broadcasts it
        # to the host's other GPUs, in the order the compute thread asked for the units (the same
        # on every rank), on a stream of its own (_submit_gather)
        self.gather = self.dp is not None and rt.dp_weights == "gather" and self.dp.cfg.local_world_size > 1
        if self.gather:
            self.dp.weights_group()         # a collective: every rank creates it here
        # gather: the broadcasts of the next step's weights registered during a step (_prefetch_next_step),
        # queued at its end in the order the next forward needs them (_flush_gathers)
        self._pending_gathers: list[tuple] = []
        self.disk_released = False      # release_disk_tier(): the run is over, its moments are gone
        self.disk = (DiskTier(rt.disk_dir, {i: self.split.units[i].numel for i in disk_units},
                              block_mb=rt.disk_block_mb, buffers=self.plan.disk_buffers, io_threads=rt.disk_io_threads,
                              pinned=device.is_cuda, names={i: self.split.units[i].name for i in disk_units},
                              timeline=self.timeline,
                              masters=frozenset(u.index for u in self.plan.units if u.master == "disk"))
                     if disk_units else None)
        if self.disk is not None:
            self.disk.abort = self._abort
        try:
            self.store = HostStore(self.split, loaded.source, optim,
                                   held_dtype=self.dtype if self.deferred else None,
                                   # the clipped schedule's held buffers per host unit (the plan's:
                                   # one, or two used on alternate steps, _held_index)
                                   held_buffers=[max(1, u.held) for u in self.plan.units],
                                   kernel=rt.host_adamw,
                                   device_units=device_units, device=device.device, disk=self.disk,
                                   shared=shared, owned=owned, compute_dtype=self.dtype,
                                   upload_copies=frozenset(u.index for u in self.plan.units if u.upload_copy))
            if self.dp is not None:
                self.dp.host_barrier()      # every owner has filled its units before anyone uploads
        except BaseException:
            if self.disk is not None:
                self.disk.close()
            raise
        self.units: list[HostUnit] = self.store.units
        # Data parallel: waits for the owners of the units this rank does not update (follow()), in
        # the order their updates run, so the host worker itself never waits on another rank.
        self.follower = Worker("follow", self._on_worker_error) if self.dp is not None else None
        layer_numel = max(u.numel for u in self.split.layer_units)
        dev = device.device
        self.gpu_cast = rt.casts_on_gpu(device.is_cuda)
        if rt.cast_on == "gpu" and not device.is_cuda:
            raise ValueError("--tuning.cast_on gpu needs a CUDA device (auto picks cpu on a CPU machine)")
        # Casting on the compute stream needs FP32 on the device side: the CPU cast path
        # (cast_on=cpu) moves compute-dtype bytes and has nothing to cast there.
        self.cast_in_compute = rt.upload_cast_stream == "compute" and (self.gpu_cast or not device.is_cuda)
        grad_dtype = torch.float32 if rt.grad_slots_fp32() else self.dtype
        empty = lambda n, dt=self.dtype: torch.empty(n, dtype=dt, device=dev)  # noqa: E731

        def weight_slot(n: int) -> _Slot:
            return _Slot(empty(n), landing=empty(n, torch.float32) if self.cast_in_compute else None)

        # Resident host layers (the lowest ones above the device layers): a slot each, into
        # which the next step's weights are uploaded as soon as the update lands
        # (_prefetch_next_step), so their forward never waits on PCIe.
        self.resident_layers = self.plan.resident_layers
        # The window: interchangeable slots for the other host layers, each uploaded in the
        # forward and again in the backward.
        self.layer_slots = [weight_slot(layer_numel) for _ in range(self.plan.window_slots)]
        # Units with a slot of their own: the vocabulary units, the layers kept on the device
        # (their weights are cast from the device master there, never uploaded) and the resident
        # layers.
        resident = range(self.device_layers + 1, self.device_layers + self.resident_layers + 1)
        self.own_slots = {0: weight_slot(self.units[0].spec.numel), L + 1: weight_slot(self.units[-1].spec.numel),
                          **{i: _Slot(empty(self.units[i].spec.numel)) for i in range(1, self.device_layers + 1)},
                          **{i: weight_slot(self.units[i].spec.numel) for i in resident}}
        done = done_future(None)
        n_grad_slots = rt.resolved_grad_slots(L, eager=self.schedule == "eager")
        self.grad_slots = [_Slot(empty(layer_numel, grad_dtype), free=done) for _ in range(n_grad_slots)]
        if self.plan.shared_vocab_grad_slot:
            # the embedding's gradient reuses the head's slot once its copy to the host is done
            # (_claim_grad_slot waits for it: long done by the end of the backward)
            (numel,) = self.plan.vocab_grad_slot_numels()
            shared = _Slot(empty(numel, grad_dtype), free=done)
            self.vocab_grad_slots = {0: shared, L + 1: shared}
        else:
            self.vocab_grad_slots = {0: _Slot(empty(self.units[0].spec.numel, grad_dtype), free=done),
                                     L + 1: _Slot(empty(self.units[-1].spec.numel, grad_dtype), free=done)}
        # deferred: each device layer's gradient waits for the clip coefficient in a buffer of its
        # own (the vocabulary units' gradient slots are theirs already)
        self.device_grad_slots = ({i: _Slot(empty(self.units[i].spec.numel, grad_dtype), free=done)
                                   for i in range(1, self.device_layers + 1)} if self.deferred else {})
        chunk = rt.chunk_elems(layer_numel)
        self.chunk = chunk
        # the FP32 widening buffer of the device-side updates (compute-dtype gradient slots)
        device_numel = max((u.spec.numel for u in self.units if u.on_device), default=0)
        self.device_grad32 = (torch.empty(min(chunk, device_numel), dtype=torch.float32, device=dev)
                              if device_numel and grad_dtype != torch.float32 else None)
        # the deferred schedule copies each gradient straight into its held buffer: no ring
        ring = 0 if self.deferred else rt.download_chunks(layer_numel)
        if device.is_cuda:
            for unit in self.units:
                for held in unit.held:
                    device.register_host(held)          # one D2H copy straight into it
                if unit.weights is not None:
                    device.register_host(unit.weights)  # a disk-master unit's: one async H2D, no cast
        if self.gpu_cast:
            for unit in self.units:
                if unit.on_host and unit.master is not None and not unit.upload_copy:
                    device.register_host(unit.master)   # page-locked in place: async FP32 H2D, no copy
        self.uploader = Uploader(device, self.dtype, chunk, rt.upload_ring, gpu_cast=self.gpu_cast,
                                 stages=rt.upload_stages)
        self.upload_worker = Worker("upload", self._on_worker_error)
        self.gather_worker = Worker("gather", self._on_worker_error) if self.gather else None
        self.gather_stream = device.new_stream() if self.gather else None
        # Eager updates run earliest-deadline-first (rt.update_order; workers.DeadlineWorker).
        self.host_worker = DeadlineWorker("host", self._on_worker_error)
        # OpenMP's thread count is per calling thread: this sets the worker's own pool
        self.host_threads = rt.resolved_host_threads(device.is_cuda)
        self.host_worker.submit(torch.set_num_threads, self.host_threads).result()
        # Gradients in the compute dtype reach AdamW as they landed where native_adamw's kernel
        # reads them (built here once per process: a C compile, ~0.2 s); else the host widens
        # each chunk into an FP32 scratch for torch's kernel.
        downloads_fp32 = rt.downloads_fp32(device.is_cuda)
        widen = (self.schedule == "eager" and not downloads_fp32 and rt.host_adamw != "torch"
                 and grad_dtype in native_adamw.GRAD_TYPES and grad_dtype != torch.float32
                 and native_adamw.load() is not None)
        self.drainer = GradDrain(device, grad_dtype, chunk, ring, gpu_cast=self.gpu_cast and downloads_fp32,
                                 widen_in_adamw=widen)
        self.drainer.timeline = self.uploader.timeline = self.timeline
        self.drainer.abort = self.uploader.abort = self._abort
        self.deadline_order = self.schedule == "eager" and rt.update_order == "deadline"
        # The D2H issuer also goes earliest-deadline-first under deadline order: the ring then
        # carries the most urgent gradients while the others wait in their GPU slots.
        self.d2h_worker = DeadlineWorker("d2h", self._on_worker_error)
        for worker in (self.upload_worker, self.host_worker, self.d2h_worker):
            # tests only (faults.py): the step a job runs in is the one being issued
            worker.before_job = (lambda name=worker.name: maybe_fail(name, self.step_index + 1)) \
                if os.environ.get(FAULT_ENV) else None
        # The worker threads need the GIL between their (GIL-free) kernels while the compute
        # thread runs Python; the default 5 ms switch interval would stall each hand-off.
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(rt.gil_switch_ms / 1e3)
        self.acts = ActivationStore(device, L, rt.offloads_activations, keep_on_gpu=self.plan.gpu_checkpoints)
        self.gc_freeze = GCFreeze(rt.gc_freeze)
        self.layers = LayerRunner(self.split, rt, device.device)   # HF's or the lean layer, eager or compiled
        self.step_index = 0
        self._views_cache: dict = {}
        self._held_landed: dict[int, Future] = {}     # deferred: unit -> event of its held gradient's copy
        # deferred: (unit, held buffer) -> the moment pass that last read that buffer is done
        self._held_free: dict[tuple[int, int], Future] = {}
        self.watchdog = Watchdog()                    # bounds every wait of the compute thread (watchdog.py)
        self._last_step_t: float | None = None

    # ------------------------------------------------------------------ utils
    def _wait(self, fut: Future, what: str = "wait", unit: str = ""):
        try:
            if fut.done():
                return fut.result()
            with self.timeline.span("compute", what, unit), record_function(f"slidetune.{what}"):
                return self._wait_loop(fut, f"{what} {unit}".strip())
        except Exception as e:
            first = self._first_error
            if first is not None and e is not first:
                # a consequence of an earlier failure: report the root cause
                raise WorkerError(f"{self._failed_where}: {first!r}") from first
            raise

    def _on_worker_error(self, error: BaseException, thread: str = "a pipeline") -> None:
        if self._first_error is None:          # the root cause; later failures are consequences
            self._first_error = error
            self._failed_where = f"the {thread} thread failed during step {self.step_index + 1}"
        self._abort.set()

    def _wait_loop(self, fut: Future, what: str = "a pipeline thread"):
        t0 = time.monotonic()
        while True:
            try:
                return fut.result(timeout=_WAIT_S)
            except TimeoutError:
                self._raise_if_aborted()
                self.watchdog.check(time.monotonic() - t0, what, self._workers())

    def _workers(self) -> list:
        return ([self.upload_worker, self.d2h_worker, self.host_worker] + ([self.follower] if self.follower else [])
                + ([self.gather_worker] if self.gather_worker else []))

    def _raise_if_aborted(self) -> None:
        if self._abort.is_set():
            err = self._first_error
            raise WorkerError(f"{self._failed_where}: {err!r}") from err

    def _views(self, unit: UnitSpec, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        key = (unit.signature(), flat.data_ptr())
        if key not in self._views_cache:
            self._views_cache[key] = unit.views(flat)
        return self._views_cache[key]

    def _timed(self, thread: str, what: str, unit: str, fn, *args, **kwargs):
        with self.timeline.span(thread, what, unit):
            return fn(*args, **kwargs)

    @staticmethod
    def _leaves(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fresh autograd leaves over the same memory (so gradients can be asked for)."""
        return {k: v.detach().requires_grad_(True) for k, v in views.items()}

    # ------------------------------------------------------------- uploads
    def _submit_upload(self, unit_index: int, slot: _Slot, version: int | None = None,
                       when_update_starts: bool = False) -> None:
        """Queue the upload of the unit after its `version`-th update (default: this step's weights).

        With `when_update_starts` the job reaches the (FIFO) upload thread only once the host
        has begun that update, so uploads run in the order the updates do; the slot's
        bookkeeping is still set here, on the compute thread, so _plan sees it at once.
        """
        unit = self.units[unit_index]
        version = self.step_index if version is None else version
        if self.gather and unit.on_host:
            self._submit_gather(unit_index, slot, version, when_update_starts)
            return
        after = done_future(slot.last_use)
        slot.content = (unit_index, version)
        # With a landing buffer the upload only moves FP32 bytes; _acquire casts them. A disk-master
        # unit's weights are in the compute dtype already: straight into the slot.
        landing = slot.landing is not None and unit.weights is None
        dst = slot.landing if landing else slot.flat
        slot.cast_pending = landing
        job = (self._timed, "upload", "upload", unit.spec.name, self.uploader.upload, unit, dst, version, after)
        if not when_update_starts:
            slot.ready = self.upload_worker.submit(*job)
            return
        ready: Future = Future()
        slot.ready = ready

        def release() -> None:
            self.upload_worker.submit(*job).add_done_callback(lambda f: _chain(f, ready))
        unit.when_update_starts(version, release)

    def _submit_gather(self, unit_index: int, slot: _Slot, version: int, when_update_starts: bool) -> None:
        """dp_weights=gather: the unit's weights after its `version`-th update reach this rank's slot
        by a broadcast from its owner, which uploads them (as _submit_upload does, the cast included)
        before sending. Every rank queues its broadcasts on the compute thread, in the same order,
        so the collectives match; a rank that is not the owner uploads nothing.

        The gather thread runs them in that order, so the order must be the one they are needed
        in: a broadcast whose owner waits for a late update holds back every one behind it. The
        next step's weights (version > this step's) are registered in the middle of a step
        (resident layers as their gradient completes, the vocabulary units): their broadcasts
        are kept aside and queued once the step's own are (_flush_gathers), the owner's upload
        starting at once all the same."""
        unit = self.units[unit_index]
        after = done_future(slot.last_use)
        slot.content = (unit_index, version)
        slot.cast_pending = False               # the owner casts before it sends
        uploaded = None
        landing = slot.landing is not None and unit.weights is None     # as _submit_upload
        if unit.owned:
            dst = slot.landing if landing else slot.flat
            upload = (self._timed, "upload", "upload", unit.spec.name, self.uploader.upload, unit, dst, version, after)
            if when_update_starts:
                uploaded = Future()
                unit.when_update_starts(version, lambda: self.upload_worker.submit(*upload).add_done_callback(
                    lambda f: _chain(f, uploaded)))
            else:
                uploaded = self.upload_worker.submit(*upload)
        gather = (self._timed, "gather", "gather", unit.spec.name, self._gather, unit_index, slot, uploaded, after,
                  landing)
        if version > self.step_index:
            slot.ready = Future()
            self._pending_gathers.append((unit_index, slot.ready, gather))
        else:
            slot.ready = self.gather_worker.submit(*gather)

    def _flush_gathers(self) -> None:
        """Queue the next step's broadcasts kept aside during this one, in the order the next
        forward needs them: the embedding, the decoder layers from the bottom up, the head
        (the unit indices' order; the same on every rank)."""
        pending, self._pending_gathers = sorted(self._pending_gathers, key=lambda e: e[0]), []
        for _, ready, job in pending:
            self.gather_worker.submit(*job).add_done_callback(lambda f, ready=ready: _chain(f, ready))

    def _gather(self, unit_index: int, slot: _Slot, uploaded: Future | None, after: Future,
                landing: bool) -> object:
        """Gather thread: the owner's upload (then its cast into the compute dtype) or, elsewhere, the
        slot's last reader, then the broadcast into the slot; the event the compute stream waits on."""
        unit = self.units[unit_index]
        n = unit.spec.numel
        with self.device.stream_ctx(self.gather_stream):
            if uploaded is not None:
                ev = wait_or_abort(uploaded, self._abort, f"the upload of {unit.spec.name} to broadcast")
                if ev is not None:
                    self.gather_stream.wait_event(ev)
                if landing:
                    slot.flat[:n].copy_(slot.landing[:n])      # FP32 -> compute dtype, sent as such
            else:
                ev = after.result()
                if ev is not None:
                    self.gather_stream.wait_event(ev)          # the slot's last reader is done with it
            self.dp.broadcast_weights_(slot.flat[:n], self.owner_of[unit_index])
            return self.device.record(self.gather_stream)

    def _prefetch_next_step(self, unit_index: int, slot: _Slot) -> None:
        """Upload the unit's next-step weights into `slot` as its update is written.

        The job is released to the upload thread when the update begins and trails it chunk
        by chunk. It is registered only where no upload the current step still needs can
        queue behind it: the resident layers need none, the head is updated first of all
        units, long before the middle of the backward, and the embedding is the last unit.
        """
        self._submit_upload(unit_index, slot, version=self.step_index + 1, when_update_starts=True)

    def _resident(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a host-updated layer with a slot of its own."""
        place = self.plan.units[layer + 1]
        return place.slot == "own" and place.host_updated

    def _has_own_slot(self, layer: int) -> bool:
        return self.plan.has_own_slot(layer)

    def _use_own_slot(self, unit_index: int) -> _Slot:
        """The weights of a unit with a slot of its own (vocabulary units, device layers, resident
        layers) for this step: uploaded from the host master, or cast from the device one."""
        slot = self.own_slots[unit_index]
        if slot.content != (unit_index, self.step_index):
            if self.units[unit_index].on_host:
                self._submit_upload(unit_index, slot)
            else:
                self._refresh_from_device_master(unit_index, slot)
        return slot

    def _refresh_from_device_master(self, unit_index: int, slot: _Slot) -> None:
        """The compute-dtype weights of a unit kept on the device, cast from its FP32 master on
        the compute stream (stream order covers every reader before and after)."""
        unit = self.units[unit_index]
        slot.flat[: unit.spec.numel].copy_(unit.master)
        slot.content = (unit_index, unit.version)
        slot.ready = done_future(None)
        slot.cast_pending = False

    def _update_on_device(self, unit_index: int, gslot: _Slot, lr: float,
                          coef: float | torch.Tensor = 1.0) -> None:
        """vocab_update=device or device_layers: AdamW on the unit's device master on the compute
        stream (eager: right after its gradient is complete; deferred: after the backward, with
        the clip coefficient `coef`, a 0-dim tensor on the device), then its next-step weights
        into its slot (stream order: after every kernel that read the old ones).
        The gradient slot is free again in stream order, so nothing waits on the host."""
        unit = self.units[unit_index]
        n = unit.spec.numel
        grad = gslot.flat[:n]                                   # [n] FP32 or compute dtype
        with self.timer.span("optimizer_device", -1):
            unit.begin_update()
            unit.opt.begin_step()
            if grad.dtype == torch.float32:
                unit.opt.update(grad, lr, grad_scale=coef)
            else:
                # torch's fused AdamW wants FP32 gradients: widened a chunk at a time into one
                # preallocated buffer, not a unit-sized FP32 copy allocated every step (2.5 GB
                # for a 152K-vocabulary matrix, asked of an allocator the auto settings have
                # filled to 90% of the GPU)
                unit.opt.update_widened(grad, lr, self.device_grad32, grad_scale=coef)
            unit.bump_version()
            self._refresh_from_device_master(unit_index, self.own_slots[unit_index])
        gslot.free = done_future(None)

    def _plan(self, visits: list[int], v: int, assign: dict[int, int]) -> None:
        """Make sure uploads are submitted for visits v .. v+K-1 (layer indices)."""
        K = len(self.layer_slots)
        for w in range(v, min(len(visits), v + K)):
            if w in assign or self._has_own_slot(visits[w]):
                continue
            unit_index = visits[w] + 1
            want = (unit_index, self.step_index)
            hit = [s for s, sl in enumerate(self.layer_slots) if sl.content == want]
            if hit:
                assign[w] = hit[0]
                continue
            busy = {assign[u] for u in range(v, w) if u in assign}

            def next_use(s: int) -> float:
                c = self.layer_slots[s].content
                if c is None or c[1] != self.step_index:
                    return math.inf
                for u in range(w + 1, len(visits)):
                    if visits[u] + 1 == c[0]:
                        return u
                return math.inf

            free = [s for s in range(K) if s not in busy]
            s = max(free, key=next_use)
            # Released to the (FIFO) upload thread once this step's update of the unit has begun:
            # a window upload planned ahead must not hold back, behind an update the host has
            # not reached, the uploads of units it updates first (resident layers below).
            self._submit_upload(unit_index, self.layer_slots[s], when_update_starts=True)
            assign[w] = s

    def _acquire(self, slot: _Slot) -> None:
        ev = self._wait(slot.ready, "wait_upload", self.units[slot.content[0]].spec.name if slot.content else "")
        if ev is not None:
            self.device.current_stream().wait_event(ev)
        if slot.cast_pending:
            n = self.units[slot.content[0]].spec.numel
            slot.flat[:n].copy_(slot.landing[:n])     # FP32 -> compute dtype on the compute stream
            slot.cast_pending = False

    def _release(self, slot: _Slot) -> None:
        slot.last_use = self.device.record()

    # ------------------------------------------------------------- gradients
    def _grad_slot(self, unit_index: int) -> _Slot:
        """A gradient slot for the unit: any layer slot whose last gradient has been copied out
        (they come back out of order when the issuer runs earliest-deadline-first)."""
        if unit_index in self.vocab_grad_slots:
            return self.vocab_grad_slots[unit_index]
        if unit_index in self.device_grad_slots:
            return self.device_grad_slots[unit_index]
        t0 = time.monotonic()
        while True:
            for slot in self.grad_slots:
                if slot.free.done():
                    return slot
            with self.timeline.span("compute", "wait_grad_slot"), record_function("slidetune.wait_grad_slot"):
                wait_any([s.free for s in self.grad_slots], timeout=_WAIT_S, return_when=FIRST_COMPLETED)
            self._raise_if_aborted()
            self.watchdog.check(time.monotonic() - t0, "a free gradient slot", self._workers())

    def _claim_grad_slot(self, slot: _Slot) -> None:
        ev = self._wait(slot.free, "wait_grad_slot")
        if ev is not None:
            self.device.current_stream().wait_event(ev)

    def _gradient_complete(self, unit_index: int, slot: _Slot, lr: float) -> None:
        """The unit's gradient for this step is in `slot` (every micro-batch summed): its squared
        norm joins the step's, then it is applied (eager) or held until the norm is known."""
        unit = self.units[unit_index]
        if self.dp is not None:
            # every rank's share summed (each scaled by 1 / the global token count): the global
            # gradient, so the norm below is the global one on every rank
            self.dp.all_reduce_(slot.flat[: unit.spec.numel])
        self._norm_on_device(slot.flat[: unit.spec.numel])
        if not unit.owned:
            # another rank updates it from the same gradient; its slot is free again in stream order
            if not self.deferred:
                self._follow(unit_index)
            return
        if unit.on_device:
            if not self.deferred:
                self._update_on_device(unit_index, slot, lr)
            # deferred: it waits in its own slot for _update_device_units
        elif self.deferred:
            self._submit_hold(unit_index, slot)
        else:
            self._submit_drain(unit_index, slot, lr)

    def _submit_hold(self, unit_index: int, slot: _Slot) -> None:
        """Deferred: one D2H copy of the unit's gradient slot into its held host buffer of this
        step (held_buffers=2: the one the last step's moment pass is not reading)."""
        unit = self.units[unit_index]
        k = self._held_index(unit_index)
        ready = self.device.record()
        slot.free = Future()
        landed: Future = Future()
        self._held_landed[unit_index] = landed
        self.d2h_worker.submit(self._issue_hold, unit, unit.held[k], slot.flat[: unit.spec.numel], ready, slot.free,
                               landed, self._held_free.get((unit_index, k), done_future(None)))

    def _held_index(self, unit_index: int) -> int:
        """Which of a host unit's held buffers the step being issued writes: step s writes buffer
        s % its count (PlacementPlan: 1, or 2 on alternate steps)."""
        return self.step_index % len(self.units[unit_index].held)

    def _issue_hold(self, unit: HostUnit, held: torch.Tensor, src: torch.Tensor, ready, free: Future,
                    landed: Future, held_free: Future) -> None:
        # the moment pass that last read this buffer (the previous step's, or with two buffers the
        # one before) must be done with it first
        wait_or_abort(held_free, self._abort, f"the previous moments of {unit.spec.name}")
        with self.timeline.span("d2h", "hold", unit.spec.name):
            event = self.drainer.hold(held, src, ready)
        free.set_result(event)
        landed.set_result(event)

    def _submit_drain(self, unit_index: int, slot: _Slot, lr: float) -> None:
        """Eager: the unit's gradient goes down chunk by chunk and the host's AdamW consumes it."""
        unit = self.units[unit_index]
        ready = self.device.record()
        chunks = [Future() for _ in range(-(-unit.spec.numel // self.chunk))]
        # The host job is queued first so it consumes chunk c while later chunks are issued.
        # Earliest deadline first: a unit's deadline is its place in the next forward
        # (embedding 0, layer i at i + 1, head last), among the units whose first chunk has
        # landed in host memory: such a unit is fully issued or the one the issuer is working
        # on (so consuming it frees ring buffers). Queued is not enough: the compute thread
        # runs layers ahead of the GPU, so the newest unit's copy waits for a backward the GPU
        # has not run yet, and a host that picked it would idle while older gradients sit
        # in the ring (benchmarks/NOTES.md "Pipeline threads"). Units that are whole (every chunk landed, or
        # the ring has room, so the rest is on its way) go first: with the ring full, the
        # newest unit's next chunk waits for a buffer that only its own first chunk's AdamW
        # frees (NOTES.md "Pipeline threads").
        order = dict(deadline=unit_index, ready=lambda: _landed(chunks[0]),
                     whole=lambda: self.drainer.has_free_buffer() or all(_landed(c) for c in chunks)
                     ) if self.deadline_order else {}
        if self.deadline_order:
            chunks[0].add_done_callback(lambda _: self.host_worker.notify())
        self.host_worker.submit(self._timed, "host", "drain", unit.spec.name, self._consume, unit,
                                chunks, lr=lr, **order)
        # A third thread queues the copies as ring buffers free up, so neither the compute
        # thread (which only needs its GPU gradient slot back) nor AdamW ever waits on it.
        slot.free = Future()
        # The issuer, too, takes the most urgent unit whose gradient the GPU has computed:
        # copies run in issue order on one stream, so a copy queued behind a backward still
        # to come would hold back the copies of gradients that are already there.
        self.d2h_worker.submit(self._issue_drain, unit, slot.flat[: unit.spec.numel], ready, chunks, slot.free,
                               **({"deadline": unit_index, "ready": ready.query} if self.deadline_order else {}))

    def _norm_on_device(self, flat: torch.Tensor) -> None:
        """Add the squared L2 norm of one unit's gradient slot to the step's GPU accumulator.

        On the compute stream, right after the slot was written: reading 2 bytes/param at HBM
        speed is ~0.1 ms per 8B layer, where the host worker took ~5 ms per 64 MB chunk (a
        single-threaded reduction on the critical path of every chunk's AdamW). The slot
        holds exactly the values AdamW reads (widened to FP32), so this is the same norm.
        """
        (norm,) = torch._foreach_norm([flat], 2, dtype=torch.float32)
        self._sq_device.add_(norm.square())

    def _read_device_norm(self, sq_host: torch.Tensor, ready) -> float:
        """Host worker: the step's squared norm once its copy to pinned memory has landed."""
        ready.synchronize()
        return float(sq_host[0])

    def _consume(self, unit: HostUnit, chunks: list[Future], *, lr: float) -> None:
        """Host worker (eager): the unit's AdamW as its chunks land; weights and moments in one pass."""
        self.drainer.consume(unit, chunks, lr=lr)
        unit.publish_state()

    def _follow(self, unit_index: int) -> None:
        """Data parallel: count this step's update of a unit another rank owns once its owner has
        written it (HostUnit.follow), on the follower thread."""
        unit = self.units[unit_index]
        self.follower.submit(self._timed, "follow", "follow", unit.spec.name, unit.follow, self.step_index + 1,
                             self._abort)

    def _issue_drain(self, unit: HostUnit, src: torch.Tensor, ready, chunks: list[Future], free: Future) -> None:
        with self.timeline.span("d2h", "issue", unit.spec.name):
            last = self.drainer.issue(unit, src, ready, futs=chunks)
        free.set_result(last)

    def _write_summed(self, unit: UnitSpec, slot: _Slot, summed: GradSum) -> None:
        """A layer's micro-batch gradient sum into its slot. The fused sum's first use with several
        micro-batches is checked bit for bit against torch's; a difference is logged and the
        run goes on with torch's sum (the slot gets torch's values either way)."""
        views = list(self._views(unit, slot.flat).values())
        check = (self.grad_sum == "fused" and not self._grad_sum_checked and 1 < summed.k <= MAX_HELD)
        same = summed.write(views, check=check)
        if check:
            self._grad_sum_checked = True
        why = summed.failed or (None if same else "its sums differ from torch's")
        if why and self.grad_sum == "fused":
            log.warning("slidetune: the fused micro-batch gradient sum failed on %s (%s); summing with "
                        "torch from now on (--tuning.grad_sum torch says so up front)", unit.name, why)
            self.grad_sum = "torch"

    def _write_grads(self, unit: UnitSpec, slot: _Slot, grads: list[torch.Tensor], accumulate: bool = False):
        views = list(self._views(unit, slot.flat).values())
        if accumulate:
            torch._foreach_add_(views, grads)
        else:
            torch._foreach_copy_(views, grads)

    # ------------------------------------------------------------- the step
    def train_step(self, micro_batches: list, lr: float) -> StepResult:
        self._check_disk_tier_kept("train a step")
        n_tokens = sum(mb.num_target_tokens() for mb in micro_batches)
        if self.dp is not None:
            # every rank scales its gradient by 1 / the step's tokens over all ranks: the summed
            # gradients are then one rank's at the whole batch
            (n_tokens,) = (int(n) for n in self.dp.sum_scalars([n_tokens]))
        if n_tokens == 0:
            raise ValueError("the step's batches contain no target tokens (all labels are -100)")
        now = time.monotonic()
        if self._last_step_t is not None:
            self.watchdog.record_step(now - self._last_step_t)       # the interval between steps
        self._last_step_t = now
        self._held_landed = {}
        self._sq_device = torch.zeros((), dtype=torch.float32, device=self.device.device)
        if self.disk is not None:
            # the disk units' moments, read ahead in the order their updates will run: as the
            # backward releases them (eager), or as the sweep reaches them (deferred); moments do
            # not depend on the gradient, so the reads start now
            order = sorted(self.disk.units, reverse=not self.deferred)
            for i in order:
                self.disk.prefetch(i)
        # The summed loss is copied out right after the head, with its own event: reading it
        # waits for that head only. (A float() of a GPU scalar at the end would wait for the
        # whole backward queued behind it, spinning a core the host's AdamW needs; NOTES.md "Pipeline threads".)
        try:
            host_loss, loss_ready = self._forward_backward(micro_batches, 1.0 / n_tokens, lr)
        except BaseException as e:
            # A failure of the compute thread itself (a CUDA OOM): the workers may be waiting for
            # gradients that will never come, so mark the run failed; close() then skips the final
            # synchronize and the workers' waits give up instead of hanging.
            self._on_worker_error(e, "compute")
            raise
        # The squared norm, complete once the last unit's is added: copied out on the compute
        # stream and read by the host worker, so neither the compute thread nor the worker's
        # queue waits for it early.
        sq_host = self.device.host_empty(1, torch.float32)
        sq_host.copy_(self._sq_device.view(1), non_blocking=True)
        sq_ready = self.device.record()
        if self.deferred:
            self._update_device_units(lr)
            ks = {i: self._held_index(i) for i in self._held_landed}    # the held buffers this step wrote
            frees = {i: Future() for i in self._held_landed}
            self._held_free.update({(i, ks[i]): f for i, f in frees.items()})
            norm_fut = self.host_worker.submit(self._finish_deferred, sq_host, sq_ready, dict(self._held_landed),
                                               frees, ks, lr)
            if self.dp is not None:
                for index, unit in enumerate(self.units):     # in the owners' sweep order
                    if not unit.owned:
                        self._follow(index)
            # The sweep updates layers 0..L-1 in order: the resident layers' uploads follow it.
            if self.gather and self.units[0].on_host:
                # gathering: the embedding's broadcast must not queue behind the resident layers'
                self._prefetch_next_step(0, self.own_slots[0])
            for i in range(self.split.num_layers):
                if self._resident(i):
                    self._prefetch_next_step(i + 1, self.own_slots[i + 1])
        else:
            norm_fut = self.host_worker.submit(lambda: math.sqrt(self._read_device_norm(sq_host, sq_ready)))
        if self.gather:
            self._flush_gathers()
        self.step_index += 1
        if self.layers.compiled:
            # Every graph of this step is compiled by now (compilation runs on this thread at
            # issue time): free the compile workers' cores for AdamW (compile_workers.py).
            release_compile_workers()
        self.gc_freeze.freeze()        # everything the run keeps exists by now
        loss_ready.synchronize()
        loss_sum = float(host_loss[0])
        if self.dp is not None:
            (loss_sum,) = self.dp.sum_scalars([loss_sum])
        loss = loss_sum / n_tokens
        return StepResult(loss=loss, n_tokens=n_tokens, grad_norm_future=self._rooted(norm_fut))

    def _rooted(self, fut: Future) -> Future:
        """`fut`, but failing with the root cause where its job failed because another thread did
        (it gave up waiting): the caller learns which thread failed first, and in which step."""
        out: Future = Future()

        def done(f: Future) -> None:
            err = f.exception()
            if err is None:
                out.set_result(f.result())
            elif self._first_error is not None and err is not self._first_error:
                out.set_exception(WorkerError(f"{self._failed_where}: {self._first_error!r}"))
            else:
                out.set_exception(WorkerError(f"{self._failed_where}: {err!r}") if self._first_error is err else err)
        fut.add_done_callback(done)
        return out

    def _clip_coefficient_on_device(self) -> torch.Tensor:
        """clip_grad_norm_'s coefficient from the step's squared norm, as a 0-dim FP32 tensor on the
        device (no host sync): min(1, max_norm / (norm + 1e-6)); 1 when the norm is not finite
        (as clip_coefficient, which the host uses)."""
        norm = self._sq_device.sqrt()
        if self.max_grad_norm is None or self.max_grad_norm <= 0:       # deferred without clipping
            return torch.ones_like(norm)
        coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))

    def _update_device_units(self, lr: float) -> None:
        """Deferred, on the compute stream after the backward: the units kept on the device apply
        their held gradients with the clip coefficient, in the order the next forward needs them."""
        coef = self._clip_coefficient_on_device()
        L = self.split.num_layers
        for unit_index in [0, *range(1, L + 1), L + 1]:
            if self.units[unit_index].on_device:
                self._update_on_device(unit_index, self._grad_slot(unit_index), lr, coef)

    def _finish_deferred(self, sq_host: torch.Tensor, sq_ready, landed: dict[int, Future],
                         held_free: dict[int, Future], ks: dict[int, int], lr: float) -> float:
        """Host worker, once the backward is queued: the global norm, then the clipped update sweep
        of the host units from the embedding up, each as soon as its held gradient has landed;
        then their moments, from the head down (the order the next backward needs the held
        buffers back in). `ks`: which of each unit's held buffers the step wrote (_held_index).

        Why two passes: no update can start before the norm is known, at the end of the
        backward, and the next forward waits for each host layer's new weights, so the sweep is
        the part of a clipped step nothing hides. Writing only the weights there moves 18 of
        AdamW's 26 B/param of host DRAM (the loop is memory-bound); the moments (18 more) are
        written while the next step's forward and backward run, when the host is otherwise idle.
        """
        try:
            total = math.sqrt(self._read_device_norm(sq_host, sq_ready))
            coef = clip_coefficient(total, self.max_grad_norm)
            # Embedding first: the next forward needs it first. Each unit's upload for the next
            # step waits only for that unit's update (chunk by chunk), so the sweep overlaps the
            # next forward.
            # A disk unit's update reads and writes its moments once ("all"): its moments are
            # not in RAM for a second pass to find.
            host = [(i, u) for i, u in enumerate(self.units) if u.on_host and u.owned]
            for index, unit in host:
                event = wait_or_abort(landed[index], self._abort, f"the held gradient of {unit.spec.name}")
                event.synchronize()
                split = self.split_sweep and unit.disk is None
                first = ("weights" if unit.upload_copy else "params") if split else "all"
                with self.timeline.span("host", "adamw", unit.spec.name):
                    GradDrain.deferred_update(unit, unit.held[ks[index]], lr, coef, self.chunk, part=first)
                if not split:
                    unit.publish_state()
                    held_free[index].set_result(None)
            for index, unit in (reversed(host) if self.split_sweep else []):
                if unit.disk is not None:
                    continue
                with self.timeline.span("host", "adamw_moments", unit.spec.name):
                    GradDrain.deferred_moments(unit, unit.held[ks[index]], coef, self.chunk, lr=lr)
                unit.publish_state()
                held_free[index].set_result(None)
            return total
        finally:
            for fut in held_free.values():      # after a failure: the abort flag stops the waiters
                if not fut.done():
                    fut.set_result(None)

    def _forward(self, mbs: list, visits: list[int], assign: dict[int, int], save_inputs: bool):
        """Embedding and layers 0..L-1 without autograd over every micro-batch, layer by layer,
        uploads planned along `visits`. With `save_inputs` each layer's input is kept as its
        checkpoint (training).

        Returns (xs: per micro-batch [B, S, d], ids, labels and layer kwargs per micro-batch,
        embed slot, head slot).
        """
        split, dev = self.split, self.device.device
        L = split.num_layers
        ids = [mb.input_ids.to(dev, non_blocking=True) for mb in mbs]          # [B, S] each
        labels = [mb.labels.to(dev, non_blocking=True) for mb in mbs]          # [B, S] each
        kwargs = [split.layer_kwargs(*i.shape, self.dtype, dev,
                                     attention_mask=_to(mb.attention_mask, dev),
                                     position_ids=_to(getattr(mb, "position_ids", None), dev))  # masked packing
                  for i, mb in zip(ids, mbs)]
        embed_slot = self._use_own_slot(0)
        # Resident layers whose slot does not hold this step's weights (the first step, or
        # after load_state), in the order the forward needs them; later steps find them there.
        for i in range(self.device_layers, self.device_layers + self.resident_layers):
            self._use_own_slot(i + 1)
        self._plan(visits, 0, assign)
        self._acquire(embed_slot)
        with torch.no_grad(), self.timer.span("embed", -1):
            embed_params = self._views(split.embed_unit, embed_slot.flat)
            xs = [split.embed_forward(embed_params, i) for i in ids]                # [B, S, d] each
        self.memory.mark("embed")
        head_slot = None
        # The head's upload is queued ahead of the last layers' where its update is ready early
        # (eager: the backward releases the head first), so it hides under theirs. The clipped
        # sweep updates a host head last: queued early, its upload would wait for that update
        # and hold back the layers queued behind it (the uploader runs in order). On a 24 GiB
        # GPU (Llama-3.1-8B b16) the forward waited 242 ms at layer 26 for the head's update.
        head_at = L if self.deferred and self.units[L + 1].on_host else \
            max(0, L - len(self.layer_slots) - self.resident_layers)
        for i in range(L):
            self._plan(visits, i, assign)
            if i == head_at:
                head_slot = self._use_own_slot(L + 1)         # queue the head behind the last layers
            slot = self._use_own_slot(i + 1) if self._has_own_slot(i) else self.layer_slots[assign[i]]
            self._acquire(slot)
            params = self._views(split.layer_units[i], slot.flat)
            for m in range(len(mbs)):
                if save_inputs:
                    self.acts.save(i, xs[m], m)
                with torch.no_grad(), self.timer.span("forward", i):
                    xs[m] = self.layers.forward(i, params, xs[m], kwargs[m][i])
            self._release(slot)
            self.memory.mark("forward", i)
        if head_slot is None:
            head_slot = self._use_own_slot(L + 1)
        return xs, ids, labels, kwargs, embed_slot, head_slot

    def _forward_backward(self, mbs: list, scale: float, lr: float):
        """Queue the step's forward, head and backward over all micro-batches; returns (the summed
        loss in a [1] host tensor, the event after which that tensor holds it)."""
        split = self.split
        L = split.num_layers
        k = len(mbs)
        visits = list(range(L)) + list(reversed(range(L)))     # forward then backward
        assign: dict[int, int] = {}
        head_index = L + 1
        xs, ids, labels, kwargs, embed_slot, head_slot = self._forward(mbs, visits, assign, save_inputs=True)

        # ---- head: loss and its gradients, a micro-batch at a time (the head never holds more
        # than a chunk of logits), their parameter gradients summed as the layers' are
        self._acquire(head_slot)
        head_params = self._views(split.head_unit, head_slot.flat)
        tied_w = self._views(split.embed_unit, embed_slot.flat)["weight"] if split.tied else None
        gs: list[torch.Tensor] = []       # the gradient reaching each micro-batch's last layer output, [B, S, d]
        acc = None
        loss_sum = None
        maybe_oom(self.step_index + 1)        # tests only (faults.py): an OOM mid-step, past the forward
        for m in range(k):
            with self.timer.span("head", -1):
                # loss and gradients in one pass, no autograd graph (the chunked heads scale their
                # gradients in place: models/units.head_loss_and_grads)
                loss, g_x, g = split.head_loss_and_grads(
                    head_params, xs[m], labels[m], poison_scale(scale, self.step_index + 1),  # NaN: tests only
                    lm_weight=tied_w, impl=self.rt.resolved_head_impl, chunk_tokens=self.rt.head_chunk_tokens)
                loss = maybe_poison(loss, self.step_index + 1)       # tests only (faults.py)
            gs.append(g_x)
            grads = [g[name] for name in head_params] + ([g["lm_head.weight"]] if tied_w is not None else [])
            acc = accumulate(acc, grads, k)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            xs[m] = None
            del loss, g_x, g, grads
        self._release(head_slot)
        self.memory.mark("head")
        host_loss = self.device.host_empty(1, torch.float32)
        host_loss.copy_(loss_sum.float().view(1), non_blocking=True)
        loss_ready = self.device.record()
        gslot = self._grad_slot(head_index)
        self._claim_grad_slot(gslot)
        self._write_grads(split.head_unit, gslot, acc[:len(head_params)])
        self._gradient_complete(head_index, gslot, lr)
        # a tied embedding's gradient: the head's share, to which the embedding's own is added
        tied_acc = acc[len(head_params):] if tied_w is not None else None
        del xs, acc

        # ---- backward: recompute each layer from its checkpoints, then differentiate, every
        # micro-batch while the layer's weights are on the GPU
        for i in reversed(range(L)):
            v = 2 * L - 1 - i
            self._plan(visits, v, assign)
            slot = self.own_slots[i + 1] if self._has_own_slot(i) else self.layer_slots[assign[v]]
            self.acts.prefetch(i, 0)
            self._acquire(slot)
            params = self._leaves(self._views(split.layer_units[i], slot.flat))
            summed = GradSum(k, self.grad_sum)
            for m in range(k):
                # the next checkpoint the backward reads: this layer's next micro-batch, or the
                # layer below's first
                self.acts.prefetch(*((i, m + 1) if m + 1 < k else (i - 1, 0)))
                res = self.layers.recompute_backward(i, params, self.acts.load(i, m), gs[m], kwargs[m][i],
                                                     self.timer)
                gs[m] = res[0]
                summed.add(res[1:])
                del res
            self._release(slot)
            gslot = self._grad_slot(i + 1)
            self._claim_grad_slot(gslot)
            self._write_summed(split.layer_units[i], gslot, summed)
            self._gradient_complete(i + 1, gslot, lr)
            if not self.deferred:
                if self._resident(i):
                    self._prefetch_next_step(i + 1, slot)
                if i == L // 2 and not self.vocab_on_device:
                    self._prefetch_next_step(L + 1, head_slot)
            del summed, params
            self.memory.mark("backward", i)

        # ---- embedding gradient, a micro-batch at a time, summed
        self._acquire(embed_slot)
        w = self._leaves(self._views(split.embed_unit, embed_slot.flat))
        acc = tied_acc
        for m in range(k):
            with torch.enable_grad(), self.timer.span("embed_backward", -1):
                e = split.embed_forward(w, ids[m])
                grads = torch.autograd.grad(e, [w["weight"]], gs[m], materialize_grads=True)
            acc = accumulate(acc, grads, k)
            gs[m] = None
            del e, grads
        self._release(embed_slot)
        embed_gslot = self._grad_slot(0)
        self._claim_grad_slot(embed_gslot)
        self._write_grads(split.embed_unit, embed_gslot, acc)
        self._gradient_complete(0, embed_gslot, lr)
        if not self.deferred and not self.vocab_on_device:
            self._prefetch_next_step(0, embed_slot)
        self.acts.clear()
        self.memory.mark("embed_backward")
        return host_loss, loss_ready

    # ------------------------------------------------------------- evaluation
    @torch.no_grad()
    def eval_loss(self, batch) -> tuple[float, int]:
        """Sum of token losses and token count of one batch with the current weights."""
        split = self.split
        xs, _, labels, _, embed_slot, head_slot = self._forward([batch], list(range(split.num_layers)), {},
                                                                save_inputs=False)
        self._acquire(head_slot)
        tied_w = self._views(split.embed_unit, embed_slot.flat)["weight"] if split.tied else None
        loss = split.head_loss(self._views(split.head_unit, head_slot.flat), xs[0], labels[0], lm_weight=tied_w,
                               impl=self.rt.resolved_head_impl, chunk_tokens=self.rt.head_chunk_tokens)
        self._release(embed_slot)
        self._release(head_slot)
        return float(loss), batch.num_target_tokens()

    # ------------------------------------------------------------- state
    def synchronize(self) -> None:
        """Wait until every submitted update and copy has finished (not used on the hot path)."""
        try:
            # in the order work hands on: copies -> updates -> (an update's start releases the uploads
            # registered on it, HostUnit.begin_update: an owner's on the host worker, another rank's
            # unit on the follower) -> uploads -> broadcasts. The follower drained after the uploader
            # could still submit an upload once synchronize() had returned (test_data_parallel's
            # upload count read one unit short on a loaded CI machine).
            self.d2h_worker.drain()
            self.host_worker.drain()
            if self.follower is not None:
                self.follower.drain()
            self.upload_worker.drain()
            if self.gather_worker is not None:
                self.gather_worker.drain()
            if self.disk is not None:
                self.disk.drain()
            if self.dp is not None:
                # the other owners' moments too (not a collective: one rank may call it alone)
                for unit in self.units:
                    unit.wait_state(self.step_index, self._abort)
        except WorkerError as e:
            first = self._first_error or e
            raise WorkerError(f"{self._failed_where}: {first!r}") from first
        self.device.synchronize()

    def named_master_params(self):
        """(HF name, FP32 host tensor) for every parameter; call after synchronize(). Units kept
        on the device (vocab_update=device) are copied to the host; a disk-master unit's come as
        StreamedTensors read from the disk tier when consumed (checkpoint.write_safetensors)."""
        for unit in self.units:
            for name, t in unit.params().items():
                yield name, (t if unit.on_host else t.cpu())

    def optimizer_tensors(self, on_host: bool = True) -> dict[str, torch.Tensor]:
        """Every unit's AdamW state by name; on_host=False leaves the device units' where they are
        (a checkpoint writer copies one tensor at a time instead of all of them at once)."""
        self._check_disk_tier_kept("read the optimizer state")
        out = {}
        for unit in self.units:
            for k, t in unit.state_tensors().items():
                out[f"{unit.spec.name}.{k}"] = t if unit.on_host or not on_host else t.cpu()
        return out

    def load_state(self, masters: dict[str, torch.Tensor], optim: dict[str, torch.Tensor], step: int) -> None:
        """Data parallel: a collective over the host (every rank loads; each owner writes its units
        into the shared state, the others wait for it)."""
        self.synchronize()
        if self.dp is not None:
            self.dp.host_barrier()      # no rank still reads the old state
        for unit in self.units:
            if not unit.owned:
                unit.set_version(step)
                continue
            unit.load(masters, {k: optim[f"{unit.spec.name}.{k}"] for k in ("exp_avg", "exp_avg_sq", "step")})
            unit.set_version(step)
        self.step_index = step
        for slot in self.layer_slots + list(self.own_slots.values()):
            slot.content = None
        if self.dp is not None:
            self.dp.host_barrier()      # every owner has written its units

    def memory_report(self) -> dict[str, int]:
        slots = (self.layer_slots + self.grad_slots + list(self.own_slots.values())
                 + list({id(s): s for s in self.vocab_grad_slots.values()}.values())     # one, where shared
                 + list(self.device_grad_slots.values()))
        gpu_buffers = sum(t.numel() * t.element_size() for s in slots for t in (s.flat, s.landing) if t is not None)
        pinned = (sum(b.numel() * b.element_size() for b in self.uploader.ring + self.drainer.ring)
                  + self.acts.pinned_bytes() + (self.disk.pinned_bytes() if self.disk is not None else 0))
        device_state = sum(FP32_ADAMW.bytes_per_param * u.spec.numel for u in self.units if u.on_device)   # vocab_update=device, device_layers
        # the shared host state is counted once per host, by its local rank 0
        shared = self.shared.nbytes if self.shared is not None and self.dp.local_rank == 0 else 0
        out = {"gpu_buffers": gpu_buffers, "pinned": pinned, "host_state": self.store.state_bytes() + shared,
               "device_state": device_state}
        if self.disk is not None:
            out.update(disk_state=self.plan.state_bytes()["disk"], disk_read=self.disk.bytes_read,
                       disk_written=self.disk.bytes_written)
        return out

    def _check_disk_tier_kept(self, what: str) -> None:
        if self.disk_released:
            raise RuntimeError(f"cannot {what}: the disk tier's files (the AdamW moments of its units) were "
                               f"removed by release_disk_tier() at the end of the run")

    def release_disk_tier(self) -> None:
        """Remove the disk tier's files now (the run is over and keeps no resumable state): the
        weights (masters in host RAM) stay exportable; the disk units' AdamW moments are gone, so
        no further step or optimizer-state checkpoint is possible."""
        if self.disk is None:
            return
        if self.disk.masters:
            raise RuntimeError("the disk tier holds the FP32 masters of "
                               f"{self.plan.ranges(lambda u: u.master == 'disk')} (--tuning.disk_master): "
                               f"its files are the model's weights until final/ is written")
        self.synchronize()
        self.disk.close()
        self.disk_released = True

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            if not self._abort.is_set():      # after a failure, nothing is left to finish
                self.synchronize()
        finally:
            self.upload_worker.close()
            self.host_worker.close()
            self.d2h_worker.close()
            if self.follower is not None:
                self.follower.close()
            if self.gather_worker is not None:
                self.gather_worker.close()
            sys.setswitchinterval(self._switch_interval)
            self.acts.close()
            if self.disk is not None:
                self.disk.close()           # the scratch files go; the run's state is in its checkpoints
            self.gc_freeze.release()
            if self.device.is_cuda:
                for unit in self.units:
                    for held in unit.held:
                        self.device.unregister_host(held)
                    if unit.weights is not None:
                        self.device.unregister_host(unit.weights)
            if self.gpu_cast:
                for unit in self.units:
                    if unit.on_host and unit.master is not None and not unit.upload_copy:   # as registered
                        self.device.unregister_host(unit.master)
                self.gpu_cast = False


def _chain(src: Future, dst: Future) -> None:
    """Resolve `dst` with `src`'s outcome."""
    err = src.exception()
    if err is not None:
        dst.set_exception(err)
    else:
        dst.set_result(src.result())
