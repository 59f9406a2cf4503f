"""The choice by predicted time: of the placements the auto search finds (engine/fit/search.py), each
checked against the budget and priced by the step model (bench/step_model.py: the floor's terms at
probed or nominal rates), the fastest that fits; and what `slidetune plan` says of the others.

A placement must be predicted more than TIE (1%) faster than one the search's order prefers to
displace it: the rates move more than that between calls of one machine (NOTES.md "Floor
probes"), and where only one placement fits, or every one is bound by the same term at the same
time (the GPU's compute, with one layer kind), the order's choice stands as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import RuntimeConfig
from ..placement import PlacementPlan
from ..tiers import TIERS

TIE = 0.03


@dataclass(frozen=True)
class Candidate:
    """One placement the search found: its configuration and plan, its shortfalls against the
    budget ([(what, needed, usable)]; none: it fits), and its predicted step (None outside slide mode)."""
    config: RuntimeConfig
    plan: PlacementPlan | None
    short: tuple[tuple[str, int, int], ...]
    prediction: object | None          # bench.step_model.StepPrediction
    disk: bool                         # it puts units on the disk tier

    @property
    def fits(self) -> bool:
        return not self.short

    @property
    def seconds(self) -> float:
        return self.prediction.seconds if self.prediction is not None else float("inf")


def kept_layers(c: Candidate) -> int:
    """Decoder layers whose weights stay on the GPU between steps (resident or updated there): those
    the forward never waits to upload. The choice keeps at least as many as the search's own order
    chose (its first placement that fits): what they buy, the forward not waiting on uploads, the
    floor's bandwidth terms do not see (every layer resident: Qwen3-8B b16 2.65 -> 2.36 s at the same
    floor, NOTES.md "PCIe uploads"), so the model is not let trade them away for what it does see."""
    return c.plan.resident_layers + c.plan.device_layers if c.plan is not None else 0


def fastest(candidates: list[Candidate]) -> Candidate:
    """The first of `candidates` (the search's order) predicted within TIE of the fastest."""
    best = min(c.seconds for c in candidates)
    return next(c for c in candidates if c.seconds <= best * (1 + TIE))


# The settings a placement is told apart by, as `slidetune plan` names them (key: how to read it)
_SETTINGS = (("lean_layer", lambda c, p: c.layer.lean_layer),
             ("offload_activations", lambda c, p: c.offload_activations),
             ("gpu_checkpoints", lambda c, p: p.gpu_checkpoints),
             ("cache_units", lambda c, p: c.placement.cache_units),
             ("resident_layers", lambda c, p: p.resident_layers),
             ("device_layers", lambda c, p: p.device_layers),
             ("vocab_update", lambda c, p: c.placement.vocab_update),
             ("grad_slot_dtype", lambda c, p: c.transfer.grad_slot_dtype),
             ("disk_units", lambda c, p: len(p.indices(TIERS.with_files))))


def settings_of(c: Candidate) -> dict:
    return {name: read(c.config, c.plan) for name, read in _SETTINGS}


def differences(c: Candidate, chosen: Candidate) -> str:
    """`c`'s settings that differ from the chosen placement's, NAME=value."""
    mine, theirs = settings_of(c), settings_of(chosen)
    return " ".join(f"{k}={v}" for k, v in mine.items() if v != theirs[k]) or "(the same placement)"


@dataclass
class PlacementChoice:
    """What the auto search chose and what it weighed: `candidates` in the search's order (each
    placement once), `chosen` the resolved configuration (the host-only autos applied after the
    choice), `pick` its candidate (None where nothing fits: the one short of least), `rates` where the
    step model's numbers came from, `skipped` the memory recipes not searched (their compute alone
    slower than a placement found)."""
    chosen: RuntimeConfig
    candidates: list[Candidate]
    pick: Candidate | None
    rates: str = ""
    skipped: list[str] = field(default_factory=list)
    kept: int = 0                      # kept_layers of the order's own choice (the least a choice keeps)
    label: str = ""                    # the rates' source in a word or two

    def weighed(self) -> list[Candidate]:
        """The placements the choice was between: those that fit, off the disk tier where any is,
        keeping at least `kept` layers on the GPU (the chosen among them)."""
        fitting = [c for c in self.candidates if c.fits]
        off_disk = [c for c in fitting if not c.disk] or fitting
        return [c for c in off_disk if kept_layers(c) >= self.kept] or [self.pick]

    def rejected(self) -> list[tuple[Candidate, str]]:
        """Every other candidate with why it was not taken: those that fit, the fastest first, then
        those that do not."""
        if self.pick is None:
            return []
        out, best = [], min(c.seconds for c in self.weighed())
        for c in self.candidates:
            if c is self.pick:
                continue
            if not c.fits:
                what, need, usable = c.short[0]
                why = f"does not fit: {what} {need / 2**30:.1f} GiB > {usable / 2**30:.1f} usable"
            elif c.disk and not self.pick.disk:
                why = "puts units on the disk tier (its rate is not predicted without its probe)"
            elif kept_layers(c) < self.kept:
                why = (f"keeps {kept_layers(c)} layers on the GPU between steps, fewer than the order's "
                       f"{self.kept} (the forward's waits on uploads are not in the model)")
            elif c.seconds <= best * (1 + TIE):
                why = f"within {TIE:.0%} of the fastest, as the chosen: the search's order prefers the chosen"
            else:
                why = f"slower ({c.prediction.bound})"
            out.append((c, why))
        return sorted(out, key=lambda cw: (not cw[0].fits, cw[0].seconds))

    def summary_line(self) -> str:
        """One line for `plan`: the chosen placement's predicted step and how many others fit."""
        if self.pick is None or self.pick.prediction is None:
            return ""
        weighed = self.weighed()
        p = self.pick.prediction
        if len(weighed) < 2:
            return f"predicted step {p.seconds:.3f} s (bound by {p.bound}; rates: {self.label})"
        rank = "the fastest" if p.seconds <= min(c.seconds for c in weighed) else f"within {TIE:.0%} of the fastest"
        return (f"predicted step {p.seconds:.3f} s (bound by {p.bound}; rates: {self.label}), {rank} of "
                f"{len(weighed)} placements weighed (plan --terms lists them)")

    def table_lines(self, limit: int = 10) -> list[str]:
        """The rejected alternatives for `plan --terms`: what differs, the predicted step, why not."""
        if self.pick is None or self.pick.prediction is None:
            return []
        p = self.pick.prediction
        lines = [f"predicted step {p.seconds:.3f} s (bound by {p.bound}), rates {self.rates}"]
        rejected = self.rejected()
        if rejected:
            lines.append(f"  {'predicted':>9}  {'bound by':<13} differs from the chosen / why not taken")
        for c, why in rejected[:limit]:
            bound = c.prediction.bound if c.prediction is not None else "-"
            lines.append(f"  {c.seconds:8.3f}s  {bound:<13} {differences(c, self.pick)} / {why}")
        if len(rejected) > limit:
            lines.append(f"  ({len(rejected) - limit} more, slower or not fitting)")
        lines += [f"  not searched: {s}, slower than the chosen" for s in self.skipped]
        return lines if len(lines) > 1 else lines + ["  no other placement was found"]
