"""Host-side spans of the pipeline's threads (compute waits, AdamW, D2H waits, uploads).

The profiler does not see what the worker threads do, so the engine records its own
wall-clock spans when enabled: (thread label, what, start, end) in perf_counter
seconds. Appending to a list is atomic under the GIL; the cost when disabled is one
attribute check.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict


class HostTimeline:
    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.spans: list[tuple[str, str, float, float]] = []

    @contextlib.contextmanager
    def span(self, thread: str, what: str):
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((thread, what, t0, time.perf_counter()))

    def take(self) -> list[tuple[str, str, float, float]]:
        out, self.spans = self.spans, []
        return out


def summarize(spans: list[tuple[str, str, float, float]], t0: float, t1: float) -> dict[str, float]:
    """Seconds spent per (thread, what) inside [t0, t1]."""
    agg: dict[str, float] = defaultdict(float)
    for thread, what, s, e in spans:
        s, e = max(s, t0), min(e, t1)
        if e > s:
            agg[f"{thread}.{what}"] += e - s
    return dict(sorted(agg.items()))
