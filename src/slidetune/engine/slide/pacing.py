"""A cap on the PCIe rate of the engine's weight uploads and gradient downloads (--tuning.pcie_gbps).

--gpu-memory-limit 24 gives an H200 a 24 GB card's memory but not its link: the H200 VM's Gen5
x16 moves ~50 GB/s pinned each way, an RTX 4090's PCIe 4.0 x16 ~25. A LinkPacer per direction
makes the copies of that direction move at most `gbps` GB/s (decimal, as link rates are quoted),
so that a run on the big GPU shows what the slower link would cost.

The copies are asynchronous (CUDA streams), so the pacer acts where they are issued: the issuing
thread sleeps before a copy until the modelled link would have moved its bytes. That bounds the
real rate because a copy issued at t cannot start before t: with no credit for idle time, the
bytes issued by any moment T since the first copy are at most gbps x (T - first issue), so the
bytes copied by T are too. On the CPU the "copies" are host copies, run by the issuing thread:
the same bound holds and the CPU tests measure it.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

# A token bucket's depth, in seconds of the link: the time a thread spends issuing a copy (tens of
# us) overlaps the previous copy on a real link, so without this credit 1 MB copies at 25 GB/s
# (40 us each) measured 20 GB/s on a fake clock with 10 us of issue time. It is also the most the
# cap may be exceeded by over any window: 1 ms, 0.3% of a 0.3 s step's copies.
BURST_S = 1e-3


class LinkPacer:
    """One direction's link: a copy of n bytes is issued once the link, free at `free_at` and moving
    `gbps` GB/s, would have moved it (a token bucket BURST_S deep: idle time earns at most that
    credit, so the copies of any window take at least their bytes / rate - BURST_S however they
    are spread). gbps None: no cap.

    clock and sleep are injectable (the unit tests drive a fake clock); the engine passes its abort
    event's wait as sleep, so that a failed pipeline thread does not leave a pacer asleep."""

    def __init__(self, gbps: float | None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep):
        if gbps is not None and not gbps > 0:
            raise ValueError(f"pcie_gbps must be > 0 GB/s, not {gbps!r}")
        self.bytes_per_s = gbps * 1e9 if gbps is not None else None
        self.clock, self.sleep = clock, sleep
        self.free_at = float("-inf")
        self.bytes = 0               # bytes paced, and the seconds slept for them (reports, tests)
        self.slept_s = 0.0
        self._lock = threading.Lock()   # a direction's copies may be issued from more than one thread

    def take(self, nbytes: int) -> None:
        """Before issuing a copy of `nbytes`: wait until the capped link has moved them."""
        if self.bytes_per_s is None or nbytes <= 0:
            return
        with self._lock:        # reserve the link's time under the lock, sleep outside it
            now = self.clock()
            done = max(now - BURST_S, self.free_at) + nbytes / self.bytes_per_s
            self.free_at = done
            self.bytes += nbytes
            wait = done - now
            self.slept_s += max(0.0, wait)
        if wait > 0:
            self.sleep(wait)


class LinkPacers:
    """The two directions, independent (PCIe is full duplex): h2d for the weights' uploads, d2h for
    the gradients' downloads."""

    def __init__(self, gbps: float | None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep):
        self.gbps = gbps
        self.h2d = LinkPacer(gbps, clock, sleep)
        self.d2h = LinkPacer(gbps, clock, sleep)
