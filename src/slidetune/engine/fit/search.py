"""The auto search: slide mode's memory-dependent auto settings resolved against the GPU's and the
host's room (choose_auto_settings), each choice taken only where the whole configuration fits; among
the placements that fit, the one predicted fastest (choose_placement: bench/step_model.py's step at
probed or nominal rates, engine/fit/choice.py's rule), plain and clipped runs alike.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...models.lean_layer import lean_support_reason
from ...models.units import SplitModel
from ..config import RuntimeConfig
from ..placement import DISK_BUFFERS_UNRESOLVED, PlacementPlan, cache_unit_options, unit_shapes
from ..slide.disk_tier import buffer_bytes, tier_blocks
from .budget import FIT_SAFETY, budget_for, query_gpu_free_bytes, query_host_available_bytes
from .byte_models import device_type_of
from ..slide.layer_runner import resolve_lean_layer
from ..tiers import TIERS
from .choice import TIE, Candidate, PlacementChoice, fastest, kept_layers
from .estimate import MemoryEstimate, estimate_memory


def choose_auto_settings(split: SplitModel, rt: RuntimeConfig, *, batch_size: int, seq_len: int,
                         grad_accum: int = 1, max_grad_norm: float | None = None,
                         gpu_free_bytes: int | None = None, host_available_bytes: int | None = None,
                         safety: float = FIT_SAFETY, padded: bool = True, ranks_per_host: int = 1,
                         rates=None) -> RuntimeConfig:
    """The auto settings resolved: choose_placement's choice (`rates`: bench.step_model.StepRates,
    default its nominal ones)."""
    return choose_placement(split, rt, batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum,
                            max_grad_norm=max_grad_norm, gpu_free_bytes=gpu_free_bytes,
                            host_available_bytes=host_available_bytes, safety=safety, padded=padded,
                            ranks_per_host=ranks_per_host, rates=rates).chosen


def choose_placement(split: SplitModel, rt: RuntimeConfig, *, batch_size: int, seq_len: int,
                     grad_accum: int = 1, max_grad_norm: float | None = None,
                     gpu_free_bytes: int | None = None, host_available_bytes: int | None = None,
                     safety: float = FIT_SAFETY, padded: bool = True, ranks_per_host: int = 1,
                     rates=None) -> PlacementChoice:
    """The placements _placement_candidates finds for each memory recipe (_memory_recipes: HF's layer
    or the lean one, checkpoints on the GPU or offloaded), each checked against the budget and its
    step predicted (bench.step_model at `rates`, default its nominal ones); the fastest of those that
    fit without the disk tier (engine/fit/choice.py: ties within 1% by the search's order: the
    recipes' from the cheapest in step time, then each recipe's own). Else the first that fits with
    the disk tier (the tier binds a step at the disk's rate: Qwen3-8B b32 with the head's moments on
    disk 7.15 s, with the lean layer and none there 4.30 s; NOTES.md "Lean layer"), which the model
    cannot price without a disk probe. Where none fits, each recipe's first placement, the one short
    of least, so that the refusal and its options start there.
    Then the host-RAM-only autos beside the chosen placement (_host_autos: they cost no GPU memory,
    so they never displace a placement choice)."""
    kw = dict(batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum, max_grad_norm=max_grad_norm,
              padded=padded)
    room = dict(gpu_free_bytes=gpu_free_bytes, host_available_bytes=host_available_bytes, safety=safety,
                ranks_per_host=ranks_per_host)
    if rt.mode != "slide":
        return PlacementChoice(rt, [], None)
    judge = _Judge(split, rates, room, kw)
    recipes = _memory_recipes(split, rt)
    recipes = recipes if len(recipes) > 1 else [rt]      # nothing of them on auto: `rt` itself
    heads, candidates, skipped = [], [], []    # each recipe's first placement (the order's own choice)
    for recipe in recipes:
        # a recipe whose compute alone (its layer kind, nothing on the GPU's AdamW) is slower than a
        # placement found already cannot be chosen: no step is predicted below its compute
        compute_s = judge.model.compute(resolve_lean_layer(split, recipe))["compute_s"]
        best = min((c.seconds for c in candidates if c.fits and not c.disk), default=None)
        if best is not None and compute_s > best * (1 + TIE):
            skipped.append(f"lean_layer={recipe.layer.lean_layer} offload_activations={recipe.offload_activations} "
                           f"(its compute alone {compute_s:.3f} s)")
            continue
        placements = _placement_candidates(split, recipe, estimates=judge.estimates, **room, **kw)
        heads.append(placements[0])
        if len(recipes) == 1 and len(placements) == 1:
            # one placement, nothing to choose between: taken as it is (check_fit judges it), predicted
            only = judge.one(placements[0], checked=False)
            return PlacementChoice(_host_autos(split, only.config, host_available_bytes, safety, ranks_per_host,
                                               **kw), [only], only, judge.model.rates.source,
                                   label=judge.model.rates.label)
        candidates += judge.new(placements)
    fitting = [c for c in candidates if c.fits]
    no_disk = [c for c in fitting if not c.disk]
    if no_disk:
        pick = fastest([c for c in no_disk if kept_layers(c) >= kept_layers(no_disk[0])])
    elif fitting:
        pick = fitting[0]
    else:
        pick = min((judge.one(h) for h in heads), key=lambda c: (len(c.short), sum(n - u for _, n, u in c.short)))
    chosen = _host_autos(split, pick.config, host_available_bytes, safety, ranks_per_host, **kw)
    return PlacementChoice(chosen, candidates, pick if pick.fits else None, judge.model.rates.source, skipped,
                           kept_layers(no_disk[0]) if no_disk else 0, judge.model.rates.label)


class _Judge:
    """Each placement's shortfalls against the budget and its predicted step (bench.step_model), once;
    `estimates`, shared with the search (_PlacementSearch.estimate), each configuration's once."""

    def __init__(self, split: SplitModel, rates, room: dict, kw: dict):
        from ...bench.step_model import NOMINAL_RATES, StepModel
        self.split, self.room, self.kw = split, room, kw
        self.model = StepModel(split, batch_size=kw["batch_size"], seq_len=kw["seq_len"],
                               grad_accum=kw["grad_accum"], ranks_per_host=room["ranks_per_host"],
                               rates=rates or NOMINAL_RATES)
        self.estimates: dict = {}
        self.seen: set = set()

    def estimate(self, c: RuntimeConfig) -> MemoryEstimate:
        key = repr(c)
        if key not in self.estimates:
            self.estimates[key] = estimate_memory(self.split, c, ranks_per_host=self.room["ranks_per_host"],
                                                  **self.kw)
        return self.estimates[key]

    def one(self, c: RuntimeConfig, checked: bool = True) -> Candidate:
        """`c` judged: its shortfalls (checked=False: none looked for) and, for a GPU, its predicted step."""
        est = self.estimate(c)
        short = ()
        if checked:
            budget = budget_for(est, c, self.room["gpu_free_bytes"], self.room["host_available_bytes"],
                                self.room["safety"], self.room["ranks_per_host"])
            short = tuple((what, need, usable) for what, need, usable, _, _ in budget.shortfalls(est))
        on_gpu = est.plan is not None and est.device_type == "cuda"
        prediction = self.model.predict(c, est.plan) if on_gpu else None
        return Candidate(c, est.plan, short, prediction, bool(c.disk_dir) and c.disk.disk_units != 0)

    def new(self, configs: list[RuntimeConfig]) -> list[Candidate]:
        """The placements of `configs` not judged before, in the order given: one configuration for
        each layer kind and plan (settings that place nothing differently, e.g. a resident count
        beside a slot per layer, are one placement)."""
        out = []
        for c in configs:
            est = self.estimate(c)
            key = (resolve_lean_layer(self.split, c), repr(est.plan.to_dict()) if est.plan is not None else repr(c))
            if key not in self.seen:
                self.seen.add(key)
                out.append(self.one(c))
        return out


