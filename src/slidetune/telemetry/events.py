"""Per-phase, per-layer timing from events recorded on the stream that does the work.

On CUDA each span is a pair of events recorded on the current stream; nothing is
synchronized while the step runs, and `collect()` reads all elapsed times once,
after the step. On the CPU (synchronous execution) spans are wall-clock intervals.

`anchor()` (one synchronize, outside the measured steps) ties the GPU clock to the
host's perf_counter: every later span then also gets host-clock start/end times, so
GPU compute can be intersected with the host threads' spans (AdamW, copies, waits).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass


from ..device import Device


@dataclass
class Span:
    phase: str          # forward | recompute | backward | head | embed | optimizer | ...
    layer: int          # decoder layer index, -1 for non-layer work
    ms: float
    start_s: float | None = None   # host perf_counter clock, when anchored (CPU: always)
    end_s: float | None = None


class EventTimer:
    def __init__(self, device: Device, enabled: bool = True):
        self.device = device
        self.enabled = enabled
        self._open: list = []
        self._anchor: tuple | None = None     # (cuda event, perf_counter at that event)

    def anchor(self) -> None:
        """Synchronize once and remember (GPU event, host time) to map GPU spans onto the host clock."""
        if self.device.is_cuda:
            ev = self.device.record(timing=True)
            ev.synchronize()
            self._anchor = (ev, time.perf_counter())

    @contextlib.contextmanager
    def span(self, phase: str, layer: int = -1):
        if not self.enabled:
            yield
            return
        if self.device.is_cuda:
            start = self.device.event(timing=True)
            end = self.device.event(timing=True)
            start.record()
            yield
            end.record()
            self._open.append((phase, layer, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._open.append((phase, layer, t0, time.perf_counter()))

    def mark(self, phase: str, layer: int = -1):
        """A point event (start of a span whose end is the next mark's start)."""
        if not self.enabled:
            return None
        if self.device.is_cuda:
            return self.device.record(timing=True)
        return time.perf_counter()

    def add(self, phase: str, layer: int, start, end) -> None:
        if self.enabled:
            self._open.append((phase, layer, start, end))

    def cut(self) -> list:
        """Hand over the spans recorded since the last cut, unresolved (no synchronize): a
        measurement loop cuts after every step and resolves after the last, so reading the
        timer never makes a step wait for the GPU."""
        out, self._open = self._open, []
        return out

    def resolve(self, spans: list) -> list[Span]:
        """Elapsed times of spans from cut() (on CUDA, waits for the last one's end event)."""
        if not spans:
            return []
        if not self.device.is_cuda:
            return [Span(p, l, (e - s) * 1e3, s, e) for p, l, s, e in spans]
        spans[-1][3].synchronize()
        out = []
        for p, l, s, e in spans:
            span = Span(p, l, s.elapsed_time(e))
            if self._anchor is not None:
                ev0, t0 = self._anchor
                span.start_s = t0 + ev0.elapsed_time(s) / 1e3
                span.end_s = t0 + ev0.elapsed_time(e) / 1e3
            out.append(span)
        return out

    def collect(self) -> list[Span]:
        """Elapsed times of all spans since the last collect (synchronizes once on CUDA)."""
        return self.resolve(self.cut())
