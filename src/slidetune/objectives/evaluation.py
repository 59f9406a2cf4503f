"""A preference run's held-out evaluation (issue 47): the objective's loss and TRL's metrics on pairs
the run does not train on, with the current weights.

Each held-out pair is scored by the same forward-only pass as the reference (reference.score_pairs);
its loss is the objective's (pair_loss's mean over the pairs, plus SimPO's or ORPO's NLL term over
the chosen rows' tokens) against the reference's sums of the same pairs, computed before step 1 with
the training pairs'. The metrics are TRL's evaluation names: `eval_loss`, `eval_rewards/accuracies`
(the share of pairs whose chosen completion the policy prefers, relative to the reference for DPO and
IPO), `eval_rewards/margins`, ..., as DPOTrainer logs them at each evaluation.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..data.pair_source import reference_rows
from ..data.preference import TokenizedPair
from .preference import PreferenceConfig, metrics, pair_loss
from .reference import score_pairs

if TYPE_CHECKING:
    from ..parallel.ranks import Ranks


def heldout_pairs(heldout: list[TokenizedPair], batch_pairs: int, max_batches: int) -> list[TokenizedPair]:
    """The held-out pairs an evaluation scores: the first `max_batches` batches of them (0: all)."""
    return heldout[:max_batches * batch_pairs] if max_batches else heldout


def evaluate_pairs(engine, pairs: list[TokenizedPair], reference: torch.Tensor | None, cfg: PreferenceConfig,
                   pad_id: int, max_length: int | None, batch_pairs: int,
                   ranks: "Ranks | None" = None) -> dict[str, float]:
    """{eval_loss, eval_rewards/chosen, ..., eval_logps/rejected} of `pairs` with the engine's current
    weights; `reference` [len(pairs), 2] the reference's sums where the objective has one. Several
    `ranks` share the forwards and each gets every pair's scores (score_pairs; a collective), so
    every rank computes the same metrics."""
    scores = score_pairs(engine, pairs, cfg, pad_id, max_length, batch_pairs, ranks)
    idx = list(range(len(pairs)))
    logps, tokens = reference_rows(scores.logps, idx), reference_rows(scores.tokens, idx)      # [2n] each
    ref = reference_rows(reference, idx) if cfg.needs_reference else None
    out = pair_loss(cfg, logps, tokens, ref)
    loss = float(out.loss)
    if cfg.nll_weight:
        loss += cfg.nll_weight * scores.nll_sum / max(scores.nll_tokens, 1)
    return {"eval_loss": loss, **{f"eval_{k}": v for k, v in metrics(cfg, out, logps, tokens).items()}}
