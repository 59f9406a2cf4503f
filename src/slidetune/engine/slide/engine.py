"""The layer-sliding engine: FP32 master + AdamW on the host, a window of layers on the GPU.

One step: embed -> layers 0..L-1 forward without autograd (each layer's input saved as
a checkpoint) -> head loss with its gradients -> layers L-1..0: recompute from the
checkpoint and differentiate -> embedding gradient. The step's micro-batches (gradient
accumulation) run layer by layer: a layer, once on the GPU, runs every micro-batch before
the next layer, and sums their gradients on the GPU (in FP32 when the compute dtype is
narrower). Its weights cross PCIe once a step whatever the accumulation, no host buffer
accumulates anything, and every unit's gradient is complete right after its backward;
what it costs is the checkpoints of the whole batch (a micro-batch's working set).

Two update schedules (--tuning.schedule):
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

The parts: GpuSlots (slots.py) holds the GPU slots and plans the uploads into them;
DeferredSweep (deferred.py) the clipped schedule's held gradients and host sweep; StepNorm
(step_norm.py) the global norm; PipelineThreads (threads.py) the worker threads and their
shared failure state. SlideEngine builds them and runs a step: _forward, _head, _backward.
"""
from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future

import torch

from ...data.batch import IGNORE_INDEX, Batch
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
from ..distributed import DataParallel
from ..gc_policy import GCFreeze
from ..interface import Engine
from ..placement import PlacementPlan, unit_shapes
from ..result import StepResult
from ..tiers import TIERS
from .activations import ActivationStore
from .deferred import DeferredSweep
from . import grad_sum as grad_sum_mod
from .grad_sum import MAX_HELD, GradSum, accumulate
from .host_state import build_host_state
from .host_store import HostUnit
from .layer_runner import LayerRunner
from .slots import GpuSlots, Slot, shapes_for
from .step_norm import StepNorm
from .pacing import LinkPacers
from .threads import PipelineThreads
from .transfer import GradDrain, Uploader
from .update_hold import UpdateHold
from ...faults import maybe_oom, maybe_poison, poison_scale
from ...objectives.head import PairStats, head_step, step_loss, step_metrics
from ...objectives.preference import PreferenceConfig
from .workers import WorkerError, done_future

log = logging.getLogger(__name__)


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


def _row_positions(position_ids: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """[B, S] position ids for every micro-batch: masked packing's (restarting per document), else
    0..S-1 in each row, the values transformers assumes for None. One form, so the rotary tensors a
    compiled layer receives are [B, S, hd] for every batch (None gave [1, S, hd]: a recompile of the
    layer's two graphs at the first batch with a document boundary, 2026-11-29)."""
    if position_ids is not None:
        return position_ids
    return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape)                  # [B, S]


def _leaves(views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh autograd leaves over the same memory (so gradients can be asked for)."""
    return {k: v.detach().requires_grad_(True) for k, v in views.items()}


def _gradient_drain(rt: RuntimeConfig, device: Device, *, schedule: str, chunk: int, gpu_cast: bool,
                    grad_dtype: torch.dtype, layer_numel: int) -> GradDrain:
    """The gradients' way down to the host (transfer.GradDrain). Gradients in the compute dtype
    reach AdamW as they landed where native_adamw's kernel reads them (built here once per
    process: a C compile, ~0.2 s); else the host widens each chunk into an FP32 scratch for
    torch's kernel. The deferred schedule copies each gradient straight into its held buffer:
    no ring."""
    downloads_fp32 = rt.downloads_fp32(device.is_cuda)
    widen = (schedule == "eager" and not downloads_fp32 and rt.host.host_adamw != "torch"
             and grad_dtype in native_adamw.GRAD_TYPES and grad_dtype != torch.float32
             and native_adamw.load() is not None)
    ring = 0 if schedule == "deferred" else rt.download_chunks(layer_numel)
    return GradDrain(device, grad_dtype, chunk, ring, gpu_cast=gpu_cast and downloads_fp32, widen_in_adamw=widen)


def _pin_host_buffers(device: Device, units: list, *, gpu_cast: bool, pin: bool) -> None:
    """Page-lock (pin) or release the host buffers the copies read or write in place: the held
    gradients (one D2H copy straight into each), a disk-master unit's compute-dtype weights
    (one async H2D, no cast) and, casting on the GPU, the FP32 masters (async FP32 H2D, no copy)."""
    op = device.register_host if pin else device.unregister_host
    if device.is_cuda:
        for unit in units:
            for held in unit.held:
                op(held)
            if unit.weights is not None:
                op(unit.weights)
    if gpu_cast:
        for unit in units:
            if unit.on_host and unit.master is not None and not unit.upload_copy:
                op(unit.master)


def _refuse_after_disk_release(released: bool, what: str) -> None:
    """The disk tier's files went with release_disk_tier(): no step or optimizer state after that."""
    if released:
        raise RuntimeError(f"cannot {what}: the disk tier's files (the AdamW moments of its units) were "
                           f"removed by release_disk_tier() at the end of the run")


