"""The one placement plan: where each unit's state lives and how its weights reach the GPU.

Every unit (0 the embedding, 1..L the decoder layers, L+1 the head) gets:
  state: where its FP32 master and AdamW moments live, and who updates it: a tier of
    engine/tiers.py (its bytes, who updates it, its line in `slidetune plan` are the tier's):
    "gpu"  - master and moments on the GPU, updated on the compute stream (vocab_update=device,
             device_layers); its weights never cross PCIe; under data parallel every GPU's own copy;
    "shard" - data parallel on one host (shard_layers): master and moments on one GPU of the host,
             its owner's (distributed.plan_owners), which updates it on its compute stream and
             broadcasts its weights to the host's other GPUs through their window slots; neither
             its weights nor its gradient cross PCIe, and it takes no host RAM;
    "host" - master and moments in host RAM, updated by the host's AdamW;
    the disk tier - moments in a file in a directory (engine/slide/disk_tier.py), read ahead of
             the unit's host update and written behind it;
  master: where a unit's FP32 master lives: with its state ("gpu", "host"), or for a disk unit
    "host" (RAM; the uploads cast it) or the disk tier (in its block beside the moments; RAM
    keeps only the compute-dtype weights the uploads copy: --tuning.disk_master);
  held: the clipped (deferred) schedule's held gradient buffers of a host-updated unit in host
    RAM: 1, or 2 used on alternate steps (--tuning.held_buffers; with held_second_units, only
    the lowest units get the second); 0 for units updated on the GPU and for the eager schedule;
  slot: how its compute-dtype weights are held on the GPU
    "own"    - a slot of its own (vocabulary units, device layers, resident host layers): uploaded
               once a step (or cast from the GPU master), as its update lands;
    "window" - one of the window's interchangeable slots, uploaded in the forward and again in
               the backward.
Plus the activation checkpoints kept on the GPU (the last `gpu_checkpoints` layers), the
window's slot count, the decoder layers' GPU gradient slots (how many, and whether FP32), and the
disk tier's block buffers.

RuntimeConfig holds what the user (or engine.fit.choose_auto_settings) asked for;
PlacementPlan.build turns it into this plan, once, by the rules below, and the engine, the fit
estimate, `slidetune plan`, the floor model (bench/roofline.py) and the reports read the plan.
Nothing else restates these rules. Every auto (-1, 0 or "auto") of the placement resolves here:
the plan holds counts and choices only, so the engine never interprets a sentinel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .adamw import FP32_ADAMW, OptimizerState
from .config import RuntimeConfig
from .tiers import TIERS, Tier

STATES = TIERS.names()
# The disk tier's block buffers where --tuning.disk_buffers is left at auto (-1) unresolved: the
# count before the auto existed (fit.choose_auto_settings resolves it from host RAM's room).
DISK_BUFFERS_UNRESOLVED = 8


AUTO_WINDOW = 3     # cache_units auto, where not every layer gets a slot of its own: a window of 3


def cache_unit_options(cache_units: int) -> list[int]:
    """The slot counts cache_units auto chooses between, the preferred first (0: a slot per layer,
    then the AUTO_WINDOW window); an explicit count alone."""
    return [0, AUTO_WINDOW] if cache_units == -1 else [cache_units]


def resolved_disk_buffers(disk_buffers: int) -> int:
    """The disk tier's block buffers for --tuning.disk_buffers (-1, auto left unresolved: the old 8)."""
    return DISK_BUFFERS_UNRESOLVED if disk_buffers == -1 else disk_buffers
SLOTS = ("own", "window")


@dataclass(frozen=True)
class UnitShape:
    """What the plan needs of a unit: its name and size."""
    name: str
    numel: int


def unit_shapes(split) -> list[UnitShape]:
    """The units of a SplitModel (models/units.py), in unit order."""
    return [UnitShape(u.name, u.numel) for u in split.units]


