"""Summarize a torch.profiler Chrome trace into overlap figures (small JSON, no multi-MB trace).

From the trace: GPU kernels (compute), H2D and D2H memcpys, and the CPU ranges the
engine labels (slidetune.adamw, slidetune.cast). For the measured window it reports
each activity's busy time (union of its intervals), its fraction of the window, and
how much of it overlaps GPU compute.
"""
from __future__ import annotations

import json
from pathlib import Path

from .host_timeline import union as _union


def _length(iv: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in iv)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s = max(a[i][0], b[j][0])
        e = min(a[i][1], b[j][1])
        if e > s:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize_trace(trace_path: Path, window: tuple[float, float] | None = None) -> dict:
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    groups: dict[str, list[tuple[float, float]]] = {"gpu_compute": [], "h2d": [], "d2h": [],
                                                    "cpu_adamw": [], "cpu_cast": [], "step": []}
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        s = float(ev["ts"])
        e = s + float(ev["dur"])
        cat, name = ev.get("cat", ""), ev.get("name", "")
        if cat == "kernel":
            groups["gpu_compute"].append((s, e))
        elif cat == "gpu_memcpy":
            if "HtoD" in name:
                groups["h2d"].append((s, e))
            elif "DtoH" in name:
                groups["d2h"].append((s, e))
        elif cat == "user_annotation":
            if name == "slidetune.adamw":
                groups["cpu_adamw"].append((s, e))
            elif name == "slidetune.cast":
                groups["cpu_cast"].append((s, e))
            elif name == "slidetune.step":
                groups["step"].append((s, e))
    if window is None:
        steps = groups["step"]
        if steps:
            window = (min(s for s, _ in steps), max(e for _, e in steps))
        else:
            allv = [x for k, v in groups.items() for x in v]
            window = (min(s for s, _ in allv), max(e for _, e in allv))
    w0, w1 = window
    clipped = {k: _union([(max(s, w0), min(e, w1)) for s, e in v if e > w0 and s < w1]) for k, v in groups.items()}
    span = w1 - w0
    compute = clipped["gpu_compute"]
    out = {"window_ms": span / 1e3, "n_steps": len(groups["step"])}
    for k in ("gpu_compute", "h2d", "d2h", "cpu_adamw", "cpu_cast"):
        busy = _length(clipped[k])
        out[f"{k}_busy_ms"] = busy / 1e3
        out[f"{k}_fraction_of_step"] = busy / span if span else 0.0
        if k != "gpu_compute":
            ov = _intersection(clipped[k], compute)
            out[f"{k}_overlapped_with_compute_fraction"] = ov / busy if busy else None
    return out
