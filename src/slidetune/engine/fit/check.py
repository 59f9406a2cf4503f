"""The check: the estimate if it fits the budget, else InsufficientMemoryError with the numbers and
the changes that would fit; the same on every data-parallel rank.

    check_fit(split, rt, batch_size=16, seq_len=1024)                 # or InsufficientMemoryError
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...models.units import SplitModel
from ..config import RuntimeConfig
from ..placement import PlacementPlan
from ..tiers import TIERS
from .budget import FIT_SAFETY, budget_for
from .estimate import MemoryEstimate, estimate_memory
from .search import choose_auto_settings
from .suggestions import disk_tier_note, refusal_message, suggest

class InsufficientMemoryError(RuntimeError):
    """The configuration does not fit; the message has the numbers and options that would."""

    def __init__(self, message: str, estimate: MemoryEstimate | None = None, options: list[str] | None = None):
        super().__init__(message)
        self.estimate = estimate
        self.options = options or []


@dataclass(frozen=True)
class Workload:
    """A run's shape as the fit estimate and the auto settings read it, beside the model and the
    runtime: one value that `slidetune train`, the benchmarks and the soak build once and pass to
    choose_auto_settings and check_fit (place_on_ranks / check_fit_on_ranks under data parallel)."""
    batch_size: int                    # rows per rank and micro-batch x grad_accum
    seq_len: int
    grad_accum: int = 1
    max_grad_norm: float | None = None
    padded: bool = True                # rows may carry padding ([B,1,S,S] masks); packed or synthetic: False
    gpu_free_bytes: int | None = None  # None: this GPU's free memory now
    ranks_per_host: int = 1

    def fit_kwargs(self) -> dict:
        return dataclasses.asdict(self)


def place_on_ranks(split: SplitModel, rt: RuntimeConfig, work: Workload, ranks) -> RuntimeConfig:
    """The auto settings, chosen on rank 0 from its GPU and shared (`ranks`: slidetune.parallel.ranks.Ranks):
    every rank runs the same placement, the host's RAM counted for all of its ranks."""
    return ranks.on_main(lambda: choose_auto_settings(split, rt, **work.fit_kwargs()))


def check_fit_on_ranks(split: SplitModel, rt: RuntimeConfig, work: Workload, ranks) -> None:
    """check_fit on every rank (its own GPU; the host with all of its ranks, the shared state once);
    a refusal anywhere stops every rank."""
    ranks.on_each(lambda: check_fit(split, rt, **work.fit_kwargs()))


def check_fit(split: SplitModel, rt: RuntimeConfig, *, batch_size: int, seq_len: int, grad_accum: int = 1,
              max_grad_norm: float | None = None, gpu_free_bytes: int | None = None,
              host_available_bytes: int | None = None, safety: float = FIT_SAFETY, padded: bool = True,
              ranks_per_host: int = 1, shm_free_bytes: int | None = None,
              disk_free_bytes: int | None = None) -> MemoryEstimate:
    """The estimate if it fits in `safety` x the available memory, else InsufficientMemoryError.

    ranks_per_host: data-parallel ranks on this host; the GPU check is per rank (each has its own
    GPU), the host check counts the shared state once and each rank's own buffers per rank, and
    the shared state must fit the host's /dev/shm (`shm_free_bytes`, default: its free space), and
    the disk tier's files the disk of its directory (`disk_free_bytes`, default: its free space).

    gpu_free_bytes: default torch.cuda.mem_get_info()[0] (device cuda); ignored on device cpu,
    where model state and activations count against host RAM.
    host_available_bytes: default psutil's available RAM, or $SLIDETUNE_HOST_MEMORY_BYTES.
    """
    if not 0 < safety <= 1:
        raise ValueError("safety must be in (0, 1]")
    est = estimate_memory(split, rt, batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum,
                          max_grad_norm=max_grad_norm, padded=padded, ranks_per_host=ranks_per_host)
    # the tier with files' directory: there, writable, with room for its files (DiskTierError)
    TIERS.with_files.check_resources(rt, est.plan, est.disk_bytes, disk_free_bytes)
    if ranks_per_host > 1 and est.plan is not None:
        # the host's ranks share the state through a tmpfs file (SharedMemoryError, naming the fix;
        # a container's /dev/shm is 64 MB unless it is given more)
        from .. import distributed
        distributed.check_shared_memory(shared_state_bytes(est.plan), distributed.SHM_DIR, shm_free_bytes)
    budget = budget_for(est, rt, gpu_free_bytes, host_available_bytes, safety, ranks_per_host)
    short = budget.shortfalls(est)
    if not short:
        return est
    options = suggest(split, rt, budget, batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum,
                      max_grad_norm=max_grad_norm, padded=padded)
    disk_note = disk_tier_note(split, rt, budget, short, batch_size=batch_size, seq_len=seq_len,
                               grad_accum=grad_accum, max_grad_norm=max_grad_norm, padded=padded)
    raise InsufficientMemoryError(refusal_message(rt, est, short, options, batch_size, seq_len, grad_accum, safety,
                                                  disk_note), est, options)


def shared_state_bytes(plan: PlacementPlan) -> int:
    """Data parallel: the bytes of the host's shared state file for a placement (its layout:
    master, moments and step of every host-updated unit, a disk unit's master only)."""
    from ..distributed import SharedHostState, shared_layout
    return SharedHostState.layout_bytes(*shared_layout(plan), state=plan.host_state)
