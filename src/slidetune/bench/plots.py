"""PNG plots (matplotlib, Agg backend): of a results directory's tables (bench.tables), and the
grouped bars and Pareto scatters of the techniques, throughput and roofline scenarios.

Every plot_* function takes rows as read from the CSVs (values may be strings), writes one
PNG and returns its path. Error bars are 95% Student-t CIs over measured steps.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib
import matplotlib.patches
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .output import number

COLORS = {"forward": "#4C72B0", "head": "#8172B3", "backward": "#DD8452", "recompute": "#C44E52",
          "optimizer": "#55A868", "transfer": "#937860", "gpu_idle": "#BBBBBB"}


def _z(v) -> float:
    x = number(v)
    return 0.0 if math.isnan(x) else x


def _ok(rows):
    return [r for r in rows if r.get("status") == "ok"]


def _save(fig, path: Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


GPU_PHASES = ("forward", "head", "backward", "recompute", "gpu_idle")
HOST_PHASES = ("optimizer", "transfer")


def plot_breakdown(summary: list[dict], path: Path) -> Path:
    """Per configuration two bars: the compute stream (forward, head, backward, recompute and
    GPU idle, which add up to the step's wall time) and, beside it, the host threads' work
    (optimizer, transfer). Host work overlaps the compute stream, so it gets its own bar
    instead of being stacked on top (which would exceed the wall time)."""
    rows = _ok(summary)
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(rows) + 3), 4))
    xs = list(range(len(rows)))
    w = 0.38
    for group, offset in ((GPU_PHASES, -w / 2), (HOST_PHASES, w / 2)):
        bottom = [0.0] * len(rows)
        for k in group:
            vals = [_z(r.get(f"t_{k}_s")) for r in rows]
            ax.bar([x + offset for x in xs], vals, width=w, bottom=bottom, label=k, color=COLORS[k],
                   hatch="//" if group is HOST_PHASES else None, edgecolor="white")
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter([x - w / 2 for x in xs], [_z(r.get("step_s_mean")) for r in rows], marker="_", s=500, color="k",
               zorder=3, label="step wall")
    ax.set_xticks(xs)
    ax.set_xticklabels([r["config"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("seconds per step (mean)")
    ax.set_title("Time per step: compute stream | host threads (hatched)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    return _save(fig, path)


def plot_peaks(summary: list[dict], path: Path) -> Path:
    """Peak GPU allocated and reserved memory and peak CPU RSS per configuration."""
    rows = _ok(summary)
    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(7, 1.6 * len(rows) + 4), 4))
    x = range(len(rows))
    w = 0.4
    axes[0].bar([i - w / 2 for i in x], [_z(r.get("gpu_peak_alloc_gib")) for r in rows], w, label="allocated")
    axes[0].bar([i + w / 2 for i in x], [_z(r.get("gpu_peak_reserved_gib")) for r in rows], w, label="reserved")
    axes[0].set_title("Peak GPU memory (GiB)")
    axes[0].legend(fontsize=8)
    axes[1].bar(list(x), [_z(r.get("cpu_peak_rss_gib")) for r in rows], 0.6, color="#55A868")
    axes[1].set_title("Peak CPU RSS (GiB)")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right")
    return _save(fig, path)


def plot_memory_timeline(mem: list[dict], path: Path) -> Path:
    """Memory at the step's sampling points (mean +- std over measured steps): GPU
    allocated, GPU reserved and CPU RSS; x is the point index, labelled with its phase."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in mem:
        by[r["config"]].append(r)
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=False)
    for ax, key, title in zip(axes, ("allocated", "reserved", "rss"),
                              ("GPU allocated (GiB)", "GPU reserved (GiB)", "CPU RSS (GiB)")):
        longest: list[dict] = []
        for name, rows in by.items():
            rows = sorted(rows, key=lambda r: int(r["point"]))
            xs = [int(r["point"]) for r in rows]
            m = [_z(r[f"{key}_gib_mean"]) for r in rows]
            s = [_z(r[f"{key}_gib_std"]) for r in rows]
            ax.plot(xs, m, label=name, lw=1.2)
            ax.fill_between(xs, [a - b for a, b in zip(m, s)], [a + b for a, b in zip(m, s)], alpha=0.25)
            if len(rows) > len(longest):
                longest = rows
        ax.set_title(title)
        ticks = _phase_ticks(longest)
        ax.set_xticks([t for t, _ in ticks])
        ax.set_xticklabels([lab for _, lab in ticks], rotation=45, ha="right", fontsize=7)
        _legend(ax)
    return _save(fig, path)