def _host_autos(split: SplitModel, placed: RuntimeConfig, host_available_bytes: int | None, safety: float,
                ranks_per_host: int, **kw) -> RuntimeConfig:
    """The host-RAM-only autos beside a chosen placement, in this order:
      disk_buffers=-1: the disk tier's block buffers, as many as host RAM has room for, at least 8
        (DISK_BUFFERS_UNRESOLVED) and at most half the disk units' blocks. First: an idle disk
        cost a disk-tier step far more than a gradient slot wait (NOTES.md "Disk tier").
      held_buffers=-1: 2 where the clipped schedule runs and host RAM has room for the second
        buffer, else 1 (always 1 under checkpoints_in_held: the checkpoints borrow it)."""
    if placed.mode != "slide":
        return placed
    host = query_host_available_bytes() if host_available_bytes is None else host_available_bytes
    budget = safety * host
    schedule = placed.resolved_schedule(kw["grad_accum"], kw["max_grad_norm"])

    def host_bytes(c: RuntimeConfig) -> int:
        return estimate_memory(split, c, ranks_per_host=ranks_per_host, **kw).host_bytes_per_host(ranks_per_host)
    if placed.disk.disk_buffers == -1:
        placed = _with_disk_buffers(split, placed, schedule, budget, host_bytes)
    if placed.clip.held_buffers != -1:
        return placed
    one = dataclasses.replace(placed, held_buffers=1, held_second_units=-1)
    if schedule != "deferred" or placed.clip.checkpoints_in_held == "on":   # the checkpoints borrow the one buffer
        return one
    two = dataclasses.replace(one, held_buffers=2)
    if host_bytes(two) <= budget:
        return two
    # Room for some: the lowest host-updated units first (the backward reaches them last, so a
    # second buffer there frees it for the rest of its way down; held_second_units' note), as
    # many as the estimate fits (~1 ms an estimate, once at start-up)
    fits = one
    host_units = sum(u.host_updated for u in PlacementPlan.build(unit_shapes(split), one, schedule).units)
    for count in range(1, host_units):
        some = dataclasses.replace(two, held_second_units=count)
        if host_bytes(some) > budget:
            break
        fits = some
    return fits


