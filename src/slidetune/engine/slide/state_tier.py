"""Where a host unit's AdamW state lives: one small interface, a tier, and its implementations.

A tier holds one unit's two moments and, where `holds_master`, its master too (RAM then keeps
only the compute-dtype weights the uploads copy), in the unit's optimizer state format (FP32 by
default; --moments / --master: FlatAdamW.state_format). HostUnit calls its tier for every
update (read ahead, write behind), checkpoint read and load; the engine asks each unit's tier
to read ahead before a step (prefetch) and to finish its writes before a checkpoint (drain),
and the store counts RAM and disk by the tier's bytes per parameter.

  RamMoments      the moments in the unit's FlatAdamW tensors (FP32: 12 B/param of RAM with the master)
  DiskMoments     the moments, and optionally the master, in the disk tier's files
                  (disk_tier.DiskTier), taken block by block as an update reaches them
  OtherRankDisk   data parallel: a disk unit of another local rank; only its owner's tier holds
                  the moments, this rank knows their shape
  OtherRankGpu    data parallel: a sharded layer another local rank keeps on its GPU (master and
                  moments); this rank holds nothing of it

moment_tier() picks one for a unit; nothing else branches on where the state lives.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from ...models.units import ParamSlot, UnitSpec
from ..adamw import FP32_ADAMW, FlatAdamW
from ..distributed import SharedUnit
from ..tiers import TIERS
from .disk_tier import Block, DiskTier, StreamedTensor

State = dict[str, "torch.Tensor | StreamedTensor"]


class MomentTier(ABC):
    """One unit's AdamW moments (and, where `holds_master`, its FP32 master) in one place."""

    name: str                  # "ram", the disk tier's name, ...: where the state lives (reports, tests)
    holds_master: bool = False      # the FP32 master lives here too; RAM keeps `weights` in the compute dtype
    moments_in_ram: bool = True     # the moments are FlatAdamW's own tensors (allocated there)
    # an update may pass over a range twice (the clipped sweep's "params"/"weights" then
    # "moments"/"rest"); False: each range is read and written once, part "all"
    split_update: bool = True
    ram_bytes_per_param: int | float       # the master and moments this tier keeps in host RAM
    disk_bytes_per_param: int | float = 0  # ... and on disk (the state format's, padding aside)

    def __init__(self, spec: UnitSpec):
        self.spec = spec
        self.opt: FlatAdamW | None = None
        self.weights: torch.Tensor | None = None

    def attach(self, opt: FlatAdamW, weights: torch.Tensor | None) -> None:
        """The unit's optimizer (its kernel and step count) and its compute-dtype weights [numel]
        (None without them): a clip_sweep=weights copy, or what a tier holding the master rewrites
        as each range's update lands."""
        self.opt, self.weights = opt, weights

    def take_master(self, master: torch.Tensor) -> None:
        """A tier that holds the master: the unit's initial FP32 master [numel], with zero moments."""
        raise TypeError(f"{self.spec.name}: the {self.name} tier holds no master")

    @abstractmethod
    def update(self, grad: torch.Tensor, lr: float, start: int, grad_scale: float, part: str) -> None:
        """AdamW on elements [start, start + len(grad)) (FlatAdamW.update's part), reading the
        state ahead and writing it behind where it is not in RAM."""

    @abstractmethod
    def state_tensors(self) -> State:
        """FlatAdamW.state_names(): exp_avg, exp_avg_sq ([numel] in the format's dtype, tensors or
        StreamedTensors read when consumed), 8-bit moments' scales, and step."""

    @abstractmethod
    def load_state(self, state: dict[str, torch.Tensor],
                   master: Callable[[int, int], torch.Tensor] | None = None) -> None:
        """A checkpoint's moments and step into the tier; a tier that holds the master takes it too,
        as master(lo, hi) -> [hi - lo] FP32 (and rewrites `weights` from it)."""

    def master_params(self, params: list[ParamSlot]) -> dict[str, StreamedTensor]:
        """A tier that holds the master: each parameter (HF name) as a StreamedTensor."""
        raise TypeError(f"{self.spec.name}: the {self.name} tier holds no master")

    def prefetch(self) -> None:
        """Start reading the state the unit's next update needs (once per foreseen update)."""

    def drain(self) -> None:
        """Wait until every write behind of this unit's state has landed (a checkpoint reads it next)."""


class RamMoments(MomentTier):
    """The moments in the unit's FlatAdamW tensors, beside the master: nothing to read or write."""

    name = "ram"
    ram_bytes_per_param = FP32_ADAMW.bytes_per_param

    def attach(self, opt: FlatAdamW, weights: torch.Tensor | None) -> None:
        super().attach(opt, weights)
        # the unit's own state format (--moments): 12 B/param in FP32, less compact
        self.ram_bytes_per_param = opt.state_format.bytes_per_param

    def update(self, grad, lr, start, grad_scale, part) -> None:
        weights = self.weights[start:start + grad.numel()] if part == "weights" else None
        self.opt.update(grad, lr, start, grad_scale=grad_scale, part=part, weights=weights)

    def state_tensors(self) -> State:
        return self.opt.state_tensors()

    def load_state(self, state, master=None) -> None:
        self.opt.load_state_tensors(state)


