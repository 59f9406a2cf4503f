"""Fault injection for tests: make one of the run's threads fail at a chosen step.

Not a user flag: the environment variable SLIDETUNE_INJECT_FAULT=THREAD:STEP (THREAD one of
upload, d2h, host, checkpoint, data; STEP the optimizer step, 1-based, during which it fails)
makes that thread raise InjectedFault at its next piece of work of that step. The pipeline
threads check it before each job (engine/slide/workers.py), the checkpoint writer before it
writes, the data loader before it builds a step's micro-batches (train.py). Tests use it to
prove that every thread's failure ends the run promptly with a message naming the thread and
the step, and leaves the newest complete checkpoint intact and resumable. THREAD:STEP:RANK fails
on that data-parallel rank only (RANK from torchrun's environment); without it, on every rank.
"""
from __future__ import annotations

import os

ENV = "SLIDETUNE_INJECT_FAULT"
THREADS = ("upload", "d2h", "host", "checkpoint", "data")


class InjectedFault(RuntimeError):
    pass


def _target() -> tuple[str, int, int | None] | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    thread, _, rest = spec.partition(":")
    step, _, rank = rest.partition(":")
    if thread not in THREADS or not step.isdigit() or not (rank == "" or rank.isdigit()):
        raise ValueError(f"{ENV}={spec!r}: expected THREAD:STEP or THREAD:STEP:RANK with THREAD one of "
                         f"{', '.join(THREADS)}")
    return thread, int(step), int(rank) if rank else None


def maybe_fail(thread: str, step: int) -> None:
    """Raise InjectedFault when the environment asks `thread` to fail at `step` (1-based)."""
    target = _target()
    if target is None or target[:2] != (thread, step):
        return
    rank = target[2]
    if rank is None:
        raise InjectedFault(f"injected fault in the {thread} thread at step {step} ({ENV})")
    if rank == int(os.environ.get("RANK", "0")):
        raise InjectedFault(f"injected fault in the {thread} thread at step {step} on rank {rank} ({ENV})")
