"""What the engines' head computes for one micro-batch, by objective (issue 47).

Supervised fine-tuning (the default): one pass over the head, each token's cross-entropy summed,
its gradients scaled by 1 / the step's target tokens (models/units.head_loss_and_grads). A
preference objective (objectives/preference.py) needs each sequence's whole log-probability
before any token's gradient can be scaled, so its head takes two passes over the same chunks of
logits: each token's CE (the forward alone), then the gradients with each token scaled by its
sequence's coefficient (`head_scales`). Both engines call `head_step`; neither keeps logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .preference import PairLoss, PairTokens, PreferenceConfig, head_scales, metric_sums, metrics_of_sums


@dataclass
class PairStats:
    """A micro-batch's pairs as TRL's metrics read them (device tensors, read once a step)."""
    out: PairLoss                 # the preference term (its rewards per pair)
    logps: torch.Tensor           # [2P] the sequences' completion log-probability sums
    tokens: torch.Tensor          # [2P] their completion tokens


@dataclass
class HeadResult:
    loss: torch.Tensor                 # [] the micro-batch's part of the step's loss (see step_loss)
    g_hidden: torch.Tensor             # [B, S, d] the gradient reaching the last layer's output
    grads: dict[str, torch.Tensor]     # the head's parameter gradients (a tied weight's: "lm_head.weight")
    pairs: PairStats | None = None


def head_step(split, params: dict[str, torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
              pairs: PairTokens | None, objective: PreferenceConfig | None, scale: float,
              lm_weight: torch.Tensor | None, impl: str, chunk_tokens: int) -> HeadResult:
    """The head of one micro-batch: hidden [B, S, d] (the last layer's output), labels [B, S].
    Supervised: the tokens' summed CE, gradients x `scale`. Preference (`objective` and the batch's
    `pairs`): the micro-batch's share of the step's mean preference term plus its NLL term's share,
    gradients of exactly that; `scale` is not used (the step's normalization is in `pairs`)."""
    if objective is None:
        if pairs is not None:
            raise ValueError("a batch of preference pairs reached a supervised run's head")
        loss, g_h, grads = split.head_loss_and_grads(params, hidden, labels, scale, lm_weight=lm_weight,
                                                     impl=impl, chunk_tokens=chunk_tokens)
        return HeadResult(loss, g_h, grads)
    if pairs is None:
        raise ValueError(f"objective {objective.objective}: the batch carries no preference pairs")
    token_ce = split.head_token_losses(params, hidden, labels, lm_weight=lm_weight, impl=impl,
                                       chunk_tokens=chunk_tokens)                                # [N]
    out, token_scale, logps, tokens = head_scales(objective, token_ce, pairs)
    _, g_h, grads = split.head_loss_and_grads(params, hidden, labels, token_scale.to(token_ce.dtype),
                                              lm_weight=lm_weight, impl=impl, chunk_tokens=chunk_tokens)
    loss = out.loss
    if objective.nll_weight:
        nll = (token_ce * pairs.nll).sum(dtype=out.loss.dtype)
        loss = loss + objective.nll_weight * nll / max(pairs.nll_tokens_in_step, 1)
    return HeadResult(loss, g_h, grads, PairStats(out, logps, tokens))


def step_loss(objective: PreferenceConfig | None, loss_sum: float, n_tokens: int) -> float:
    """The step's reported loss from its micro-batches' summed head losses: supervised, the mean
    over the step's target tokens; preference, the sum itself (each part already its share)."""
    return loss_sum / n_tokens if objective is None else loss_sum


def step_metrics(objective: PreferenceConfig | None, stats: list[PairStats],
                 sum_over_ranks: Callable[[list[float]], list[float]] | None = None) -> dict[str, float]:
    """TRL's preference metrics over the step's pairs (every micro-batch; with `sum_over_ranks`, a
    data-parallel step's every rank's: their sums added, a collective every rank calls); {} for
    supervised."""
    if objective is None or not stats:
        return {}
    out = PairLoss(torch.stack([s.out.loss for s in stats]).sum(), torch.cat([s.out.per_pair for s in stats]),
                   torch.cat([s.out.chosen_rewards for s in stats]), torch.cat([s.out.rejected_rewards for s in stats]))
    # each micro-batch's sequences are its chosen rows then its rejected rows: regroup the step's
    logps = torch.cat([s.logps.chunk(2)[0] for s in stats] + [s.logps.chunk(2)[1] for s in stats])
    tokens = torch.cat([s.tokens.chunk(2)[0] for s in stats] + [s.tokens.chunk(2)[1] for s in stats])
    sums = metric_sums(objective, out, logps, tokens)
    return metrics_of_sums(sum_over_ranks(sums) if sum_over_ranks is not None else sums)
