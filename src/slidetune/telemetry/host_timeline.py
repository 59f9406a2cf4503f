"""Host-side spans of the pipeline's threads (compute waits, AdamW, D2H waits, uploads).

The profiler does not see what the worker threads do, so the engine records its own
wall-clock spans when enabled: (thread label, what, start, end, unit label) in
perf_counter seconds; the unit label (e.g. "layer.3") is "" where the span serves no
one unit. Appending to a list is atomic under the GIL; the cost when disabled is one
attribute check.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict


class HostTimeline:
    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.spans: list[tuple[str, str, float, float, str]] = []

    @contextlib.contextmanager
    def span(self, thread: str, what: str, unit: str = ""):
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((thread, what, t0, time.perf_counter(), unit))

    def take(self) -> list[tuple[str, str, float, float, str]]:
        out, self.spans = self.spans, []
        return out


def summarize(spans: list[tuple], t0: float, t1: float) -> dict[str, float]:
    """Seconds spent per (thread, what) inside [t0, t1]."""
    agg: dict[str, float] = defaultdict(float)
    for thread, what, s, e, *_ in spans:
        s, e = max(s, t0), min(e, t1)
        if e > s:
            agg[f"{thread}.{what}"] += e - s
    return dict(sorted(agg.items()))


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap_report(gpu_spans: list[tuple[float, float]], host_spans: list[tuple],
                   t0: float, t1: float) -> dict[str, float]:
    """For one step [t0, t1]: the fraction of it the GPU computes, and for each host activity
    (e.g. host.adamw, upload.upload) its busy seconds and the fraction overlapped by GPU compute."""
    clip = lambda iv: [(max(s, t0), min(e, t1)) for s, e in iv if e > t0 and s < t1]  # noqa: E731
    gpu = union(clip(gpu_spans))
    span = t1 - t0
    out = {"gpu_compute_fraction_of_step": sum(e - s for s, e in gpu) / span if span > 0 else 0.0}
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for thread, what, s, e, *_ in host_spans:
        groups[f"{thread}.{what}"].append((s, e))
    for key, iv in sorted(groups.items()):
        busy = union(clip(iv))
        total = sum(e - s for s, e in busy)
        if total <= 0:
            continue
        inter = 0.0
        for s, e in busy:
            for gs, ge in gpu:
                inter += max(0.0, min(e, ge) - max(s, gs))
        out[f"{key}_s"] = total
        out[f"{key}_overlapped_with_gpu_compute"] = inter / total
    return out
