"""The preference losses as functions of each sequence's completion log-probabilities (issue 47).

A batch of B pairs is 2B sequences (data/preference.py `collate_pairs`: rows 0..B-1 chosen,
B..2B-1 rejected). The engine's head reduces each sequence to the sum of its completion tokens'
log-probabilities (`logps`, [2B]) and counts those tokens (`tokens`, [2B]); a pair's loss depends
on its own two sums alone (and the reference's, precomputed), so the loss's gradient with respect
to a sequence's sum, `coefficients`, is all the head needs to scale each of its tokens' gradients
by: no logits kept, no second model. Each objective is TRL's, with its names and defaults:

  dpo    DPOTrainer, loss_type "sigmoid":  -log sigmoid(beta ((c - c_ref) - (r - r_ref)))
  ipo    DPOTrainer, loss_type "ipo": ((c - c_ref) / n_c - (r - r_ref) / n_r - 1 / (2 beta))^2, n the
         completion's tokens (TRL normalizes IPO by length)
  simpo  CPOTrainer, loss_type "simpo" (no reference): -log sigmoid(beta (c / n_c - r / n_r) - gamma),
         label smoothing as CPO's, plus cpo_alpha x the chosen completions' mean token NLL
  orpo   ORPOTrainer (no reference): the chosen sequences' mean token NLL - beta x log sigmoid(log odds
         of c / n_c against r / n_r)

where c and r are a pair's chosen and rejected sums. The reduction over pairs is the mean, as TRL's.
The NLL terms of SimPO and ORPO are the SFT cross-entropy on the chosen rows (ORPO's over the
prompt's tokens too, as ORPOTrainer's); `nll_weight` is their weight. `head_scales` turns the
head's first pass (each token's CE) into the second pass's per-token gradient factors for a
micro-batch of whole pairs, normalized over the step (its micro-batches' gradients add up to the
whole batch's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

OBJECTIVES = ("sft", "dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclass(frozen=True)
class PreferenceConfig:
    """The preference objectives' hyperparameters, TRL's names and defaults."""
    objective: str = "dpo"
    beta: float = 0.1              # DPOConfig.beta, CPOConfig.beta, ORPOConfig.beta (ORPO's lambda)
    label_smoothing: float = 0.0   # CPOConfig.label_smoothing (SimPO)
    simpo_gamma: float = 0.5       # CPOConfig.simpo_gamma: the target reward margin
    cpo_alpha: float = 1.0         # CPOConfig.cpo_alpha: the chosen NLL's weight in SimPO (0: SimPO's paper)

    def __post_init__(self):
        if self.objective not in OBJECTIVES[1:]:
            raise ValueError(f"objective {self.objective!r}: one of {', '.join(OBJECTIVES[1:])}")
        if not self.beta > 0:
            raise ValueError(f"beta = {self.beta}: must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing = {self.label_smoothing}: must be in [0, 0.5)")

    @property
    def needs_reference(self) -> bool:
        return self.objective not in REFERENCE_FREE

    @property
    def nll_weight(self) -> float:
        """The weight of the chosen rows' mean token NLL in the loss (SimPO's cpo_alpha, ORPO's 1)."""
        return {"simpo": self.cpo_alpha, "orpo": 1.0}.get(self.objective, 0.0)


@dataclass(frozen=True)
class PairLoss:
    loss: torch.Tensor            # [] the preference term, mean over pairs (the NLL term apart)
    per_pair: torch.Tensor        # [B]
    chosen_rewards: torch.Tensor  # [B] TRL's rewards/chosen before the mean
    rejected_rewards: torch.Tensor


def pair_loss(cfg: PreferenceConfig, logps: torch.Tensor, tokens: torch.Tensor,
              ref_logps: torch.Tensor | None = None) -> PairLoss:
    """The preference term of a batch: logps and tokens [2B] (chosen rows first), ref_logps [2B]
    the reference's sums where the objective has one. Differentiable in logps."""
    c, r = _wide(logps).chunk(2)                                        # [B] each
    n_c, n_r = tokens.to(c.dtype).clamp(min=1).chunk(2)
    beta = cfg.beta
    if cfg.needs_reference:
        if ref_logps is None:
            raise ValueError(f"objective {cfg.objective}: the reference's log-probabilities are needed")
        c_ref, r_ref = _wide(ref_logps).chunk(2)
        chosen_ratio, rejected_ratio = c - c_ref, r - r_ref
        if cfg.objective == "dpo":
            per_pair = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
        else:   # ipo
            per_pair = (chosen_ratio / n_c - rejected_ratio / n_r - 1 / (2 * beta)) ** 2
        rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    elif cfg.objective == "simpo":
        margin = (c / n_c - r / n_r) - cfg.simpo_gamma / beta
        ls = cfg.label_smoothing
        per_pair = -F.logsigmoid(beta * margin) * (1 - ls) - F.logsigmoid(-beta * margin) * ls
        rewards = beta * (c / n_c).detach(), beta * (r / n_r).detach()
    else:       # orpo
        a_c, a_r = c / n_c, r / n_r
        log_odds = (a_c - a_r) - (_log1mexp(a_c) - _log1mexp(a_r))
        per_pair = -beta * F.logsigmoid(log_odds)
        rewards = beta * a_c.detach(), beta * a_r.detach()
    return PairLoss(per_pair.mean(), per_pair, *rewards)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """FP32 at least (sums of thousands of log-probabilities lose their differences in BF16)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (ORPO's odds)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def coefficients(cfg: PreferenceConfig, logps: torch.Tensor, tokens: torch.Tensor,
                 ref_logps: torch.Tensor | None = None) -> tuple[PairLoss, torch.Tensor]:
    """The batch's preference term and d(term)/d(logps) [2B]: the factor each sequence's completion
    tokens' log-probability gradients take in the head."""
    leaf = _wide(logps.detach()).requires_grad_()
    out = pair_loss(cfg, leaf, tokens, ref_logps)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return PairLoss(out.loss.detach(), out.per_pair.detach(), out.chosen_rewards, out.rejected_rewards), grad


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")    # TRL's names, in metric_sums' order


