"""The trackers `--report-to` chooses: metrics.csv (always: loss.png and a resume read it), TensorBoard,
Weights & Biases and MLflow. Each is a Tracker (telemetry/tracker.py) and calls its library's own API.

`--report-to auto` (the default) is metrics.csv plus TensorBoard where the tensorboard package is
installed. A tracker named explicitly whose package is missing is refused before the run starts,
with the line that installs it; slidetune never installs them itself.
"""
from __future__ import annotations

import html
import importlib.util
import os
from pathlib import Path

from .tracker import Tracker, dashboard_tag

REPORT_TO_NAMES = ("csv", "tensorboard", "wandb", "mlflow")
# tracker -> (the package it imports, how to install it)
_PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard  (or: pip install 'slidetune[tensorboard]')"),
             "wandb": ("wandb", "pip install wandb"),
             "mlflow": ("mlflow", "pip install mlflow")}


class TrackerUnavailable(RuntimeError):
    """A tracker --report-to names whose package is not installed."""


def parse_report_to(spec: str) -> list[str]:
    """The names in a --report-to value: "auto", or a comma list of REPORT_TO_NAMES. ValueError names
    a wrong one."""
    names = [n.strip().lower() for n in str(spec).split(",") if n.strip()]
    if names == ["auto"]:
        return names
    unknown = [n for n in names if n not in REPORT_TO_NAMES]
    if unknown or not names:
        raise ValueError(f"report_to (--report-to) must be auto or a comma list of {', '.join(REPORT_TO_NAMES)}; "
                         f"got {spec!r}")
    return list(dict.fromkeys(names))


def is_installed(name: str) -> bool:
    """Whether the package tracker `name` needs can be imported here (csv needs none)."""
    return name not in _PACKAGES or importlib.util.find_spec(_PACKAGES[name][0]) is not None


def resolve_report_to(spec: str) -> list[str]:
    """The trackers a run opens, metrics.csv first. TrackerUnavailable, with the install line, for a
    tracker named explicitly whose package is missing."""
    names = parse_report_to(spec)
    if names == ["auto"]:
        names = ["tensorboard"] if is_installed("tensorboard") else []
    missing = [n for n in names if not is_installed(n)]
    if missing:
        raise TrackerUnavailable("; ".join(
            f"--report-to {n}: the {_PACKAGES[n][0]} package is not installed; install it with `{_PACKAGES[n][1]}`, "
            f"or leave {n} out of --report-to" for n in missing))
    return ["csv"] + [n for n in names if n != "csv"]


def open_dashboards(names: list[str], out: Path, config: dict, resume_step: int | None) -> list[Tracker]:
    """The trackers of `names` other than csv, opened for the run writing to `out` (its directory name
    names the run). `resume_step`: the checkpoint's step on a resume, None for a fresh start."""
    opened: list[Tracker] = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(out / "tensorboard", resume_step))
            elif name == "wandb":
                opened.append(WandbTracker(out, config))
            elif name == "mlflow":
                opened.append(MlflowTracker(out, config))
    except BaseException:
        for t in opened:
            t.close()
        raise
    return opened


class TensorBoardTracker(Tracker):
    """Event files in `log_dir` (`tensorboard --logdir <output_dir>/tensorboard` shows them).

    A fresh start removes an earlier run's event files there (metrics.csv is started afresh too); a
    resume writes TensorBoard's purge marker at the step after the checkpoint, so the steps a killed
    run logged past its checkpoint are dropped by the readers and logged once again by this run."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter
        log_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir),
                                    purge_step=None if resume_step is None else resume_step + 1)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(dashboard_tag(name), value, global_step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run named after the output directory, in the project $WANDB_PROJECT (default
    "slidetune"), with the run's config; its local files go under the output directory. Each
    invocation is a W&B run of its own (a resume starts a new one at the checkpoint's step)."""

    name = "wandb"

    def __init__(self, out: Path, config: dict):
        import wandb
        self.wandb = wandb
        wandb.init(project=os.environ.get("WANDB_PROJECT", "slidetune"), name=out.name, dir=str(out), config=config)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.wandb.log({dashboard_tag(k): v for k, v in scalars.items()}, step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        self.wandb.log({tag: self.wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def close(self) -> None:
        self.wandb.finish()


class MlflowTracker(Tracker):
    """An MLflow run named after the output directory, in the tracking store MLflow is configured for
    ($MLFLOW_TRACKING_URI; ./mlruns by default), with the run's config as its parameters; text goes
    in as artifacts (text/<tag>/step-<step>.txt)."""

    name = "mlflow"

    def __init__(self, out: Path, config: dict):
        import mlflow
        self.mlflow = mlflow
        mlflow.start_run(run_name=out.name)
        mlflow.log_params(flat_params(config))

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics({dashboard_tag(k): float(v) for k, v in scalars.items()}, step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        self.mlflow.log_text(text, f"text/{tag}/step-{step}.txt")

    def close(self) -> None:
        self.mlflow.end_run()


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as flat "section.field" -> text parameters (MLflow's parameters are flat strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out