def _phase_ticks(rows: list[dict]) -> list[tuple[int, str]]:
    """One tick where each phase run starts (e.g. forward 0, head, backward 27, optimizer)."""
    out, prev = [], None
    for r in rows:
        if r["phase"] != prev:
            lay = int(r["layer"])
            out.append((int(r["point"]), r["phase"] + (f" {lay}" if lay >= 0 else "")))
            prev = r["phase"]
    return out


def plot_layers(layers: list[dict], path: Path,
                phases: tuple[str, ...] = ("forward", "backward", "recompute", "optimizer")) -> Path:
    """Per-layer mean time (ms) with 95% CI error bars, one panel per phase, one line per config."""
    fig, axes = plt.subplots(len(phases), 1, figsize=(10, 2.6 * len(phases)), squeeze=False)
    order = list(dict.fromkeys(r["config"] for r in layers))          # one colour per config in every panel
    for ax, phase in zip(axes[:, 0], phases):
        by: dict[str, list[dict]] = defaultdict(list)
        for r in layers:
            if r["phase"] == phase and int(r["layer"]) >= 0:
                by[r["config"]].append(r)
        for name, rows in by.items():
            rows.sort(key=lambda r: int(r["layer"]))
            ax.errorbar([int(r["layer"]) for r in rows], [_z(r["mean_ms"]) for r in rows],
                        yerr=[_z(r["ci95_ms"]) for r in rows], label=name, capsize=2, marker=".", lw=1,
                        color=f"C{order.index(name) % 10}")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_title(f"{phase} per layer (mean, 95% t CI)")
        ax.set_ylabel("ms")
        if by:
            _legend(ax)
        else:
            ax.text(0.5, 0.5, "no spans of this phase", ha="center", va="center", transform=ax.transAxes)
    axes[-1, 0].set_xlabel("decoder layer")
    return _save(fig, path)


def plot_layer_delta(layers: list[dict], baseline: str, path: Path, top_k: int = 3) -> Path:
    """Per-layer total (forward + backward + recompute) delta vs the baseline config."""
    tot: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for r in layers:
        if r["phase"] in ("forward", "backward", "recompute") and int(r["layer"]) >= 0:
            tot[r["config"]][int(r["layer"])] += _z(r["mean_ms"])
    fig, ax = plt.subplots(figsize=(10, 3.5))
    base = tot.get(baseline, {})
    for name, per in tot.items():
        if name == baseline:
            continue
        ls = sorted(per)
        ax.plot(ls, [per[i] - base.get(i, 0.0) for i in ls], marker=".", label=f"{name} - {baseline}")
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("ms")
    ax.set_title(f"Per-layer total time delta vs {baseline}")
    _legend(ax)
    return _save(fig, path)


def plot_step_times(steps: list[dict], baseline: str | None, path: Path) -> Path:
    """Step wall time per measured step, and its delta vs the baseline config step by step."""
    by: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in steps:
        if str(r["warmup"]) in ("0", "False", "false"):
            by[r["config"]].append((int(r["step"]), _z(r["wall_s"]) * 1e3))
    fig, axes = plt.subplots(2, 1, figsize=(9, 6))
    for name, pts in by.items():
        pts.sort()
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=name)
    axes[0].set_ylabel("step wall (ms)")
    axes[0].set_title("Step wall time (measured steps)")
    _legend(axes[0])
    base = dict(by.get(baseline, [])) if baseline else {}
    for name, pts in by.items():
        if name == baseline or not base:
            continue
        d = [(s, v - base[s]) for s, v in sorted(pts) if s in base]
        axes[1].plot([p[0] for p in d], [p[1] for p in d], marker=".", label=f"{name} - {baseline}")
    axes[1].axhline(0, color="k", lw=0.6)
    axes[1].set_ylabel("delta (ms)")
    axes[1].set_xlabel("step")
    axes[1].set_title(f"Delta vs {baseline}" if baseline else "no baseline")
    _legend(axes[1])
    return _save(fig, path)


