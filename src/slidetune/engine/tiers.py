"""The places a unit's optimizer state can live, each a class registered once here (issue 49).

A unit's `state` in the placement plan (engine/placement.py) names one of these tiers, and so does
its `master` (where its FP32 master lives). The plan, the fit estimate (engine/fit/), the limits,
the floor (bench/roofline.py), `slidetune plan` (cli.py) and the run's setup (train_setup.py,
engine/slide/host_state.py) ask the tier what they need instead of branching on its name:

  gpu    master and moments on the GPU, updated there (device layers, vocab_update=device)
  shard  data parallel: master and moments on one GPU of the host, its owner's, which broadcasts
         the weights to the others
  host   master and moments in host RAM, updated by the host's AdamW
  disk   the moments (and, with --tuning.disk_master, the master) in files of the disk tier in a
         directory (--disk-dir; engine/slide/disk_tier.py), read ahead of the host's update and
         written behind it; the master otherwise stays in host RAM

What a tier answers: its name (the plan's records, JSON and reports; for a tier with a directory
also its probe's key in the floor probes, its lane in the host timeline and what a limit
`binds`), whether the host's AdamW updates its units, whether it keeps files in a directory, where
its units' masters live by default and whether other tiers' masters may live in it, its bytes
(state_bytes: what `slidetune plan` and the fit count; stored_bytes_per_param: what a parameter
takes there; io_bytes_per_step: what crosses to it a step, plan.disk_io_bytes), its line in
`slidetune plan`, and its own formulas, where a tier without files answers 0, nothing or None:
io_seconds (its I/O a step at its probe's rates: the floor's disk_s), host_ram_items and
pinned_host_bytes (its items in the fit estimate's host RAM, and those page-locked), swept_state
(the format the floor counts the host AdamW's pass over its units in), free_bytes and
check_resources (its directory: there, writable, with room for its files; check_directory, also
the runtime's and the disk probe's check). A new tier is a class here, registered with
`@TIERS.register`; the plan's order of tiers is the registration order.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

from ..processes import dead_runs
from .adamw import FP32_ADAMW, OptimizerState

# The methods take a placement plan (`plan`: engine/placement.py's PlacementPlan) and its units
# (`u`: UnitPlace) unannotated: placement.py imports this module, and tests/test_imports.py counts
# an import under TYPE_CHECKING as a cycle.

SCRATCH_PREFIX = "slidetune-disk-tier-"     # a run's scratch directory in a tier's directory: <prefix><pid>-<ns>


class DiskTierError(RuntimeError):
    """The disk tier cannot be set up or has failed (a missing, read-only or full directory, I/O)."""


class Tier:
    """One place a unit's state can live. Subclasses set the class attributes and, where their
    bytes are not the FP32 state's of the tier's own units, override the byte methods."""

    name: str = ""
    updated_on_host: bool = False    # the host's AdamW updates its units: their gradients and weights cross PCIe
    keeps_files: bool = False        # its state lives in files of a directory (--disk-dir), probed before a run
    streams_state: bool = False      # its units' state is read ahead of each update and written behind it
    masters_of_others: bool = True   # units of another tier may keep their FP32 master here
    listed_when_empty: bool = False  # `slidetune plan` lists it with no units in it
    counted_when_empty: bool = True  # state_bytes() has its key with no units in it

    def default_master(self) -> str:
        """Where a unit of this tier keeps its FP32 master unless told otherwise: with its state."""
        return self.name

    def holds(self, u) -> bool:
        """Whether unit `u`'s state lives here."""
        return u.state == self.name

    def holds_master(self, u) -> bool:
        """Whether unit `u`'s FP32 master lives here."""
        return u.master == self.name

    def stored_bytes_per_param(self, u, host_state: OptimizerState) -> int | float:
        """Bytes a parameter of `u` (one of this tier's units) takes here: master and moments (FP32: 12)."""
        return FP32_ADAMW.bytes_per_param

    def state_bytes(self, plan) -> int | float:
        """Bytes of optimizer state this tier holds for `plan`: its units' master and moments."""
        return FP32_ADAMW.bytes_per_param * plan.params(self)

    def io_bytes_per_step(self, plan) -> int:
        """Bytes through this tier a step beyond the uploads and gradients (a streamed tier's reads and writes)."""
        return 0

    def swept_state(self, plan) -> OptimizerState:
        """The format the floor counts the host's AdamW pass over its units in (bench/roofline.py's
        adamw_dram_bytes; asked of the host-updated tiers): the host's (--master, --moments)."""
        return plan.host_state

    def io_seconds(self, plan, probe: dict | None) -> float:
        """Seconds a step its I/O takes beyond the uploads and gradients (the floor's term, bench/roofline.py),
        at `probe`'s rates (probe_of's record of its directory; None: not probed): 0 for a tier without files."""
        return 0.0

    def host_ram_items(self, plan, weight_bytes: int, block_buffer_bytes: int) -> dict[str, int]:
        """The fit estimate's host RAM items for this tier's units (engine/fit/estimate.py), by label:
        none for a tier whose state is on the GPU. weight_bytes: a compute-dtype weight's bytes (BF16:
        2); block_buffer_bytes: a tier with files' page-locked block buffers (engine/slide/disk_tier.py's
        buffer_bytes: the runtime's block size and count, which the tier does not know)."""
        return {}

    def pinned_host_bytes(self, plan, weight_bytes: int, block_buffer_bytes: int) -> int:
        """Bytes of its host RAM items (host_ram_items, the same arguments) that are page-locked: none."""
        return 0

    def free_bytes(self, rt) -> int | None:
        """Free bytes where its files go (the runtime `rt`'s directory); None: no directory there."""
        return None

    def check_resources(self, rt, plan, need_bytes: int, free_bytes: int | None = None) -> None:
        """Before anything is allocated: the resources `plan`'s units here need beyond memory are there
        (a tier with files: its directory exists, is writable and has `need_bytes` free: its files'
        bytes, engine/slide/disk_tier.py's tier_bytes; `free_bytes`: a disk described); nothing to check
        for a tier without files."""

    def summary_label(self, plan) -> str:
        """What `slidetune plan` says of this tier, before its units."""
        raise NotImplementedError

    def probe_of(self, floors: dict) -> dict | None:
        """A tier with files: its directory's probe (read, write and mixed GiB/s; floor_probes.probe_disk)
        in a floor probe's record (bench.scenarios.roofline.measure_floor), which keeps it under the
        tier's name; None where the directory was not probed."""
        return floors.get(self.name)


