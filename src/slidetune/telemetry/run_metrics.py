"""A run's metrics: one row per step and evaluation (METRIC_COLUMNS), handed to the trackers --report-to
names (metrics.csv, TensorBoard, W&B, MLflow; rank 0 opens them), the progress bar or a short line per
logging step, and loss.png drawn from metrics.csv.

`RunMetrics` is what the trainer holds of them: the rows not yet logged, the trackers, the bar. The
trainer builds the rows (`_row`); the checkpoint manager logs them before each save (`log_rows`) and
writes them and the plot on the way out of a failed save (`flush_files`).
"""
from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..atomic_write import write_atomically
from ..evaluation.samples import keep_samples_up_to
from ..objectives.preference import METRICS
from .csv_tracker import CsvTracker
from .machine import HostRss
from .tracker import Trackers
from .trackers import open_dashboards

if TYPE_CHECKING:
    from ..engine.interface import Engine
    from ..parallel.ranks import Ranks

METRIC_COLUMNS = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "step_s",
                  "gpu_peak_alloc_gib", "gpu_peak_reserved_gib", "cpu_rss_gib", "eval_loss", "eval_ppl"]
PRECISE_COLUMNS = {"loss", "lr", "grad_norm", "eval_loss"}     # 9 digits in metrics.csv: an FP32 value round-trips
# a preference objective's metrics (objectives/preference.METRICS), TRL's names: each step's, then
# each evaluation's (objectives/evaluation.py)
PREFERENCE_COLUMNS = [*METRICS, *(f"eval_{m}" for m in METRICS)]


def metric_columns(objective: str) -> list[str]:
    """metrics.csv's columns for a run of `objective` (sft, or a preference objective's)."""
    return METRIC_COLUMNS + (PREFERENCE_COLUMNS if objective != "sft" else [])


class RunMetrics:
    """The metrics of one invocation: rows to the trackers (rank 0 logs them), the progress bar, loss.png."""

    def __init__(self, out: Path, report_to: list[str], ranks: Ranks, columns: list[str] | None = None):
        self.out, self.report_to, self.ranks = out, report_to, ranks
        self.columns = columns or METRIC_COLUMNS
        self.path = out / "metrics.csv"
        self.rows: list[dict] = []       # metrics rows not yet handed to the trackers
        self.trackers = Trackers()       # opened by open_trackers once the step to start from is known (rank 0)
        self.bar = None

    def open_trackers(self, start_step: int, run_record: dict) -> None:
        """The trackers of --report-to (rank 0). On a resume they keep the earlier rows of this run up to
        the checkpoint (rows after it are recomputed); the held-out evaluation at the end of an earlier
        invocation is dropped: the end of this one redoes it."""
        if not self.ranks.is_main:
            return
        resume_step = start_step or None
        csv_log = CsvTracker(self.path, self.columns, PRECISE_COLUMNS, resume_step=resume_step,
                             drop_at_resume=_end_of_run_eval_row)
        keep_samples_up_to(self.out / "eval_samples.jsonl", resume_step)
        self.trackers = Trackers([csv_log] + open_dashboards(self.report_to, self.out, run_record, resume_step))

    def row(self, values: dict) -> dict:
        """A metrics row of this run's columns from `values` (a column it lacks: empty)."""
        return {c: values.get(c, "") for c in self.columns}

    def close_trackers(self) -> None:
        """Close every tracker at the end of run (best effort on the way out of an error: a note)."""
        try:
            self.trackers.close()
        except Exception as e:  # noqa: BLE001 - the run's result (or its real error) matters more
            print(f"note: could not close the trackers ({', '.join(self.report_to)}): {e}", file=sys.stderr)

    def open_progress(self, show: bool, start_step: int, total_steps: int) -> None:
        """Start the progress bar (when `show`, steps remain and this is rank 0)."""
        if show and start_step < total_steps and self.ranks.is_main:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def close_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def add_step(self, row: dict, total_steps: int, on_gpu: bool, log_every: int) -> None:
        """A step's row, kept to be logged, and shown: the bar ticks, or with no bar (--progress false,
        a log file) one short line per logging step (rank 0)."""
        self.rows.append(row)
        gpu = (dict(tflops=f"{row['tflops']:.1f}", gpu=f"{row['gpu_peak_alloc_gib']:.1f}G") if on_gpu else {})
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:,.0f}", **gpu,
                                 rss=f"{row['cpu_rss_gib']:.1f}G")
        elif self.ranks.is_main and row["step"] % log_every == 0:
            print(f"step {row['step']}/{total_steps}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
                  f"{row['step_s']:.2f} s  {row['tokens_per_s']:,.0f} tok/s"
                  + "".join(f"  {k} {v}" for k, v in gpu.items()) + f"  rss {row['cpu_rss_gib']:.1f}G", flush=True)

    def write(self) -> None:
        """The rows so far to the trackers (rank 0 logs them; the other ranks drop theirs, the same rows)."""
        if self.ranks.is_main:
            self.log_rows()
        else:
            self.rows.clear()

    def log_rows(self) -> None:
        """Each row not yet logged to every tracker, then the trackers flushed (metrics.csv appended)."""
        for row in self.rows:
            self.trackers.log_scalars(int(row["step"]), _scalars(row))
        self.rows.clear()
        self.trackers.flush()

    def flush(self) -> None:
        """metrics.csv and loss.png as they stand (rank 0)."""
        self.write()
        if self.ranks.is_main:
            self._plot_loss()

    def flush_files(self) -> None:
        """The rows to the trackers, then loss.png (on the way out of an error: best effort for the plot)."""
        self.log_rows()
        self._plot_loss()

    def _plot_loss(self) -> None:
        """loss.png from metrics.csv; a failure is a note, never the run's error."""
        try:
            _plot(self.path, self.out / "loss.png")
        except Exception as e:  # noqa: BLE001 - a plot must never hide the real error
            print(f"note: could not draw {self.out / 'loss.png'}: {e}", file=sys.stderr)


