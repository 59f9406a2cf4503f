"""A preference run's part of `train` (issue 47): what the trainer does differently for pairs.

The trainer (trainer.py) holds one `PairRun` where the objective is a preference one and asks it:
the reference pass before step 1 (and before a resume loads its checkpoint's weights: the
reference is the initial weights), each step's micro-batches of whole pairs, the held-out
evaluation and its one-line description, and what summary.json and the model card say of the
data. Under data parallel the reference pass and the evaluation are collectives: every rank runs
the same forwards and gets every pair's sums (objectives/reference.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..data.batch import Batch
from ..data.pair_source import PairSampler
from ..data.preference import TokenizedPair
from .evaluation import evaluate_pairs, heldout_pairs
from .reference import cached_reference_logps

if TYPE_CHECKING:
    from ..parallel.ranks import Ranks


@dataclass
class PairRun:
    sampler: PairSampler              # the training pairs and each step's micro-batches (data/pair_source.py)
    batch_size: int                   # pairs a micro-batch on each rank (--batch-size)
    eval_batches: int                 # --eval-batches (0: every held-out pair)
    ranks: "Ranks"
    heldout_reference: torch.Tensor | None = None    # [evaluated pairs, 2] the reference's sums
    reference_s: float | None = None                 # the reference pass's seconds (or the cache's read)
    reference_cached: bool | None = None             # read from the cache rather than computed

    @property
    def objective(self):
        return self.sampler.objective

    def step_batches(self, step: int) -> list[Batch]:
        return self.sampler.step_batches(step)

    def has_heldout(self) -> bool:
        return len(self.sampler.data.heldout) > 0

    def evaluated(self) -> list[TokenizedPair]:
        """The held-out pairs each evaluation scores: --eval-batches global batches of them (--batch-size
        pairs a rank), so N ranks at batch b evaluate the pairs one rank at N b does."""
        return heldout_pairs(self.sampler.data.heldout, self.batch_size * self.ranks.world_size, self.eval_batches)

    def prepare_reference(self, engine, cache_dir: Path | None, fingerprint: str, dtype: str) -> None:
        """DPO's and IPO's reference log-probabilities of the training pairs and the evaluated held-out
        ones: read from the data cache where a run on the same weights and pairs left them, else
        computed by the engine with its current (initial) weights and written there; said in a line."""
        if not self.objective.needs_reference:
            return
        data, evaluated = self.sampler.data, self.evaluated()
        t0 = time.perf_counter()
        # under data parallel the ranks share the forwards and each gets every pair's sums; rank 0
        # alone reads and writes the cache (cached_reference_logps)
        ref = cached_reference_logps(engine, data.train + evaluated, self.objective, self.sampler.pad_id,
                                     data.max_length, self.batch_size, cache_dir, fingerprint, dtype, self.ranks)
        self.reference_s, self.reference_cached = time.perf_counter() - t0, ref.read
        self.sampler.reference, self.heldout_reference = ref.logps[:len(data.train)], ref.logps[len(data.train):]
        n = len(data.train) + len(evaluated)
        how = (f"read from {ref.file}" if ref.read else f"computed in {self.reference_s:.1f} s (a forward over "
               f"{2 * n} sequences)" + (f", cached in {ref.file}" if ref.file is not None else ""))
        print(f"reference log-probabilities of {n} pairs ({len(data.train)} training, {len(evaluated)} held out): {how}")

    def evaluate(self, engine) -> dict[str, float]:
        """The objective's held-out loss and TRL's eval_rewards/... (a collective under data parallel)."""
        return evaluate_pairs(engine, self.evaluated(), self.heldout_reference, self.objective, self.sampler.pad_id,
                              self.sampler.data.max_length, self.batch_size, self.ranks)

    def describe(self, held: dict[str, float]) -> str:
        return (f"{self.objective.objective} loss {held['eval_loss']:.4f}  reward accuracy "
                f"{held['eval_rewards/accuracies']:.3f}  reward margin {held['eval_rewards/margins']:.4f}")

    def data_line(self) -> str:
        """The run's data in one line (the model card's)."""
        d = self.sampler.data
        return (f"{d.source}: {len(d.train)} preference pairs (sequences up to {d.max_length} tokens), "
                f"{len(d.heldout)} held out")

    def summary(self) -> dict:
        """summary.json's fields of the data and the reference pass."""
        d = self.sampler.data
        return dict(data_source=d.source, train_sequences=2 * len(d.train), heldout_sequences=2 * len(d.heldout),
                    train_pairs=len(d.train), heldout_pairs=len(d.heldout), reference_s=self.reference_s,
                    reference_cached=self.reference_cached)
