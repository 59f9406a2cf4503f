"""Run each configuration in its own process (clean peaks) and collect the JSON results."""
from __future__ import annotations

from .baselines.proc import run_worker
from .measure import MeasureSpec


def run_isolated(spec: MeasureSpec, timeout_s: float = 1800, env: dict | None = None) -> dict:
    """One slidetune configuration in a fresh process (`python -m slidetune.bench.measure`); with
    spec.ranks > 1, that many processes of this host under torchrun (data parallel), rank 0's result."""
    return run_worker("slidetune.bench.measure", spec.to_dict(), timeout_s=timeout_s, env=env, ranks=spec.ranks)
