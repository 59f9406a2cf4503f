"""No silent hangs: a bound on how long the compute thread waits for another thread.

The compute thread waits on futures of the upload, D2H and host threads (engine.py's _wait
and gradient slots). A thread that stops making progress without failing (a deadlock, a
copy that never completes, a stuck system call) would leave the run waiting forever with no
message. The watchdog bounds each wait: STEP_FACTOR x the median of the recent step times
(at least MIN_S), or FIRST_S before two steps have been timed (the first steps include
start-up work: a compile, first-touch page faults). Past the bound it prints every thread's
Python stack and what each pipeline worker is running and since when, then raises HangError,
which ends the run with that message (the last complete checkpoint is untouched).
"""
from __future__ import annotations

import faulthandler
import statistics
import sys
import time
from collections import deque

MIN_S = 120.0          # never less: a GC pause, a slow disk or a busy host must not end a run
STEP_FACTOR = 20.0     # a wait this many steps long is not a slow step
FIRST_S = 1800.0       # before two steps are timed (the compile of an 8B's layers takes ~40 s)


class HangError(RuntimeError):
    """The compute thread waited longer than the watchdog's bound for another thread."""


class Watchdog:
    def __init__(self):
        self.step_s: deque[float] = deque(maxlen=20)
        self.override_s: float | None = None          # tests: a fixed bound
        self._holds: list = []                        # an asynchronous save's UpdateHolds (watch_save)
        self._holds_since = 0.0

    def watch_save(self, holds: list) -> None:
        """An asynchronous checkpoint holds these units' updates (update_hold.py): while it does, a
        wait counts only from the writer's last progress (a unit released), so a save that takes
        minutes on a slow disk is not a hang, and a writer that stops is still caught."""
        self._holds, self._holds_since = list(holds), time.monotonic()

    def _since_save_progress(self, waited_s: float) -> float:
        if not self._holds or all(h.released for h in self._holds):
            return waited_s
        last = max([self._holds_since] + [h.released_at for h in self._holds if h.released_at is not None])
        return min(waited_s, time.monotonic() - last)

    def record_step(self, seconds: float) -> None:
        self.step_s.append(seconds)

    def bound_s(self) -> float:
        if self.override_s is not None:
            return self.override_s
        if len(self.step_s) < 2:
            return FIRST_S
        return max(MIN_S, STEP_FACTOR * statistics.median(self.step_s))

    def check(self, waited_s: float, what: str, workers) -> None:
        """Raise HangError (after printing every thread's stack) if `waited_s` exceeds the bound."""
        waited_s = self._since_save_progress(waited_s)
        bound = self.bound_s()
        if waited_s <= bound:
            return
        basis = ("a fixed bound" if self.override_s is not None else
                 f"{STEP_FACTOR:.0f}x the median step of {statistics.median(self.step_s):.2f} s, at least {MIN_S:.0f} s"
                 if len(self.step_s) >= 2 else "the bound before two steps are timed")
        now = time.monotonic()
        busy = [f"  {w.name}: " + (f"running {w.current} for {now - w.since:.1f} s" if w.current else "idle")
                for w in workers]
        print(f"\nslidetune watchdog: the compute thread has waited {waited_s:.1f} s for {what} "
              f"(bound {bound:.1f} s: {basis}). Pipeline threads:\n" + "\n".join(busy)
              + "\nEvery thread's stack follows.", file=sys.stderr, flush=True)
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):      # stderr without a file descriptor (captured)
            frames = sys._current_frames()
            import traceback
            for ident, frame in frames.items():
                print(f"Thread {ident}:\n" + "".join(traceback.format_stack(frame)), file=sys.stderr)
        raise HangError(f"the compute thread waited {waited_s:.0f} s for {what}, longer than the watchdog's "
                        f"bound ({bound:.0f} s: {basis}); a pipeline thread seems stuck: "
                        + "; ".join(b.strip() for b in busy) + ". Every thread's stack was printed above. "
                        "The newest complete checkpoint is intact: resume with --resume auto")
