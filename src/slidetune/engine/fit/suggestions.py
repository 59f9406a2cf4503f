"""Suggestions: where a configuration does not fit, the changes that do (each a line of CLI flags
found by re-running the same estimate), the disk tier's note, and the refusal's message.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...models.units import SplitModel
from ..adamw import optimizer_state
from ..config import RuntimeConfig, cli_flag, recompute_set
from ..tiers import TIERS
from .budget import ENV_HOST_MEMORY, Budget
from .estimate import MemoryEstimate, estimate_memory, gib
from .search import choose_auto_settings

def disk_tier_note(split: SplitModel, rt: RuntimeConfig, budget: Budget, short, **kw) -> str:
    """Where host RAM is what does not fit and no disk tier was given: what the disk tier would take
    (the auto placement with a disk directory), or "" where it would not help."""
    if rt.mode != "slide" or rt.disk_dir or not any(what == "host RAM" for what, *_ in short) \
            or (budget.device_type == "cuda" and budget.gpu_free is None):
        return ""
    trial = dataclasses.replace(rt, disk_dir="PATH", disk_units=-1)
    placed = choose_auto_settings(split, trial, gpu_free_bytes=budget.gpu_free, host_available_bytes=budget.host_avail,
                                  safety=budget.safety, ranks_per_host=budget.ranks_per_host, **kw)
    est = estimate_memory(split, placed, ranks_per_host=budget.ranks_per_host, **kw)
    options = []
    if not budget.fits(est):
        if any(what == "host RAM" for what, *_ in budget.shortfalls(est)):
            return ""
        # the tier makes host RAM fit and the GPU is what is left: the tier with one of the changes
        # that make the GPU fit
        options = suggest(split, placed, budget, **kw)
        if not options:
            return ""
    files = TIERS.with_files
    n = len(est.plan.indices(files))
    masters = est.plan.ranges(files.holds_master) if est.plan.master_params(files) else ""
    note = (f"With a local disk: --disk-dir PATH (the disk tier: AdamW moments of {n} units, "
            f"{est.plan.ranges(files.holds)}"
            + (f", and the masters of {masters} (--tuning.disk_master)" if masters else "")
            + f", {gib(est.disk_bytes)} GiB of files there; "
            + (f"GPU {gib(est.gpu_bytes)} GiB, " if est.device_type == "cuda" else "")
            + f"host {gib(est.host_bytes_per_host(budget.ranks_per_host))} GiB; each step moves "
              f"{gib(est.plan.disk_io_bytes())} GiB through the disk)")
    if options:
        note += ", with one of:\n" + "\n".join(f"  --disk-dir PATH {o}" for o in options)
    return note


def refusal_message(rt, est, short, options, B, S, accum, safety, disk_note: str = "") -> str:
    lines = [f"slidetune: mode {rt.mode}, batch {B} x {S} tokens"
             + (f" x {accum} micro-batches" if accum > 1 else "") + f", {rt.dtype} on {est.device_type}: "
             + " and ".join(w for w, *_ in short) + " too small."]
    for what, need, usable, avail, parts in short:
        lines.append(f"  {what}: needs {gib(need)} GiB, usable {gib(usable)} GiB "
                     f"({safety:.0%} of {gib(avail)} GiB available).")
        top = sorted(parts.items(), key=lambda kv: -kv[1])[:5]
        lines.append("    largest items: " + ", ".join(f"{k} {gib(v)} GiB" for k, v in top))
        if what == "host RAM":
            lines.append(f"    (if this host grows its RAM on demand, set {ENV_HOST_MEMORY} to what it can give)")
    if options:
        lines.append("Options that fit (per the same estimate):")
        lines += [f"  {o}" for o in options]
    if disk_note:
        lines.append(disk_note)
    if not options and not disk_note:
        lines.append("No single change among batch size, activation offload, cache slots, head chunking "
                     "and mode fits: use a smaller model or sequence length, or a machine with more memory.")
    return "\n".join(lines)


def _fmt_flag(name: str, value) -> str:
    flag = cli_flag(name)                             # --tuning.NAME for a tuning knob
    if value is True:
        return flag                                   # boolean flags take no value when true
    if value is False:
        value = "false"
    return f"{flag} {value}"


@dataclass
class _Suggestions:
    """suggest's state: the configuration and budget, the lines found so far and the largest
    micro-batch the plain batch reduction reached (a change no better than it adds nothing)."""

    split: SplitModel
    rt: RuntimeConfig
    budget: Budget
    batch_size: int
    seq_len: int
    grad_accum: int
    max_grad_norm: float | None
    limit: int
    padded: bool
    out: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    plain_best: int = 0

    @property
    def total(self) -> int:
        """Sequences per step."""
        return self.batch_size * self.grad_accum

    def attempt(self, changes: dict, B: int, accum: int, clip) -> MemoryEstimate | None:
        """The estimate with `changes` at micro-batch B, where it fits the budget; else None."""
        ch = dict(changes)
        try:
            est = estimate_memory(self.split, dataclasses.replace(self.rt, **ch) if ch else self.rt, batch_size=B,
                                  seq_len=self.seq_len, grad_accum=accum, max_grad_norm=clip, padded=self.padded,
                                  ranks_per_host=self.budget.ranks_per_host)
        except ValueError:
            return None
        return est if self.budget.fits(est) else None

    def accum_for(self, B: int, keep_total: bool) -> int:
        return -(-self.total // B) if keep_total else self.grad_accum

    def largest_batch(self, changes: dict, keep_total: bool) -> int | None:
        """Bisection: the estimate is monotone in the batch."""
        lo, hi, best = 1, self.batch_size - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.attempt(changes, mid, self.accum_for(mid, keep_total), self.max_grad_norm) is not None:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    def add(self, flags: list[str], est: MemoryEstimate, note: str = "") -> None:
        key = " ".join(flags)
        if key in self.seen or len(self.out) >= self.limit:
            return
        self.seen.add(key)
        where = (f"GPU {gib(est.gpu_bytes)} GiB, " if est.device_type == "cuda" else "") + \
            f"host {gib(est.host_total_bytes)} GiB"
        self.out.append(f"{key}  -> {where}" + (f" ({note})" if note else ""))

    def flags_of(self, changes: dict, B: int | None = None, accum: int | None = None) -> list[str]:
        flags = [_fmt_flag(k, v) for k, v in changes.items()]
        if B is not None:
            flags.append(_fmt_flag("batch_size", B))
        if accum is not None and accum != self.grad_accum:
            flags.append(_fmt_flag("grad_accum", accum))
        return flags

    def consider(self, changes: dict) -> bool:
        """Add the change (with a smaller micro-batch if needed); True if it fits somehow."""
        est = self.attempt(changes, self.batch_size, self.grad_accum, self.max_grad_norm)
        if est is not None:
            self.add(self.flags_of(changes), est)
            return True
        if self.batch_size == 1:
            return False
        for keep_total in (True, False):
            best = self.largest_batch(changes, keep_total)
            if best is None:
                continue
            if not changes:
                self.plain_best = max(self.plain_best, best)
            elif best <= self.plain_best:
                return True       # no better than reducing the batch alone
            pick = best
            if keep_total:        # prefer a divisor of the sequences per step: the same effective batch
                divisor = next(k for k in range(best, 0, -1) if self.total % k == 0)
                pick = divisor if 2 * divisor > best else best
            accum = self.accum_for(pick, keep_total)
            est = self.attempt(changes, pick, accum, self.max_grad_norm)
            note = f"{pick * accum} sequences per step" + ("" if keep_total else f" instead of {self.total}")
            if pick != best:
                note += f"; largest micro-batch that fits: {best}"
            self.add(self.flags_of(changes, pick, accum), est, note)
            return True
        return False

    def auto_placement(self) -> None:
        """Where placements were given explicitly: the one the auto settings would choose on this
        GPU and host (which turns to the host's RAM where that is what does not fit)."""
        rt, budget = self.rt, self.budget
        if not (rt.mode == "slide" and budget.device_type == "cuda" and budget.gpu_free is not None):
            return
        fields = ["cache_units", "vocab_update", "grad_slot_dtype", "device_layers"] + \
            (["gpu_checkpoints"] if rt.offloads_activations else []) + \
            (["disk_units", "disk_master"] if rt.disk_dir else [])
        # the disk tier re-resolved with the rest: disk units counted for one placement (the head on
        # the host) are one too many for another (the head on the GPU)
        disk = dict(disk_units=-1, disk_master="auto") if rt.disk_dir else {}
        placed = choose_auto_settings(
            self.split, dataclasses.replace(rt, cache_units=-1, vocab_update="auto", grad_slot_dtype="auto",
                                            device_layers=-1, gpu_checkpoints=-1, **disk),
            batch_size=self.batch_size, seq_len=self.seq_len, grad_accum=self.grad_accum,
            max_grad_norm=self.max_grad_norm, gpu_free_bytes=budget.gpu_free, host_available_bytes=budget.host_avail,
            safety=budget.safety, padded=self.padded)
        changes = {k: placed.setting(k) for k in fields if placed.setting(k) != rt.setting(k)}
        if changes:
            self.consider(changes)

    def slide_buffers(self) -> None:
        """slide mode's single changes, cheapest first: offload, a smaller window, one grad slot."""
        rt = self.rt
        if rt.mode != "slide":
            return
        if not rt.offloads_activations:
            self.consider({"offload_activations": "on"})
        if rt.placement.cache_units == 0:
            self.consider({"cache_units": 3})
        if rt.placement.cache_units != 2:
            self.consider({"cache_units": 2})
        if rt.resolved_grad_slots(self.split.num_layers) > 1:
            self.consider({"grad_slots": 1})

    def head_chunks(self) -> None:
        """The chunked head, else smaller logits chunks: the largest chunk that fits at the current batch."""
        rt = self.rt
        head_base = {"head_impl": "chunked"} if rt.resolved_head_impl == "full" else {}
        if head_base and self.consider(head_base):
            return
        chunk = min(rt.head.head_chunk_tokens, self.batch_size * self.seq_len) // 2
        while chunk >= 256:
            if self.attempt(dict(head_base, head_chunk_tokens=chunk), self.batch_size, self.grad_accum,
                            self.max_grad_norm):
                self.consider(dict(head_base, head_chunk_tokens=chunk))
                break
            chunk //= 2

    def modes(self) -> None:
        """gpu and ckpt modes: recompute every layer, or slide."""
        rt, L = self.rt, self.split.num_layers
        if rt.mode == "gpu":
            self.consider({"mode": "ckpt", "recompute": "all"})
        if rt.mode == "ckpt" and recompute_set(rt.recompute, L) != set(range(L)):
            self.consider({"recompute": "all"})
        if rt.mode in ("gpu", "ckpt"):
            if not self.consider({"mode": "slide"}):
                self.consider({"mode": "slide", "offload_activations": "on"})

    def all_at_once(self) -> None:
        """Everything that saves GPU memory at once, when no single change is enough."""
        if self.out:
            return
        rt = self.rt
        lean = {"mode": "slide", "offload_activations": "on", "cache_units": 2, "grad_slots": 1,
                "head_impl": "chunked" if rt.resolved_head_impl == "full" else rt.resolved_head_impl,
                "head_chunk_tokens": min(rt.head.head_chunk_tokens, 1024)}
        lean = {k: v for k, v in lean.items() if rt.setting(k) != v}
        if lean:
            self.consider(lean)

    def compact_moments(self) -> None:
        """Host: the first compact state smaller than the run's that fits, least rounding first
        (opt-in, named as a change of the arithmetic): BF16 moments (12 -> 8 B/param of a host
        unit's state), 8-bit moments (~6), then a BF16 master beside them (~4); a run already on a
        compact state is offered what it lacks (--moments 8bit: --master bf16). In RAM, the shared
        mapping or the disk tier alike."""
        rt = self.rt
        if rt.mode != "slide" or rt.host.host_adamw == "torch":
            return
        now = {"master": rt.master, "moments": rt.moments}
        for step in ({"moments": "bf16"}, {"moments": "8bit"}, {"master": "bf16", "moments": "8bit"}):
            merged = now | step
            if optimizer_state(**merged).bytes_per_param >= rt.host_state.bytes_per_param:
                continue
            change = {k: v for k, v in merged.items() if v != now[k]}
            est = self.attempt(change, self.batch_size, self.grad_accum, self.max_grad_norm)
            if est is not None:
                what = " and ".join(f"{'AdamW' + chr(39) + 's moments' if k == 'moments' else 'the master'} in {v}"
                                    for k, v in sorted(change.items(), key=lambda kv: kv[0] != "moments"))
                self.add([_fmt_flag(k, v) for k, v in change.items()], est,
                         f"opt-in: {what}, not the FP32 reference's arithmetic")
                return

    def checkpoints_in_held(self) -> None:
        """Host, clipped: the offloaded checkpoints in their layers' held gradient buffers (exact:
        the same arithmetic; the whole sweep instead of the split one), offloading them if needed. An
        explicit held_buffers 2 is refused by the plan, so its attempt finds nothing."""
        rt = self.rt
        if rt.mode != "slide" or not (self.max_grad_norm or 0) > 0 or rt.clip.checkpoints_in_held == "on" \
                or rt.clip.schedule == "eager":
            return
        change = {"offload_activations": "on"} if not rt.offloads_activations else {}
        change |= {"clip_sweep": "whole", "checkpoints_in_held": "on"}
        est = self.attempt(change, self.batch_size, self.grad_accum, self.max_grad_norm)
        if est is not None:
            self.add(self.flags_of(change), est, "exact: the offloaded checkpoints in their layers' held gradient "
                                                 "buffers, the clipped sweep in one pass")

    def no_clipping(self) -> None:
        """Host: the deferred schedule (clipping) holds the step's gradients, eager does not."""
        rt = self.rt
        if rt.mode == "slide" and rt.clip.schedule != "deferred" and (self.max_grad_norm or 0) > 0:
            est = self.attempt({}, self.batch_size, self.grad_accum, None)
            if est is not None:
                self.add([_fmt_flag("max_grad_norm", 0)], est,
                         "eager schedule, no held gradients; changes the recipe: no clipping")


def suggest(split: SplitModel, rt: RuntimeConfig, budget: Budget, *, batch_size: int, seq_len: int,
            grad_accum: int, max_grad_norm: float | None, limit: int = 8, padded: bool = True) -> list[str]:
    """Changes that fit per the estimate, cheapest first; each a line of CLI flags + the result.

    Each candidate change is tried at the current micro-batch; where it does not fit, the
    largest micro-batch that does is searched (bisection: the estimate is monotone in the
    batch), keeping the sequences per step through more accumulation. A candidate that
    only fits at the same reduced batch as the plain batch reduction adds nothing and is
    left out.
    """
    s = _Suggestions(split=split, rt=rt, budget=budget, batch_size=batch_size, seq_len=seq_len,
                     grad_accum=grad_accum, max_grad_norm=max_grad_norm, limit=limit, padded=padded)
    s.consider({})            # the same configuration with a smaller micro-batch (more accumulation)
    s.auto_placement()
    s.slide_buffers()
    s.head_chunks()
    s.modes()
    s.all_at_once()
    s.checkpoints_in_held()
    s.compact_moments()
    s.no_clipping()
    return s.out