def plot_pareto(summary: list[dict], path: Path) -> Path:
    """Peak memory vs step time; the Pareto-optimal configs (no other is both faster and
    smaller) are joined. GPU reserved memory, or CPU RSS when there is no GPU."""
    rows = _ok(summary)
    gpu = any(_z(r.get("gpu_peak_reserved_gib")) > 0 for r in rows)
    key, label = ("gpu_peak_reserved_gib", "peak GPU reserved (GiB)") if gpu else ("cpu_peak_rss_gib",
                                                                                      "peak CPU RSS (GiB, no GPU)")
    pts = [(_z(r.get("step_s_mean")), _z(r.get(key)), r["config"]) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for x, y, n in pts:
        ax.scatter([x], [y])
        ax.annotate(n, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = [p for p in pts if not any((q[0] <= p[0] and q[1] <= p[1]) and (q[0] < p[0] or q[1] < p[1])
                                       for q in pts)]
    front.sort()
    if len(front) > 1:
        ax.plot([p[0] for p in front], [p[1] for p in front], "k--", lw=0.8, label="Pareto front")
        _legend(ax)
    ax.set_xlabel("step time (s, mean)")
    ax.set_ylabel(label)
    ax.set_title("Memory vs time")
    return _save(fig, path)


def plot_head(summary: list[dict], path: Path) -> Path:
    """Head forward / backward time per configuration (the "head" and "head_backward" spans)."""
    rows = _ok(summary)
    names = [r["config"] for r in rows]
    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows) + 3), 4))
    ax.bar([i - 0.2 for i in x], [_z(r.get("head_fwd_ms")) for r in rows], 0.4, label="head (forward; slide: fwd+bwd)")
    ax.bar([i + 0.2 for i in x], [_z(r.get("head_bwd_ms")) for r in rows], 0.4, label="head backward")
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel("ms per step")
    ax.set_title("Output layer time")
    _legend(ax)
    return _save(fig, path)


