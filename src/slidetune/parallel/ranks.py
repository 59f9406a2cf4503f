"""The trainer's data-parallel ranks (docs/data_parallel.md): one process, or several under torchrun.

`Ranks` is what trainer.py needs from torch.distributed beyond the engine's gradient reduction:
which rows of a global batch are this rank's, decisions taken once on rank 0 and shared
(`on_main`), checks every rank runs that must pass everywhere (`on_each`), and the stop flag
all ranks agree on. A world of one takes none of the collective paths.

A failure inside `on_main` / `on_each` is raised on every rank: the failing rank raises its own
error, the others a `RankFailure` naming that rank and its message, so every rank stops at the same
point with the reason instead of hanging in the next collective.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as tdist

from ..device import Device
from ..engine.distributed import DataParallel, DistConfig, close_process_group

T = TypeVar("T")

# A collective waits this long before failing: long enough for rank 0 to write a large checkpoint
# or final/ while the others wait for it (an 8B model's optimizer state is ~100 GB).
COLLECTIVE_TIMEOUT_S = 3600.0


class RankFailure(RuntimeError):
    """Another rank failed at a point where every rank must agree; says which and why."""


@dataclass
class Ranks:
    cfg: DistConfig
    dp: DataParallel | None           # None: one rank, nothing distributed

    @classmethod
    def single(cls) -> Ranks:
        return cls(DistConfig(), None)

    @classmethod
    def start(cls, device_name: str | None, waits: str) -> tuple[Ranks, Device]:
        """This process's rank (torchrun's environment) and device; with several ranks the process
        group is created and each rank takes the GPU of its local rank."""
        env = DistConfig.from_env(backend="gloo")
        if env.world_size == 1:
            return cls.single(), Device.resolve(device_name, waits=waits)
        name = device_name if device_name not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu")
        if name.startswith("cuda"):
            if name != "cuda":
                raise ValueError(f"--device {name} names one GPU, but under {env.world_size} ranks each rank takes "
                                 f"cuda:LOCAL_RANK; use --device cuda")
            count = torch.cuda.device_count()
            if env.local_rank >= count:
                raise ValueError(f"rank {env.rank} (local rank {env.local_rank}) has no GPU: this host shows "
                                 f"{count} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                                 f"start at most {count} ranks per host (--gpus / --nproc-per-node)")
            name = f"cuda:{env.local_rank}"
        device = Device.resolve(name, waits=waits)
        if device.is_cuda:
            torch.cuda.set_device(device.device)      # NCCL and the default CUDA calls use this rank's GPU
        cfg = DistConfig.from_env(backend="nccl" if device.is_cuda else "gloo", timeout_s=COLLECTIVE_TIMEOUT_S)
        return cls(cfg, DataParallel(cfg)), device

    # ------------------------------------------------------------------ who
    @property
    def world_size(self) -> int:
        return self.cfg.world_size

    @property
    def rank(self) -> int:
        return self.cfg.rank

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes the run's files (metrics, config, checkpoints, final/)."""
        return self.cfg.rank == 0

    def rows(self, global_rows: Sequence[int], per_rank: int) -> list[int]:
        """This rank's rows of a global batch: [rank * per_rank, (rank + 1) * per_rank); the last,
        shorter batch of an evaluation may leave a rank fewer rows or none."""
        return list(global_rows[self.rank * per_rank:(self.rank + 1) * per_rank])

    # ------------------------------------------------------------------ agreement
    def on_main(self, fn: Callable[[], T], service=None) -> T:
        """fn() on rank 0, its result on every rank (it must pickle); rank 0's error on every rank.
        service: a save's (engine.save_service, where the host shards layers over its GPUs): the
        other ranks serve rank 0's reads of their GPU state until fn() has ended there."""
        if self.dp is None:
            return fn()
        outcome: list = [None]
        error: BaseException | None = None
        if self.is_main:
            try:
                outcome[0] = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - sent to the other ranks, then raised here
                error = e
                outcome[0] = ("error", f"{type(e).__name__}: {e}")
            finally:
                if service is not None:
                    service.end()
        elif service is not None:
            service.serve()
        tdist.broadcast_object_list(outcome, src=0, group=self.dp.world_cpu)
        if error is not None:
            raise error
        status, value = outcome[0]
        if status == "error":
            raise RankFailure(f"rank 0 failed, so this rank stops too: {value}")
        return value

    def on_each(self, fn: Callable[[], T]) -> T:
        """fn() on every rank; if it failed anywhere, every rank raises (its own error, or the first
        failing rank's message)."""
        if self.dp is None:
            return fn()
        result, error, message = None, None, None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every rank learns of it, then it is raised here
            error, message = e, f"{type(e).__name__}: {e}"
        messages: list = [None] * self.world_size
        tdist.all_gather_object(messages, message, group=self.dp.world_cpu)
        if error is not None:
            raise error
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if failed:
            r, m = failed[0]
            raise RankFailure(f"rank {r} failed, so this rank stops too: {m}")
        return result

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any (a stop signal that reached some ranks only)."""
        if self.dp is None:
            return flag
        return self.dp.sum_scalars([float(flag)])[0] > 0

    def gather(self, value: T) -> list[T]:
        """Every rank's `value` (it must pickle), in rank order, on every rank."""
        if self.dp is None:
            return [value]
        out: list = [None] * self.world_size
        tdist.all_gather_object(out, value, group=self.dp.world_cpu)
        return out

    def sum(self, values: list[float]) -> list[float]:
        return values if self.dp is None else self.dp.sum_scalars(values)

    def close(self) -> None:
        if self.dp is not None:
            close_process_group()