class TierRegistry:
    """The tiers by name, in the order they were registered (the plan's order of tiers)."""

    def __init__(self):
        self._tiers: dict[str, Tier] = {}

    def register(self, cls: type[Tier]) -> type[Tier]:
        """A class decorator: its one instance joins the registry under its name."""
        if not cls.name or cls.name in self._tiers:
            raise ValueError(f"tier {cls.__name__}: a name of its own is needed (have {list(self._tiers)})")
        self._tiers[cls.name] = cls()
        return cls

    def __getitem__(self, name: str) -> Tier:
        try:
            return self._tiers[name]
        except KeyError:
            raise ValueError(f"{name!r} is not a tier (one of {', '.join(self._tiers)})") from None

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._tiers.values())

    def names(self) -> tuple[str, ...]:
        return tuple(self._tiers)

    def host_updated(self) -> tuple[Tier, ...]:
        """The tiers whose units the host's AdamW updates."""
        return tuple(t for t in self if t.updated_on_host)

    @property
    def with_files(self) -> Tier:
        """The tier that keeps its units' state in files of a directory (--disk-dir): the one place
        the run needs a directory for, whose probe, I/O threads, block buffers and scratch space the
        callers size (one such tier today)."""
        (tier,) = (t for t in self if t.keeps_files)
        return tier