def _wire_copiers(uploader: Uploader, drainer: GradDrain, timeline, abort, pcie_gbps: float | None) -> LinkPacers:
    """The uploader and the gradient drain share the engine's timeline and abort event, and pace
    their copies at --tuning.pcie_gbps, each direction its own (pacing.py): a failed thread's abort
    wakes a pacer's sleep."""
    drainer.timeline = uploader.timeline = timeline
    drainer.abort = uploader.abort = abort
    pacers = LinkPacers(pcie_gbps, sleep=abort.wait)
    uploader.pace, drainer.pace = pacers.h2d, pacers.d2h
    return pacers


class SlideEngine(Engine):
    def __init__(self, loaded: LoadedModel, rt: RuntimeConfig, optim: AdamWConfig, device: Device,
                 grad_accum: int = 1, max_grad_norm: float | None = None, timer: EventTimer | None = None,
                 dist: DataParallel | None = None, objective: PreferenceConfig | None = None):
        """dist: data parallel over several ranks (engine/distributed.py, docs/data_parallel.md); None
        or one rank: this process alone. objective: a preference objective (objectives/head.py); None: SFT.

        Builds, in order: the placement plan (which refuses a combination of settings it cannot
        run), the host state (host_state.py), the worker threads (threads.py), the GPU slots
        (slots.py) and the clipped schedule's sweep (deferred.py)."""
        self.split, self.rt, self.device, self.dtype = loaded.split, rt, device, rt.torch_dtype
        self.schedule = rt.resolved_schedule(grad_accum, max_grad_norm)
        self.deferred = self.schedule == "deferred"
        self.max_grad_norm = max_grad_norm
        self.objective = objective
        self.pair_stats: list[PairStats] = []      # this step's pairs, as the head saw them (preference)
        self._closed = False
        self.timer = timer or EventTimer(device, enabled=False)
        self.timeline = HostTimeline(enabled=False)
        self.memory = MemoryTimeline(device, enabled=False)
        self.step_index = 0
        self._last_step_t: float | None = None
        self.dp = dist if dist is not None and dist.world_size > 1 else None
        # where each unit's state lives (GPU, host RAM, disk) and how its weights reach the GPU (placement.py)
        self.plan = PlacementPlan.build(unit_shapes(self.split), rt, self.schedule,
                                        ranks=self.dp.world_size if self.dp is not None else 1, dtype=self.dtype,
                                        local_ranks=self.dp.cfg.local_world_size if self.dp is not None else 1)
        self.vocab_on_device = self.plan.vocab_on_device
        self.host_state = self.plan.host_state     # --master / --moments (a checkpoint's state.json records them)
        self.device_layers, self.resident_layers = self.plan.device_layers, self.plan.resident_layers
        if rt.transfer.cast_on == "gpu" and not device.is_cuda:
            raise ValueError("--tuning.cast_on gpu needs a CUDA device (auto picks cpu on a CPU machine)")
        self.grad_sum = grad_sum_mod.resolve(rt.transfer.grad_sum, self.device.device)   # fused (Triton) or torch
        self._grad_sum_checked = False
        self.threads = PipelineThreads(self.timeline, lambda: self.step_index)
        hs = build_host_state(loaded, self.plan, rt, optim, device, self.dp, self.dtype, self.deferred,
                              self.timeline, self.threads.abort)       # host_state.py
        self.store, self.disk, self.shared, self.save_service = hs.store, hs.disk, hs.shared, hs.save_service
        self.owner_of, self.gather = hs.owner_of, hs.gather
        self.disk_released = False      # release_disk_tier(): the run is over, its moments are gone
        self.units: list[HostUnit] = self.store.units
        layer_numel = max(u.numel for u in self.split.layer_units)
        self.gpu_cast = rt.casts_on_gpu(device.is_cuda)
        # Casting on the compute stream needs FP32 on the device side: the CPU cast path
        # (cast_on=cpu) moves compute-dtype bytes and has nothing to cast there.
        self.cast_in_compute = rt.transfer.upload_cast_stream == "compute" and (self.gpu_cast or not device.is_cuda)
        shapes = shapes_for(self.plan, self.dtype, self.cast_in_compute)
        self.chunk = rt.transfer.chunk_elems(layer_numel, align=self.plan.host_state.moment_block or 1)
        # the FP32 widening buffer of the device-side updates (compute-dtype gradient slots)
        device_numel = max((u.spec.numel for u in self.units if u.on_device), default=0)
        self.device_grad32 = (torch.empty(min(self.chunk, device_numel), dtype=torch.float32, device=device.device)
                              if device_numel and shapes.grad_dtype != torch.float32 else None)
        _pin_host_buffers(device, self.units, gpu_cast=self.gpu_cast, pin=True)
        self.uploader = Uploader(device, self.dtype, self.chunk, rt.transfer.upload_ring, gpu_cast=self.gpu_cast,
                                 stages=rt.transfer.upload_stages)
        self.host_threads = rt.resolved_host_threads(device.is_cuda)      # the host AdamW's (reports read it)
        self.threads.start(follower=self.dp is not None, gather=self.gather, host_threads=self.host_threads,
                           gil_switch_s=rt.host.gil_switch_ms / 1e3)
        self.slots = GpuSlots(self.plan, self.units, shapes, device, self.uploader, self.threads,
                              lambda: self.step_index, dp=self.dp, owner_of=self.owner_of, gather=self.gather)
        # the slots the tests and reports read as the engine's
        self.layer_slots, self.own_slots = self.slots.layer_slots, self.slots.own_slots
        self.device_grad_slots = self.slots.device_grad_slots
        self.drainer = _gradient_drain(rt, device, schedule=self.schedule, chunk=self.chunk, gpu_cast=self.gpu_cast,
                                       grad_dtype=shapes.grad_dtype, layer_numel=layer_numel)
        self.pacers = _wire_copiers(self.uploader, self.drainer, self.timeline, self.threads.abort,
                                    rt.transfer.pcie_gbps)
        # Eager updates and their D2H copies run earliest-deadline-first (rt.host.update_order;
        # workers.DeadlineWorker): the ring then carries the most urgent gradients while the
        # others wait in their GPU slots.
        self.deadline_order = self.schedule == "eager" and rt.host.update_order == "deadline"
        self.norm = StepNorm(device)
        # the clipped sweep's first pass: "params" (split), "weights" (the units with an upload copy
        # write their compute-dtype weights, clip_sweep=weights) or the whole update (whole)
        self.sweep = (DeferredSweep(self.units, device, self.threads, self.drainer, self.chunk, max_grad_norm,
                                    split_sweep=rt.clip.clip_sweep in ("split", "weights"),
                                    step_index=lambda: self.step_index) if self.deferred else None)
        self.acts = ActivationStore(device, self.split.num_layers, rt.offloads_activations, self.plan.gpu_checkpoints,
                                    self.sweep.lend_held if self.sweep and self.plan.checkpoints_in_held else None)
        self.gc_freeze = GCFreeze(rt.host.gc_freeze)
        self.layers = LayerRunner(self.split, rt, device.device)   # HF's or the lean layer, eager or compiled

    # ------------------------------------------------------------- gradients
    def _update_on_device(self, unit_index: int, gslot: Slot, lr: float,
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
            if unit_index in self.slots.own_slots:
                self.slots.refresh_from_device_master(unit_index)
            else:
                self.slots.master_updated(unit_index)     # a sharded layer: its owner broadcasts it
        gslot.free = done_future(None)

    def _update_device_units(self, lr: float) -> None:
        """Deferred, on the compute stream after the backward: the units kept on the device apply
        their held gradients with the clip coefficient, in the order the next forward needs them."""
        coef = self.norm.clip_coefficient_on_device(self.max_grad_norm)
        L = self.split.num_layers
        for unit_index in [0, *range(1, L + 1), L + 1]:
            if self.units[unit_index].on_device:
                self._update_on_device(unit_index, self.slots.grad_slot(unit_index), lr, coef)

    def _gradient_complete(self, unit_index: int, slot: Slot, lr: float) -> None:
        """The unit's gradient for this step is in `slot` (every micro-batch summed): its squared
        norm joins the step's, then it is applied (eager) or held until the norm is known."""
        unit = self.units[unit_index]
        if self.dp is not None:
            # every rank's share summed (each scaled by 1 / the global token count): the global
            # gradient, so the norm below is the global one on every rank
            self.dp.all_reduce_(slot.flat[: unit.spec.numel])
        self.norm.add(slot.flat[: unit.spec.numel])
        if not unit.owned:
            # another rank updates it from the same gradient; its slot is free again in stream order
            # (a sharded layer's new weights come by its owner's broadcast, nothing to follow)
            if not self.deferred and not unit.remote:
                self._follow(unit_index)
            return
        if unit.on_device:
            if not self.deferred:
                self._update_on_device(unit_index, slot, lr)
            # deferred: it waits in its own slot for _update_device_units
        elif self.deferred:
            self.sweep.hold(unit_index, slot)
        else:
            self._submit_drain(unit_index, slot, lr)

    def _submit_drain(self, unit_index: int, slot: Slot, lr: float) -> None:
        """Eager: the unit's gradient goes down chunk by chunk and the host's AdamW consumes it."""
        unit = self.units[unit_index]
        threads = self.threads
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
            chunks[0].add_done_callback(lambda _: threads.host_worker.notify())

        def consume() -> None:
            """Host worker: the unit's AdamW as its chunks land; weights and moments in one pass."""
            self.drainer.consume(unit, chunks, lr=lr)
            unit.publish_state()
        threads.host_worker.submit(threads.timed, "host", "drain", unit.spec.name, consume, **order)
        # A third thread queues the copies as ring buffers free up, so neither the compute
        # thread (which only needs its GPU gradient slot back) nor AdamW ever waits on it.
        slot.free = free = Future()

        def issue(src: torch.Tensor) -> None:
            with self.timeline.span("d2h", "issue", unit.spec.name):
                last = self.drainer.issue(unit, src, ready, futs=chunks)
            free.set_result(last)
        # The issuer, too, takes the most urgent unit whose gradient the GPU has computed:
        # copies run in issue order on one stream, so a copy queued behind a backward still
        # to come would hold back the copies of gradients that are already there.
        threads.d2h_worker.submit(issue, slot.flat[: unit.spec.numel],
                                  **({"deadline": unit_index, "ready": ready.query} if self.deadline_order else {}))

    def _follow(self, unit_index: int) -> None:
        """Data parallel: count this step's update of a unit another rank owns once its owner has
        written it (HostUnit.follow), on the follower thread."""
        unit = self.units[unit_index]
        threads = self.threads
        threads.follower.submit(threads.timed, "follow", "follow", unit.spec.name, unit.follow, self.step_index + 1,
                                threads.abort)

    def _write_summed(self, unit: UnitSpec, slot: Slot, summed: GradSum) -> None:
        """A layer's micro-batch gradient sum into its slot. The fused sum's first use with several
        micro-batches is checked bit for bit against torch's; a difference is logged and the
        run goes on with torch's sum (the slot gets torch's values either way)."""
        views = list(self.slots.views(unit, slot.flat).values())
        check = (self.grad_sum == "fused" and not self._grad_sum_checked and 1 < summed.k <= MAX_HELD)
        same = summed.write(views, check=check)
        if check:
            self._grad_sum_checked = True
        why = summed.failed or (None if same else "its sums differ from torch's")
        if why and self.grad_sum == "fused":
            log.warning("slidetune: the fused micro-batch gradient sum failed on %s (%s); summing with "
                        "torch from now on (--tuning.grad_sum torch says so up front)", unit.name, why)
            self.grad_sum = "torch"

    # ------------------------------------------------------------- the step
    def train_step(self, micro_batches: list, lr: float) -> StepResult:
        _refuse_after_disk_release(self.disk_released, "train a step")
        n_tokens = sum(mb.num_target_tokens() for mb in micro_batches)
        if self.dp is not None:
            # every rank scales its gradient by 1 / the step's tokens over all ranks: the summed
            # gradients are then one rank's at the whole batch
            (n_tokens,) = (int(n) for n in self.dp.sum_scalars([n_tokens]))
        if n_tokens == 0:
            raise ValueError("the step's batches contain no target tokens (all labels are -100)")
        now = time.monotonic()
        if self._last_step_t is not None:
            self.threads.watchdog.record_step(now - self._last_step_t)       # the interval between steps
        self._last_step_t = now
        if self.sweep is not None:
            self.sweep.begin_step()
        self.norm.reset()
        # the disk units' moments, read ahead in the order their updates will run: as the
        # backward releases them (eager), or as the sweep reaches them (deferred); moments do
        # not depend on the gradient, so the reads start now (a unit in RAM has nothing to read)
        self.store.prefetch(reverse=not self.deferred)
        # The summed loss is copied out right after the head, with its own event: reading it
        # waits for that head only. (A float() of a GPU scalar at the end would wait for the
        # whole backward queued behind it, spinning a core the host's AdamW needs; NOTES.md "Pipeline threads".)
        try:
            host_loss, loss_ready = self._forward_backward(micro_batches, 1.0 / n_tokens, lr)
        except BaseException as e:
            # A failure of the compute thread itself (a CUDA OOM): the workers may be waiting for
            # gradients that will never come, so mark the run failed; close() then skips the final
            # synchronize and the workers' waits give up instead of hanging.
            self.threads.on_error(e, "compute")
            raise
        copied = self.norm.copy_out()
        if self.deferred:
            self._update_device_units(lr)
            norm_fut = self.sweep.start(copied, lr)
            if self.dp is not None:
                for index, unit in enumerate(self.units):     # in the owners' sweep order
                    if not unit.owned and not unit.remote:
                        self._follow(index)
            # The sweep updates layers 0..L-1 in order: the resident layers' uploads follow it.
            if self.gather and self.units[0].on_host:
                # gathering: the embedding's broadcast must not queue behind the resident layers'
                self.slots.prefetch_next_step(0, self.own_slots[0])
            for i in range(self.split.num_layers):
                if self.slots.resident(i):
                    self.slots.prefetch_next_step(i + 1, self.own_slots[i + 1])
        else:
            norm_fut = self.threads.host_worker.submit(lambda: math.sqrt(copied.squared()))
        if self.gather:
            self.slots.flush_gathers()
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
        return StepResult(loss=step_loss(self.objective, loss_sum, n_tokens), n_tokens=n_tokens,
                          grad_norm_future=self.threads.rooted(norm_fut),
                          metrics=step_metrics(self.objective, self.pair_stats,
                                               self.dp.sum_scalars if self.dp is not None else None))

    def _forward(self, mbs: list, visits: list[int], assign: dict[int, int], save_inputs: bool):
        """The forward phase: embedding and layers 0..L-1 without autograd over every micro-batch,
        layer by layer, uploads planned along `visits`. With `save_inputs` each layer's input is
        kept as its checkpoint (training).

        Returns (xs: per micro-batch [B, S, d], ids, labels and layer kwargs per micro-batch,
        embed slot, head slot).
        """
        split, dev, slots = self.split, self.device.device, self.slots
        L = split.num_layers
        ids = [mb.input_ids.to(dev, non_blocking=True) for mb in mbs]          # [B, S] each
        labels = [mb.labels.to(dev, non_blocking=True) for mb in mbs]          # [B, S] each
        kwargs = [split.layer_kwargs(*i.shape, self.dtype, dev,
                                     attention_mask=_to(mb.attention_mask, dev),
                                     position_ids=_row_positions(_to(getattr(mb, "position_ids", None), dev), i))
                  for i, mb in zip(ids, mbs)]
        embed_slot = slots.use_own_slot(0)
        # Resident layers whose slot does not hold this step's weights (the first step, or
        # after load_state), in the order the forward needs them; later steps find them there.
        for i in range(L):
            if slots.resident(i):
                slots.use_own_slot(i + 1)
        slots.plan_window(visits, 0, assign)
        slots.acquire(embed_slot)
        with torch.no_grad(), self.timer.span("embed", -1):
            embed_params = slots.views(split.embed_unit, embed_slot.flat)
            xs = [split.embed_forward(embed_params, i) for i in ids]                # [B, S, d] each
            for m in range(len(mbs)):      # Gemma 4 E2B / E4B: the per-layer inputs (models/layer_sides.py)
                split.attach_sides(kwargs[m], embed_params, ids[m], xs[m])
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
            slots.plan_window(visits, i, assign)
            if i == head_at:
                head_slot = slots.use_own_slot(L + 1)         # queue the head behind the last layers
            slot = slots.use_own_slot(i + 1) if self.plan.has_own_slot(i) else slots.layer_slot(visits, i, assign)
            slots.acquire(slot)
            params = slots.views(split.layer_units[i], slot.flat)
            for m in range(len(mbs)):
                if save_inputs:
                    self.acts.save(i, xs[m], m)
                with torch.no_grad(), self.timer.span("forward", i):
                    xs[m] = self.layers.forward(i, params, xs[m], kwargs[m][i])
            slots.release(slot)
            self.memory.mark("forward", i)
        if head_slot is None:
            head_slot = slots.use_own_slot(L + 1)
        return xs, ids, labels, kwargs, embed_slot, head_slot

    def _forward_backward(self, mbs: list, scale: float, lr: float):
        """Queue the step's forward, head and backward over all micro-batches; returns (the summed
        loss in a [1] host tensor, the event after which that tensor holds it)."""
        L = self.split.num_layers
        visits = list(range(L)) + list(reversed(range(L)))     # forward then backward
        assign: dict[int, int] = {}                            # visit -> window slot (GpuSlots.plan_window)
        xs, ids, labels, kwargs, embed_slot, head_slot = self._forward(mbs, visits, assign, save_inputs=True)
        pairs = [mb.pairs.to(self.device.device, non_blocking=True) if mb.pairs is not None else None for mb in mbs]
        host_loss, loss_ready, gs, tied_acc = self._head(xs, labels, pairs, embed_slot, head_slot, scale, lr)
        del xs
        self._backward(gs, ids, kwargs, visits, assign, embed_slot, head_slot, tied_acc, lr)
        return host_loss, loss_ready

    def _head(self, xs: list, labels: list, pairs: list, embed_slot: Slot, head_slot: Slot, scale: float, lr: float):
        """The head phase: loss and its gradients, a micro-batch at a time (the head never holds more
        than a chunk of logits), their parameter gradients summed as the layers' are. Frees each
        micro-batch's last hidden state in `xs`. `pairs`: each micro-batch's preference pairs, or None
        (objectives/head.py: the head's passes by objective).

        Returns (the summed loss in a [1] host tensor, the event after which it holds it, the
        gradient reaching each micro-batch's last layer output [B, S, d], a tied embedding's
        gradient share from the head or None)."""
        split, slots = self.split, self.slots
        k = len(xs)
        head_index = split.num_layers + 1
        slots.acquire(head_slot)
        head_params = slots.views(split.head_unit, head_slot.flat)
        tied_w = slots.views(split.embed_unit, embed_slot.flat)["weight"] if split.tied else None
        gs: list[torch.Tensor] = []       # the gradient reaching each micro-batch's last layer output, [B, S, d]
        acc = None
        loss_sum = None
        self.pair_stats = []
        maybe_oom(self.step_index + 1)        # tests only (faults.py): an OOM mid-step, past the forward
        for m in range(k):
            with self.timer.span("head", -1):
                # loss and gradients without an autograd graph (the chunked heads scale their
                # gradients in place: models/units.head_loss_and_grads), by objective
                res = head_step(split, head_params, xs[m], labels[m], pairs[m], self.objective,
                                poison_scale(scale, self.step_index + 1),                   # NaN: tests only
                                tied_w, self.rt.resolved_head_impl, self.rt.head.head_chunk_tokens)
                loss, g_x, g = maybe_poison(res.loss, self.step_index + 1), res.g_hidden, res.grads  # tests only
                if res.pairs is not None:
                    self.pair_stats.append(res.pairs)
            gs.append(g_x)
            grads = [g[name] for name in head_params] + ([g["lm_head.weight"]] if tied_w is not None else [])
            acc = accumulate(acc, grads, k)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            xs[m] = None
            del loss, g_x, g, grads, res
        slots.release(head_slot)
        self.memory.mark("head")
        host_loss = self.device.host_empty(1, torch.float32)
        host_loss.copy_(loss_sum.float().view(1), non_blocking=True)
        loss_ready = self.device.record()
        gslot = slots.grad_slot(head_index)
        slots.claim_grad_slot(gslot)
        torch._foreach_copy_(list(slots.views(split.head_unit, gslot.flat).values()), acc[:len(head_params)])
        self._gradient_complete(head_index, gslot, lr)
        # a tied embedding's gradient: the head's share, to which the embedding's own is added
        tied_acc = acc[len(head_params):] if tied_w is not None else None
        return host_loss, loss_ready, gs, tied_acc

    def _backward(self, gs: list, ids: list, kwargs: list, visits: list[int], assign: dict[int, int],
                  embed_slot: Slot, head_slot: Slot, tied_acc: list | None, lr: float) -> None:
        """The backward phase: recompute each layer from its checkpoints, then differentiate, every
        micro-batch while the layer's weights are on the GPU; then the embedding's gradient, a
        micro-batch at a time, summed (onto the head's share where tied). `gs`: the gradient
        reaching each micro-batch's last layer output [B, S, d]."""
        split, slots = self.split, self.slots
        L, k = split.num_layers, len(gs)
        for i in reversed(range(L)):
            v = 2 * L - 1 - i
            slots.plan_window(visits, v, assign)
            slot = slots.layer_slot(visits, v, assign)
            self.acts.prefetch(i, 0)
            slots.acquire(slot)
            params = _leaves(slots.views(split.layer_units[i], slot.flat))
            summed = GradSum(k, self.grad_sum)
            for m in range(k):
                # the next checkpoint the backward reads: this layer's next micro-batch, or the
                # layer below's first
                self.acts.prefetch(*((i, m + 1) if m + 1 < k else (i - 1, 0)))
                res = self.layers.recompute_backward(i, params, self.acts.load(i, m), gs[m], kwargs[m][i],
                                                     self.timer, kwargs[m].sides)
                gs[m] = res[0]
                summed.add(res[1:])
                del res
            slots.release(slot)
            gslot = slots.grad_slot(i + 1)
            slots.claim_grad_slot(gslot)
            self._write_summed(split.layer_units[i], gslot, summed)
            self._gradient_complete(i + 1, gslot, lr)
            if not self.deferred:
                if slots.resident(i):
                    slots.prefetch_next_step(i + 1, slot)
                if i == L // 2 and not self.vocab_on_device:
                    slots.prefetch_next_step(L + 1, head_slot)
            del summed, params
            self.memory.mark("backward", i)
        slots.acquire(embed_slot)
        w = _leaves(slots.views(split.embed_unit, embed_slot.flat))
        # a tied weight's head share first (the embedding's weight leads the unit's parameters)
        acc = tied_acc if tied_acc is None or len(w) == 1 else \
            tied_acc + [torch.zeros_like(v, dtype=tied_acc[0].dtype) for v in list(w.values())[1:]]
        for m in range(k):
            with self.timer.span("embed_backward", -1):
                grads = split.embed_grads(w, ids[m], gs[m], kwargs[m].sides)
            acc = accumulate(acc, grads, k)
            gs[m] = kwargs[m].sides = None
            del grads
        slots.release(embed_slot)
        embed_gslot = slots.grad_slot(0)
        slots.claim_grad_slot(embed_gslot)
        torch._foreach_copy_(list(slots.views(split.embed_unit, embed_gslot.flat).values()), acc)
        self._gradient_complete(0, embed_gslot, lr)
        if not self.deferred and not self.vocab_on_device:
            slots.prefetch_next_step(0, embed_slot)
        self.acts.clear()
        self.memory.mark("embed_backward")

    # ------------------------------------------------------------- evaluation
    @torch.no_grad()
    def token_losses(self, batch) -> torch.Tensor:
        """[B * S] each position's loss with the current weights (0 where ignored; eval_loss sums them):
        every layer streamed through the window, then the head's first pass alone."""
        split, slots = self.split, self.slots
        xs, _, labels, _, embed_slot, head_slot = self._forward([batch], list(range(split.num_layers)), {},
                                                                save_inputs=False)
        slots.acquire(head_slot)
        tied_w = slots.views(split.embed_unit, embed_slot.flat)["weight"] if split.tied else None
        rows = split.head_token_losses(slots.views(split.head_unit, head_slot.flat), xs[0], labels[0],
                                       lm_weight=tied_w, impl=self.rt.resolved_head_impl,
                                       chunk_tokens=self.rt.head.head_chunk_tokens)
        slots.release(embed_slot)
        slots.release(head_slot)
        return rows

    @torch.no_grad()
    def next_token_logits(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The logits of the token after each row's first lengths[b] tokens, with the current weights:
        input_ids [B, S] (right-padded; causal attention keeps the padding out of earlier positions),
        lengths [B] -> [B, V] float32. One full forward as eval_loss runs it (every layer streamed
        through the window), no KV cache (evaluation/samples.py: greedy samples)."""
        split, slots = self.split, self.slots
        batch = Batch(input_ids, torch.full_like(input_ids, IGNORE_INDEX), None)
        xs, _, _, _, embed_slot, head_slot = self._forward([batch], list(range(split.num_layers)), {},
                                                           save_inputs=False)
        last = xs[0][torch.arange(input_ids.shape[0], device=xs[0].device), lengths.to(xs[0].device) - 1]  # [B, d]
        slots.acquire(head_slot)
        tied_w = slots.views(split.embed_unit, embed_slot.flat)["weight"] if split.tied else None
        logits = split.head_logits(slots.views(split.head_unit, head_slot.flat), last, lm_weight=tied_w)
        slots.release(embed_slot)
        slots.release(head_slot)
        return logits                                                              # [B, V]

    # ------------------------------------------------------------- state
    def synchronize(self) -> None:
        """Wait until every submitted update and copy has finished (not used on the hot path)."""
        try:
            self.threads.drain()
            self.store.drain()              # the tiers' writes behind (the disk tier's blocks)
            if self.dp is not None:
                # the other owners' moments too (not a collective: one rank may call it alone)
                for unit in self.units:
                    unit.wait_state(self.step_index, self.threads.abort)
        except WorkerError as e:
            first = self.threads.first_error or e
            raise WorkerError(f"{self.threads.failed_where}: {first!r}") from first
        self.device.synchronize()

    def async_save_refusal(self) -> str | None:
        """Why this engine cannot save asynchronously (checkpoint/background.py), or None: it can."""
        if self.dp is not None:
            return ("under data parallel every rank updates the units it owns while rank 0 writes the "
                    "checkpoint; a save there is blocking")
        if self.disk_released:
            return "the disk tier's files (AdamW moments) are gone"
        return None

    def hold_updates(self) -> list[UpdateHold]:
        """Hold every unit's next update until an asynchronous checkpoint has read the unit (one hold
        per unit, in unit order: release each once its weights and moments are written). Call at a
        step boundary, after synchronize(): no update is in flight, so what the writer reads is
        the state of step `step_index` until it releases the unit."""
        holds = []
        for unit in self.units:
            unit.hold = hold = UpdateHold(self.threads.abort)
            holds.append(hold)
        self.threads.watchdog.watch_save(holds)     # waits on them are the writer's pace, not a hang
        return holds

    def named_master_params(self, on_host: bool = True):
        """(HF name, FP32 tensor) for every parameter; call after synchronize(). Units kept on the
        device (vocab_update=device) are copied to the host, or left there with on_host=False (a
        checkpoint writer stages them down in chunks); a disk-master unit's come as
        StreamedTensors read from the disk tier when consumed (checkpoint/writer.py's write_safetensors)."""
        for unit in self.units:
            for name, t in unit.params().items():
                yield name, (t if not unit.on_device or not on_host else t.cpu())

    def optimizer_tensors(self, on_host: bool = True) -> dict[str, torch.Tensor]:
        """Every unit's AdamW state by name; on_host=False leaves the device units' where they are
        (a checkpoint writer stages them down in chunks instead of copying all of them at once)."""
        _refuse_after_disk_release(self.disk_released, "read the optimizer state")
        out = {}
        for unit in self.units:
            for k, t in unit.state_tensors().items():
                out[f"{unit.spec.name}.{k}"] = t if not unit.on_device or not on_host else t.cpu()
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
            # the names FlatAdamW keeps (8-bit moments: their block scales too)
            unit.load(masters, {k: optim[f"{unit.spec.name}.{k}"] for k in unit.opt.state_names()})
            unit.set_version(step)
        self.step_index = step
        self.slots.forget_weights()
        for i in self.plan.indices("shard"):
            if self.units[i].owned:
                self.slots.master_updated(i)      # its broadcasts read the loaded master
        if self.dp is not None:
            self.dp.host_barrier()      # every owner has written its units

    def memory_report(self) -> dict[str, int]:
        pinned = (sum(b.numel() * b.element_size() for b in self.uploader.ring + self.drainer.ring)
                  + self.acts.pinned_bytes() + (self.disk.pinned_bytes() if self.disk is not None else 0))
        device_state = sum(FP32_ADAMW.bytes_per_param * u.spec.numel for u in self.units if u.on_device)   # vocab_update=device, device_layers
        # the shared host state is counted once per host, by its local rank 0
        shared = self.shared.nbytes if self.shared is not None and self.dp.local_rank == 0 else 0
        out = {"gpu_buffers": self.slots.gpu_bytes(), "pinned": pinned,
               "host_state": self.store.state_bytes() + shared, "device_state": device_state}
        if self.disk is not None:
            out.update(disk_state=self.store.disk_bytes(), disk_read=self.disk.bytes_read,
                       disk_written=self.disk.bytes_written)
        return out

    def release_disk_tier(self) -> None:
        """Remove the disk tier's files now (the run is over and keeps no resumable state): the
        weights (masters in host RAM) stay exportable; the disk units' AdamW moments are gone, so
        no further step or optimizer-state checkpoint is possible."""
        if self.disk is None:
            return
        if self.disk.masters:
            raise RuntimeError("the disk tier holds the FP32 masters of "
                               f"{self.plan.ranges(TIERS.with_files.holds_master)} (--tuning.disk_master): "
                               f"its files are the model's weights until final/ is written")
        self.synchronize()
        self.disk.close()
        self.disk_released = True

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            if not self.threads.abort.is_set():      # after a failure, nothing is left to finish
                self.synchronize()
        finally:
            self.threads.close()                # and the interpreter's switch interval restored
            self.acts.close()
            if self.disk is not None:
                self.disk.close()           # the scratch files go; the run's state is in its checkpoints
            self.gc_freeze.release()
            _pin_host_buffers(self.device, self.units, gpu_cast=self.gpu_cast, pin=False)
            self.gpu_cast = False
