"""Result writers of the techniques / throughput / roofline scenarios: CSV (the suite's
common format), JSON, bar / scatter PNGs (matplotlib Agg), Markdown tables."""
from __future__ import annotations

import json
import math
from pathlib import Path


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, default=float))


def write_csv(path: Path, rows: list[dict], columns: list[str] | None, machine: dict) -> None:
    """The suite's one CSV format (scenarios.common.write_csv): machine details as leading
    `# machine.<key>: <value>` lines, then the table; read it with scenarios.common.read_csv."""
    from ..scenarios.common import machine_of, write_csv as write_table
    machine = machine or machine_of([])          # this machine, when the rows carry none
    write_table(Path(path), rows, columns or list(dict.fromkeys(k for r in rows for k in r)), machine)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fmt(v, p: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{p}f}" if math.isfinite(v) else str(v)
    return str(v)


def md_table(rows: list[dict], columns: list[str], digits: dict | None = None) -> list[str]:
    digits = digits or {}
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c), digits.get(c, 2)) for c in columns) + " |")
    return lines


def machine_lines(machine: dict) -> list[str]:
    keys = ["gpu", "gpu_count", "gpu_memory_gib", "driver", "cuda_runtime", "torch", "transformers", "cpu",
            "cpu_cores_physical", "cpu_cores_logical", "ram_total_gib", "torch_threads", "hostname"]
    return ["| machine | |", "|---|---|"] + [f"| {k} | {machine.get(k)} |" for k in keys if k in machine]


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def bar_plot(path: Path, labels: list[str], series: dict[str, list], ylabel: str, title: str) -> None:
    """Grouped bars: one group per label, one bar per series; missing values (OOM, None) drawn as 0 with 'x'."""
    plt = _plt()
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
    plt = _plt()
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