TIERS = TierRegistry()


@TIERS.register
class GpuTier(Tier):
    name = "gpu"

    def summary_label(self, plan) -> str:
        return "GPU (master + moments, updated on the GPU)"


@TIERS.register
class ShardTier(Tier):
    name = "shard"
    counted_when_empty = False       # every GPU of the host together, where there are sharded layers

    def summary_label(self, plan) -> str:
        return ("the host's GPUs, one each (master + moments on its owner's GPU, "
                "broadcast to the others)")


@TIERS.register
class HostTier(Tier):
    name = "host"
    updated_on_host = True
    listed_when_empty = True

    def stored_bytes_per_param(self, u, host_state: OptimizerState) -> int | float:
        return host_state.bytes_per_param

    def state_bytes(self, plan) -> int | float:
        """Its units' master and moments in the host's format, and the masters other tiers' units
        keep in RAM (a disk unit's without --tuning.disk_master: 4 B/param in FP32)."""
        guests = sum(u.numel for u in plan.units if self.holds_master(u) and not self.holds(u))
        host = plan.host_state
        return host.bytes_per_param * plan.params(self) + host.master_bytes * guests

    def host_ram_items(self, plan, weight_bytes: int, block_buffer_bytes: int) -> dict[str, int]:
        """Its units' master and moments (12 B/param, or less with --moments / --master: plan.host_state);
        the masters other tiers keep here are their tiers' items."""
        state = plan.host_state
        label = f"{state.bytes_per_param:g} B/param" + ("" if state is FP32_ADAMW else f", {state.name}")
        return {f"master + Adam moments ({label})": int(state.bytes_per_param * plan.params(self))}

    def summary_label(self, plan) -> str:
        return "host RAM (master + moments, host AdamW)"


@TIERS.register
class DiskFilesTier(Tier):
    """The disk tier's placement (its files, I/O and buffers: engine/slide/disk_tier.py's DiskTier)."""
    name = "disk"
    updated_on_host = True
    keeps_files = True
    streams_state = True
    masters_of_others = False        # only a disk unit's master can live on disk

    def default_master(self) -> str:
        return HostTier.name       # RAM (the uploads cast it) unless --tuning.disk_master

    def stored_bytes_per_param(self, u, host_state: OptimizerState) -> int | float:
        """In host_state's format (padding aside): the moments (FP32: 8); the master too (FP32: 12)."""
        return host_state.bytes_per_param if self.holds_master(u) else host_state.moment_bytes

    def state_bytes(self, plan) -> int:
        return int(sum(self.stored_bytes_per_param(u, plan.host_state) * u.numel for u in plan.units if self.holds(u)))

    def io_bytes_per_step(self, plan) -> int:
        """Each unit's block read ahead of its update and written behind it (FP32: 16 B/param, 24
        with its master there)."""
        return int(sum(2 * self.stored_bytes_per_param(u, plan.host_state) * u.numel
                       for u in plan.units if self.holds(u)))

    def io_seconds(self, plan, probe: dict | None) -> float:
        """Its bytes a step (io_bytes_per_step) at the probe's mixed rate (probe_disk: reads and writes at
        once, as the tier reads ahead while it writes behind); a probe without it, one after the other."""
        io, gib = self.io_bytes_per_step(plan), 2**30
        if not probe or not io:
            return 0.0
        if probe.get("mixed_gib_s"):
            return io / (probe["mixed_gib_s"] * gib)
        return io / 2 / (probe["read_gib_s"] * gib) + io / 2 / (probe["write_gib_s"] * gib)

    def host_ram_items(self, plan, weight_bytes: int, block_buffer_bytes: int) -> dict[str, int]:
        """What its units keep in RAM, their moments (and a disk-master unit's master) being in its files:
        their masters (FP32: 4 B/param), a disk-master unit's compute-dtype weights instead (the uploads
        read them), and the block buffers the files pass through."""
        params, masters = plan.params(self), plan.master_params(self)
        if not params:
            return {}
        items, master = {}, plan.host_state.master_bytes
        if params > masters:
            items[f"disk units' masters ({master} B/param; moments on disk)"] = master * (params - masters)
        if masters:
            items[f"disk-master units' weights ({weight_bytes} B/param; master + moments on disk)"] = \
                weight_bytes * masters
        items["disk tier block buffers"] = block_buffer_bytes
        return items

    def pinned_host_bytes(self, plan, weight_bytes: int, block_buffer_bytes: int) -> int:
        """Its block buffers, and a disk-master unit's weights (registered for one async H2D each upload)."""
        if not plan.params(self):
            return 0
        return block_buffer_bytes + weight_bytes * plan.master_params(self)

    def free_bytes(self, rt) -> int | None:
        return shutil.disk_usage(rt.disk_dir).free if rt.disk_dir and os.path.isdir(rt.disk_dir) else None

    def check_resources(self, rt, plan, need_bytes: int, free_bytes: int | None = None) -> None:
        """Its directory, --disk-dir (check_directory; DiskTierError), where it is to hold files."""
        if need_bytes:
            check_directory(rt.disk_dir, need_bytes, free_bytes, state=plan.host_state)

    def summary_label(self, plan) -> str:
        masters, params = plan.master_params(self), plan.params(self)
        if not masters:
            return "disk tier (moments; master in host RAM)"
        if masters == params:
            return "disk tier (master + moments; compute-dtype weights in host RAM)"
        return (f"disk tier (moments; the masters of {plan.ranges(self.holds_master)} too, "
                f"the others' in host RAM)")