def _memory_recipes(split: SplitModel, rt: RuntimeConfig) -> list[RuntimeConfig]:
    """Slide mode's memory-saving choices left on auto, resolved into configurations from the
    cheapest in step time to the dearest: every checkpoint on the GPU before offloading some (their
    PCIe traffic shares the link with the uploads; with gpu_checkpoints auto only those that do not
    fit leave), HF's layer before the lean one (1-12% slower a layer, NOTES.md "Lean layer"; it also frees
    GPU room for checkpoints where the host is what binds). One configuration where nothing is on
    auto; on the CPU (no GPU to leave) offload is off."""
    if rt.mode != "slide":
        return [rt]
    on_gpu = device_type_of(rt) == "cuda"
    offloads = (["off", "on"] if on_gpu else ["off"]) if rt.offload_activations == "auto" \
        else [rt.offload_activations]
    leans = (["off", "on"] if lean_support_reason(split) is None else ["off"]) if rt.layer.lean_layer == "auto" \
        else [rt.layer.lean_layer]
    return [dataclasses.replace(rt, offload_activations=o, lean_layer=lean) for lean in leans for o in offloads]


def _with_disk_buffers(split: SplitModel, rt: RuntimeConfig, schedule: str, budget: float,
                       host_bytes) -> RuntimeConfig:
    """disk_buffers auto (choose_auto_settings): the tier's read-ahead as deep as host RAM's room
    (`budget` over host_bytes(rt) at the least count) allows, at least DISK_BUFFERS_UNRESOLVED (the
    fit counted that many already), at most half the disk units' blocks: half a step read ahead.
    Not more: buffers for every block keep each written block until the next step needs it, so the
    tier stops reading and becomes an in-RAM store of the same size that also writes to disk (a
    Qwen3-8B step with 4 layers on disk then moved 46% of its bytes, at 2.41 s; NOTES.md "Disk tier"). Where
    host RAM could hold that, the moments belong in RAM, which the fit's disk_units auto decides.
    Nothing on disk: `rt` itself, left at auto (moot)."""
    least = dataclasses.replace(rt, disk_buffers=DISK_BUFFERS_UNRESOLVED)
    plan = PlacementPlan.build(unit_shapes(split), least, schedule)
    per_buffer = buffer_bytes(plan, rt.disk.disk_block_mb, 1)
    if not per_buffer:
        return rt
    room = int(budget - host_bytes(least))
    most = max(DISK_BUFFERS_UNRESOLVED, tier_blocks(plan, rt.disk.disk_block_mb) // 2)
    count = max(DISK_BUFFERS_UNRESOLVED, min(most, DISK_BUFFERS_UNRESOLVED + max(0, room) // per_buffer))
    return dataclasses.replace(rt, disk_buffers=count)


# The orders the GPU's room left after an option set is filled in (_PlacementSearch.fill), each
# placement priced by the time model: resident layers first in both (each saves a layer's upload a
# step), then device layers (each takes its AdamW off the host) or checkpoints (their PCIe and DRAM
# traffic). Resident layers always come first, and the slot per layer (cache_units 0) before the
# window: what they buy is the forward no longer waiting on uploads, which the floor's bandwidth
# terms do not see (all layers resident: Qwen3-8B b16 2.65 -> 2.36 s at the same floor, NOTES.md
# "PCIe uploads"), so the model is not let trade them away for what it does see.
SPEED_ORDERS = (("resident_layers", "device_layers", "gpu_checkpoints"),
                ("resident_layers", "gpu_checkpoints", "device_layers"))


@dataclass
class _PlacementSearch:
    """The state _choose_placement's stages share: the workload, the GPU's and host's room, and
    which settings are on auto (the options each may take, the counts filled while room is left)."""

    split: SplitModel
    rt: RuntimeConfig
    batch_size: int
    seq_len: int
    grad_accum: int
    max_grad_norm: float | None
    padded: bool
    safety: float
    ranks_per_host: int
    cache_options: list[int]
    dtype_options: list[str]
    vocab_options: list[str]
    fillable: list[str]          # the counts filled one at a time while the GPU has room
    on_gpu: bool = False
    free: int = 0                # the GPU's free bytes (0 on the CPU)
    host: int = 0                # the host's available bytes
    estimates: dict = dataclasses.field(default_factory=dict)    # repr(config) -> its MemoryEstimate

    @classmethod
    def of(cls, split: SplitModel, rt: RuntimeConfig, **work) -> _PlacementSearch:
        """The options `rt`'s auto settings leave open (nothing about the machine yet)."""
        # FP32 slots help the GPU cast path (no cast kernel on the D2H stream); with compute-dtype
        # downloads or cast_on=cpu the host widens the gradients anyway
        p, t = rt.placement, rt.transfer
        fp32_useful = rt.casts_on_gpu(device_type_of(rt) == "cuda") and t.grad_download == "fp32"
        dtype_options = (["fp32", "compute"] if fp32_useful else ["compute"]) if t.grad_slot_dtype == "auto" \
            else [t.grad_slot_dtype]
        vocab_options = ["device", "host"] if p.vocab_update == "auto" else [p.vocab_update]
        # each fillable count grows the estimate; resident layers are auto only beside an auto
        # window: an explicit cache_units=3 asks for the small-window placement
        fillable = [name for name, auto in (("resident_layers", p.resident_layers == -1 and p.cache_units == -1),
                                            ("device_layers", p.device_layers == -1),
                                            ("gpu_checkpoints", p.gpu_checkpoints == -1 and rt.offloads_activations))
                    if auto]
        return cls(split=split, rt=rt, cache_options=cache_unit_options(p.cache_units),
                   dtype_options=dtype_options, vocab_options=vocab_options, fillable=fillable, **work)

    def nothing_on_auto(self) -> bool:
        rt = self.rt
        return len(self.cache_options) == 1 and rt.transfer.grad_slot_dtype != "auto" \
            and rt.placement.vocab_update != "auto" \
            and rt.placement.device_layers != -1 and "gpu_checkpoints" not in self.fillable \
            and (rt.disk.disk_units != -1 or not rt.disk_dir) and (rt.disk.disk_master != "auto" or not rt.disk_dir) \
            and (rt.placement.shard_layers != -1 or self.ranks_per_host < 2)

    def candidate(self, cache_units: int, vocab: str, grad_dtype: str) -> RuntimeConfig:
        rt, p = self.rt, self.rt.placement
        return dataclasses.replace(rt, cache_units=cache_units, grad_slot_dtype=grad_dtype, vocab_update=vocab,
                                   device_layers=max(0, p.device_layers), gpu_checkpoints=max(0, p.gpu_checkpoints),
                                   resident_layers=max(0, p.resident_layers), disk_units=max(0, rt.disk.disk_units),
                                   shard_layers=max(0, p.shard_layers),
                                   disk_master="off" if rt.disk.disk_master == "auto" else rt.disk.disk_master)

    def lean(self) -> RuntimeConfig:
        return self.candidate(self.cache_options[-1], self.vocab_options[-1], self.dtype_options[-1])

    def estimate(self, c: RuntimeConfig) -> MemoryEstimate:
        """estimate_memory of `c` for this workload, each configuration once (the search's orders
        meet the same ones; ~1 ms an estimate)."""
        key = repr(c)
        if key not in self.estimates:
            self.estimates[key] = estimate_memory(self.split, c, batch_size=self.batch_size, seq_len=self.seq_len,
                                                  grad_accum=self.grad_accum, max_grad_norm=self.max_grad_norm,
                                                  padded=self.padded, ranks_per_host=self.ranks_per_host)
        return self.estimates[key]

    def fits(self, c: RuntimeConfig) -> bool:
        return not self.on_gpu or self.estimate(c).gpu_bytes <= self.safety * self.free

    def host_bytes(self, c: RuntimeConfig) -> int:
        return self.estimate(c).host_bytes_per_host(self.ranks_per_host)

    def host_fits(self, c: RuntimeConfig) -> bool:
        return self.host_bytes(c) <= self.safety * self.host

    def fill(self, c: RuntimeConfig, order: list[str]) -> RuntimeConfig:
        """`c` with each fillable count of `order`, in turn, as high as the GPU still holds."""
        L = self.split.num_layers
        for name in (n for n in order if n in self.fillable):
            if name == "resident_layers" and c.placement.cache_units == 0:
                continue                              # every host layer is resident already
            top = L - c.placement.device_layers - c.placement.shard_layers if name == "resident_layers" else L
            # the largest count that fits, by bisection: each count's GPU bytes grow with it
            lo, hi = c.setting(name), top
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.fits(dataclasses.replace(c, **{name: mid})) else (lo, mid - 1)
            c = dataclasses.replace(c, **{name: max(lo, c.setting(name))})
        return c

    def fewest_device_layers(self, c: RuntimeConfig) -> RuntimeConfig | None:
        """`c` with the fewest device layers (auto) that make the host fit, or None."""
        ks = range(c.placement.device_layers, self.split.num_layers + 1) if "device_layers" in self.fillable \
            else [c.placement.device_layers]
        for k in ks:
            t = dataclasses.replace(c, device_layers=k)
            if not self.fits(t):
                return None
            if self.host_fits(t):
                return t
        return None

    def fastest(self, lean: RuntimeConfig) -> RuntimeConfig:
        """For speed: the first option set that fits, then the resident layers (each saves a layer's
        upload per step), then the device layers (each takes its AdamW off the host), then the
        checkpoints."""
        first = next((c for cache_units in self.cache_options for vocab in self.vocab_options
                      for grad_dtype in self.dtype_options if self.fits(c := self.candidate(cache_units, vocab,
                                                                                           grad_dtype))), lean)
        return self.fill(first, ["resident_layers", "device_layers", "gpu_checkpoints"])

    def option_sets(self) -> list[RuntimeConfig]:
        """The first window option with which anything fits the GPU (a slot per layer before the
        window: SPEED_ORDERS' note), each vocabulary option with it with the first gradient slot
        dtype that fits, unfilled."""
        for cache_units in self.cache_options:
            out = [first for vocab in self.vocab_options
                   if (first := next((c for grad_dtype in self.dtype_options
                                      if self.fits(c := self.candidate(cache_units, vocab, grad_dtype))), None))]
            if out:
                return out
        return []

    def speed_fills(self, c: RuntimeConfig) -> list[RuntimeConfig]:
        """`c` with the GPU's room filled in each of SPEED_ORDERS (those that differ where some
        counts are not on auto)."""
        orders = dict.fromkeys(tuple(n for n in order if n in self.fillable) for order in SPEED_ORDERS)
        return [self.fill(c, list(order)) for order in orders]

    def speed_candidates(self) -> list[RuntimeConfig]:
        """The placements the time model weighs against fastest()'s: its option set (the first that
        fits) filled in each of SPEED_ORDERS, every other option set that fits in the first order."""
        sets = self.option_sets()
        return [*(self.speed_fills(sets[0]) if sets else []),
                *(self.fill(c, list(SPEED_ORDERS[0])) for c in sets[1:])]

    def host_bound_speed(self) -> list[RuntimeConfig]:
        """Host RAM binds: per window and vocabulary option (host_bound's), the fewest checkpoints on
        the GPU, then the fewest device layers, that make the host fit, and the GPU's room left
        filled in each of SPEED_ORDERS (host_bound gives the GPU's room to checkpoints first, and
        then to resident layers)."""
        if "gpu_checkpoints" not in self.fillable:
            return []
        out = []
        for cache_units in sorted(self.cache_options, reverse=True):
            for vocab in self.vocab_options:
                c = self.candidate(cache_units, vocab, self.dtype_options[-1])
                k = 0
                while k < self.split.num_layers and self.fits(c) and not self.host_fits(c):
                    k += 1
                    c = dataclasses.replace(c, gpu_checkpoints=k)
                enough = self.fewest_device_layers(c) if self.fits(c) else None
                out += self.speed_fills(enough) if enough is not None else []
        return out

    def host_bound(self) -> list[RuntimeConfig]:
        """Host RAM binds: the GPU's room first to what takes the most off the host per GPU byte
        (checkpoints, then device layers), but only as many device layers as the host needs;
        what is left goes to speed again (resident layers, then more device layers). One
        configuration per window and vocabulary option that fits the GPU, the smallest window first."""
        leanest = []
        for cache_units in sorted(self.cache_options, reverse=True):
            for vocab in self.vocab_options:
                if not self.fits(c := self.candidate(cache_units, vocab, self.dtype_options[-1])):
                    continue
                c = self.fill(c, ["gpu_checkpoints"])
                enough = self.fewest_device_layers(c)
                leanest.append(self.fill(enough, ["resident_layers", "device_layers"]) if enough
                               else self.fill(c, ["device_layers"]))
        return leanest

    def sharded(self, candidates: list[RuntimeConfig]) -> RuntimeConfig | None:
        """Data parallel, shard_layers auto, where the host's RAM does not hold what the GPUs leave it
        even with their room given to it: the fewest sharded layers that make it (each takes 12 B/param
        off the host, and 2 more of held gradient when clipped, for 1/N of that on each of the N
        GPUs, where a device layer costs every GPU 16), from each candidate in turn (the leanest
        first) with its device layers given back to them, then the GPU's room left to resident
        layers. Where none makes the host fit: the one with the most the GPUs hold that needs the
        least host (the disk tier takes the rest). None: not data parallel on GPUs, or set."""
        if self.ranks_per_host < 2 or self.rt.placement.shard_layers != -1 or not self.on_gpu:
            return None
        L, best = self.split.num_layers, None
        for c in candidates:
            if "device_layers" in self.fillable:
                c = dataclasses.replace(c, device_layers=0)
            if "resident_layers" in self.fillable:
                c = dataclasses.replace(c, resident_layers=0)
            lo, hi = 0, L - c.placement.device_layers
            while lo < hi:          # the most the GPUs hold
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.fits(dataclasses.replace(c, shard_layers=mid)) else (lo, mid - 1)
            most = dataclasses.replace(c, shard_layers=lo)
            if not lo or not self.fits(most):
                continue
            if not self.host_fits(most):
                best = most if best is None or self.host_bytes(most) < self.host_bytes(best) else best
                continue
            lo, hi = 1, lo
            while lo < hi:          # the fewest that make the host fit (more only move more state)
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if self.host_fits(dataclasses.replace(c, shard_layers=mid)) else (mid + 1, hi)
            return self.fill(dataclasses.replace(c, shard_layers=lo), ["resident_layers"])
        return best

    def onto_disk(self, least: RuntimeConfig) -> RuntimeConfig:
        """RAM and GPU cannot hold the state: with disk_units auto, the disk tier takes the moments
        of as few units as make the host fit (the head, then layers from the top down; each 8
        B/param off the host); then disk_master auto (with_disk_masters)."""
        if self.rt.disk.disk_units == -1 and self.rt.disk_dir:
            host_units = PlacementPlan.build(unit_shapes(self.split), least).disk_capacity()
            for k in range(1, host_units + 1):
                c = dataclasses.replace(least, disk_units=k)
                if self.host_fits(c) and self.fits(c):
                    return c
            least = dataclasses.replace(least, disk_units=host_units)
        return self.with_disk_masters(least)

    def with_disk_masters(self, c: RuntimeConfig) -> RuntimeConfig:
        """disk_master auto, where the moments on disk do not make the host fit: the masters of as
        few of `c`'s disk units as do (in disk order; each 4 - b B/param more off the host, for 8
        more through the disk). Every disk unit on disk first, moments only, then masters: the
        same RAM for the least disk traffic (moving a unit's moments saves 8 B/param for 16 of
        I/O a step, its master then 2 more for 8 more). None fitting: all of them, where that
        helps at all (a compute dtype of 4 bytes saves nothing). Not under data parallel (the
        engine refuses it there)."""
        if self.rt.disk.disk_master != "auto" or self.ranks_per_host > 1 or self.host_fits(c):
            return c
        n = len(PlacementPlan.build(unit_shapes(self.split), c).indices(TIERS.with_files))
        for m in range(1, n + 1):
            t = dataclasses.replace(c, disk_master="on" if m == n else str(m))
            if self.host_fits(t) and self.fits(t):
                return t
        every = dataclasses.replace(c, disk_master="on")
        return every if n and self.host_bytes(every) < self.host_bytes(c) else c


def _placement_candidates(split: SplitModel, rt: RuntimeConfig, *, batch_size: int, seq_len: int,
                          grad_accum: int = 1, max_grad_norm: float | None = None,
                          gpu_free_bytes: int | None = None, host_available_bytes: int | None = None,
                          safety: float = FIT_SAFETY, padded: bool = True, ranks_per_host: int = 1,
                          estimates: dict | None = None) -> list[RuntimeConfig]:
    """The placements that resolve slide mode's memory-dependent autos (cache_units=-1 with
    resident_layers=-1, vocab_update=auto, grad_slot_dtype=auto, device_layers=-1, gpu_checkpoints=-1,
    and with a disk directory disk_units=-1 and disk_master=auto) for choose_placement to choose
    from by predicted time: the order's own choice first (below), then every other placement that
    fits the host: each window and vocabulary option filled in each of SPEED_ORDERS, the host-bound
    ones, and those with only the checkpoints the host needs (_PlacementSearch.host_bound_speed).
    Where nothing fits the host, the one placement of the rules below that come after it.

    The order's own choice. For speed, in order of what they bought on the H100: one slot per layer (the forward stops
    waiting on PCIe; Qwen3-8B b16 2.65 -> 2.36 s, benchmarks/NOTES.md "PCIe uploads"), then the vocabulary
    units updated on the GPU (the host's AdamW, the bound, loses 13% of its work on
    Llama-3.1-8B; NOTES.md "GPU-updated units"), then FP32 gradient slots (the copy stream
    runs no cast kernels; Llama-3.1-8B b16 2.38 -> 2.16 s, NOTES.md "Gradient downloads"), then with
    device_layers=-1 as many of the lowest layers kept and updated on the GPU as still fit
    (NOTES.md "Host AdamW"), then with offload and gpu_checkpoints=-1 as many checkpoints as still fit.
    Each is taken only where the whole configuration then fits in `safety` x the GPU's free
    memory, so an auto choice never causes an OOM the lean choice would not; otherwise the
    3-slot window with as many resident layers as fit, and compute-dtype slots.

    Where that configuration does not fit in `safety` x the host's available RAM (long
    sequences with offloaded checkpoints, models near 12 B/param of the host's RAM), the GPU's
    room goes instead to what takes the most off the host per GPU byte: the 3-slot window
    (resident layers save no host RAM), the vocabulary units on the GPU, then checkpoints
    (a GPU byte for each host byte), then the fewest device layers (12 host bytes for 14 GPU
    bytes) that make the host fit; the room left goes to resident layers (Qwen3-14B on an H200:
    the window alone left its b8 step bound by uploads, NOTES.md "PCIe uploads"), then more device layers.
    If even that does not fit, the disk tier (with a disk directory): the moments of as few
    units as make the host fit, then, where every unit that may go there is not enough, the
    masters of as few of them (disk_master auto; off wherever the moments suffice). Failing
    that, the configuration that needs the least host RAM is returned and check_fit reports
    it. On the CPU (nothing to hide) the lean choices (disk_master auto: off).
    Settings given explicitly are kept; with nothing on auto, `rt` itself is the one placement.

    ranks_per_host: data-parallel ranks on this host, each with a GPU like this one. The GPU
    checks are per rank; the host check counts the shared state once and each rank's own
    buffers per rank (MemoryEstimate.host_bytes_per_host), so N ranks may need the GPU to take
    more off the host than one rank would.
    """
    if rt.mode != "slide":
        return [rt]
    search = _PlacementSearch.of(split, rt, batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum,
                                 max_grad_norm=max_grad_norm, padded=padded, safety=safety,
                                 ranks_per_host=ranks_per_host, estimates={} if estimates is None else estimates)
    if search.nothing_on_auto():
        return [rt]
    lean = search.lean()
    on_gpu = device_type_of(rt) == "cuda"
    if not on_gpu and not (rt.disk.disk_units == -1 and rt.disk_dir):
        return [lean]
    search.on_gpu = on_gpu
    search.free = (query_gpu_free_bytes(rt) if gpu_free_bytes is None else gpu_free_bytes) if on_gpu else 0
    search.host = query_host_available_bytes() if host_available_bytes is None else host_available_bytes
    if not on_gpu:
        # the CPU (nothing to hide, nothing on a GPU): the lean choices, and where host RAM does not
        # hold them, the disk tier
        if search.host_fits(lean):
            return [lean]
        return [search.onto_disk(lean)]
    # what fits the host, the order's own choice first, then the others the time model weighs
    # against it: the speed-first placements, else the host-bound ones
    fastest = search.fastest(lean)
    fitting = [c for c in [fastest, *search.speed_candidates()] if search.host_fits(c)]
    if fitting:
        return fitting
    leanest = search.host_bound()
    fitting = [c for c in [*leanest, *search.host_bound_speed()] if search.host_fits(c)]
    if fitting:
        return fitting
    sharded = search.sharded(leanest)
    if sharded is not None and search.host_fits(sharded):
        return [sharded]
    leanest += [sharded] if sharded is not None else []
    return [search.onto_disk(min([fastest, *leanest], key=search.host_bytes))]
