"""Data parallel over torch.distributed: the process groups, the units' owners and the host state
every rank of a host shares (docs/data_parallel.md).

Ranks come from torchrun's environment (env://: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Torchrun numbers ranks host by host, so the ranks of host h are
h * local_world_size .. (h + 1) * local_world_size - 1.

The state of every host-updated unit (master, AdamW moments and step: adamw.FP32_ADAMW's 12 B/param + 4 B,
or a compact format's, --moments / --master) lives once per host
in one file in /dev/shm, mapped by each of the host's ranks; each unit is updated by one of them
(its owner, `shard_units`), and every host updates its own copy with the same all-reduced gradients.
Two int64 counters per unit tell the other ranks how far the owner is: the weights version (the
new weights are written: they may be uploaded) and the state version (the moments too: a
checkpoint may read them).
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..processes import dead_runs
from .adamw import FP32_ADAMW, OptimizerState, StateField
from .tiers import TIERS

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
SHM_DIR = "/dev/shm"
SHM_PREFIX = "slidetune-"          # + <local rank 0's pid>-<random>
_ALIGN = 64                 # bytes: every tensor of the shared file starts on a cache line
_POLL_S = 0.0005            # how often a rank re-reads another rank's counter while waiting


@dataclass(frozen=True)
class DistConfig:
    """Where this process sits among the ranks (torchrun's variables)."""
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1     # ranks on this host; they share one copy of the host state
    backend: str = "gloo"         # gloo: CPU tensors (the tests); nccl: CUDA tensors (the GPU machine)
    timeout_s: float = 600.0      # a collective waiting this long fails instead of hanging

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {self.backend!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(f"{self.world_size} ranks do not split into hosts of {self.local_world_size}")
        if self.local_rank != self.rank % self.local_world_size:
            raise ValueError(f"local rank {self.local_rank} is not rank {self.rank} mod {self.local_world_size} "
                             f"(torchrun numbers ranks host by host)")

    @classmethod
    def from_env(cls, backend: str | None = None, timeout_s: float = 600.0) -> DistConfig:
        """From torchrun's variables; a process started without them is one rank of one."""
        env = os.environ
        world = int(env.get("WORLD_SIZE", "1"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        default = "nccl" if torch.cuda.is_available() else "gloo"
        return cls(world_size=world, rank=int(env.get("RANK", "0")), local_rank=int(env.get("LOCAL_RANK", "0")),
                   local_world_size=local_world, backend=backend or default, timeout_s=timeout_s)

    @property
    def host(self) -> int:
        return self.rank // self.local_world_size

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size


def shard_units(numels: list[int], parts: int, pinned: dict[int, int] | None = None) -> list[int]:
    """The owner (0 .. parts-1) of each unit, balanced by parameter count: units largest first,
    each to the least-loaded part (ties: the lower part, then the lower unit index), so every rank
    computes the same answer. Greedy is within 4/3 of the best balance; with L equal layers and two
    vocabulary matrices it is near even.
    pinned: unit -> part for units whose owner is fixed (the disk tier's, on local rank 0); they
    count towards their part's load before the others are placed."""
    load = [0] * parts
    owner = [0] * len(numels)
    for i, p in (pinned or {}).items():
        owner[i] = p
        load[p] += numels[i]
    for i in sorted((i for i in range(len(numels)) if i not in (pinned or {})), key=lambda i: (-numels[i], i)):
        p = min(range(parts), key=lambda p: (load[p], p))
        owner[i] = p
        load[p] += numels[i]
    return owner


def shared_layout(plan) -> tuple[list[int], frozenset[int]]:
    """What the host's shared state holds for a placement plan (engine/placement.py): each unit's
    parameters (0 for units updated on the GPU: every rank's own copy), and the units whose moments
    are not there (the tier with files'). SharedHostState's arguments; its size is layout_bytes(*...)."""
    return [u.numel if u.host_updated else 0 for u in plan.units], frozenset(plan.indices(TIERS.with_files))


def plan_owners(plan, parts: int) -> list[int]:
    """The local rank (0 .. parts-1) that updates each unit of a placement plan: the host-updated
    units balanced by size (shard_units), the disk tier's pinned to local rank 0 (the host has one
    disk, which more ranks' I/O would not make faster, and the checkpoint writer, rank 0, then
    reads their moments from its own tier). The sharded layers (state "shard") go round robin from
    the lowest, so consecutive layers' broadcasts come from different GPUs and each GPU holds
    ceil(n / parts) of them at most. Units updated on every GPU are every rank's; their entry is
    meaningless."""
    numels, disk = shared_layout(plan)
    owners = shard_units(numels, parts, pinned={i: 0 for i in disk})
    for k, i in enumerate(plan.indices("shard")):
        owners[i] = k % parts
    return owners


@dataclass
class SharedUnit:
    """One unit's views of the host's shared state, in the optimizer's format (FP32 by default)."""
    master: torch.Tensor            # [numel] fp32 (--master bf16: bf16)
    exp_avg: torch.Tensor           # [numel] fp32, bf16 or 8-bit codes (--moments); [0] for a disk unit
    exp_avg_sq: torch.Tensor        # [numel] the same
    step: torch.Tensor              # [] fp32, AdamW's step count (what FlatAdamW keeps)
    weights_version: torch.Tensor   # [] int64: updates whose new weights are written
    state_version: torch.Tensor     # [] int64: updates whose moments are written too
    exp_avg_scales: torch.Tensor | None = None      # [ceil(numel / 256)] fp32 each: 8-bit moments
    exp_avg_sq_scales: torch.Tensor | None = None

    def optimizer_state(self) -> tuple[torch.Tensor, ...]:
        """FlatAdamW's `state`: (exp_avg, exp_avg_sq, step), 8-bit moments' two scales after them."""
        scales = () if self.exp_avg_scales is None else (self.exp_avg_scales, self.exp_avg_sq_scales)
        return (self.exp_avg, self.exp_avg_sq, self.step, *scales)

    def wait(self, counter: torch.Tensor, v: int, abort: threading.Event | None, what: str) -> None:
        """Block until `counter` (one of the two versions) reaches `v`, polling shared memory."""
        while int(counter) < v:
            if abort is not None and abort.is_set():
                raise RuntimeError(f"{what}: version {v} will not arrive (another pipeline thread failed)")
            time.sleep(_POLL_S)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _unit_fields(numel: int, moments: bool, state: OptimizerState) -> list[tuple[StateField, int]]:
    """A unit's tensors in the mapping and their lengths: the master, the moments and 8-bit scales
    (empty where the disk tier holds them), the step (FP32_ADAMW: 4 B/param each, a 4 B step)."""
    return [(f, f.count(numel) if moments or f.name == "master" else 0) for f in state.fields()] \
        + [(StateField("step", state.step_dtype), 1)]


class SharedHostState:
    """Every unit's master, moments, step and versions in one mapping of a /dev/shm file.

    Layout, unit after unit: master, exp_avg, exp_avg_sq ([numel] each, in the optimizer state's
    dtypes: FP32 by default), 8-bit moments' scales, step ([1] fp32), each 64-byte aligned; then
    the versions, [units, 2] int64. A new file reads as zeros: moments, scales, steps and versions
    start at 0 as AdamW's do. Units in `no_moments` (the disk tier's: their moments are in its
    files) have zero-length moments here."""

    @staticmethod
    def layout_bytes(numels: list[int], no_moments: frozenset[int] = frozenset(),
                     state: OptimizerState = FP32_ADAMW) -> int:
        """The mapping's size: every unit's master, moments and step, aligned, then the versions."""
        return sum(_aligned(f.dtype.itemsize * k) for i, n in enumerate(numels)
                   for f, k in _unit_fields(n, i not in no_moments, state)) + _aligned(16 * len(numels))

    def __init__(self, numels: list[int], path: str, create: bool, no_moments: frozenset[int] = frozenset(),
                 state: OptimizerState = FP32_ADAMW):
        self.numels = list(numels)
        self.path = path
        self.state = state
        offsets, at = [], 0           # per unit: field name -> (byte offset, dtype, elements)
        for i, n in enumerate(self.numels):
            unit = {}
            for f, k in _unit_fields(n, i not in no_moments, state):
                unit[f.name] = (at, f.dtype, k)
                at += _aligned(f.dtype.itemsize * k)
            offsets.append(unit)
        versions_at = at
        self.nbytes = at + _aligned(16 * len(self.numels))
        if create:
            with open(path, "wb") as f:
                f.truncate(self.nbytes)                    # zeros
                try:
                    # Reserved now: a tmpfs too small fails here with ENOSPC, where a sparse file
                    # would kill the run with SIGBUS at the first page written past its limit.
                    os.posix_fallocate(f.fileno(), 0, self.nbytes)
                except OSError as e:
                    os.unlink(path)
                    raise SharedMemoryError(_shm_message(self.nbytes, os.path.dirname(path), str(e))) from e
        self.buffer = torch.from_file(path, shared=True, size=self.nbytes, dtype=torch.uint8)   # [nbytes]
        versions = self.buffer[versions_at:versions_at + 16 * len(self.numels)].view(torch.int64).view(-1, 2)
        self.units = []
        for i, unit in enumerate(offsets):
            views = {name: self.buffer[at:at + dtype.itemsize * k].view(dtype) for name, (at, dtype, k) in unit.items()}
            views["step"] = views["step"].view(())
            self.units.append(SharedUnit(**views, weights_version=versions[i, 0], state_version=versions[i, 1]))

    def unlink(self) -> None:
        """Remove the file's name; the memory stays until the last rank unmaps it (its exit)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SharedMemoryError(RuntimeError):
    """The host's shared-memory filesystem cannot hold the state its ranks share."""


def _shm_message(need: int, directory: str, why: str) -> str:
    gib = 2**30
    return (f"data parallel keeps one copy of the training state per host in {directory} and needs "
            f"{need / gib:.1f} GiB there, but {why}. Enlarge it (a container: docker run --shm-size "
            f"{-(-need // gib) + 1}g ...; a host: mount -o remount,size={-(-need // gib) + 1}G {directory}), "
            f"or train on one rank")


def check_shared_memory(need: int, directory: str = SHM_DIR, free: int | None = None) -> None:
    """SharedMemoryError where `directory` (a tmpfs) has less than `need` bytes free (`free`: given,
    for planning another machine; default: asked of the filesystem). Docker gives containers 64 MB
    of /dev/shm and a host mounts it at half its RAM by default: both are below an 8B model's 96 GB
    of state."""
    if free is None and not os.path.isdir(directory):
        raise SharedMemoryError(_shm_message(need, directory, "it does not exist"))
    free = shutil.disk_usage(directory).free if free is None else free
    if free < need:
        raise SharedMemoryError(_shm_message(need, directory, f"only {free / 2**30:.1f} GiB are free"))


def remove_stale_states(directory: str = SHM_DIR) -> list[str]:
    """Remove the shared states of runs that died between creating and mapping them (their local
    rank 0's pid, in the name, is gone); a mapped state's name is removed at once."""
    removed = []
    for path in dead_runs(directory, SHM_PREFIX):
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    return removed


class DataParallel:
    """This rank's process groups and its view of the host's shared state.

    The default group carries the gradients (NCCL on GPUs, gloo on CPUs); a gloo group per host,
    and a gloo copy of the world for NCCL runs, carry the CPU-side agreements (scalars, the shared
    file's name, barriers)."""

    def __init__(self, cfg: DistConfig):
        self.cfg = cfg
        if not dist.is_initialized():
            dist.init_process_group(cfg.backend, init_method="env://", rank=cfg.rank, world_size=cfg.world_size,
                                    timeout=timedelta(seconds=cfg.timeout_s))
        self.world_cpu = dist.new_group(backend="gloo") if cfg.backend != "gloo" else None
        self.host_group = None            # None: the world (one host)
        if cfg.num_hosts > 1:
            self.host_group = self._host_groups("gloo")
        elif self.world_cpu is not None:
            self.host_group = self.world_cpu
        self._weights_group = None        # dp_weights=gather's, made on first use (weights_group)

    def _host_groups(self, backend: str):
        """A group of `backend` per host, made by every rank in the same order (a collective);
        this rank's host's."""
        mine = None
        for h in range(self.cfg.num_hosts):
            group = dist.new_group(ranks=[self.global_rank(r, host=h) for r in range(self.cfg.local_world_size)],
                                   backend=backend)
            if h == self.cfg.host:
                mine = group
        return mine

    @property
    def world_size(self) -> int:
        return self.cfg.world_size

    @property
    def local_rank(self) -> int:
        return self.cfg.local_rank

    def owners(self, plan) -> list[int]:
        """The local rank that owns (updates) each unit of a placement plan on this host."""
        return plan_owners(plan, self.cfg.local_world_size)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over every rank in place (a gradient slot: on the compute stream with NCCL)."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def weights_group(self):
        """The process group of this host's ranks that carries updated weights (dp_weights=gather):
        NCCL on GPUs (NVLink between a host's GPUs), gloo on CPUs. Its own group, so its
        broadcasts, issued by a thread of their own, never interleave with the gradient
        all-reduces or the CPU-side agreements. A collective: every rank creates every host's
        group, in the same order, on its first call."""
        if self._weights_group is None:
            self._weights_group = self._host_groups(self.cfg.backend)
        return self._weights_group

    def global_rank(self, local_rank: int, host: int | None = None) -> int:
        """The global rank of local rank `local_rank` of `host` (default: this rank's host)."""
        return (self.cfg.host if host is None else host) * self.cfg.local_world_size + local_rank

    def broadcast_weights_(self, t: torch.Tensor, owner_local_rank: int) -> None:
        """Overwrite `t` on this host's ranks with the owner's (one unit's compute-dtype weights; with
        NCCL it is queued on the current stream's order and this returns at once)."""
        work = dist.broadcast(t, src=self.global_rank(owner_local_rank), group=self.weights_group(), async_op=True)
        work.wait()          # NCCL: the current stream waits for it; gloo: the copy is done

    # ------------------------------------------------ a save reading other ranks' GPU state
    # Rank 0 writes every checkpoint; the sharded layers other local ranks of its host keep on their
    # GPUs reach it piece by piece: a request [unit, field, lo, hi] to the owner and its status over
    # the host's gloo group, the FP32 elements over the weights' group (NCCL: GPU to GPU over NVLink,
    # then one copy down; gloo on CPUs). One request at a time (the checkpoint's readers take one
    # lock: checkpoint.one_reader). On 2 H200s the elements over gloo's TCP ran at ~1.3 GB/s.

    def _data_group(self):
        """(group, device) that carries the pulled elements: NCCL's weights group and this rank's GPU,
        or on CPUs the host's gloo group."""
        if self.cfg.backend == "nccl":
            return self.weights_group(), torch.device("cuda", self.cfg.local_rank)
        return self.host_group, torch.device("cpu")

    def pull(self, owner_local_rank: int, unit: int, field: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of `field` of a sharded layer `unit` that local rank `owner_local_rank`
        keeps on its GPU, as a [hi - lo] FP32 CPU tensor (that rank runs serve())."""
        peer = self.global_rank(owner_local_rank)
        dist.send(torch.tensor([unit, field, lo, hi], dtype=torch.int64), peer, group=self.host_group)
        status = torch.empty(1, dtype=torch.int64)
        dist.recv(status, peer, group=self.host_group)
        if int(status):
            raise RuntimeError(f"local rank {owner_local_rank} could not read unit {unit}'s state for the checkpoint "
                               f"(its error is in that rank's output)")
        group, device = self._data_group()
        out = torch.empty(hi - lo, dtype=torch.float32, device=device)
        dist.recv(out, peer, group=group)
        return out.cpu()

    def serve(self, read: Callable[[int, int, int, int], torch.Tensor]) -> None:
        """Answer local rank 0's pull() requests with read(unit, field, lo, hi) -> [hi - lo] FP32 until it
        sends the end (end_serving). A failed read is answered as failed (and logged here); the
        serving goes on, so rank 0 fails its save instead of waiting."""
        peer = self.global_rank(0)
        group, device = self._data_group()
        request = torch.empty(4, dtype=torch.int64)
        while True:
            dist.recv(request, peer, group=self.host_group)
            unit, field, lo, hi = request.tolist()
            if unit < 0:
                return
            try:
                values = read(unit, field, lo, hi).to(device, torch.float32).contiguous()
            except Exception:  # noqa: BLE001 - rank 0 is told; the error is shown here
                log.exception("slidetune: reading unit %d's state for rank 0's checkpoint failed", unit)
                dist.send(torch.ones(1, dtype=torch.int64), peer, group=self.host_group)
                continue
            dist.send(torch.zeros(1, dtype=torch.int64), peer, group=self.host_group)
            dist.send(values, peer, group=group)

    def end_serving(self, local_ranks) -> None:
        """Local rank 0: the save is over; the serving ranks return from serve()."""
        for r in sorted(local_ranks):
            dist.send(torch.tensor([-1, 0, 0, 0], dtype=torch.int64), self.global_rank(r), group=self.host_group)

    def sum_scalars(self, values: list[float]) -> list[float]:
        """Sum a few host scalars over every rank (FP64: token counts are exact)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.world_cpu)
        return t.tolist()

    def barrier(self) -> None:
        dist.barrier(group=self.world_cpu)

    def host_barrier(self) -> None:
        dist.barrier(group=self.host_group)

    def share_host_state(self, numels: list[int], no_moments: frozenset[int] = frozenset(),
                         fmt: OptimizerState = FP32_ADAMW) -> SharedHostState:
        """Collective over the host: local rank 0 creates the file, every local rank maps it, and
        the name is removed once all have (the memory then goes with the last rank's exit; only a
        crash in the seconds before that leaves a /dev/shm/slidetune-* file behind). fmt: the
        host-updated units' optimizer state format (SharedHostState's `state`)."""
        shared, error = None, None
        if self.cfg.local_rank == 0:
            try:
                remove_stale_states(SHM_DIR)
                check_shared_memory(SharedHostState.layout_bytes(numels, no_moments, fmt), SHM_DIR)
                shared = SharedHostState(numels, f"{SHM_DIR}/{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}",
                                         create=True, no_moments=no_moments, state=fmt)
            except SharedMemoryError as e:
                error = str(e)
        # the name, or why there is none: every local rank raises the same error instead of waiting
        name = [shared.path if shared is not None else None, error]
        dist.broadcast_object_list(name, src=self.global_rank(0), group=self.host_group)
        if name[1] is not None:
            raise SharedMemoryError(name[1])
        if shared is None:
            shared = SharedHostState(numels, name[0], create=False, no_moments=no_moments, state=fmt)
        self.host_barrier()               # every local rank has mapped it
        if self.cfg.local_rank == 0:
            shared.unlink()
        return shared


def close_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