def metric_sums(cfg: PreferenceConfig, out: PairLoss, logps: torch.Tensor, tokens: torch.Tensor) -> list[float]:
    """TRL's preference metrics of a batch as sums over its pairs (METRICS' order), then its pairs:
    parts that add over the ranks of a data-parallel step (each rank's pairs its own part)."""
    c, r = _wide(logps.detach()).chunk(2)
    if not cfg.needs_reference:
        n_c, n_r = tokens.to(c.dtype).clamp(min=1).chunk(2)
        c, r = c / n_c, r / n_r
    margins = out.chosen_rewards - out.rejected_rewards
    parts = (out.chosen_rewards, out.rejected_rewards, (margins > 0).float(), margins, c, r)   # [B] each
    return [float(p.double().sum()) for p in parts] + [float(c.numel())]


def metrics_of_sums(sums: list[float]) -> dict[str, float]:
    """metric_sums' parts (summed over micro-batches or ranks) as TRL's means over the pairs."""
    *totals, pairs = sums
    return {name: total / pairs for name, total in zip(METRICS, totals)}


def metrics(cfg: PreferenceConfig, out: PairLoss, logps: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    """TRL's preference metrics of a batch (their names): rewards and log-probabilities, means over
    pairs; SimPO's and ORPO's log-probabilities are per token, as their trainers log them."""
    return metrics_of_sums(metric_sums(cfg, out, logps, tokens))


@dataclass(frozen=True)
class PairTokens:
    """Which tokens of a micro-batch of whole pairs enter which term (the head's labels are -100
    for the others). N tokens, 2P sequences: the micro-batch's chosen rows, then its rejected rows."""
    seq_of: torch.Tensor         # [N] int64: each token's sequence, 0..2P-1
    completion: torch.Tensor     # [N] bool: tokens summed into their sequence's log-probability
    nll: torch.Tensor            # [N] bool: the NLL term's tokens (SimPO: chosen completions; ORPO: chosen rows)
    ref_logps: torch.Tensor | None   # [2P] the reference's sums, where the objective has one
    pairs_in_step: int           # the step's pairs (every micro-batch): the mean's denominator
    nll_tokens_in_step: int      # the step's NLL tokens: that mean's denominator

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PairTokens":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)
        return PairTokens(move(self.seq_of), move(self.completion), move(self.nll), move(self.ref_logps),
                          self.pairs_in_step, self.nll_tokens_in_step)


def completion_sums(token_ce: torch.Tensor, t: PairTokens, seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each sequence's completion log-probability sum [seqs], FP32 at least; its completion tokens
    [seqs]) from each token's CE [N] (log p = -CE): the head's first pass, and the reference pass."""
    ce = _wide(token_ce)
    logps = -torch.zeros(seqs, dtype=ce.dtype, device=ce.device).index_add(0, t.seq_of, ce * t.completion)
    tokens = torch.zeros(seqs, dtype=torch.long, device=ce.device).index_add(0, t.seq_of, t.completion.long())
    return logps, tokens


def head_scales(cfg: PreferenceConfig, token_ce: torch.Tensor, t: PairTokens
                ) -> tuple[PairLoss, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the head's first pass (each token's CE [N], 0 where ignored) to its second: (the
    micro-batch's preference term with the step's normalization, each token's gradient factor [N]
    for linear_cross_entropy_grads, the sequences' log-probability sums [2P], their token counts
    [2P]). The factor of a completion token is minus its sequence's coefficient (log p = -CE), plus
    the NLL weight over the step's NLL tokens where it is one."""
    seqs = t.seq_of.max().item() + 1 if t.seq_of.numel() else 0
    logps, tokens = completion_sums(token_ce, t, seqs)
    out, coef = coefficients(cfg, logps, tokens, t.ref_logps)
    share = (seqs // 2) / t.pairs_in_step              # this micro-batch's share of the step's mean
    scale = -coef[t.seq_of] * share * t.completion
    if cfg.nll_weight:
        scale = scale + t.nll.to(scale.dtype) * (cfg.nll_weight / max(t.nll_tokens_in_step, 1))
    return PairLoss(out.loss * share, out.per_pair, out.chosen_rewards, out.rejected_rewards), scale, logps, tokens
