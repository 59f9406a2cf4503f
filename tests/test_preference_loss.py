"""The preference losses (objectives/preference.py, issue 47) against TRL 1.16: SimPO through
CPOTrainer.cpo_loss and ORPO through ORPOTrainer.odds_ratio_loss themselves; DPO and IPO, whose
loss TRL computes inside DPOTrainer._compute_loss, against its lines transcribed below."""
from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

from slidetune.objectives.preference import PreferenceConfig, coefficients, metrics, pair_loss


def _batch(seed=0, pairs=5):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(2 * pairs, generator=g, dtype=torch.float64) * 40 - 1      # [2B] sums of log-probs
    ref = logps + torch.randn(2 * pairs, generator=g, dtype=torch.float64)          # [2B]
    tokens = torch.randint(1, 30, (2 * pairs,), generator=g)                       # [2B]
    return logps, ref, tokens


def _trl_dpo(loss_type, beta, logps, ref, tokens):
    """DPOTrainer._compute_loss (trl 1.16), f_divergence reverse_kl, one loss type, no weighting."""
    chosen_logps, rejected_logps = logps.chunk(2)
    ref_chosen_logps, ref_rejected_logps = ref.chunk(2)
    chosen_scores = chosen_logps - ref_chosen_logps
    rejected_scores = rejected_logps - ref_rejected_logps
    delta_score = chosen_scores - rejected_scores
    if loss_type == "sigmoid":
        per_sequence_loss = -F.logsigmoid(beta * delta_score)
    else:
        chosen_n, rejected_n = tokens.chunk(2)
        ipo_delta = chosen_scores / chosen_n.clamp(min=1.0) - rejected_scores / rejected_n.clamp(min=1.0)
        per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
    return per_sequence_loss.mean(), beta * chosen_scores, beta * rejected_scores


@pytest.mark.parametrize("objective, loss_type", [("dpo", "sigmoid"), ("ipo", "ipo")])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_and_ipo_follow_trls_dpo_trainer(objective, loss_type, beta):
    logps, ref, tokens = _batch()
    cfg = PreferenceConfig(objective, beta=beta)
    ours = pair_loss(cfg, logps, tokens, ref)
    loss, chosen_rewards, rejected_rewards = _trl_dpo(loss_type, beta, logps, ref, tokens.double())
    assert torch.allclose(ours.loss.double(), loss, rtol=1e-6)
    assert torch.allclose(ours.chosen_rewards.double(), chosen_rewards, rtol=1e-6)
    m = metrics(cfg, ours, logps, tokens)
    assert m["rewards/accuracies"] == pytest.approx((chosen_rewards > rejected_rewards).double().mean().item())
    assert m["logps/chosen"] == pytest.approx(logps.chunk(2)[0].mean().item())


def test_dpo_starts_at_ln2_with_the_policy_equal_to_its_reference():
    logps, _, tokens = _batch(1)
    out = pair_loss(PreferenceConfig("dpo"), logps, tokens, logps.clone())
    assert out.loss.item() == pytest.approx(math.log(2), abs=1e-7) and out.loss.item() == pytest.approx(0.693147, abs=5e-7)


def _cpo_stub(beta, gamma, smoothing):
    return types.SimpleNamespace(alpha=0.0, beta=beta, loss_type="simpo", simpo_gamma=gamma, label_smoothing=smoothing,
                                 accelerator=types.SimpleNamespace(device=torch.device("cpu")))


@pytest.mark.parametrize("beta, gamma, smoothing", [(0.1, 0.5, 0.0), (2.0, 1.0, 0.1)])
def test_simpo_is_cpo_trainers_loss_on_per_token_log_probabilities(beta, gamma, smoothing):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    logps, _, tokens = _batch(2)
    cfg = PreferenceConfig("simpo", beta=beta, simpo_gamma=gamma, label_smoothing=smoothing)
    ours = pair_loss(cfg, logps, tokens)
    avg = logps / tokens                        # CPOTrainer's average_log_prob for simpo
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(_cpo_stub(beta, gamma, smoothing), *avg.chunk(2))
    assert torch.allclose(ours.per_pair.double(), losses.double(), rtol=1e-6)
    assert torch.allclose(ours.chosen_rewards.double(), chosen_rewards.double(), rtol=1e-6)
    assert cfg.nll_weight == 1.0 and PreferenceConfig("simpo", cpo_alpha=0.0).nll_weight == 0.0


