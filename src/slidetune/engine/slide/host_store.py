"""The host store: per unit one flat FP32 master tensor and its AdamW state.

About 12 bytes per parameter (master 4 + two moments 8; a disk unit's moments, and with
--tuning.disk_master its master, live in the disk tier instead, and RAM keeps only that unit's
weights in the compute dtype, which its uploads copy as they are); the deferred schedule
adds the step's gradient in the compute dtype, held until the global norm is known (2 more
for BF16; engine.py says why not FP32). The unit's parameters are views of the
flat master, so saving, loading and updating never copy the model. Each unit
carries a version (the number of optimizer updates applied) that the uploader
waits on: a layer is uploaded for step t only once its t-th update is done.
Where a unit's moments (and a master on disk) live is its tier (state_tier.py). An asynchronous
checkpoint holds each unit's next update until it has read the unit (`hold`, update_hold.py).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from ...models.load import WeightSource, fill_on_device
from ...models.units import ParamSlot, SplitModel, UnitSpec
from ..adamw import FP32_ADAMW, AdamWConfig, FlatAdamW, OptimizerState
from ..distributed import SharedHostState, SharedUnit
from .disk_tier import DiskTier, StreamedTensor
from .state_tier import OtherRankGpu, moment_tier
from .update_hold import UpdateHold

# Units materialized at once (threads); each unit kept on the device holds a host buffer of
# 4 B/param while it is built (engine.fit counts them).
BUILD_WORKERS = max(1, min(8, os.cpu_count() or 1))


class HostUnit:
    def __init__(self, spec: UnitSpec, source: WeightSource, optim: AdamWConfig,
                 held_dtype: torch.dtype | None = None, kernel: str = "dynamic",
                 device: torch.device | None = None, disk: DiskTier | None = None,
                 shared: SharedUnit | None = None, owned: bool = True, compute_dtype: torch.dtype | None = None,
                 held_buffers: int = 1, upload_copy: bool = False, remote_owner: int | None = None,
                 pull=None, host_state: OptimizerState = FP32_ADAMW):
        """held_dtype: the deferred schedule's held gradient [numel] in this dtype (host units only;
        a unit on the device holds its gradient there, in the engine), `held_buffers` of them.
        device: keep this unit's master and AdamW state there from the start (vocab_update=device,
        device_layers): the weights pass through a transient host buffer (4 B/param) on the way,
        and the moments are never allocated in host RAM.
        disk: the disk tier holding this unit's moments (its placement's tier with files); the master stays here,
        unless the tier holds it too (disk.masters): then this unit keeps `weights` [numel] in
        `compute_dtype` (what its uploads copy, rewritten as each block's update lands) and no master.
        `tier` (state_tier.moment_tier) is where the moments live: RAM, the disk tier, or under data
        parallel another rank's disk tier; every update, checkpoint read and load goes through it.
        shared: data parallel: the unit's views of the host state its ranks share (master, moments,
        step, versions); `owned`: this rank fills and updates it (and holds its gradient), else it
        follows the owner's weights version (follow()).
        upload_copy: keep `weights` [numel] in `compute_dtype` beside the master (clip_sweep=weights):
        the clipped sweep's weights pass writes them (part "weights") and the uploads copy them; the
        master and moments follow in the second pass (part "rest").
        remote_owner: data parallel, a sharded layer another local rank (this one) keeps on its GPU:
        this rank holds nothing of it (no master, no moments; tier OtherRankGpu), only its versions;
        `pull` (DataParallel.pull, on the rank that writes checkpoints) reads its state from the owner.
        host_state: the state format of a unit the host updates, wherever its master and moments
        live (this process's RAM, the host's shared mapping, the disk tier: its format is this
        one, DiskTier.state); units updated on a GPU keep FP32_ADAMW (--moments, --master; the
        placement plan's host_state)."""
        self.spec = spec
        self.shared = None if remote_owner is not None else shared
        self.owned = owned
        self.on_device = device is not None       # True: the compute stream updates it, on the device
        self.remote = remote_owner is not None
        self._init_versions()
        if self.remote:
            self.tier = OtherRankGpu(spec, remote_owner, pull)
            self.master = self.weights = self.opt = None
            self.held = []
            return
        self.tier = moment_tier(spec, disk, shared)
        fmt = FP32_ADAMW if self.on_device or upload_copy else host_state     # this unit's state format
        master = self._initial_master(source, device, shared, owned)
        self.weights: torch.Tensor | None = None  # [numel] compute dtype: a disk-master unit's upload source
        if self.tier.holds_master:
            if shared is not None or compute_dtype is None:
                raise ValueError(f"{spec.name}: a master on disk needs the compute dtype and no shared host state")
            # the master goes to its blocks (rounded there to a BF16 master); RAM keeps the
            # compute-dtype weights of that master (in FP32 the transient buffer itself becomes them)
            self.tier.take_master(master)
            self.weights = master.to(fmt.master_dtype).to(compute_dtype)
            self.master = None
        else:
            self.master = master.to(device) if self.on_device else master  # the host buffer goes with `master`
            self.master = self.master.to(fmt.master_dtype)    # [numel] --master bf16: rounded once
            if upload_copy:
                if (self.on_device or not self.tier.moments_in_ram or shared is not None
                        or compute_dtype != torch.bfloat16):
                    raise ValueError(f"{spec.name}: an upload copy (clip_sweep=weights) is for a unit in this "
                                     f"process's host RAM with a BF16 compute dtype")
                self.weights = master.to(compute_dtype)
        del master
        self.opt = FlatAdamW(self.master, spec.n_decay, optim, kernel, moments_here=self.tier.moments_in_ram,
                             state=shared.optimizer_state() if shared is not None else None,
                             state_format=fmt, seed=spec.index)
        self.tier.attach(self.opt, self.weights)
        # [numel] the step's gradient as the GPU computed it (compute dtype), written by one D2H
        # copy and read by the clipped update sweep (deferred schedule)
        # (held_buffers of them, used on alternate steps: --tuning.held_buffers)
        self.held: list[torch.Tensor] = ([torch.empty(spec.numel, dtype=held_dtype) for _ in range(held_buffers)]
                                         if held_dtype is not None and not self.on_device and owned else [])

    def _initial_master(self, source: WeightSource, device: torch.device | None, shared: SharedUnit | None,
                        owned: bool) -> torch.Tensor:
        """The unit's initial master [numel]: FP32 on the device (a GPU-updated unit: RAM holds one
        parameter on the way), the shared mapping's (filled by its owner; a BF16 one rounded once
        from FP32), or a new FP32 host tensor, cast to the state format by the caller."""
        spec = self.spec
        if self.on_device and shared is None and self.tier.moments_in_ram:
            return fill_on_device(source, spec, device)
        if shared is None or shared.master.dtype == torch.float32:
            master = torch.empty(spec.numel, dtype=torch.float32) if shared is None else shared.master
            if owned:
                source.fill(spec, master)
            return master
        if owned:
            fp32 = torch.empty(spec.numel, dtype=torch.float32)
            source.fill(spec, fp32)
            shared.master.copy_(fp32)                  # --master bf16: rounded to nearest, as .to() does
        return shared.master

    @property
    def uploads_fp32_master(self) -> bool:
        """Whether the uploads read an FP32 master (cast on the way, into an FP32 landing buffer
        where the slots have one); False for compute-dtype weights (a disk-master unit's, an upload
        copy) and a BF16 master (--master bf16), which are copied as they are."""
        return self.weights is None and (self.master is None or self.master.dtype == torch.float32)

    def _init_versions(self) -> None:
        self.version = 0              # updates applied in full
        self.progress = 0             # elements of the update in progress already written
        self.started = 0              # updates begun (version, or version + 1 while one runs)
        self._on_start: dict[int, list] = {}   # update number -> callbacks to run when it begins
        self._cond = threading.Condition()
        # an asynchronous checkpoint still to read this unit's state: the next update waits for it
        self.hold: UpdateHold | None = None

    @property
    def upload_copy(self) -> bool:
        """Whether this unit keeps a compute-dtype copy beside its master (clip_sweep=weights; a
        disk-master unit's `weights` stand in for a master it does not hold)."""
        return self.weights is not None and self.master is not None

    @property
    def upload_source(self) -> torch.Tensor:
        """[numel] what the uploads copy: the FP32 master (cast on the way), or a disk-master unit's
        compute-dtype weights (copied as they are)."""
        return self.weights if self.weights is not None else self.master

    @property
    def on_host(self) -> bool:
        """Whether the host worker updates this unit (False: the compute stream does, on this rank's
        device or, for a remote sharded layer, on its owner's)."""
        return not self.on_device and not self.remote

    def update_range(self, grad: torch.Tensor, lr: float, start: int, grad_scale: float = 1.0,
                     part: str = "all") -> None:
        """AdamW on master[start:start+len(grad)] (FlatAdamW.update) through the unit's tier: a disk
        unit's moments (and master) come block by block, read ahead and written behind
        (state_tier.DiskMoments.update); a master held there leaves the range's new weights in
        `weights` before the caller advances the progress the uploads trail."""
        self.tier.update(grad, lr, start, grad_scale, part)

    def state_tensors(self) -> dict[str, torch.Tensor | StreamedTensor]:
        """AdamW's state by name; a disk unit's moments as StreamedTensors read from the disk tier."""
        return self.tier.state_tensors()

    def load(self, masters, state: dict[str, torch.Tensor]) -> None:
        """A checkpoint's weights (`masters`: HF name -> FP32 tensor, read on demand) and AdamW state
        into this unit. A master held by the tier goes there block by block, the weights' compute-
        dtype copy with it, holding one parameter of the checkpoint at a time."""
        if self.tier.holds_master:
            self.tier.load_state(state, master=_ParamRanges(self.spec.params, masters))
            return
        for name, view in self.params().items():
            view.copy_(masters[name])
        if self.upload_copy:                  # the loaded master's cast
            self.weights.copy_(self.master)
        self.tier.load_state(state)

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        self.tier.load_state(state)

    def params(self) -> dict[str, torch.Tensor | StreamedTensor]:
        """Full HF name -> FP32 view of the master; a master the tier holds as StreamedTensors read
        block by block from it (a checkpoint writes them without holding the unit)."""
        if self.tier.holds_master:
            return self.tier.master_params(self.spec.params)
        return {p.full_name: self.master[p.offset:p.offset + p.numel].view(p.shape) for p in self.spec.params}

    def begin_update(self) -> None:
        """An update (number version + 1) starts now: run what waited for it to begin. Where an
        asynchronous checkpoint has not yet read the unit's state (`hold`), it waits for that first."""
        hold = self.hold
        if hold is not None:
            hold.wait()
            self.hold = None
        with self._cond:
            self.started = self.version + 1
            callbacks = self._on_start.pop(self.started, [])
        for cb in callbacks:             # outside the lock: they submit work to other threads
            cb()

    def when_update_starts(self, v: int, callback) -> None:
        """Run `callback` once update number `v` has begun (now, if it already has).

        The uploads of the next step's weights are released this way, in the order the host
        runs the updates: a FIFO upload thread must not wait on a unit whose update is
        scheduled late while the units updated before it could already be copied."""
        with self._cond:
            if self.started < v:
                self._on_start.setdefault(v, []).append(callback)
                return
        callback()

    def advance(self, hi: int) -> None:
        """The update in progress has written master[:hi] (updates run front to back)."""
        with self._cond:
            self.progress = hi
            self._cond.notify_all()

    def bump_version(self) -> None:
        with self._cond:
            self.version += 1
            self.progress = 0
            if self.shared is not None and self.owned:
                self.shared.weights_version.fill_(self.version)    # the host's other ranks may upload it
            self._cond.notify_all()

    def publish_state(self) -> None:
        """Data parallel, owner: the update's moments are written too (a checkpoint may read them)."""
        if self.shared is not None and self.owned:
            self.shared.state_version.fill_(self.version)

    def follow(self, v: int, abort: threading.Event | None = None) -> None:
        """Data parallel, another rank's unit: wait until its owner has written update `v`'s weights
        into the shared master, then count the update here, which releases the uploads waiting on it
        (when_update_starts, wait_version) as an update of this rank's own would."""
        self.shared.wait(self.shared.weights_version, v, abort, f"unit {self.spec.name}")
        self.begin_update()
        self.bump_version()

    def wait_state(self, v: int, abort: threading.Event | None = None) -> None:
        """Data parallel: block until the owner has written update `v`'s moments."""
        if self.shared is not None:
            self.shared.wait(self.shared.state_version, v, abort, f"unit {self.spec.name}'s moments")

    def set_version(self, v: int) -> None:
        with self._cond:
            self.version = v
            self.started = v
            self.progress = 0
            # loading a checkpoint abandons uploads registered for updates that will not run
            self._on_start = {k: cbs for k, cbs in self._on_start.items() if k > v}
            if self.shared is not None and self.owned:
                self.shared.weights_version.fill_(v)
                self.shared.state_version.fill_(v)
            self._cond.notify_all()

    def wait_version(self, v: int, abort: threading.Event | None = None, poll_s: float = 0.5,
                     upto: int | None = None) -> None:
        """Block until the unit has had `v` updates (or `abort` is set by a failing thread).

        With `upto`, only master[:upto] must be at version v: the uploader copies a chunk
        as soon as the update's AdamW has passed it, so an upload trails its update by one
        chunk instead of waiting for the whole unit (the next step's embedding and first
        layer, updated last, are needed first).
        """
        def ready() -> bool:
            return self.version >= v or (upto is not None and self.version == v - 1 and self.progress >= upto)

        with self._cond:
            while not self._cond.wait_for(ready, timeout=poll_s):
                if abort is not None and abort.is_set():
                    raise RuntimeError(f"unit {self.spec.name}: update {v} will not arrive "
                                       f"(another pipeline thread failed)")


class HostStore:
    def __init__(self, split: SplitModel, source: WeightSource, optim: AdamWConfig,
                 held_dtype: torch.dtype | None = None, kernel: str = "dynamic",
                 device_units: frozenset[int] = frozenset(), device: torch.device | None = None,
                 disk: DiskTier | None = None, shared: SharedHostState | None = None,
                 owned: frozenset[int] | None = None, compute_dtype: torch.dtype | None = None,
                 held_buffers: int | list[int] = 1, upload_copies: frozenset[int] = frozenset(),
                 remote: dict[int, int] | None = None, pull=None, host_state: OptimizerState = FP32_ADAMW):
        """held_dtype: the deferred schedule's held gradients' dtype (None: eager, none held), and
        `held_buffers` per unit (used on alternate steps): one count for all, or one per unit index.
        kernel: the host AdamW kernel of every unit (FlatAdamW's; --tuning.host_adamw).
        device_units: indices of the units whose state lives on `device` (HostUnit's device).
        disk: the disk tier; the units it holds (disk.units) keep their moments there, and those of
        disk.masters their masters too, with their weights here in `compute_dtype`.
        shared: data parallel: the host state this host's ranks share, in place of this store's own
        allocations; `owned`: the indices of the units this rank fills and updates (None: all).
        upload_copies: the units that keep a compute-dtype copy of their weights for the uploads
        (the plan's upload_copy: clip_sweep=weights).
        remote: data parallel, sharded layers another local rank keeps on its GPU: unit -> that
        rank (HostUnit's remote_owner); this store holds nothing of them, and reads their state through
        `pull` (DataParallel.pull) where given. host_state: the RAM units' state format (HostUnit's)."""
        remote = remote or {}
        # Each unit is materialized straight from the source into its own master (no second
        # copy), several units at once: torch's normal_ with a generator runs on one core
        # (~150 M values/s), so a random 8B model took ~55 s unit by unit. Every unit seeds
        # its own generator, so the weights do not depend on the thread count.
        if device_units and device is None:
            raise ValueError("device_units needs the device they live on")
        with ThreadPoolExecutor(BUILD_WORKERS, thread_name_prefix="slidetune-init") as pool:
            self.units = list(pool.map(
                lambda i: HostUnit(split.units[i], source, optim, held_dtype, kernel,
                                   device=device if i in device_units else None,
                                   disk=disk if disk is not None and i in disk.units else None,
                                   # a unit updated on the device is each rank's own copy
                                   shared=shared.units[i] if shared is not None and i not in device_units else None,
                                   owned=owned is None or i in owned, compute_dtype=compute_dtype,
                                   held_buffers=held_buffers if isinstance(held_buffers, int) else held_buffers[i],
                                   upload_copy=i in upload_copies, remote_owner=remote.get(i), pull=pull,
                                   host_state=host_state),
                range(len(split.units))))
        self.shared = shared

    def num_params(self) -> int:
        return sum(u.spec.numel for u in self.units)

    def state_bytes(self) -> int:
        """Host bytes of masters, moments and held gradients (units kept on the device excluded);
        with a shared host state, only the held gradients this rank allocated (the shared mapping
        is counted once per host, by the engine of its local rank 0)."""
        held = sum(h.numel() * h.element_size() for u in self.units for h in u.held)
        if self.shared is not None:
            return held
        return held + sum(_unit_host_bytes(u) for u in self.units if u.on_host)

    def disk_bytes(self) -> int:
        """Bytes of state this rank's tiers keep on disk (8 B/param of a disk unit, 12 with its master)."""
        return int(sum(u.tier.disk_bytes_per_param * u.spec.numel for u in self.units))

    def prefetch(self, reverse: bool = False) -> None:
        """Every unit's tier starts reading ahead what its next update needs, in unit order (reverse:
        from the head down, the order the eager backward updates them)."""
        for unit in (reversed(self.units) if reverse else self.units):
            unit.tier.prefetch()

    def drain(self) -> None:
        """Every unit's written-behind state has landed (a checkpoint reads it next)."""
        for unit in self.units:
            unit.tier.drain()


def _unit_host_bytes(unit: HostUnit) -> int:
    """A host unit's RAM: what its tier keeps there (master + moments 12 B/param, a disk unit's
    master 4, none for a master on disk) and its compute-dtype weights (2 for BF16: a disk-master
    unit's, or an upload copy beside a master)."""
    copy = unit.weights.numel() * unit.weights.element_size() if unit.weights is not None else 0
    return int(unit.tier.ram_bytes_per_param * unit.spec.numel) + copy


class _ParamRanges:
    """master[lo:hi] of a unit from its parameters' tensors (a checkpoint's, read by name), asked for
    in increasing ranges: one parameter's tensor is held at a time, so a unit is never whole."""

    def __init__(self, params: list[ParamSlot], tensors):
        self.params = sorted(params, key=lambda p: p.offset)
        self.tensors = tensors
        self._held: tuple[str, torch.Tensor] | None = None

    def _flat(self, p: ParamSlot) -> torch.Tensor:
        if self._held is None or self._held[0] != p.full_name:
            self._held = (p.full_name, self.tensors[p.full_name].reshape(-1))
        return self._held[1]

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        out = torch.zeros(hi - lo, dtype=torch.float32)                     # [hi - lo]
        for p in self.params:
            a, z = max(lo, p.offset), min(hi, p.offset + p.numel)
            if a < z:
                out[a - lo:z - lo].copy_(self._flat(p)[a - p.offset:z - p.offset])
        return out
