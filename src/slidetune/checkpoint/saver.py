"""The run's resumable saves, one at a time: asynchronous where the engine can (background.py),
blocking otherwise, each timed into `saves.jsonl` beside metrics.csv.

`--async-save auto|on|off` (TrainConfig.async_save) picks the periodic saves' kind
(resolve_async_save); the saves at a stop and at the end of the run are blocking (the run
waits for them anyway). A second save waits for the first; the step loop polls the one in
flight between steps, and the end of the run (or a failure) waits for it: a failed
asynchronous save is raised in the step loop, never lost.

saves.jsonl, one line a save: step, mode (async | blocking), ok, started (epoch seconds), save_s (start to complete,
verified and pruned), blocked_s (what the step loop waited for it: the start and any wait for its
end; a blocking save's whole duration), boundary_s, written_s (start to every unit's state
written), held_s (the updates' waits for the writer, summed over units: their cost shows in the
next steps' step_s in metrics.csv), waited_s, streams_s (each tensor stream's seconds to its last byte:
"weights" and each optimizer file; the last to end bound the write).
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

from .background import PendingSave, SaveTiming
from .format import CheckpointError


def resolve_async_save(setting: str, engine, on_gpu: bool) -> tuple[bool, str]:
    """(asynchronous periodic saves?, why). `on` where the engine cannot is a ValueError naming why."""
    refusal = engine.async_save_refusal()
    if setting == "off":
        return False, "--async-save off"
    if refusal is not None:
        if setting == "on":
            raise ValueError(f"--async-save on is not possible here: {refusal}. Use --async-save auto or off")
        return False, refusal
    if setting == "auto" and not on_gpu:
        return False, "auto: off on a CPU (the writer would take the cores the step runs on)"
    return True, f"--async-save {setting}"


def overlap_note(timing: SaveTiming, save_every: int) -> str | None:
    """A hint, once a run, when an asynchronous save was still being written as the next one came
    due (a save cannot start before the previous one has ended: the steps waited for it). The
    saves' period is what the steps took from its start to the next save's (save_s - waited_s),
    so --save-every scaled by save_s over that period, with a tenth to spare, keeps them apart."""
    if timing.mode != "async" or timing.waited_s < 1.0 or not timing.save_s:
        return None
    period_s = max(timing.save_s - timing.waited_s, 1e-3)
    every = math.ceil(save_every * timing.save_s / period_s * 1.1)
    steps = f"{save_every} step{'s' if save_every != 1 else ''}"
    return (f"note: the checkpoint of step {timing.step} was still being written when the next one came due: "
            f"the steps waited {timing.waited_s:.1f} s for it (a save took {timing.save_s:.1f} s here, "
            f"{steps} {period_s:.1f} s); --save-every {every} or more keeps the saves from waiting on each other")


class CheckpointSaver:
    """One save at a time; each one's SaveTiming appended to `log_path` (None: not logged)."""

    def __init__(self, asynchronous: bool, log_path: Path | None):
        self.asynchronous = asynchronous
        self.log_path = log_path
        self.pending: PendingSave | None = None
        self.timings: list[SaveTiming] = []

    def blocking(self, step: int, write: Callable[[dict[str, float]], Path]) -> Path:
        """Run `write(streams_s)` (a blocking save of `step`, filling its streams' seconds) after any
        save in flight, timed."""
        self.settle()
        timing = SaveTiming(step=int(step), mode="blocking", started=time.time())
        t0 = time.monotonic()
        try:
            path = write(timing.streams_s)
            timing.ok = True
            return path
        except BaseException:
            timing.ok = False
            raise
        finally:
            timing.save_s = timing.boundary_s = time.monotonic() - t0
            self._record(timing)

    def start(self, begin: Callable[[], PendingSave]) -> None:
        """Start an asynchronous save (`begin()`: background.start_async_save); the caller has
        collected the previous one (poll(wait=True)): a second save waits for the first."""
        if self.pending is not None:
            raise RuntimeError("a checkpoint is still being written: poll(wait=True) first")
        self.pending = begin()

    def poll(self, wait: bool = False) -> PendingSave | None:
        """The save in flight once it has ended (waiting for it with `wait`), recorded and no longer
        in flight; None while it runs or when there is none. Its `error` is the caller's to raise."""
        p = self.pending
        if p is None or not (wait or p.done()):
            return None
        self.pending = None
        try:
            p.wait()
        except CheckpointError:
            pass                         # in p.error
        self._record(p.timing)
        return p

    def abandon(self) -> None:
        """Give up a save in flight (a second Ctrl-C): it never completes, and no update waits for it."""
        if self.pending is not None:
            self.pending.abandon()
            self.pending = None

    def settle(self) -> PendingSave | None:
        """Wait for a save in flight (at the end of the run, or on the way out of an error)."""
        return self.poll(wait=True)

    def _record(self, timing: SaveTiming) -> None:
        self.timings.append(timing)
        if self.log_path is not None:
            try:
                with self.log_path.open("a") as f:
                    f.write(json.dumps(timing.record()) + "\n")
            except OSError:
                pass                     # a record of timings never ends a run (a full disk says so elsewhere)

    def totals(self) -> dict:
        """summary.json's figures: saves, their seconds, and the step loop's seconds blocked by them."""
        return {"checkpoint_saves": len(self.timings), "async_saves": sum(t.mode == "async" for t in self.timings),
                "save_s": round(sum(t.save_s or 0.0 for t in self.timings), 3),
                "save_blocked_s": round(sum(t.blocked_s for t in self.timings), 3)}
