"""What one optimizer step reports."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass
class StepResult:
    loss: float                       # mean token loss over the step's micro-batches
    n_tokens: int                     # target tokens in the step
    grad_norm_future: Future | None = field(default=None, repr=False)
    grad_norm_value: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)    # a preference objective's (TRL's names)

    def grad_norm(self) -> float | None:
        """Global gradient norm before clipping (waits for the host side if still running)."""
        if self.grad_norm_value is None and self.grad_norm_future is not None:
            self.grad_norm_value = float(self.grad_norm_future.result())
        return self.grad_norm_value