def shapes_from_counts(num_layers: int, layer_params: int, embed_params: int, head_params: int) -> list[UnitShape]:
    """Units from counts (a probe's record, where no SplitModel is at hand)."""
    return ([UnitShape("embed", embed_params)] + [UnitShape(f"layer.{i}", layer_params) for i in range(num_layers)]
            + [UnitShape("head", head_params)])


@dataclass(frozen=True)
class UnitPlace:
    index: int        # unit index: 0 embedding, 1..L decoder layers, L+1 head
    name: str
    numel: int
    state: str        # a tier's name (STATES, engine/tiers.py)
    slot: str         # own | window (SLOTS)
    master: str = ""  # a tier's name: where its FP32 master lives ("": the state's tier's default_master)
    held: int = 0     # held gradient buffers in host RAM (deferred schedule, host-updated units): 0, 1, 2
    # clip_sweep=weights (deferred, units in host RAM): a compute-dtype copy of the weights in
    # host RAM, written by the weights pass, which the uploads read instead of the FP32 master
    upload_copy: bool = False

    def __post_init__(self):
        if not self.master:
            object.__setattr__(self, "master", TIERS[self.state].default_master())
        if self.master != self.state and not TIERS[self.master].masters_of_others:
            raise ValueError(f"{self.name}: only a {self.master} unit's master can live on {self.master}")

    @property
    def tier(self) -> Tier:
        """The tier its state lives in."""
        return TIERS[self.state]

    @property
    def host_updated(self) -> bool:
        """Whether the host's AdamW updates it (its gradient crosses PCIe, its weights too)."""
        return self.tier.updated_on_host