class OtherRankDisk(MomentTier):
    """Data parallel: a disk unit of another local rank (local rank 0 keeps the disk tier). Its
    master is in the shared mapping; its moments' shape is known here (a resume checks it on every
    rank), their values only in the owner's tier. This rank never updates or loads it."""

    name = "other rank's disk"
    moments_in_ram = False
    split_update = False
    ram_bytes_per_param = FP32_ADAMW.master_bytes

    def attach(self, opt: FlatAdamW, weights: torch.Tensor | None) -> None:
        super().attach(opt, weights)
        self.ram_bytes_per_param = opt.state_format.master_bytes

    def update(self, grad, lr, start, grad_scale, part) -> None:
        raise RuntimeError(f"{self.spec.name} is updated by local rank 0, whose disk tier holds its moments")

    def state_tensors(self) -> State:
        def elsewhere():
            raise RuntimeError(f"the AdamW moments of {self.spec.name} are in local rank 0's disk tier; "
                               f"only that rank reads them")
        return {f.name: StreamedTensor((f.count(self.spec.numel),), f.dtype, elsewhere)
                for f in self.opt.state_format.fields(master=False)} | {"step": self.opt.step_count}

    def load_state(self, state, master=None) -> None:
        raise RuntimeError(f"{self.spec.name} is loaded by local rank 0, whose disk tier holds its moments")


# A sharded layer's tensors as OtherRankGpu pulls them from their owner (DataParallel.pull's field).
SHARD_FIELDS = ("master", "exp_avg", "exp_avg_sq", "step")
PULL_ELEMS = 16 * 2**20          # 64 MiB of FP32 a request


class OtherRankGpu(MomentTier):
    """Data parallel: a sharded layer (placement "shard") another local rank keeps on its GPU,
    master and moments both. This rank holds none of it (its weights come by the owner's broadcast)
    and never updates or loads it; it knows the shapes (a resume checks them on every rank). Its
    master and state read as StreamedTensors: with `pull` (local rank 0, which writes the
    checkpoints) piece by piece from the owner (DataParallel.pull); without, an error naming it."""

    name = "other rank's GPU"
    holds_master = True
    moments_in_ram = False
    split_update = False
    ram_bytes_per_param = 0

    def __init__(self, spec: UnitSpec, owner: int, pull: Callable[..., torch.Tensor] | None = None):
        super().__init__(spec)
        self.owner, self.pull = owner, pull

    def _streamed(self, shape: tuple[int, ...], field: str, lo: int, hi: int) -> StreamedTensor:
        """Elements [lo, hi) of one of the owner's tensors (SHARD_FIELDS), read when consumed."""
        def source():
            if self.pull is None:
                raise RuntimeError(f"the {field} of {self.spec.name} is on local rank {self.owner}'s GPU; only that "
                                   f"rank reads it")
            for a in range(lo, hi, PULL_ELEMS):
                yield self.pull(self.owner, self.spec.index, SHARD_FIELDS.index(field), a, min(hi, a + PULL_ELEMS))
        return StreamedTensor(shape, torch.float32, source)

    def update(self, grad, lr, start, grad_scale, part) -> None:
        raise RuntimeError(f"{self.spec.name} is updated by local rank {self.owner}, whose GPU holds its state")

    def state_tensors(self) -> State:
        n = self.spec.numel
        return {"exp_avg": self._streamed((n,), "exp_avg", 0, n), "exp_avg_sq": self._streamed((n,), "exp_avg_sq", 0, n),
                "step": self._streamed((), "step", 0, 1)}

    def load_state(self, state, master=None) -> None:
        raise RuntimeError(f"{self.spec.name} is loaded by local rank {self.owner}, whose GPU holds its state")

    def master_params(self, params: list[ParamSlot]) -> dict[str, StreamedTensor]:
        return {p.full_name: self._streamed(tuple(p.shape), "master", p.offset, p.offset + p.numel) for p in params}