def plot_pipeline_lanes(lanes: dict, path: Path, title: str = "One step, per stream and thread") -> Path:
    """Gantt chart of one profiled step: GPU streams (kernels, copies) and labelled CPU ranges."""
    rows = sorted(lanes.get("lanes", {}).items(), key=lambda kv: (not kv[0].startswith("compute"),
                                                                  kv[0].startswith("cpu"), kv[0]))
    fig, ax = plt.subplots(figsize=(12, 0.45 * max(4, len(rows)) + 1.2))
    colors = {"kernel": "tab:blue", "h2d": "tab:green", "d2h": "tab:orange", "d2d": "tab:gray"}
    for y, (name, iv) in enumerate(rows):
        kind = name.rsplit(": ", 1)[-1]
        c = colors.get(kind, "tab:red" if "wait" in name else "tab:purple")
        ax.broken_barh([(s, e - s) for s, e in iv], (y - 0.35, 0.7), color=c)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([n for n, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, lanes.get("step_ms", 1.0))
    ax.set_xlabel("ms from the step's start (torch.profiler; intervals closer than "
                  f"{lanes.get('merge_gap_us', 0):.0f} us merged)")
    ax.set_title(title)
    return _save(fig, path)


_TIMELINE_LANES = (("gpu", None), ("compute", "wait_upload"), ("compute", "wait_grad_slot"),
                   ("upload", "wait_update"), ("upload", "upload"), ("d2h", "issue"), ("host", "drain"),
                   ("host", "d2h_wait"), ("host", "adamw"), ("host", "adamw_moments"), ("d2h", "hold"))
_PHASE_COLORS = {"forward": "tab:blue", "recompute": "tab:cyan", "backward": "tab:purple", "head": "tab:olive",
                 "embed": "tab:brown", "embed_backward": "tab:brown"}


def _unit_tag(unit: str) -> str:
    """'layer.12' -> '12', 'embed' -> 'E', 'head' -> 'H' (labels inside the bars)."""
    return unit.split(".", 1)[1] if unit.startswith("layer.") else unit[:1].upper()


def _legend(ax) -> None:
    """A legend where something on the axes has a label (a one-config run has no deltas to name)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot_step_timeline(rows: list[dict], path: Path, title: str) -> Path:
    """Gantt chart of one step (bench.measure.step_timeline): the GPU's per-layer phases and each
    host thread's activities on one clock, AdamW and uploads labelled with their unit."""
    lanes: list[tuple[str, str | None]] = []
    for key in _TIMELINE_LANES:
        if any(r["lane"] == key[0] and (key[1] is None or r["what"] == key[1]) for r in rows):
            lanes.append(key)
    for r in rows:                                        # anything not foreseen gets a lane too
        key = (r["lane"], None if r["lane"] == "gpu" else r["what"])
        if key not in lanes:
            lanes.append(key)
    fig, ax = plt.subplots(figsize=(14, 0.5 * max(4, len(lanes)) + 1.4))
    end = max((number(r["end_ms"]) for r in rows), default=1.0)
    for y, (lane, what) in enumerate(lanes):
        mine = [r for r in rows if r["lane"] == lane and (what is None or r["what"] == what)]
        for r in mine:
            s, e = number(r["start_ms"]), number(r["end_ms"])
            color = (_PHASE_COLORS.get(r["what"], "tab:gray") if lane == "gpu"
                     else "tab:red" if "wait" in r["what"] else "tab:green")
            ax.broken_barh([(s, e - s)], (y - 0.35, 0.7), color=color, edgecolor="white", linewidth=0.3)
            if r["unit"] and lane != "gpu" and e - s > end / 120:
                ax.text((s + e) / 2, y, _unit_tag(r["unit"]), ha="center", va="center", fontsize=5)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"{lane}" if what is None else f"{lane}: {what}" for lane, what in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    handles = [matplotlib.patches.Patch(color=c, label=p) for p, c in _PHASE_COLORS.items() if p != "embed_backward"]
    handles += [matplotlib.patches.Patch(color="tab:green", label="host work"),
                matplotlib.patches.Patch(color="tab:red", label="waiting")]
    ax.legend(handles=handles, fontsize=7, ncol=len(handles), loc="upper center", bbox_to_anchor=(0.5, -0.12))
    ax.set_xlabel("ms from the step's start (GPU: per-layer events on the host clock; host: thread spans; "
                  "labels: layer index, E = embedding, H = head)")
    ax.set_title(title)
    return _save(fig, path)


# ---------------------------------------------------------------- the scenarios' own tables
def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def bar_plot(path: Path, labels: list[str], series: dict[str, list], ylabel: str, title: str) -> None:
    """Grouped bars: one group per label, one bar per series; missing values (OOM, None) drawn as 0 with 'x'."""
    n = max(1, len(series))
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) + 2), 4))
    for k, (name, vals) in enumerate(series.items()):
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(labels))]
        ys = [v if _finite(v) else 0.0 for v in vals]
        ax.bar(xs, ys, width, label=name)
        for x, v in zip(xs, vals):
            if not _finite(v):
                ax.text(x, 0, "x", ha="center", va="bottom", color="red")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if n > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _front(pts: list[tuple[str, float, float]], lower_x_better: bool, lower_y_better: bool) -> list:
    sx = 1 if lower_x_better else -1
    sy = 1 if lower_y_better else -1
    return [p for p in pts if not any((sx * q[1] <= sx * p[1] and sy * q[2] <= sy * p[2]) and
                                      (q[1] != p[1] or q[2] != p[2]) for q in pts)]


def pareto_front(points: list[tuple[str, float, float]], lower_x_better: bool = True,
                 lower_y_better: bool = True) -> list[str]:
    """The names on the Pareto front, without drawing."""
    pts = [(n, x, y) for n, x, y in points if _finite(x) and _finite(y)]
    return [p[0] for p in _front(pts, lower_x_better, lower_y_better)]


def pareto_plot(path: Path, points: list[tuple[str, float, float]], xlabel: str, ylabel: str, title: str,
                lower_x_better: bool = True, lower_y_better: bool = True) -> list[str]:
    """Scatter with the Pareto front drawn; returns the names on the front."""
    pts = [(n, x, y) for n, x, y in points if _finite(x) and _finite(y)]
    front = _front(pts, lower_x_better, lower_y_better)
    fig, ax = plt.subplots(figsize=(7, 5))
    for n, x, y in pts:
        ax.scatter([x], [y], color="C1" if (n, x, y) in front else "C0")
        ax.annotate(n, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if front:
        f = sorted(front, key=lambda p: p[1])
        ax.plot([p[1] for p in f], [p[2] for p in f], "C1--", lw=1, label="Pareto front")
        ax.legend()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [p[0] for p in front]