@dataclass(frozen=True)
class PlacementPlan:
    units: tuple[UnitPlace, ...]
    window_slots: int             # interchangeable GPU slots for the "window" layers
    gpu_checkpoints: int          # the last decoder layers whose input checkpoint stays on the GPU
    schedule: str                 # eager | deferred (RuntimeConfig.resolved_schedule)
    disk_buffers: int = DISK_BUFFERS_UNRESOLVED   # the disk tier's pinned block buffers (its read-ahead)
    grad_slots: int = 3           # the decoder layers' GPU gradient slots (RuntimeConfig.resolved_grad_slots)
    grad_slots_fp32: bool = False  # gradient slots in FP32 (grad_slot_dtype fp32), else the compute dtype
    shard_ranks: int = 1          # the host's GPUs the sharded layers are spread over (round robin)
    # what the host-updated units (host and disk) keep per parameter (--moments, --master); units
    # updated on a GPU (gpu, shard): FP32_ADAMW
    host_state: OptimizerState = FP32_ADAMW
    # --tuning.checkpoints_in_held: each offloaded layer-input checkpoint borrows its layer's held
    # gradient buffer (deferred schedule, one buffer), idle from the clipped sweep's one pass over it
    # until the next backward reaches the layer (engine/slide/activations.py)
    checkpoints_in_held: bool = False

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, shapes: list[UnitShape], rt: RuntimeConfig, schedule: str = "eager",
              ranks: int = 1, dtype: torch.dtype | None = None, local_ranks: int | None = None) -> PlacementPlan:
        """The plan of a resolved (or partly unresolved) RuntimeConfig. Unresolved autos (-1, "auto")
        mean what an engine built directly does: nothing on the GPU, a 3-slot window, no resident
        layers, nothing on disk, every checkpoint offloaded (with offload_activations). `ranks`:
        data parallel's world size (a placement some settings cannot run on several ranks), of
        which `local_ranks` (default: all) on each host: shard_layers are sharded over those, and
        with one they are device layers;
        `dtype`: the compute dtype where resolved (an engine's; by default rt's, unless auto).
        A combination of settings the engine cannot run is refused here, before anything is built."""
        L = len(shapes) - 2
        if L < 0:
            raise ValueError("a plan needs the embedding, the decoder layers and the head")
        n_dev, n_shard, resident, window_slots = _layer_counts(rt, L, ranks if local_ranks is None else local_ranks)
        vocab_dev = rt.placement.vocab_update == "device"
        # The sharded layers sit above the resident ones: the next forward needs the resident layers
        # first, and their broadcasts are queued at the step's end (slots.flush_gathers), before the
        # window's; a sharded layer below them would wait behind their host updates.
        shard_lo = n_dev + resident
        state = (["gpu" if vocab_dev else "host"]
                 + ["gpu" if i < n_dev else "shard" if shard_lo <= i < shard_lo + n_shard else "host"
                    for i in range(L)]
                 + ["gpu" if vocab_dev else "host"])
        # The disk tier takes the host units the next forward needs last: the head, then the
        # decoder layers from the top down. Their updates have the most slack (eager: the backward
        # releases them first; deferred: the sweep reaches them last, while the next forward runs
        # the layers below them).
        files = TIERS.with_files
        candidates = _disk_order(state)
        n_disk = max(0, rt.disk.disk_units)
        if 0 < n_disk < 1:                       # a fraction of the units that may go there
            n_disk = round(n_disk * len(candidates))
        if n_disk > len(candidates):
            raise ValueError(f"--tuning.disk_units {n_disk} but only {len(candidates)} units can go to disk (the head and "
                             f"the host-updated decoder layers; the others are on the GPU)")
        for i in candidates[:n_disk]:
            state[i] = files.name
        # Masters on disk: the first disk units in the same order (the most slack first).
        disk_masters = set(candidates[:rt.disk.disk_master_units(n_disk)])
        own = {0, L + 1} | set(range(1, n_dev + resident + 1))
        # Held gradient buffers (deferred only): one per host-updated unit; the second (held_buffers
        # 2) for all of them, or the lowest held_second_units: the units the backward reaches last.
        held = [0] * len(shapes)
        if schedule == "deferred":
            host_updated = [i for i in range(len(shapes)) if TIERS[state[i]].updated_on_host]
            second = host_updated if rt.clip.held_second_units == -1 else host_updated[:rt.clip.held_second_units]
            for i in host_updated:
                held[i] = 1
            if rt.clip.held_buffers == 2:
                for i in second:
                    held[i] = 2
        # Upload copies (clip_sweep=weights): the units whose update the weights pass splits, those
        # with master and moments in RAM (a disk unit's update is one pass: its moments are read once)
        copies = schedule == "deferred" and rt.clip.clip_sweep == "weights"
        units = tuple(UnitPlace(i, s.name, s.numel, state[i], "own" if i in own else "window",
                                master=files.name if i in disk_masters else "", held=held[i],
                                upload_copy=copies and state[i] == "host")
                      for i, s in enumerate(shapes))
        if dtype is None and rt.dtype != "auto":
            dtype = rt.torch_dtype
        host_state = rt.host_state
        _check_combination(units, dtype, ranks, host_state)
        kept = L if not rt.offloads_activations else min(L, max(0, rt.placement.gpu_checkpoints))
        in_held = rt.clip.checkpoints_in_held == "on"
        if in_held:
            _check_checkpoints_in_held(rt)
        return cls(units=units, window_slots=window_slots, gpu_checkpoints=kept, schedule=schedule,
                   checkpoints_in_held=in_held and schedule == "deferred" and rt.offloads_activations,
                   shard_ranks=max(1, ranks if local_ranks is None else local_ranks),
                   disk_buffers=resolved_disk_buffers(rt.disk.disk_buffers),
                   grad_slots=rt.resolved_grad_slots(L, eager=schedule == "eager"),
                   grad_slots_fp32=rt.grad_slots_fp32(), host_state=host_state)

    def held_numel(self) -> int:
        """Elements of held gradient buffers in host RAM (deferred schedule): a buffer per
        host-updated unit, and a second for those that have one."""
        return sum(u.held * u.numel for u in self.units)

    def lends_checkpoint(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s offloaded input checkpoint borrows the layer's held
        gradient buffer (checkpoints_in_held; a layer with one held buffer, its checkpoint offloaded)."""
        return (self.checkpoints_in_held and layer < self.num_layers - self.gpu_checkpoints
                and self.units[layer + 1].held == 1)

    def upload_copy_numel(self) -> int:
        """Elements of the compute-dtype upload copies in host RAM (clip_sweep=weights)."""
        return sum(u.numel for u in self.units if u.upload_copy)

    def disk_capacity(self) -> int:
        """How many units could go to disk in this plan: the head and the decoder layers not on the
        GPU (the embedding stays in RAM: the next forward needs it first)."""
        return len(_disk_order([u.state for u in self.units]))

    # ------------------------------------------------------------------ reading
    @property
    def num_layers(self) -> int:
        return len(self.units) - 2

    @property
    def layers(self) -> tuple[UnitPlace, ...]:
        return self.units[1:-1]

    @property
    def vocab_on_device(self) -> bool:
        return self.units[0].state == "gpu"

    @property
    def shared_vocab_grad_slot(self) -> bool:
        """The embedding and the head take turns in one GPU gradient slot: the head's gradient
        leaves for the host early in the backward, the embedding's is computed last. Only where
        both are updated on the host (an update on the GPU keeps its gradient in the slot until
        the clipped step's end). Saves the smaller unit's slot: 1.16 GiB for 152K x 4096."""
        return self.units[0].host_updated and self.units[-1].host_updated

    def vocab_grad_slot_numels(self) -> list[int]:
        """The GPU gradient slots of the vocabulary units, in elements."""
        e, h = self.units[0].numel, self.units[-1].numel
        return [max(e, h)] if self.shared_vocab_grad_slot else [e, h]

    @property
    def device_layers(self) -> int:
        """How many of the lowest decoder layers are kept and updated on the GPU."""
        return sum(u.state == "gpu" for u in self.layers)

    @property
    def shard_layers(self) -> int:
        """How many decoder layers (above the device layers) are sharded over the host's GPUs."""
        return sum(u.state == "shard" for u in self.layers)

    @property
    def resident_layers(self) -> int:
        """Host-updated decoder layers with a slot of their own (the lowest ones above the device layers)."""
        return sum(u.slot == "own" and u.host_updated for u in self.layers)

    @property
    def layer_slots(self) -> int:
        """GPU slots for host layers: the window's and the resident layers' own."""
        return self.window_slots + self.resident_layers

    def indices(self, where: str | Tier) -> list[int]:
        """Units whose state lives in tier `where` (or the tier of that name)."""
        return [u.index for u in self.units if u.state == _tier_name(where)]

    def params(self, where: str | Tier) -> int:
        """Parameters whose state lives in tier `where`."""
        return sum(u.numel for u in self.units if u.state == _tier_name(where))

    def master_params(self, where: str | Tier) -> int:
        """Parameters whose FP32 master lives in tier `where`."""
        return sum(u.numel for u in self.units if u.master == _tier_name(where))

    def master_units(self, where: str | Tier) -> int:
        """Units whose FP32 master lives in tier `where`."""
        return sum(u.master == _tier_name(where) for u in self.units)

    def disk_bytes_per_param(self, u: UnitPlace) -> int | float:
        """Bytes a parameter of `u` takes in the disk tier's files (TIERS.with_files), in
        host_state's format (padding aside): 0; the moments (FP32: 8); the master too (FP32: 12)."""
        files = TIERS.with_files
        return files.stored_bytes_per_param(u, self.host_state) if files.holds(u) else 0

    def disk_io_bytes(self) -> int:
        """Bytes a step through the tiers that stream their state (the disk tier's files: each
        unit's block read ahead of its update and written behind it, FP32 16 B/param, 24 with its
        master there)."""
        return sum(t.io_bytes_per_step(self) for t in TIERS if t.streams_state)

    @property
    def host_updated_params(self) -> int:
        """Parameters the host's AdamW updates (host and disk units)."""
        return sum(u.numel for u in self.units if u.host_updated)

    def has_own_slot(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has a GPU slot of its own."""
        return self.units[layer + 1].slot == "own"

    def uploads_per_step(self) -> tuple[int, int]:
        """(decoder-layer uploads, vocabulary units uploaded) a step: resident host layers once, window
        layers twice (forward and backward) except the `window_slots` still in their slots at the
        turn; host vocabulary units once."""
        window = self._host_window_layers()
        layer_uploads = self.resident_layers + (max(window, 2 * window - self.window_slots) if window else 0)
        return layer_uploads, sum(u.host_updated for u in (self.units[0], self.units[-1]))

    def shard_broadcasts_per_step(self) -> int:
        """Sharded layers' broadcasts a step (each rank receives every one its GPU does not own):
        each in the forward and again in the backward, except those still in the window at the
        turn (the top layers' forward slots serve their backward)."""
        n = self.shard_layers
        kept = max(0, self.window_slots - self._host_window_layers())    # the host's window layers are above them
        return max(n, 2 * n - kept) if n else 0

    def _host_window_layers(self) -> int:
        """Host-updated decoder layers streamed through the window."""
        return sum(u.slot == "window" and u.host_updated for u in self.layers)

    def busiest_shard_units(self) -> list[UnitPlace]:
        """The sharded layers the busiest GPU of the host owns: the first of the round robin
        (distributed.plan_owners), ceil(n / shard_ranks) of them."""
        return [u for u in self.units if u.state == "shard"][::self.shard_ranks]

    def upload_params(self) -> int:
        """Parameters uploaded a step (each layer upload counted; every layer is the same size)."""
        layer_uploads, _ = self.uploads_per_step()
        layer = max((u.numel for u in self.layers), default=0)
        return layer_uploads * layer + sum(u.numel for u in (self.units[0], self.units[-1]) if u.host_updated)

    # State bytes of each tier (Tier.state_bytes; FP32_ADAMW, the host-updated units in
    # host_state's format): GPU 12 B/param (master, moments), host 12 B/param of its units and the
    # 4 B/param master of the disk units that keep it in RAM, disk 8 B/param (the moments) or 12
    # (the master too). Not state: a disk-master unit's compute-dtype weights in RAM (engine.fit
    # counts them, with the dtype). A tier not counted_when_empty (shard) only where it has units.
    def state_bytes(self) -> dict[str, int]:
        return {t.name: t.state_bytes(self) for t in TIERS if t.counted_when_empty or self.params(t)}

    def checkpoint_bytes(self) -> int:
        """A resumable checkpoint's tensors: every unit's weights in FP32 (4 B/param, a BF16 master's
        too) and its moments, in host_state's format for the host-updated units, FP32 for the others."""
        return sum(4 * u.numel + 2 * (self.host_state if u.host_updated else FP32_ADAMW).moment_nbytes(u.numel)
                   for u in self.units)

    # ------------------------------------------------------------------ reporting
    def ranges(self, pred) -> str:
        """Unit names matching `pred`, decoder layers as ranges: "embed, layers 0-7, head"."""
        parts, run = [], []

        def flush():
            if run:
                parts.append(f"layer {run[0]}" if len(run) == 1 else f"layers {run[0]}-{run[-1]}")
                run.clear()
        for u in self.units:
            if not pred(u):
                continue
            if 1 <= u.index <= self.num_layers:
                if run and run[-1] != u.index - 2:
                    flush()
                run.append(u.index - 1)
            else:
                flush()
                parts.append(u.name)
        flush()
        return ", ".join(parts) or "none"

    def summary_lines(self) -> list[str]:
        """What goes where, for `slidetune plan` and the train log."""
        gib = 2**30
        b = self.state_bytes()
        lines = []
        for tier in TIERS:
            n = self.params(tier)
            if n or tier.listed_when_empty:
                size = (f"{n / 1e9:.2f} B params, {b[tier.name] / gib:.1f} GiB state" if n >= 1e8 else
                        f"{n / 1e6:.1f} M params, {b[tier.name] / 2**20:.1f} MiB state")
                lines.append(f"  {tier.summary_label(self)}: {self.ranges(tier.holds)} ({size})")
        if any(u.held == 2 for u in self.units):
            one = [u for u in self.units if u.held == 1]
            lines.append(f"  held gradients (clipped schedule): two buffers for {self.ranges(lambda u: u.held == 2)}"
                         + (f", one for {self.ranges(lambda u: u.held == 1)}" if one else ""))
        if any(u.upload_copy for u in self.units):
            lines.append(f"  upload copies (clip_sweep weights: compute-dtype weights the uploads read): "
                         f"{self.ranges(lambda u: u.upload_copy)}")
        lines.append(f"  GPU weight slots: own for {self.ranges(lambda u: u.slot == 'own')}; "
                     f"window of {self.window_slots} for {self.ranges(lambda u: u.slot == 'window')}")
        layer_uploads, vocab_uploads = self.uploads_per_step()
        if self.shared_vocab_grad_slot:
            lines.append("  GPU gradient slots: embed and head share one (the head's leaves before the embedding's)")
        lines.append(f"  uploads a step: {layer_uploads} layer(s), {vocab_uploads} vocabulary unit(s); "
                     f"checkpoints on the GPU: last {self.gpu_checkpoints} of {self.num_layers} layers")
        lent = sum(self.lends_checkpoint(i) for i in range(self.num_layers))
        if lent:
            lines.append(f"  offloaded checkpoints in their layers' held gradient buffers: {lent} of "
                         f"{self.num_layers - self.gpu_checkpoints} (--tuning.checkpoints_in_held)")
        if self.shard_layers:
            lines.append(f"  sharded layers: {self.shard_layers} over {self.shard_ranks} GPUs (at most "
                         f"{len(self.busiest_shard_units())} a GPU), {self.shard_broadcasts_per_step()} "
                         f"broadcasts a step from their owners")
        return lines

    def to_dict(self) -> dict:
        """A compact record for results files (bench.measure) and Placement-free floors."""
        return {"schedule": self.schedule, "window_slots": self.window_slots,
                "gpu_checkpoints": self.gpu_checkpoints, "disk_buffers": self.disk_buffers,
                "grad_slots": self.grad_slots, "grad_slots_fp32": self.grad_slots_fp32, "shard_ranks": self.shard_ranks,
                "checkpoints_in_held": self.checkpoints_in_held,
                "units": [[u.name, u.numel, u.state, u.slot, u.master, u.held, u.upload_copy] for u in self.units]}

    @classmethod
    def from_dict(cls, d: dict) -> PlacementPlan:
        """A plan from to_dict's record (or an older one without the masters' tier: masters in RAM;
        or without held buffers or upload copies: none; without the disk buffers: the old 8; without
        the gradient slots: 3 in the compute dtype)."""
        units = tuple(UnitPlace(i, name, int(numel), state, slot, *rest) for i, (name, numel, state, slot, *rest)
                      in enumerate(d["units"]))
        return cls(units=units, window_slots=int(d["window_slots"]), gpu_checkpoints=int(d["gpu_checkpoints"]),
                   schedule=d["schedule"], disk_buffers=int(d.get("disk_buffers", DISK_BUFFERS_UNRESOLVED)),
                   grad_slots=int(d.get("grad_slots", 3)), grad_slots_fp32=bool(d.get("grad_slots_fp32", False)),
                   shard_ranks=int(d.get("shard_ranks", 1)),
                   checkpoints_in_held=bool(d.get("checkpoints_in_held", False)))


def _layer_counts(rt: RuntimeConfig, L: int, local_ranks: int) -> tuple[int, int, int, int]:
    """(device layers, sharded layers, resident layers, window slots) of L decoder layers on
    `local_ranks` GPUs of a host (one: the sharded layers are device layers)."""
    n_dev, n_shard = max(0, rt.placement.device_layers), max(0, rt.placement.shard_layers)
    if n_dev + n_shard > L:
        asked = f"--tuning.device_layers {n_dev}" + (f" and --tuning.shard_layers {n_shard}" if n_shard else "")
        raise ValueError(f"{asked} but the model has {L} decoder layers")
    if local_ranks <= 1:
        n_dev, n_shard = n_dev + n_shard, 0      # one GPU of the host holds them all: device layers
    elif n_shard and rt.transfer.dp_weights != "gather":
        raise ValueError("--tuning.shard_layers needs --tuning.dp_weights gather: a sharded layer's weights reach "
                         "the host's other GPUs only by its owner's broadcast")
    host_layers = L - n_dev - n_shard
    window = AUTO_WINDOW if rt.placement.cache_units == -1 else rt.placement.cache_units
    # Resident layers: the lowest host layers get a slot of their own; all of them with
    # cache_units=0, or where the window would hold every layer left to it.
    if rt.placement.cache_units == 0:
        resident = host_layers
    else:
        resident = min(host_layers, max(0, rt.placement.resident_layers))
        if window >= host_layers - resident:
            resident = host_layers
    # the sharded layers always stream through a window (every rank but the owner receives them)
    window_slots = 0 if resident == host_layers and not n_shard else \
        (AUTO_WINDOW if rt.placement.cache_units == 0 else window)
    return n_dev, n_shard, resident, window_slots


def _check_combination(units: tuple[UnitPlace, ...], dtype: torch.dtype | None, ranks: int,
                       host_state: OptimizerState = FP32_ADAMW) -> None:
    """Refuse the placements the engine cannot run, naming the setting to change (`dtype` None: an
    auto compute dtype not resolved yet, unchecked)."""
    if host_state is not FP32_ADAMW and any(u.upload_copy for u in units):
        # the weights pass writes BF16 copies from an FP32 master and moments (native_adamw's FP32 kernels)
        raise ValueError(f"{host_state.flags} runs the clipped sweep as params then moments: use --tuning.clip_sweep "
                         f"split (the default) or whole, not weights")
    if ranks > 1 and any(TIERS.with_files.holds_master(u) for u in units):
        # the other ranks upload a disk unit's weights from the shared mapping, which holds masters
        raise ValueError("data parallel over several ranks does not support --tuning.disk_master yet (the masters "
                         "of disk units on disk); use --tuning.disk_master off, or run on one rank")
    if any(u.upload_copy for u in units):
        if ranks > 1:
            raise ValueError("--tuning.clip_sweep weights runs on one rank for now (the host's other ranks "
                             "would upload the shared master before its second pass); use split under data "
                             "parallel")
        if dtype is not None and dtype != torch.bfloat16:
            raise ValueError(f"--tuning.clip_sweep weights writes BF16 upload copies, but the compute dtype is "
                             f"{dtype}; use split")


def _check_checkpoints_in_held(rt: RuntimeConfig) -> None:
    """--tuning.checkpoints_in_held on: a held buffer is free for a checkpoint only once the clipped
    sweep's last read of it is done; the split sweep's moments pass reads it under the next step,
    after the forward has written the checkpoints, and a second buffer is the next step's."""
    if rt.clip.clip_sweep != "whole":
        raise ValueError(f"--tuning.checkpoints_in_held on needs --tuning.clip_sweep whole (have "
                         f"{rt.clip.clip_sweep}: its moments pass reads the held gradients while the next "
                         f"forward writes its checkpoints)")
    if rt.clip.held_buffers == 2:
        raise ValueError("--tuning.checkpoints_in_held on needs one held gradient buffer a unit "
                         "(--tuning.held_buffers 1 or -1), not 2")


def _disk_order(state: list[str]) -> list[int]:
    """Units that may go to disk (the host-updated head and decoder layers), in the order they do:
    the head, then decoder layers top down."""
    L = len(state) - 2
    return [i for i in [L + 1, *range(L, 0, -1)] if TIERS[state[i]].updated_on_host]


def _tier_name(where: str | Tier) -> str:
    return where.name if isinstance(where, Tier) else where
