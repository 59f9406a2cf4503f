"""The largest batch and the longest sequence a model trains with on a machine, for each recipe.

    limits = find_limits(split, rt, budget, seq_len=1024)
    limits.recipes[0].largest_batch.value     # sequences of 1024 tokens per micro-batch that fit
    limits.recipes[0].longest_seq.value       # tokens of one sequence that fit

Each candidate size is resolved and checked exactly as `slidetune train` resolves and checks a run
(engine.fit.choose_auto_settings, then check_fit): the auto settings (lean layer, offloaded
checkpoints, device layers, the disk tier's units, ...) are re-chosen at every size, so a limit is
the largest size some placement fits, and the settings reported with it are that placement. The
search assumes fit is monotone in the batch and the sequence (the estimate is, tests/test_fit.py;
the auto settings pick a fitting placement wherever one exists): doubling from a start until the
first size that does not fit, one probe past it as a guard (a fit there marks the limit
non-monotone and the doubling goes on), then bisection. An 8B preset on a 24 GiB GPU takes 0.7-3 s
for both recipes on a 2-core VM: 30-47 sizes, 25-70 ms each (the auto settings' ~100 estimates of
~0.5 ms, and where a size does not fit, check_fit's search for the options that would: half of it).

Recipes: the default (global-norm clipping: the deferred schedule, which holds the step's gradients
in host RAM) and the plain one (no clipping: the eager schedule, which holds none), so the plain
recipe's limits are at least the clipped one's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..models.units import SplitModel
from .config import RuntimeConfig
from .distributed import SharedMemoryError
from .fit import (FIT_SAFETY, InsufficientMemoryError, MemoryEstimate, budget_for, check_fit, choose_auto_settings,
                  query_gpu_free_bytes, query_host_available_bytes)
from .slide.disk_tier import DiskTierError
from .tiers import TIERS

# The search's bounds: a batch past 4096 sequences is not a fine-tuning workload, and 1M tokens is
# past every shipped preset's context (the model's max_position_embeddings caps the sequence first).
BATCH_CAP = 4096
SEQ_CAP = 2**20
# Sequence lengths are searched in multiples of 1024 tokens (the workload pads nothing to a unit of
# its own: a row is seq_len tokens); a model whose context is under 16 steps gets 1/16 of it,
# rounded down to a power of two (the tiny presets' 2048: 128).
SEQ_STEP = 1024
DEFAULT_CLIP = 1.0          # TrainConfig.max_grad_norm's default


@dataclass(frozen=True)
class Recipe:
    name: str
    max_grad_norm: float | None      # None: no clipping (the eager schedule)


def recipes_for(max_grad_norm: float | None) -> tuple[Recipe, Recipe]:
    """The clipped recipe (at the run's own norm, else the default 1.0) and the plain one."""
    clip = max_grad_norm if max_grad_norm else DEFAULT_CLIP
    return Recipe(f"clip {clip}", clip), Recipe("no clip", None)


@dataclass(frozen=True)
class MachineBudget:
    """The memory a run may use, as check_fit takes it (a None: check_fit reads this machine's;
    `resolved` reads them once for a search)."""
    gpu_free_bytes: int | None           # None: device cpu (its parts are host RAM), or unresolved: this GPU
    host_available_bytes: int
    disk_free_bytes: int | None = None   # with a disk directory; None: what its filesystem has
    shm_free_bytes: int | None = None    # data parallel: /dev/shm's free space; None: what it has
    ranks_per_host: int = 1

    @classmethod
    def resolved(cls, rt: RuntimeConfig, gpu_free_bytes: int | None = None, host_available_bytes: int | None = None,
                 disk_free_bytes: int | None = None, **rest) -> MachineBudget:
        """The budget with this machine's free GPU memory, available host RAM and the disk directory's
        free space read once where not given (the search probes many sizes against one machine)."""
        on_gpu = rt.device.startswith("cuda") or (rt.device == "auto" and torch.cuda.is_available())
        if on_gpu and gpu_free_bytes is None:
            gpu_free_bytes = query_gpu_free_bytes(rt)
        host = query_host_available_bytes() if host_available_bytes is None else host_available_bytes
        if disk_free_bytes is None:
            disk_free_bytes = TIERS.with_files.free_bytes(rt)
        return cls(gpu_free_bytes if on_gpu else None, int(host), disk_free_bytes, **rest)


@dataclass(frozen=True)
class Probe:
    """One size, resolved and checked as train would."""
    batch_size: int
    seq_len: int
    fits: bool
    settings: RuntimeConfig              # the auto settings resolved at this size
    estimate: MemoryEstimate | None      # None where the check failed before an estimate (the disk)
    # where it does not fit: "GPU memory", "host RAM", "/dev/shm", or the tier with files' name (its directory)
    binds: tuple[str, ...] = ()

    def how(self) -> str:
        """The notable resolved settings, in words: "lean layer, 30 of 36 checkpoints offloaded"."""
        s, plan = self.settings, self.estimate.plan if self.estimate is not None else None
        out = ["lean layer"] if s.layer.lean_layer == "on" else []
        if plan is not None:
            offloaded = plan.num_layers - plan.gpu_checkpoints
            if offloaded:
                out.append("every checkpoint offloaded" if offloaded == plan.num_layers else
                           f"{offloaded} of {plan.num_layers} checkpoints offloaded")
            if plan.device_layers:
                out.append(f"{plan.device_layers} layer{'s' if plan.device_layers > 1 else ''} updated on the GPU")
            files = TIERS.with_files
            disk = len(plan.indices(files))
            if disk:
                masters = plan.master_units(files)
                out.append(f"{disk} units on disk" + (f" ({masters} with their masters)" if masters else ""))
        return ", ".join(out)

    def to_dict(self) -> dict:
        s, plan = self.settings, self.estimate.plan if self.estimate is not None else None
        out = {"batch_size": self.batch_size, "seq_len": self.seq_len, "fits": self.fits, "binds": list(self.binds),
               "how": self.how(),
               "lean_layer": s.layer.lean_layer, "offload_activations": s.offload_activations,
               "cache_units": s.placement.cache_units, "vocab_update": s.placement.vocab_update,
               "grad_slot_dtype": s.transfer.grad_slot_dtype,
               "head_impl": s.head.head_impl}
        if plan is not None:
            out.update(gpu_checkpoints=plan.gpu_checkpoints, device_layers=plan.device_layers,
                       resident_layers=plan.resident_layers, disk_units=len(plan.indices(TIERS.with_files)),
                       disk_master_units=plan.master_units(TIERS.with_files))
        if self.estimate is not None:
            e = self.estimate
            out.update(device_type=e.device_type, gpu_gib=e.gpu_bytes / 2**30, host_gib=e.host_total_bytes / 2**30,
                       disk_gib=e.disk_bytes / 2**30)
        return out


@dataclass(frozen=True)
class Limit:
    """The largest size that fits (0: not even the smallest) along one axis, in multiples of `step`."""
    axis: str                            # "batch_size" or "seq_len"
    value: int
    at: Probe | None                     # the probe at `value` (None where nothing fits)
    over: Probe | None                   # the probe one step past it: what binds (None where capped)
    step: int
    cap: int
    capped_by: str | None = None         # where `value` is the cap: "the search's cap", "the model's context"
    monotone: bool = True                # False: a size past a failing one fit (see the module's note)

    @property
    def over_value(self) -> int | None:
        return getattr(self.over, self.axis) if self.over is not None else None

    def to_dict(self) -> dict:
        return {"axis": self.axis, "value": self.value, "step": self.step, "cap": self.cap, "capped_by": self.capped_by,
                "monotone": self.monotone, "at": self.at.to_dict() if self.at else None,
                "over": self.over.to_dict() if self.over else None}


@dataclass(frozen=True)
class RecipeLimits:
    recipe: Recipe
    largest_batch: Limit                 # at Limits.seq_len
    longest_seq: Limit                   # at batch 1


@dataclass(frozen=True)
class Limits:
    seq_len: int                         # the sequence the largest batch is found at
    recipes: tuple[RecipeLimits, ...]

    def to_dict(self) -> dict:
        return {"seq_len": self.seq_len,
                "recipes": [{"recipe": r.recipe.name, "max_grad_norm": r.recipe.max_grad_norm,
                             "largest_batch": r.largest_batch.to_dict(), "longest_seq": r.longest_seq.to_dict()}
                            for r in self.recipes]}


# ----------------------------------------------------------------------------- the search


def largest_fitting(fits: Callable[[int], bool], start: int, cap: int) -> tuple[int, bool]:
    """(largest k in [1, cap] with fits(k), monotone?) for fits non-increasing in k; 0 where fits(1) is
    False. Doubling from `start` (down where it does not fit), then bisection; once bracketed, one probe
    at twice the first failure guards the assumption: a fit there goes on doubling from it and returns
    monotone False."""
    monotone = True
    k = max(1, min(start, cap))
    if fits(k):
        lo, hi = k, None
    else:
        hi, lo = k, 0
        while k > 1:
            k //= 2
            if fits(k):
                lo = k
                break
            hi = k
        if lo == 0:
            return 0, monotone
    while True:
        while hi is None:                    # doubling up from the last fit
            if lo >= cap:
                return cap, monotone
            k = min(2 * lo, cap)
            if fits(k):
                lo = k
            else:
                hi = k
        guard = min(2 * hi, cap)
        if guard > hi and fits(guard):       # not monotone: go on from the fit past the failure
            monotone, lo, hi = False, guard, None
            continue
        break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, monotone


def seq_step_for(context: int | None) -> int:
    """The sequence search's step: SEQ_STEP, or for a context under 16 steps its 16th, rounded down
    to a power of two."""
    if context is None or context >= 16 * SEQ_STEP:
        return SEQ_STEP
    return 1 << max(0, (context // 16).bit_length() - 1)


def model_context(split: SplitModel) -> int | None:
    return getattr(split.config, "max_position_embeddings", None)


class _Prober:
    """Resolves and checks sizes for one recipe, each size once."""

    def __init__(self, split: SplitModel, rt: RuntimeConfig, budget: MachineBudget, recipe: Recipe,
                 grad_accum: int, padded: bool):
        self.split, self.rt, self.budget, self.recipe = split, rt, budget, recipe
        self.kw = dict(grad_accum=grad_accum, max_grad_norm=recipe.max_grad_norm, padded=padded)
        self.probes: dict[tuple[int, int], Probe] = {}

    def __call__(self, batch_size: int, seq_len: int) -> Probe:
        key = (batch_size, seq_len)
        if key not in self.probes:
            self.probes[key] = self._probe(batch_size, seq_len)
        return self.probes[key]

    def _probe(self, batch_size: int, seq_len: int) -> Probe:
        b = self.budget
        kw = dict(self.kw, batch_size=batch_size, seq_len=seq_len)
        settings = choose_auto_settings(self.split, self.rt, gpu_free_bytes=b.gpu_free_bytes,
                                        host_available_bytes=b.host_available_bytes,
                                        ranks_per_host=b.ranks_per_host, **kw)
        try:
            est = check_fit(self.split, settings, gpu_free_bytes=b.gpu_free_bytes,
                            host_available_bytes=b.host_available_bytes, ranks_per_host=b.ranks_per_host,
                            shm_free_bytes=b.shm_free_bytes, disk_free_bytes=b.disk_free_bytes, **kw)
            return Probe(batch_size, seq_len, True, settings, est)
        except InsufficientMemoryError as e:
            short = budget_for(e.estimate, settings, b.gpu_free_bytes, b.host_available_bytes, FIT_SAFETY,
                               b.ranks_per_host).shortfalls(e.estimate)
            return Probe(batch_size, seq_len, False, settings, e.estimate, tuple(what for what, *_ in short))
        except DiskTierError:
            return Probe(batch_size, seq_len, False, settings, None, (TIERS.with_files.name,))
        except SharedMemoryError:
            return Probe(batch_size, seq_len, False, settings, None, ("/dev/shm",))

    def limit(self, axis: str, at: Callable[[int], tuple[int, int]], start: int, cap: int, step: int,
              capped_by: str) -> Limit:
        """The largest k (in units of `step`) whose size at(k) = (batch, seq) fits."""
        k, monotone = largest_fitting(lambda n: self(*at(n)).fits, start, cap)
        over = self(*at(k + 1)) if k < cap else None
        return Limit(axis, k * step, self(*at(k)) if k else None, over, step, cap * step,
                     capped_by if k == cap else None, monotone)


def find_limits(split: SplitModel, rt: RuntimeConfig, budget: MachineBudget, *, seq_len: int, batch_size: int = 1,
                grad_accum: int = 1, max_grad_norm: float | None = None, padded: bool = True,
                recipes: tuple[Recipe, ...] | None = None) -> Limits:
    """For each recipe (default: recipes_for(max_grad_norm)): the largest micro-batch at `seq_len` and
    the longest sequence (a multiple of seq_step_for the model's context, at most that context and
    SEQ_CAP) at batch 1, `grad_accum` micro-batches a step, each size resolved and checked as train
    would on `budget`. `batch_size` and `seq_len` start the search (a run's own sizes: near them, it
    takes fewer probes). A recipe the runtime cannot run (clipping with --tuning.schedule eager) is
    left out."""
    context = model_context(split)
    step = seq_step_for(context)
    seq_cap = max(1, min(context or SEQ_CAP, SEQ_CAP) // step)
    out = []
    for recipe in recipes or recipes_for(max_grad_norm):
        try:
            rt.resolved_schedule(grad_accum, recipe.max_grad_norm)
        except ValueError:
            continue
        probe = _Prober(split, rt, budget, recipe, grad_accum, padded)
        batch = probe.limit("batch_size", lambda n: (n, seq_len), batch_size, BATCH_CAP, 1, "the search's cap")
        seq = probe.limit("seq_len", lambda n: (1, n * step), max(1, seq_len // step), seq_cap, step,
                          "the model's context" if context and context <= SEQ_CAP else "the search's cap")
        out.append(RecipeLimits(recipe, batch, seq))
    return Limits(seq_len, tuple(out))


# ----------------------------------------------------------------------------- words


def limit_words(limit: Limit) -> str:
    """'64 (lean layer, 30 of 36 checkpoints offloaded; at 65: GPU memory binds)', for `slidetune plan`."""
    if limit.value == 0:
        return f"none (at {limit.over_value:,}: {' and '.join(limit.over.binds)} binds)" if limit.over else "none"
    how = limit.at.how() if limit.at else ""
    notes = [how] if how else []
    if limit.capped_by:
        notes.append(f"{limit.capped_by}")
    elif limit.over is not None:
        notes.append(f"at {limit.over_value:,}: {' and '.join(limit.over.binds)} binds")
    if not limit.monotone:
        notes.append("the fit is not monotone here: a smaller size failed")
    return f"{limit.value:,}" + (f" ({'; '.join(notes)})" if notes else "")