def host_rss_meter(ranks: Ranks, engine: Engine) -> HostRss:
    """metrics.csv's cpu_rss_gib: this host's memory, not one rank's. With several ranks the
    pids of this host's ranks are gathered once (a collective: every rank builds its Trainer
    at the same point) and the shared state is counted once (rank 0 alone would show its own
    private memory and the part of the shared state it touched: 51.8 GiB of a host using 82
    on 2x H100, benchmarks/NOTES.md "Data parallel")."""
    if ranks.world_size == 1:
        return HostRss()
    host = ranks.dp.cfg.host
    every = ranks.gather((host, os.getpid()))
    shared = engine.shared
    return HostRss([pid for h, pid in every if h == host], shared.nbytes if shared is not None else 0)


def _row(**kw) -> dict:
    return {c: kw.get(c, "") for c in METRIC_COLUMNS}


def _scalars(row: dict) -> dict[str, float]:
    """A metrics row's values as the trackers and callbacks take them: the columns that have one, less step."""
    return {k: float(v) for k, v in row.items() if k != "step" and v not in ("", None)}


def _end_of_run_eval_row(row: dict[str, str]) -> bool:
    """A metrics.csv row holding only a held-out evaluation after step 0: the end of an earlier invocation
    (a resume drops it; the end of the resumed run evaluates again)."""
    return not row.get("loss") and row.get("step") not in ("0", "0.0")


# A smoothed training loss from this many steps: each step's batch is different text, and in the CPU
# default job (20 steps) the batches' own difficulty moved the per-step loss by 2.7-3.9 while the
# held-out loss fell 3.17 -> 3.12; a mean of 5 of those steps still rose (and the EMA, weight 0.8,
# rose 2.54 -> 3.09): it showed the batches, not the learning
SMOOTHED_FROM_STEPS = 50


def _plot(metrics: Path, png: Path) -> None:
    """loss.png: the held-out loss (the headline: the same rows before and after, so its change is the
    run's learning), the per-step training loss, and from SMOOTHED_FROM_STEPS steps that smoothed by a
    centred running mean over a fifth of the run. Titled with the run's directory and model (from
    config.json beside it), integer step ticks."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    with metrics.open() as f:
        rows = list(csv.DictReader(f))
    train_pts = [(int(r["step"]), float(r["loss"])) for r in rows if r["loss"]]
    eval_pts = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    if train_pts:
        steps, losses = zip(*train_pts)
        ax.plot(steps, losses, ".-", color="tab:blue", alpha=0.3, label="train loss (each step: a different batch)")
        half = len(losses) // 10                          # window 2 x half + 1: about a fifth of the run
        if len(losses) >= SMOOTHED_FROM_STEPS:
            smooth = [float(np.mean(losses[max(0, i - half):i + half + 1])) for i in range(len(losses))]
            ax.plot(steps, smooth, color="tab:blue", label=f"train loss (mean of {2 * half + 1} steps around each)")
    if eval_pts:
        change = f" ({eval_pts[0][1]:.3f} -> {eval_pts[-1][1]:.3f})" if len(eval_pts) > 1 else ""
        ax.plot(*zip(*eval_pts), "o-", color="tab:red", lw=2.5, ms=7, label=f"held-out loss{change}")
    title = png.parent.name
    try:
        title += f": {json.loads((png.parent / 'config.json').read_text())['model']}"
    except (OSError, ValueError, KeyError):
        pass
    ax.set_title(title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        # matplotlib takes the format from the name's suffix: the temporary name keeps .png
        write_atomically(png, lambda tmp: fig.savefig(tmp, dpi=120), tmp=png.with_suffix(".tmp.png"))
    finally:
        plt.close(fig)
