"""The slide engine's GPU slots and the plan of what is uploaded into which, when.

Weight slots: units with a slot of their own (the vocabulary units, the device layers, whose
weights are cast from their GPU master, and the resident layers) are uploaded once a step as
their update lands; the other host layers share a window of interchangeable slots, planned
`window - 1` visits ahead (plan_window). A slot is overwritten only after the event of its
last reader, a gradient slot only after the event of the D2H copy that drained it. Under
dp_weights=gather a host unit's owner alone uploads it and broadcasts it to the host's other
GPUs (engine.py's docstring).
"""
from __future__ import annotations

import math
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_any
from dataclasses import dataclass
from typing import Callable

import torch
from torch.profiler import record_function

from ...device import Device
from ...models.units import UnitSpec
from ..distributed import DataParallel
from ..placement import PlacementPlan
from .host_store import HostUnit
from .threads import WAIT_S, PipelineThreads
from .transfer import Uploader
from .workers import done_future, wait_or_abort


@dataclass
class Slot:
    """A GPU buffer holding one unit's weights (or gradients) in the compute dtype."""

    flat: torch.Tensor                 # [numel] compute dtype (FP32 for FP32 gradient slots)
    content: tuple | None = None       # (unit index, version) planned into it
    ready: Future | None = None        # -> event after which the weights are on the GPU
    landing: torch.Tensor | None = None   # [numel] FP32, upload_cast_stream=compute: uploads land here
    cast_pending: bool = False         # landing holds an upload not yet cast into `flat`
    last_use: object = None            # event after the last kernel that read it
    free: Future | None = None         # gradient slots: -> event after its D2H drained it


@dataclass
class SlotShapes:
    """What the slots are allocated for."""

    dtype: torch.dtype                 # the compute dtype of the weight slots
    grad_dtype: torch.dtype            # the gradient slots' (FP32 with grad_slot_dtype=fp32)
    landing: bool                      # weight slots get an FP32 landing buffer (casts on the compute stream)
    grad_slots: int                    # the layers' interchangeable gradient slots
    deferred: bool                     # device layers hold their gradient in a slot of their own


