"""Fault injection for tests: make one of the run's threads, or its step, fail at a chosen step.

Not a user flag: the environment variable SLIDETUNE_INJECT_FAULT=KIND:STEP (STEP the
optimizer step, 1-based, during which it happens) with KIND one of
  upload, d2h, host, checkpoint, data   that thread raises InjectedFault at its next piece of
                                        work of that step (engine/slide/workers.py jobs, the
                                        checkpoint writer, the data loader in trainer.py);
  oom                                   the compute thread raises torch.OutOfMemoryError in
                                        the middle of the step (after the forward, before the
                                        head: where a real one usually strikes);
  nan                                   the step's loss, hence every gradient, becomes NaN;
  bitrot                                the checkpoint of that step has a byte of its largest
                                        file flipped on the disk after it was written and
                                        synced (a disk that corrupts a write);
  stall                                 the asynchronous save of that step's checkpoint stops
                                        for an hour once its tensors are written, before it is
                                        complete, while training goes on (a save that a kill
                                        catches mid-way: tests/test_async_save.py).
Tests use it to prove that each fault ends the run promptly with a message naming what
failed and the step, and leaves the newest complete checkpoint intact and resumable.
KIND:STEP:RANK fails on that data-parallel rank only (RANK from torchrun's environment);
without it, on every rank.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

ENV = "SLIDETUNE_INJECT_FAULT"
THREADS = ("upload", "d2h", "host", "checkpoint", "data")
KINDS = THREADS + ("oom", "nan", "bitrot", "stall")
STALL_S = 3600.0


class InjectedFault(RuntimeError):
    pass


def _target() -> tuple[str, int, int | None] | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    kind, _, rest = spec.partition(":")
    step, _, rank = rest.partition(":")
    if kind not in KINDS or not step.isdigit() or not (rank == "" or rank.isdigit()):
        raise ValueError(f"{ENV}={spec!r}: expected KIND:STEP or KIND:STEP:RANK with KIND one of {', '.join(KINDS)}")
    return kind, int(step), int(rank) if rank else None


def due(kind: str, step: int) -> bool:
    """Whether the environment asks for fault `kind` at `step` (1-based) on this rank."""
    target = _target()
    if target is None or target[:2] != (kind, step):
        return False
    return target[2] is None or target[2] == int(os.environ.get("RANK", "0"))


def maybe_fail(thread: str, step: int) -> None:
    """Raise InjectedFault when the environment asks `thread` to fail at `step` (1-based)."""
    if due(thread, step):
        rank = _target()[2]
        raise InjectedFault(f"injected fault in the {thread} thread at step {step}"
                            + (f" on rank {rank}" if rank is not None else "") + f" ({ENV})")


def maybe_oom(step: int) -> None:
    """Raise the error a failed CUDA allocation raises, when asked for at `step` (1-based)."""
    if due("oom", step):
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected at step {step} "
                                     f"by {ENV})")


def maybe_poison(loss: torch.Tensor, step: int) -> torch.Tensor:
    """`loss` made NaN (and so every gradient of it) when asked for at `step` (1-based)."""
    return loss * float("nan") if due("nan", step) else loss


def poison_scale(scale: float, step: int) -> float:
    """The gradient scale, NaN when a NaN loss is asked for at `step`: the gradients a NaN loss
    would give, for a head that computes its gradients without autograd."""
    return float("nan") if due("nan", step) else scale


def maybe_corrupt(directory: Path, step: int) -> None:
    """Flip one byte in the middle of the largest file under `directory`, on the disk, when asked
    for at `step` (1-based): what a disk that corrupts a write leaves."""
    if not due("bitrot", step):
        return
    path = max((p for p in Path(directory).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def maybe_stall(step: int) -> None:
    """Sleep STALL_S when asked for at `step` (1-based): an asynchronous save that hangs mid-way."""
    if due("stall", step):
        time.sleep(STALL_S)
