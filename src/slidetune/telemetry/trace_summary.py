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


# --------------------------------------------------------------------- per-stream view
def _gpu_events(events: list[dict]):
    """(stream, kind, start_us, end_us, name) for every GPU kernel and memcpy in a trace."""
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev or ev.get("cat") not in ("kernel", "gpu_memcpy"):
            continue
        s = float(ev["ts"])
        name = ev.get("name", "")
        if ev["cat"] == "kernel":
            kind = "kernel"
        else:
            kind = "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "d2d"
        yield int(ev.get("args", {}).get("stream", -1)), kind, s, s + float(ev["dur"]), name


def stream_stats(trace_path: Path, window: tuple[float, float] | None = None) -> dict:
    """Per-stream busy time, and how long the kernels off the compute stream take.

    The compute stream is the one with the most kernel time. Kernels on the copy streams
    (the GPU casts) share the SMs with the compute stream's GEMMs: when a 16M-element cast
    that needs ~50 us alone lasts milliseconds, the copies queued behind it wait that long.
    """
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    if window is None:
        steps = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                 if e.get("ph") == "X" and e.get("name") == "slidetune.step" and "dur" in e]
        window = (min(s for s, _ in steps), max(e for _, e in steps)) if steps else (-float("inf"), float("inf"))
    w0, w1 = window
    per: dict[int, dict[str, list]] = {}
    for stream, kind, s, e, _ in _gpu_events(events):
        if e <= w0 or s >= w1:
            continue
        per.setdefault(stream, {}).setdefault(kind, []).append((max(s, w0), min(e, w1)))
    if not per:
        return {"streams": {}}
    kernel_ms = {st: _length(_union(k.get("kernel", []))) / 1e3 for st, k in per.items()}
    compute = max(kernel_ms, key=kernel_ms.get)
    out: dict = {"compute_stream": compute, "streams": {}}
    side: list[float] = []
    for st, kinds in sorted(per.items()):
        row = {}
        for kind, iv in kinds.items():
            row[f"{kind}_busy_ms"] = _length(_union(iv)) / 1e3
            row[f"{kind}_count"] = len(iv)
        out["streams"][str(st)] = row
        if st != compute:
            side += [e - s for s, e in kinds.get("kernel", [])]
    if side:
        side.sort()
        out["side_kernels"] = {"count": len(side), "total_ms": sum(side) / 1e3, "mean_us": sum(side) / len(side),
                               "p50_us": side[len(side) // 2], "max_us": side[-1]}
    return out


def lanes(trace_path: Path, step_index: int = 1, merge_gap_us: float = 200.0) -> dict:
    """Busy intervals of one profiled step, per lane, for a Gantt chart (small: merged).

    Lanes: each GPU stream's kernels and copies (labelled compute / upload / d2h by what
    they carry) and the CPU ranges the engine labels (AdamW, CPU casts, D2H waits).
    Times are ms from the step's start.
    """
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                   if e.get("ph") == "X" and e.get("name") == "slidetune.step" and "dur" in e)
    if not steps:
        return {}
    w0, w1 = steps[min(step_index, len(steps) - 1)]
    raw: dict[str, list[tuple[float, float]]] = {}
    stream_kinds: dict[int, dict[str, float]] = {}
    for stream, kind, s, e, _ in _gpu_events(events):
        if e <= w0 or s >= w1:
            continue
        raw.setdefault(f"gpu:{stream}:{kind}", []).append((max(s, w0), min(e, w1)))
        stream_kinds.setdefault(stream, {}).setdefault(kind, 0.0)
        stream_kinds[stream][kind] += e - s
    cpu_names = {"slidetune.adamw": "cpu: AdamW", "slidetune.cast": "cpu: cast", "slidetune.d2h_wait": "cpu: wait D2H"}
    for ev in events:
        name = cpu_names.get(ev.get("name", ""))
        if name is None and ev.get("name", "").startswith("slidetune.wait_"):   # compute-thread waits
            name = "cpu: compute " + ev["name"].removeprefix("slidetune.")
        if name and ev.get("ph") == "X" and "dur" in ev:
            s, e = float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])
            if e > w0 and s < w1:
                raw.setdefault(name, []).append((max(s, w0), min(e, w1)))
    kernel_time = {st: k.get("kernel", 0.0) for st, k in stream_kinds.items()}
    compute = max(kernel_time, key=kernel_time.get) if kernel_time else None

    def label(key: str) -> str:
        if not key.startswith("gpu:"):
            return key
        _, st, kind = key.split(":")
        kinds = stream_kinds[int(st)]
        role = ("compute" if int(st) == compute else "upload" if kinds.get("h2d", 0) >= kinds.get("d2h", 0)
                else "download")
        return f"{role} stream {st}: {kind}"

    out = {}
    for key, iv in raw.items():
        merged: list[list[float]] = []
        for s, e in sorted(iv):
            if merged and s - merged[-1][1] <= merge_gap_us:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        out[label(key)] = [((s - w0) / 1e3, (e - w0) / 1e3) for s, e in merged]
    return {"step_ms": (w1 - w0) / 1e3, "merge_gap_us": merge_gap_us, "lanes": out}