class GpuSlots:
    """The GPU weight and gradient slots, and the uploads planned into them.

    `step_index()`: the step the compute thread is issuing (a slot's content is a unit at a
    version: the step after whose update it was uploaded)."""

    def __init__(self, plan: PlacementPlan, units: list[HostUnit], shapes: SlotShapes, device: Device,
                 uploader: Uploader, threads: PipelineThreads, step_index: Callable[[], int],
                 dp: DataParallel | None = None, owner_of: list[int] | None = None, gather: bool = False):
        self.plan, self.units, self.device = plan, units, device
        self.uploader, self.threads, self.step_index = uploader, threads, step_index
        self.dp, self.owner_of, self.gather = dp, owner_of, gather
        # gather: the broadcasts on a stream of their own; those of the next step's weights
        # registered during a step (prefetch_next_step) are queued at its end in the order the
        # next forward needs them (flush_gathers)
        self.gather_stream = device.new_stream() if gather else None
        self._pending_gathers: list[tuple] = []
        # sharded layers this rank owns: the event after the latest update of each one's master (on
        # the compute stream; None: the master as built), which its broadcasts read
        self._master_ready: dict[int, object] = {}
        self._views_cache: dict = {}
        self._allocate(shapes)

    def _allocate(self, shapes: SlotShapes) -> None:
        dev, L = self.device.device, self.plan.num_layers
        layer_numel = max(u.numel for u in self.plan.layers)
        empty = lambda n, dt=shapes.dtype: torch.empty(n, dtype=dt, device=dev)  # noqa: E731
        numel = [u.spec.numel for u in self.units]

        def weight_slot(n: int) -> Slot:
            return Slot(empty(n), landing=empty(n, torch.float32) if shapes.landing else None)

        def grad_slot(n: int) -> Slot:
            return Slot(empty(n, shapes.grad_dtype), free=done_future(None))

        # The window: interchangeable slots for the host layers without one of their own, each
        # uploaded in the forward and again in the backward.
        self.layer_slots = [weight_slot(layer_numel) for _ in range(self.plan.window_slots)]
        # Units with a slot of their own: the vocabulary units, the layers kept on the device
        # (their weights are cast from the device master there, never uploaded) and the resident
        # layers (the lowest ones above the device layers), into which the next step's weights
        # are uploaded as soon as the update lands (prefetch_next_step), so their forward never
        # waits on PCIe.
        device_layers = self.plan.device_layers
        resident = [u.index for u in self.plan.layers if u.slot == "own" and u.host_updated]
        self.own_slots = {0: weight_slot(numel[0]), L + 1: weight_slot(numel[-1]),
                          **{i: Slot(empty(numel[i])) for i in range(1, device_layers + 1)},
                          **{i: weight_slot(numel[i]) for i in resident}}
        self.grad_slots = [grad_slot(layer_numel) for _ in range(shapes.grad_slots)]
        if self.plan.shared_vocab_grad_slot:
            # the embedding's gradient reuses the head's slot once its copy to the host is done
            # (claim_grad_slot waits for it: long done by the end of the backward)
            (n,) = self.plan.vocab_grad_slot_numels()
            shared = grad_slot(n)
            self.vocab_grad_slots = {0: shared, L + 1: shared}
        else:
            self.vocab_grad_slots = {0: grad_slot(numel[0]), L + 1: grad_slot(numel[-1])}
        # deferred: each device layer's gradient (and each sharded layer's on its owner) waits for
        # the clip coefficient in a buffer of its own (the vocabulary units' slots are theirs already)
        self.device_grad_slots = ({i: grad_slot(numel[i]) for i in range(1, L + 1) if self.units[i].on_device}
                                  if shapes.deferred else {})

    def views(self, unit: UnitSpec, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The unit's named parameter views over a slot's buffer (cached per buffer)."""
        key = (unit.signature(), flat.data_ptr())
        if key not in self._views_cache:
            self._views_cache[key] = unit.views(flat)
        return self._views_cache[key]

    # ------------------------------------------------------------- uploads
    def submit_upload(self, unit_index: int, slot: Slot, version: int | None = None,
                      when_update_starts: bool = False) -> None:
        """Queue the upload of the unit after its `version`-th update (default: this step's weights).

        With `when_update_starts` the job reaches the (FIFO) upload thread only once the host
        has begun that update, so uploads run in the order the updates do; the slot's
        bookkeeping is still set here, on the compute thread, so plan_window sees it at once.
        """
        unit = self.units[unit_index]
        version = self.step_index() if version is None else version
        if self.gather and (unit.on_host or self.plan.units[unit_index].state == "shard"):
            self._submit_gather(unit_index, slot, version, when_update_starts)
            return
        after = done_future(slot.last_use)
        slot.content = (unit_index, version)
        # With a landing buffer the upload only moves FP32 bytes; acquire casts them. A disk-master
        # unit's weights are in the compute dtype already: straight into the slot.
        landing = slot.landing is not None and unit.uploads_fp32_master
        dst = slot.landing if landing else slot.flat
        slot.cast_pending = landing
        job = (self.threads.timed, "upload", "upload", unit.spec.name, self.uploader.upload, unit, dst, version, after)
        if not when_update_starts:
            slot.ready = self.threads.upload_worker.submit(*job)
            return
        ready: Future = Future()
        slot.ready = ready

        def release() -> None:
            self.threads.upload_worker.submit(*job).add_done_callback(lambda f: _chain(f, ready))
        unit.when_update_starts(version, release)

    def _submit_gather(self, unit_index: int, slot: Slot, version: int, when_update_starts: bool) -> None:
        """dp_weights=gather: the unit's weights after its `version`-th update reach this rank's slot
        by a broadcast from its owner, which uploads them (as submit_upload does, the cast included)
        before sending. Every rank queues its broadcasts on the compute thread, in the same order,
        so the collectives match; a rank that is not the owner uploads nothing.

        The gather thread runs them in that order, so the order must be the one they are needed
        in: a broadcast whose owner waits for a late update holds back every one behind it. The
        next step's weights (version > this step's) are registered in the middle of a step
        (resident layers as their gradient completes, the vocabulary units): their broadcasts
        are kept aside and queued once the step's own are (flush_gathers), the owner's upload
        starting at once all the same.

        A sharded layer's owner uploads nothing: it casts its GPU master into the slot on the
        gather stream, after the update that made `version` (issued on the compute stream before
        this step's window was planned: master_updated's event), then sends."""
        unit = self.units[unit_index]
        threads = self.threads
        after = done_future(slot.last_use)
        slot.content = (unit_index, version)
        slot.cast_pending = False               # the owner casts before it sends
        uploaded = None
        landing = slot.landing is not None and unit.uploads_fp32_master     # as submit_upload
        master = None
        if unit.owned and unit.on_device:       # a sharded layer, this rank's
            master = (unit.master, self._master_ready.get(unit_index))
            landing = False
        elif unit.owned:
            dst = slot.landing if landing else slot.flat
            upload = (threads.timed, "upload", "upload", unit.spec.name, self.uploader.upload, unit, dst, version,
                      after)
            if when_update_starts:
                uploaded = Future()
                unit.when_update_starts(version, lambda: threads.upload_worker.submit(*upload).add_done_callback(
                    lambda f: _chain(f, uploaded)))
            else:
                uploaded = threads.upload_worker.submit(*upload)
        gather = (threads.timed, "gather", "gather", unit.spec.name, self._gather, unit_index, slot, uploaded, after,
                  landing, master)
        if version > self.step_index():
            slot.ready = Future()
            self._pending_gathers.append((unit_index, slot.ready, gather))
        else:
            slot.ready = threads.gather_worker.submit(*gather)

    def flush_gathers(self) -> None:
        """Queue the next step's broadcasts kept aside during this one, in the order the next
        forward needs them: the embedding, the decoder layers from the bottom up, the head
        (the unit indices' order; the same on every rank)."""
        pending, self._pending_gathers = sorted(self._pending_gathers, key=lambda e: e[0]), []
        for _, ready, job in pending:
            self.threads.gather_worker.submit(*job).add_done_callback(lambda f, ready=ready: _chain(f, ready))

    def _gather(self, unit_index: int, slot: Slot, uploaded: Future | None, after: Future,
                landing: bool, master: tuple | None = None) -> object:
        """Gather thread: the owner's upload (then its cast into the compute dtype), a sharded layer's
        owner's cast of its GPU master (`master`: the master [n] FP32 and the event of its update) or,
        elsewhere, the slot's last reader; then the broadcast into the slot; the event the compute
        stream waits on."""
        unit = self.units[unit_index]
        n = unit.spec.numel
        with self.device.stream_ctx(self.gather_stream):
            if master is not None:
                for ev in (after.result(), master[1]):     # the slot's last reader; the update
                    if ev is not None:
                        self.gather_stream.wait_event(ev)
                slot.flat[:n].copy_(master[0])              # FP32 -> compute dtype, sent as such
            elif uploaded is not None:
                ev = wait_or_abort(uploaded, self.threads.abort, f"the upload of {unit.spec.name} to broadcast")
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

    def prefetch_next_step(self, unit_index: int, slot: Slot) -> None:
        """Upload the unit's next-step weights into `slot` as its update is written.

        The job is released to the upload thread when the update begins and trails it chunk
        by chunk. It is registered only where no upload the current step still needs can
        queue behind it: the resident layers need none, the head is updated first of all
        units, long before the middle of the backward, and the embedding is the last unit.
        """
        self.submit_upload(unit_index, slot, version=self.step_index() + 1, when_update_starts=True)

    def resident(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a host-updated layer with a slot of its own."""
        place = self.plan.units[layer + 1]
        return place.slot == "own" and place.host_updated

    def use_own_slot(self, unit_index: int) -> Slot:
        """The weights of a unit with a slot of its own (vocabulary units, device layers, resident
        layers) for this step: uploaded from the host master, or cast from the device one."""
        slot = self.own_slots[unit_index]
        if slot.content != (unit_index, self.step_index()):
            if self.units[unit_index].on_host:
                self.submit_upload(unit_index, slot)
            else:
                self.refresh_from_device_master(unit_index)
        return slot

    def master_updated(self, unit_index: int) -> None:
        """A sharded layer this rank owns has a new master (its update, or a load, was just issued on
        the compute stream): its next broadcasts wait for this event."""
        self._master_ready[unit_index] = self.device.record()

    def refresh_from_device_master(self, unit_index: int) -> None:
        """The compute-dtype weights of a unit kept on the device, cast from its FP32 master into its
        slot on the compute stream (stream order covers every reader before and after)."""
        unit, slot = self.units[unit_index], self.own_slots[unit_index]
        slot.flat[: unit.spec.numel].copy_(unit.master)
        slot.content = (unit_index, unit.version)
        slot.ready = done_future(None)
        slot.cast_pending = False

    def layer_slot(self, visits: list[int], v: int, assign: dict[int, int]) -> Slot:
        """The weight slot of visit `v` (decoder layer visits[v]): its own, or the window slot planned."""
        layer = visits[v]
        return self.own_slots[layer + 1] if self.plan.has_own_slot(layer) else self.layer_slots[assign[v]]

    def plan_window(self, visits: list[int], v: int, assign: dict[int, int]) -> None:
        """Make sure uploads are submitted for visits v .. v+K-1 (decoder layer indices, K window
        slots); `assign` maps each visit planned to its window slot."""
        K = len(self.layer_slots)
        step = self.step_index()
        for w in range(v, min(len(visits), v + K)):
            if w in assign or self.plan.has_own_slot(visits[w]):
                continue
            unit_index = visits[w] + 1
            want = (unit_index, step)
            hit = [s for s, sl in enumerate(self.layer_slots) if sl.content == want]
            if hit:
                assign[w] = hit[0]
                continue
            busy = {assign[u] for u in range(v, w) if u in assign}

            def next_use(s: int) -> float:
                c = self.layer_slots[s].content
                if c is None or c[1] != step:
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
            self.submit_upload(unit_index, self.layer_slots[s], when_update_starts=True)
            assign[w] = s

    def acquire(self, slot: Slot) -> None:
        """The compute stream waits for the slot's weights (and casts them from its landing buffer)."""
        ev = self.threads.wait(slot.ready, "wait_upload",
                               self.units[slot.content[0]].spec.name if slot.content else "")
        if ev is not None:
            self.device.current_stream().wait_event(ev)
        if slot.cast_pending:
            n = self.units[slot.content[0]].spec.numel
            slot.flat[:n].copy_(slot.landing[:n])     # FP32 -> compute dtype on the compute stream
            slot.cast_pending = False

    def release(self, slot: Slot) -> None:
        slot.last_use = self.device.record()

    def forget_weights(self) -> None:
        """The weight slots hold nothing current (load_state replaced the masters)."""
        for slot in self.layer_slots + list(self.own_slots.values()):
            slot.content = None

    # ------------------------------------------------------------- gradients
    def grad_slot(self, unit_index: int) -> Slot:
        """A gradient slot for the unit: any layer slot whose last gradient has been copied out
        (they come back out of order when the issuer runs earliest-deadline-first)."""
        if unit_index in self.vocab_grad_slots:
            return self.vocab_grad_slots[unit_index]
        if unit_index in self.device_grad_slots:
            return self.device_grad_slots[unit_index]
        threads = self.threads
        t0 = time.monotonic()
        while True:
            for slot in self.grad_slots:
                if slot.free.done():
                    return slot
            with threads.timeline.span("compute", "wait_grad_slot"), record_function("slidetune.wait_grad_slot"):
                wait_any([s.free for s in self.grad_slots], timeout=WAIT_S, return_when=FIRST_COMPLETED)
            threads.raise_if_aborted()
            threads.watchdog.check(time.monotonic() - t0, "a free gradient slot", threads.workers())

    def claim_grad_slot(self, slot: Slot) -> None:
        ev = self.threads.wait(slot.free, "wait_grad_slot")
        if ev is not None:
            self.device.current_stream().wait_event(ev)

    def gpu_bytes(self) -> int:
        """Bytes of every slot's buffers (a shared gradient slot once)."""
        slots = (self.layer_slots + self.grad_slots + list(self.own_slots.values())
                 + list({id(s): s for s in self.vocab_grad_slots.values()}.values())     # one, where shared
                 + list(self.device_grad_slots.values()))
        return sum(t.numel() * t.element_size() for s in slots for t in (s.flat, s.landing) if t is not None)


def shapes_for(plan: PlacementPlan, dtype: torch.dtype, landing: bool) -> SlotShapes:
    """The slots' shapes for a placement plan (the gradient slots' dtype and count)."""
    grad_dtype = torch.float32 if plan.grad_slots_fp32 else dtype
    return SlotShapes(dtype=dtype, grad_dtype=grad_dtype, landing=landing, grad_slots=plan.grad_slots,
                      deferred=plan.schedule == "deferred")


def _chain(src: Future, dst: Future) -> None:
    """Resolve `dst` with `src`'s outcome."""
    err = src.exception()
    if err is not None:
        dst.set_exception(err)
    else:
        dst.set_result(src.result())