# The disk tier's directory (--disk-dir): checked before a run, a plan or a probe allocates anything.

def check_directory(path: str | os.PathLike, need_bytes: int, free_bytes: int | None = None,
                    state: OptimizerState = FP32_ADAMW) -> Path:
    """The disk tier's directory, checked before anything is allocated: it exists, is writable and
    has `need_bytes` free (`free_bytes`: a disk described, as `slidetune plan --disk-free-gib` does;
    default: what the directory's filesystem has). A described disk is another machine's (a plan for
    the host a run will have): only its size is checked, the directory need not exist here.
    DiskTierError names the problem and the fix."""
    p = Path(path).expanduser()
    if free_bytes is not None:
        _check_size(p, need_bytes, free_bytes, state)
        return p
    if not p.exists():
        raise DiskTierError(f"--disk-dir {p} does not exist; create it (on a local disk, ideally NVMe) "
                            f"or give another directory")
    if not p.is_dir():
        raise DiskTierError(f"--disk-dir {p} is a file, not a directory; give a directory on a local disk")
    if not os.access(p, os.W_OK | os.X_OK):
        raise DiskTierError(f"--disk-dir {p} is not writable (read-only filesystem or permissions); "
                            f"give a directory you can write to")
    remove_stale(p)
    _check_size(p, need_bytes, shutil.disk_usage(p).free, state)
    return p


def _check_size(p: Path, need_bytes: int, free: int, state: OptimizerState) -> None:
    if need_bytes > free:
        gib = 2**30
        raise DiskTierError(f"--disk-dir {p} has {free / gib:.1f} GiB free but the disk tier needs "
                            f"{need_bytes / gib:.1f} GiB ({state.moment_bytes:g} bytes per parameter of the "
                            f"units placed there, {state.bytes_per_param:g} with their masters); "
                            f"free space there, give a larger disk, or put fewer units on disk (--tuning.disk_units)")


def remove_stale(directory: Path) -> list[Path]:
    """Remove the scratch directories of runs that are no longer alive (killed mid-run)."""
    removed = dead_runs(directory, SCRATCH_PREFIX)
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed
