"""The slide engine's host state, built once: each host unit's master and AdamW state (HostStore),
the disk tier's files, and under data parallel the host's shared mapping, which local rank owns
(updates) each unit, and what the other ranks do while rank 0 saves.

Why a module of its own: the ownership rules are data parallel's (docs/data_parallel.md) and the
disk tier's, not the step's; SlideEngine reads the result and runs steps over it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...device import Device
from ...models.load import LoadedModel
from ..adamw import AdamWConfig
from ..config import RuntimeConfig
from ..distributed import DataParallel, shared_layout
from ..placement import PlacementPlan
from ..tiers import TIERS
from .disk_tier import DiskTier
from .host_store import HostStore
from .save_service import SaveService


@dataclass
class HostState:
    store: HostStore
    disk: DiskTier | None                  # the disk tier's files of this rank's disk units, if any
    shared: object | None                  # data parallel: the host's shared mapping (distributed.py)
    owner_of: list[int] | None             # data parallel: unit -> the local rank that updates it
    gather: bool                           # dp_weights=gather: a host unit's owner alone uploads it
    save_service: SaveService | None       # what the other ranks do while rank 0 saves


def build_host_state(loaded: LoadedModel, plan: PlacementPlan, rt: RuntimeConfig, optim: AdamWConfig,
                     device: Device, dp: DataParallel | None, dtype: torch.dtype, deferred: bool,
                     timeline, abort) -> HostState:
    """Masters and moments, the disk tier's files and, under data parallel, the shared mapping and
    the units' owners. `abort`: the pipeline's shared failure flag (threads.py), which the disk
    tier's waits poll."""
    split = loaded.split
    shared, owned, remote, owner_of = None, None, {}, None
    disk_units = plan.indices(TIERS.with_files)
    if dp is not None:
        # Host-updated units (host and disk) are shared and sharded over the host's ranks. Units
        # updated on the GPU are every rank's own: each rank applies the same all-reduced
        # gradient to its own device copy (GPU memory is per rank anyway), so they have no
        # owner, take no room in the shared mapping and are never followed.
        # The disk units are local rank 0's (distributed.plan_owners says why). Their masters
        # are shared like any other; their moments are not in RAM.
        # A sharded layer (shard_layers) is its owner's alone: master and moments on its GPU, no
        # room in the shared mapping; the others hold nothing of it (remote) and receive its
        # weights by the owner's broadcast.
        owners = dp.owners(plan)
        owned = frozenset(i for i, r in enumerate(owners) if r == dp.local_rank or plan.units[i].state == "gpu")
        remote = {i: owners[i] for i in plan.indices("shard") if i not in owned}
        numels, no_moments = shared_layout(plan)
        shared = dp.share_host_state(numels, no_moments=no_moments, fmt=plan.host_state)
        disk_units = [i for i in disk_units if i in owned]
        owner_of = owners          # (and, gathering, the only rank that uploads it)
    # dp_weights=gather: a host unit's owner alone uploads it; a thread of its own broadcasts it
    # to the host's other GPUs, in the order the compute thread asked for the units (the same
    # on every rank), on a stream of its own (slots.GpuSlots)
    gather = dp is not None and rt.transfer.dp_weights == "gather" and dp.cfg.local_world_size > 1
    if gather:
        dp.weights_group()         # a collective: every rank creates it here
    units = split.units
    disk = (DiskTier(rt.disk_dir, {i: units[i].numel for i in disk_units},
                     block_mb=rt.disk.disk_block_mb, buffers=plan.disk_buffers, io_threads=rt.disk.disk_io_threads,
                     pinned=device.is_cuda, names={i: units[i].name for i in disk_units}, timeline=timeline,
                     masters=frozenset(u.index for u in plan.units if TIERS.with_files.holds_master(u)),
                     state=plan.host_state)
            if disk_units else None)
    if disk is not None:
        disk.abort = abort
    try:
        store = HostStore(split, loaded.source, optim,
                          held_dtype=dtype if deferred else None,
                          # the clipped schedule's held buffers per host unit (the plan's:
                          # one, or two used on alternate steps, DeferredSweep._held_index)
                          held_buffers=[max(1, u.held) for u in plan.units],
                          kernel=rt.host.host_adamw,
                          device_units=frozenset(plan.indices("gpu"))
                          | frozenset(i for i in plan.indices("shard") if i not in remote),
                          device=device.device, remote=remote,
                          # local rank 0 writes the checkpoints: it reads the others' sharded layers
                          pull=dp.pull if remote and dp.cfg.local_rank == 0 else None,
                          disk=disk, shared=shared, owned=owned, compute_dtype=dtype,
                          upload_copies=frozenset(u.index for u in plan.units if u.upload_copy),
                          host_state=plan.host_state)
        if dp is not None:
            dp.host_barrier()      # every owner has filled its units before anyone uploads
        # what the other ranks do while rank 0 saves (save_service.py): where the host shards
        # layers over its GPUs, the owners serve rank 0's reads of them; None where nothing is
        save_service = SaveService.for_engine(dp, store.units, owner_of, plan.indices("shard"))
    except BaseException:
        if disk is not None:
            disk.close()
        raise
    return HostState(store, disk, shared, owner_of, gather, save_service)
