"""The interface every metrics sink implements (metrics.csv, TensorBoard, W&B, MLflow), and the
fan-out that hands each call to all of a run's sinks.

A tracker is told three things: the scalars of one step (`log_scalars`), a piece of text at a step
(`log_text`: generated samples of an evaluation), and that the run is over (`close`). `flush` makes
what was logged so far durable; the trainer calls it at each logging step (`--log-every`) and before
each checkpoint, so the rows up to a checkpoint are on disk with it. The trainer calls them on rank 0
only. telemetry/trackers.py opens the ones `--report-to` names.
"""
from __future__ import annotations

# The names the trainer logs under (run_metrics.METRIC_COLUMNS, less "step") -> the tag the dashboards
# (TensorBoard, W&B, MLflow) show, grouped by what they measure; metrics.csv keeps the plain names.
DASHBOARD_TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens_per_s": "speed/tokens_per_s", "tflops": "speed/tflops", "step_s": "speed/step_s",
    "gpu_peak_alloc_gib": "memory/gpu_peak_alloc_gib", "gpu_peak_reserved_gib": "memory/gpu_peak_reserved_gib",
    "cpu_rss_gib": "memory/host_rss_gib", "eval_loss": "eval/loss", "eval_ppl": "eval/perplexity",
}


def dashboard_tag(name: str) -> str:
    """The dashboards' tag of a scalar (the name itself where it has no group). A preference
    objective's TRL metrics group as TRL's do: `rewards/margins` under train/, `eval_rewards/margins`
    under eval/."""
    if name in DASHBOARD_TAGS:
        return DASHBOARD_TAGS[name]
    if name.startswith(("rewards/", "logps/")):
        return f"train/{name}"
    if name.startswith(("eval_rewards/", "eval_logps/")):
        return f"eval/{name.removeprefix('eval_')}"
    return name


class Tracker:
    """One sink of a run's metrics. Subclasses implement log_scalars, log_text and close."""

    name = "tracker"

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """The values of `step` (the optimizer step they follow; 0: before training)."""
        raise NotImplementedError

    def log_text(self, step: int, tag: str, text: str) -> None:
        """A piece of text at `step`, under `tag` (e.g. a generated sample)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was logged so far durable (the default: each call already is)."""

    def close(self) -> None:
        """The run is over: flush and release what the tracker holds."""
        raise NotImplementedError


class Trackers(Tracker):
    """Every tracker of a run as one: each call goes to each of them, in order. Closing closes each
    even when one fails (the first failure is raised after the others are closed)."""

    name = "trackers"

    def __init__(self, trackers: list[Tracker] | None = None):
        self.trackers = list(trackers or [])

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for t in self.trackers:
            t.log_scalars(step, scalars)

    def log_text(self, step: int, tag: str, text: str) -> None:
        for t in self.trackers:
            t.log_text(step, tag, text)

    def flush(self) -> None:
        for t in self.trackers:
            t.flush()

    def close(self) -> None:
        first: BaseException | None = None
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:  # noqa: BLE001 - the others still close; the first is raised below
                first = first or e
        self.trackers = []
        if first is not None:
            raise first
