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
takes there; io_bytes_per_step: what crosses to it a step, plan.disk_io_bytes) and its line in
`slidetune plan`. A new tier is a class here, registered with `@TIERS.register`; the plan's order
of tiers is the registration order.
"""
from __future__ import annotations

from typing import Iterator

from .adamw import FP32_ADAMW, OptimizerState

# The methods take a placement plan (`plan`: engine/placement.py's PlacementPlan) and its units
# (`u`: UnitPlace) unannotated: placement.py imports this module, and tests/test_imports.py counts
# an import under TYPE_CHECKING as a cycle.


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

    def summary_label(self, plan) -> str:
        masters, params = plan.master_params(self), plan.params(self)
        if not masters:
            return "disk tier (moments; master in host RAM)"
        if masters == params:
            return "disk tier (master + moments; compute-dtype weights in host RAM)"
        return (f"disk tier (moments; the masters of {plan.ranges(self.holds_master)} too, "
                f"the others' in host RAM)")