def test_orpo_is_orpo_trainers_odds_ratio_term():
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer
    logps, _, tokens = _batch(3)
    tokens = tokens.clamp(min=8)                # per-token log-probs in (-5, 0): both log1mexp branches
    cfg = PreferenceConfig("orpo", beta=0.25)
    ours = pair_loss(cfg, logps, tokens)
    stub = types.SimpleNamespace(beta=0.25, accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    losses, chosen_rewards, _, _, _ = ORPOTrainer.odds_ratio_loss(stub, *(logps / tokens).chunk(2))
    # ORPOTrainer: loss = nll - losses.mean(); ours keeps the preference term, the NLL's weight apart
    assert torch.allclose(ours.per_pair.double(), -losses.double(), rtol=1e-6)
    assert torch.allclose(ours.chosen_rewards.double(), chosen_rewards.double(), rtol=1e-6)
    assert cfg.nll_weight == 1.0 and not cfg.needs_reference


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "orpo"])
def test_the_heads_coefficients_are_the_losss_gradient_in_each_sum(objective):
    logps, ref, tokens = _batch(4)
    cfg = PreferenceConfig(objective)
    out, coef = coefficients(cfg, logps, tokens, ref)
    # central differences of the loss in each sequence's sum
    for i in range(logps.numel()):
        step = torch.zeros_like(logps)
        step[i] = 1e-6
        numeric = (pair_loss(cfg, logps + step, tokens, ref).loss - pair_loss(cfg, logps - step, tokens, ref).loss) / 2e-6
        assert coef[i].item() == pytest.approx(numeric.item(), rel=1e-4, abs=1e-9)
    assert out.loss.item() == pytest.approx(pair_loss(cfg, logps, tokens, ref).loss.item())


def test_bad_settings_and_a_missing_reference_are_refused():
    with pytest.raises(ValueError, match="objective 'kto'"):
        PreferenceConfig("kto")
    with pytest.raises(ValueError, match="beta = 0"):
        PreferenceConfig("dpo", beta=0)
    with pytest.raises(ValueError, match="label_smoothing = 0.5"):
        PreferenceConfig("simpo", label_smoothing=0.5)
    logps, _, tokens = _batch()
    with pytest.raises(ValueError, match="reference's log-probabilities are needed"):
        pair_loss(PreferenceConfig("dpo"), logps, tokens)


def _head_case(seed=0, pairs=3, length=8):
    """A head's inputs for `pairs` pairs: chosen rows then rejected rows, the first 3 tokens of each
    the prompt; ORPO's NLL runs over the chosen rows' every token, SimPO's over their completions."""
    g = torch.Generator().manual_seed(seed)
    n, d, vocab = 2 * pairs * length, 8, 29
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(vocab, d, generator=g, dtype=torch.float64) / d ** 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    seq_of = torch.arange(n) // length
    completion = (torch.arange(n) % length) >= 3
    chosen_row = seq_of < pairs
    ref = torch.randn(2 * pairs, generator=g, dtype=torch.float64) - 12
    return hidden, weight, targets, seq_of, completion, chosen_row, ref


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "orpo"])
@pytest.mark.parametrize("micro", [1, 3])
def test_head_scales_give_the_whole_objectives_gradients_micro_batch_by_micro_batch(objective, micro):
    """head_scales between the head's two passes, over `micro` micro-batches of whole pairs, sums to
    autograd's gradients of the whole objective (TRL's: the preference term's mean over pairs, plus
    SimPO's cpo_alpha x its chosen completions' mean NLL, or ORPO's chosen rows' mean NLL)."""
    from slidetune.objectives.preference import PairTokens, head_scales
    from slidetune.ops.cross_entropy import IGNORE_INDEX, linear_cross_entropy_grads, linear_token_losses
    pairs, length = 3, 8
    hidden, weight, targets, seq_of, completion, chosen_row, ref = _head_case(pairs=pairs, length=length)
    cfg = PreferenceConfig(objective, beta=0.4, cpo_alpha=0.7)
    nll = chosen_row & (completion if objective == "simpo" else torch.ones_like(completion))
    used = completion | (nll if cfg.nll_weight else torch.zeros_like(nll))
    labels = targets.masked_fill(~used, IGNORE_INDEX)
    # autograd through the full logits
    ce = F.cross_entropy(F.linear(hidden, weight), labels, ignore_index=IGNORE_INDEX, reduction="none")
    logps = -torch.zeros(2 * pairs, dtype=ce.dtype).index_add(0, seq_of, ce * completion)
    tokens = torch.zeros(2 * pairs, dtype=torch.long).index_add(0, seq_of, completion.long())
    total = pair_loss(cfg, logps, tokens, ref).loss + cfg.nll_weight * (ce * nll).sum() / nll.sum()
    want = torch.autograd.grad(total, (hidden, weight))
    # the head, one micro-batch of whole pairs at a time (pair j: rows j and pairs + j)
    got_h, got_w, value = torch.zeros_like(hidden), torch.zeros_like(weight), 0.0
    for part in torch.arange(pairs).chunk(micro):
        rows = torch.cat([part, part + pairs])                              # the micro-batch's sequences
        idx = (rows[:, None] * length + torch.arange(length)).reshape(-1)    # their tokens, chosen first
        local = torch.arange(len(rows)).repeat_interleave(length)
        t = PairTokens(local, completion[idx], nll[idx], ref[rows], pairs_in_step=pairs,
                       nll_tokens_in_step=int(nll.sum()))
        h, y = hidden.detach()[idx], labels[idx]
        token_ce = linear_token_losses(h, weight.detach(), y, "chunked", 5)
        out, scale, _, _ = head_scales(cfg, token_ce, t)
        _, g_h, g_w, _, _ = linear_cross_entropy_grads(h, weight.detach(), y, scale, "chunked", 5)
        got_h[idx] += g_h
        got_w += g_w
        value += out.loss.item() + cfg.nll_weight * (token_ce * t.nll).sum().item() / t.nll_tokens_in_step
    assert value == pytest.approx(total.item(), rel=1e-12)
    for a, b in zip((got_h, got_w), want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
