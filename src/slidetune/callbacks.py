"""Hooks into a training run from Python: `slidetune.train(cfg, callbacks=[MyCallback()])`.

A callback sees each finished step's metrics, each held-out evaluation and each save, as they
happen (docs/library.md). A callback that raises stops the run: the trainer writes the metrics so
far and raises a TrainingError naming the callback, the hook and the step (the newest checkpoint
stays intact). With several ranks (data parallel) rank 0 calls the callbacks, and a failure there
stops every rank.
"""
from __future__ import annotations

from pathlib import Path


class Callback:
    """Override any of the hooks; the others do nothing. The metrics are plain floats keyed by
    metrics.csv's column names."""

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        """Optimizer step `step` (1-based) is complete: loss, lr, grad_norm, tokens_per_s, tflops, step_s,
        gpu_peak_alloc_gib, gpu_peak_reserved_gib, cpu_rss_gib (grad_norm absent where not computed)."""

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """A held-out evaluation after step `step` (0: before training): eval_loss, eval_ppl."""

    def on_save(self, step: int, path: Path) -> None:
        """A checkpoint of step `step` is complete at `path` (checkpoint-<step>/, or final/ for the
        exported model)."""


class CallbackFailed(RuntimeError):
    """A callback raised: names it, the hook and the step; the callback's error is the __cause__."""

    def __init__(self, callback: Callback, hook: str, step: int, error: BaseException):
        self.callback, self.hook, self.step, self.error = callback, hook, step, error
        super().__init__(f"callback {type(callback).__name__}.{hook} raised at step {step}: "
                         f"{type(error).__name__}: {error}")


def call_hook(callbacks: list[Callback], hook: str, step: int, arg) -> None:
    """`hook(step, arg)` of each callback in order; the first that raises stops there (CallbackFailed)."""
    for cb in callbacks:
        try:
            getattr(cb, hook)(step, arg)
        except Exception as e:  # noqa: BLE001 - any error of user code stops the run, named
            raise CallbackFailed(cb, hook, step, e) from e
