"""A unit's next optimizer update held back until an asynchronous checkpoint has read its state.

An asynchronous save (checkpoint/background.py) starts at a step boundary, when every unit holds the
state of that step. It gives each unit an UpdateHold; the unit's next update waits in
HostUnit.begin_update until the writer has streamed that unit's weights and moments to the
files and released the hold. The step loop goes on meanwhile: the next step's forward and
backward read the weights (reads never conflict with the writer), and only an update that
reaches a unit the writer has not passed yet waits. The writer releases every hold, whatever
happens to it (a failed save must never leave an update waiting).
"""
from __future__ import annotations

import threading
import time


class UpdateHold:
    """One unit's next update waits for `release()` (the checkpoint writer has read the unit)."""

    def __init__(self, abort: threading.Event | None = None):
        self._released = threading.Event()
        self.released_at: float | None = None   # time.monotonic() of release()
        self._abort = abort            # the pipeline failed: stop waiting (the writer releases anyway)
        self.waited_s = 0.0            # how long the update waited (the save's cost to the step loop)

    def release(self) -> None:
        if self.released_at is None:
            self.released_at = time.monotonic()
        self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def wait(self) -> None:
        """Block the update until the writer has read the unit (polls the pipeline's abort flag)."""
        if self._released.is_set():
            return
        t0 = time.monotonic()
        while not self._released.wait(timeout=0.5):
            if self._abort is not None and self._abort.is_set():
                break
        self.waited_s += time.monotonic() - t0