class DiskMoments(MomentTier):
    """The moments (and, for a unit in disk.masters, the master) in the disk tier's files. An
    update holds each block from the first range that touches it until its last element is
    written, then writes it behind; prefetch queues the unit's blocks for reading ahead."""

    name = TIERS.with_files.name
    moments_in_ram = False
    split_update = False           # the moments are read and written once per update

    def __init__(self, spec: UnitSpec, disk: DiskTier):
        super().__init__(spec)
        self.disk = disk
        self.index = spec.index
        self.holds_master = spec.index in disk.masters
        fmt = disk.state                             # the tier's format is its units' (HostStore)
        self.ram_bytes_per_param = 0 if self.holds_master else fmt.master_bytes
        self.disk_bytes_per_param = fmt.bytes_per_param if self.holds_master else fmt.moment_bytes
        self._open_block: int | None = None          # the block this update holds
        self._open_view: Block | None = None         # ... and its fields in the tier's buffer

    def take_master(self, master: torch.Tensor) -> None:
        """The initial master [numel] FP32 (rounded to a BF16 master's dtype as it is written), and
        zero moments and scales, as FlatAdamW's own."""
        zeros = {name: 0.0 for name in self.disk.fields(self.index) if name != "master"}
        self.disk.write_unit(self.index, master=master, **zeros)

    def update(self, grad, lr, start, grad_scale, part) -> None:
        """A master here comes in the same block as the moments, and the range's new weights are
        written into `weights` (the compute dtype) before the caller advances the progress the
        uploads trail."""
        if part != "all":
            raise ValueError("a disk unit's update reads and writes its moments once: part must be 'all'")
        end, index, disk = start + grad.numel(), self.index, self.disk
        lo = start
        while lo < end:
            b = lo // disk.block
            block_lo, block_hi = disk.block_range(index, b)
            hi = min(end, block_hi)
            if self._open_block != b:
                if self._open_block is not None:       # an update that skipped a block's tail
                    disk.release(index, self._open_block)
                self._open_view = disk.acquire(index, b, disk.abort)
                self._open_block = b
            blk = self._open_view                     # [block_hi - block_lo] each field
            a, z = lo - block_lo, hi - block_lo
            params = blk.master[a:z] if self.holds_master else None
            scales = None
            if blk.scales is not None:                # 8-bit: the range starts on a 256-element block
                per = disk.state.moment_block
                scales = tuple(s[a // per:-(-z // per)] for s in blk.scales)
            self.opt.update(grad[lo - start:hi - start], lr, lo, grad_scale=grad_scale,
                            moments=(blk.exp_avg[a:z], blk.exp_avg_sq[a:z]), params=params, scales=scales)
            if params is not None:
                self.weights[lo:hi].copy_(params)     # FP32 -> compute dtype: the next upload's source
            if hi == block_hi:
                disk.release(index, b)
                self._open_block = self._open_view = None
            lo = hi

    def _streamed(self, shape: tuple[int, ...], field: str, lo: int, hi: int) -> StreamedTensor:
        """Elements [lo, hi) of a field of this unit (in its own elements), read when consumed."""
        index, disk = self.index, self.disk
        dtype = disk.layout(index).field(field).dtype
        return StreamedTensor(shape, dtype, lambda: disk.read_range(index, field, lo, hi))

    def state_tensors(self) -> State:
        """The moments (and 8-bit scales) in the tier's format, streamed from its files; the step."""
        n = self.spec.numel
        return {f.name: self._streamed((f.count(n),), f.name, 0, f.count(n))
                for f in self.disk.state.fields(master=False)} | {"step": self.opt.step_count}

    def load_state(self, state, master=None) -> None:
        """Block by block into the files; a master's compute-dtype weights are rewritten with it.
        The state's tensors are the tier's format's (checkpoint/reader.py's load_checkpoint checked
        them)."""
        fields = {}
        if master is not None:
            def master_and_weights(lo: int, hi: int) -> torch.Tensor:
                flat = master(lo, hi)                     # [hi - lo] fp32
                self.weights[lo:hi].copy_(flat)           # the compute dtype: what the uploads copy
                return flat                               # rounded to the master's dtype as written
            fields["master"] = master_and_weights
        moments = {f.name: state[f.name] for f in self.disk.state.fields(master=False)}
        self.disk.write_unit(self.index, **fields, **moments)
        self.opt.step_count.copy_(state["step"])

    def master_params(self, params: list[ParamSlot]) -> dict[str, StreamedTensor]:
        if not self.holds_master:
            return super().master_params(params)
        return {p.full_name: self._streamed(p.shape, "master", p.offset, p.offset + p.numel) for p in params}

    def prefetch(self) -> None:
        self.disk.prefetch(self.index)

    def drain(self) -> None:
        self.disk.drain()         # every block of the tier: its buffers are shared by its units


def moment_tier(spec: UnitSpec, disk: DiskTier | None, shared: SharedUnit | None) -> MomentTier:
    """The tier of a unit: the disk tier's where one is given for it (its placement's tier with files); another
    rank's where the host's shared mapping has no room for its moments; else RAM."""
    if disk is not None:
        return DiskMoments(spec, disk)
    if shared is not None and shared.exp_avg.numel() != spec.numel:
        return OtherRankDisk(spec)
    return RamMoments(spec)
