"""The clipped (deferred) schedule's host side: gradients held until the global norm is known,
then the host's AdamW sweep over them.

Each host unit's gradient slot is copied once into its held host buffer in the compute dtype
as its backward ends (hold). Once the backward is queued, the host worker reads the step's
squared norm, computes clip_grad_norm_'s coefficient and sweeps the host units from the
embedding up (each next-step upload trails its unit's update, so the sweep overlaps the next
forward), then, with clip_sweep split or weights, writes their moments from the head down.
"""
from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Callable

import torch

from ...device import Device
from .host_store import HostUnit
from .slots import Slot
from .step_norm import CopiedNorm
from .threads import PipelineThreads
from .transfer import GradDrain, clip_coefficient
from .workers import done_future, wait_or_abort


class DeferredSweep:
    """The held gradient buffers' bookkeeping and the clipped update sweep of the host units.

    split_sweep: the sweep's first pass writes the parameters ("params", clip_sweep=split) or
    the compute-dtype weights of units with an upload copy ("weights"), and a second pass their
    moments; otherwise one pass does the whole update. `step_index()`: the step being issued."""

    def __init__(self, units: list[HostUnit], device: Device, threads: PipelineThreads, drainer: GradDrain,
                 chunk: int, max_grad_norm: float | None, split_sweep: bool, step_index: Callable[[], int]):
        self.units, self.device, self.threads, self.drainer = units, device, threads, drainer
        self.chunk, self.max_grad_norm, self.split_sweep = chunk, max_grad_norm, split_sweep
        self.step_index = step_index
        self._held_landed: dict[int, Future] = {}     # unit -> event of its held gradient's copy, this step
        # (unit, held buffer) -> the moment pass that last read that buffer is done
        self._held_free: dict[tuple[int, int], Future] = {}

    def begin_step(self) -> None:
        self._held_landed = {}

    def _held_index(self, unit_index: int) -> int:
        """Which of a host unit's held buffers the step being issued writes: step s writes buffer
        s % its count (PlacementPlan: 1, or 2 on alternate steps)."""
        return self.step_index() % len(self.units[unit_index].held)

    def lend_held(self, layer: int) -> tuple[torch.Tensor, Callable[[], None]] | None:
        """Decoder layer `layer`'s held gradient buffer (its unit's, layer + 1: the embedding is
        unit 0) for the layer's offloaded input checkpoint (--tuning.checkpoints_in_held;
        activations.ActivationStore), and a wait until the last clipped sweep has read it (with
        clip_sweep whole, its unit's one pass; before the first sweep, none); None where the unit
        holds no single buffer (updated on a GPU, another rank's, two buffers)."""
        unit_index = layer + 1
        unit = self.units[unit_index]
        if len(unit.held) != 1:
            return None
        read = self._held_free.get((unit_index, 0))

        def wait_until_read() -> None:
            if read is not None:
                wait_or_abort(read, self.threads.abort, f"the clipped sweep's read of {unit.spec.name}'s held gradient")
        return unit.held[0], wait_until_read

    def hold(self, unit_index: int, slot: Slot) -> None:
        """One D2H copy of the unit's gradient slot into its held host buffer of this step
        (held_buffers=2: the one the last step's moment pass is not reading)."""
        unit = self.units[unit_index]
        k = self._held_index(unit_index)
        ready = self.device.record()
        slot.free = Future()
        landed: Future = Future()
        self._held_landed[unit_index] = landed
        self.threads.d2h_worker.submit(self._issue_hold, unit, unit.held[k], slot.flat[: unit.spec.numel], ready,
                                       slot.free, landed, self._held_free.get((unit_index, k), done_future(None)))

    def _issue_hold(self, unit: HostUnit, held: torch.Tensor, src: torch.Tensor, ready, free: Future,
                    landed: Future, held_free: Future) -> None:
        # the moment pass that last read this buffer (the previous step's, or with two buffers the
        # one before) must be done with it first
        wait_or_abort(held_free, self.threads.abort, f"the previous moments of {unit.spec.name}")
        with self.threads.timeline.span("d2h", "hold", unit.spec.name):
            event = self.drainer.hold(held, src, ready)
        free.set_result(event)
        landed.set_result(event)

    def start(self, norm: CopiedNorm, lr: float) -> Future:
        """Queue the sweep on the host worker, after the backward; -> the step's global norm."""
        landed = dict(self._held_landed)
        ks = {i: self._held_index(i) for i in landed}    # the held buffers this step wrote
        frees = {i: Future() for i in landed}
        self._held_free.update({(i, ks[i]): f for i, f in frees.items()})
        return self.threads.host_worker.submit(self._sweep, norm, landed, frees, ks, lr)

    def _sweep(self, norm: CopiedNorm, landed: dict[int, Future], held_free: dict[int, Future],
               ks: dict[int, int], lr: float) -> float:
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
            total = math.sqrt(norm.squared())
            coef = clip_coefficient(total, self.max_grad_norm)
            # Embedding first: the next forward needs it first. Each unit's upload for the next
            # step waits only for that unit's update (chunk by chunk), so the sweep overlaps the
            # next forward.
            # A disk unit's update reads and writes its moments once ("all"): its moments are
            # not in RAM for a second pass to find.
            host = [(i, u) for i, u in enumerate(self.units) if u.on_host and u.owned]
            timeline = self.threads.timeline
            for index, unit in host:
                event = wait_or_abort(landed[index], self.threads.abort, f"the held gradient of {unit.spec.name}")
                event.synchronize()
                split = self.split_sweep and unit.tier.split_update
                first = ("weights" if unit.upload_copy else "params") if split else "all"
                with timeline.span("host", "adamw", unit.spec.name):
                    GradDrain.deferred_update(unit, unit.held[ks[index]], lr, coef, self.chunk, part=first)
                if not split:
                    unit.publish_state()
                    held_free[index].set_result(None)
            for index, unit in (reversed(host) if self.split_sweep else []):
                if not unit.tier.split_update:
                    continue
                with timeline.span("host", "adamw_moments", unit.spec.name):
                    GradDrain.deferred_moments(unit, unit.held[ks[index]], coef, self.chunk, lr=lr)
                unit.publish_state()
                held_free[index].set_result(None)
            return total
        finally:
            for fut in held_free.values():      # after a failure: the abort flag stops the waiters
                if not fut.done():
                    fut.set_result(None)
