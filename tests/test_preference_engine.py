"""The engines' head for preference objectives (issue 47): both engines follow a plain PyTorch
reference of DPO, IPO, SimPO and ORPO (a stock HF model's full logits, each sequence's completion
log-probability summed, objectives/preference.pair_loss plus the NLL term, clipping, AdamW) over
three steps, to the numerical contract's 1e-5; micro-batches of whole pairs add up to the step's
batch; the first DPO loss with the policy as its own reference is ln 2; TRL's metrics come back."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from reference import ReferenceTrainer, build_reference
from test_equivalence import LR, VOCAB, make_loaded, max_param_rel_diff
from slidetune.data.preference import TokenizedPair, collate_pairs, pair_micro_batches
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.objectives.preference import PreferenceConfig, pair_loss

PAIRS = 4
STEPS = 3
RUNS = {   # (mode, schedule, micro-batches, max_grad_norm, extra runtime options)
    "plain": ("gpu", "auto", 1, None, {}),
    "plain-accum2-clip": ("gpu", "auto", 2, 0.5, {}),
    "slide-eager": ("slide", "eager", 1, None, {}),
    "slide-deferred-accum2-clip": ("slide", "deferred", 2, 0.5, {}),
    "slide-deferred-accum4-clip-vocab-device": ("slide", "deferred", 4, 0.5, {"vocab_update": "device"}),
}


def make_pairs(step: int) -> list[TokenizedPair]:
    """PAIRS random pairs: prompts of 3-6 tokens, completions of 2-8 (so rows pad differently)."""
    g = torch.Generator().manual_seed(500 + step)

    def ids(lo: int, hi: int) -> list[int]:
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()
    return [TokenizedPair(f"pair {i}", ids(3, 6), ids(2, 8), ids(2, 8)) for i in range(PAIRS)]


def sequence_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each sequence's completion log-probability sum [2P], its completion tokens [2P], the NLL
    tokens' summed CE) from the model's full logits."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits     # [2P, S, V]
    ce = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), ignore_index=-100,
                         reduction="none")                                                  # [2P * S]
    p = batch.pairs
    seqs = batch.input_ids.shape[0]
    logps = -torch.zeros(seqs, dtype=ce.dtype).index_add(0, p.seq_of, ce * p.completion)
    tokens = torch.zeros(seqs, dtype=torch.long).index_add(0, p.seq_of, p.completion.long())
    return logps, tokens, (ce * p.nll).sum()


class PreferenceReference(ReferenceTrainer):
    """ReferenceTrainer's clipping and AdamW; the step's loss the objective's on the whole batch."""

    def __init__(self, model, cfg: PreferenceConfig, **kw):
        super().__init__(model, **kw)
        self.cfg = cfg

    def step(self, batch, lr):
        self.opt.zero_grad(set_to_none=True)
        logps, tokens, nll = sequence_logps(self.model, batch)
        loss = pair_loss(self.cfg, logps, tokens, batch.pairs.ref_logps).loss
        if self.cfg.nll_weight:
            loss = loss + self.cfg.nll_weight * nll / batch.pairs.nll_tokens_in_step
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              self.max_grad_norm if self.max_grad_norm else float("inf"))
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        return float(loss.detach()), float(norm)


def reference_logps(loaded, cfg: PreferenceConfig, steps: int) -> list[torch.Tensor | None]:
    """Each step's reference sums [2P] (the initial weights'), where the objective has one."""
    if not cfg.needs_reference:
        return [None] * steps
    model = build_reference(loaded)
    with torch.no_grad():
        return [sequence_logps(model, pair_micro_batches(collate_pairs(make_pairs(s), 0), cfg)[0])[0]
                for s in range(steps)]


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "orpo"])
@pytest.mark.parametrize("fam", ["llama", "qwen3-tied"])
def test_preference_objectives_follow_the_reference(fam, objective, run):
    mode, schedule, micro, clip, extra = RUNS[run]
    family, tied = {"llama": ("llama", False), "qwen3-tied": ("qwen3", True)}[fam]
    loaded = make_loaded(family, tied)
    cfg = PreferenceConfig(objective, beta=0.5, cpo_alpha=0.7)
    refs = reference_logps(loaded, cfg, STEPS)
    ref = PreferenceReference(build_reference(loaded), cfg, lr=LR, weight_decay=0.1, eps=1e-6, max_grad_norm=clip)
    rt = RuntimeConfig(mode=mode, dtype="fp32", device="cpu", schedule=schedule, head_chunk_tokens=16, chunk_mb=1,
                       **extra)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, weight_decay=0.1, eps=1e-6), grad_accum=micro,
                          max_grad_norm=clip, objective=cfg)
    try:
        for step in range(STEPS):
            collated = collate_pairs(make_pairs(step), pad_id=0)
            lr = LR * (0.5 + step)
            ref_loss, ref_norm = ref.step(pair_micro_batches(collated, cfg, refs[step])[0], lr)
            res = engine.train_step(pair_micro_batches(collated, cfg, refs[step], micro), lr)
            assert res.loss == pytest.approx(ref_loss, rel=1e-5), f"step {step}"
            assert res.grad_norm() == pytest.approx(ref_norm, rel=1e-5), f"step {step}"
            if step == 0 and objective == "dpo":
                assert res.loss == pytest.approx(math.log(2), rel=1e-6)     # the policy is its reference
            assert set(res.metrics) == {"rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                        "rewards/margins", "logps/chosen", "logps/rejected"}
        engine.synchronize()
        worst, where = max_param_rel_diff(engine, ref.model)
        assert worst < 1e-5, f"{where}: relative difference {worst:.2e}"
    finally:
        engine.close()


def test_metrics_are_trls_over_the_steps_pairs():
    """The step's metrics are TRL's, over every micro-batch's pairs in the batch's order: the
    chosen and rejected sums as the reference computes them, rewards beta x the log-ratios."""
    loaded = make_loaded("llama", False)
    cfg = PreferenceConfig("dpo", beta=0.5)
    refs = reference_logps(loaded, cfg, 1)
    ref_model = build_reference(loaded)
    collated = collate_pairs(make_pairs(0), pad_id=0)
    whole = pair_micro_batches(collated, cfg, refs[0])[0]
    with torch.no_grad():
        logps, _, _ = sequence_logps(ref_model, whole)
    engine = build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu", head_chunk_tokens=16),
                          AdamWConfig(lr=LR), grad_accum=2, objective=cfg)
    try:
        m = engine.train_step(pair_micro_batches(collated, cfg, refs[0], 2), LR).metrics
    finally:
        engine.close()
    chosen, rejected = logps.chunk(2)
    assert m["logps/chosen"] == pytest.approx(float(chosen.mean()), rel=1e-5)
    assert m["logps/rejected"] == pytest.approx(float(rejected.mean()), rel=1e-5)
    assert m["rewards/chosen"] == pytest.approx(0.0, abs=1e-5) and m["rewards/margins"] == pytest.approx(0.0, abs=1e-5)


def test_a_pair_batch_and_a_supervised_engine_refuse_each_other():
    loaded = make_loaded("llama", False, layers=2)
    cfg = PreferenceConfig("dpo")
    batches = pair_micro_batches(collate_pairs(make_pairs(0), pad_id=0), cfg, torch.zeros(2 * PAIRS))
    engine = build_engine(loaded, RuntimeConfig(mode="slide", dtype="fp32", device="cpu"), AdamWConfig(lr=LR))
    try:
        with pytest.raises(ValueError, match="preference pairs reached a supervised run"):
            engine.train_step(batches, LR)
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_the_slide_engines_preference_head_on_the_gpu(objective):
    """The slide engine's preference head on CUDA (the fused head's per-row losses, the clipped
    schedule, two micro-batches) in FP32 against the CPU reference, within the GPU's FP32 noise."""
    torch.backends.cuda.matmul.allow_tf32 = False
    loaded = make_loaded("qwen3", True)
    cfg = PreferenceConfig(objective, beta=0.5)
    refs = reference_logps(loaded, cfg, STEPS)
    ref = PreferenceReference(build_reference(loaded), cfg, lr=LR, weight_decay=0.1, eps=1e-6, max_grad_norm=0.5)
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cuda", head_chunk_tokens=16)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, weight_decay=0.1, eps=1e-6), grad_accum=2,
                          max_grad_norm=0.5, objective=cfg)
    try:
        for step in range(STEPS):
            collated = collate_pairs(make_pairs(step), pad_id=0)
            ref_loss, _ = ref.step(pair_micro_batches(collated, cfg, refs[step])[0], LR)
            res = engine.train_step(pair_micro_batches(collated, cfg, refs[step], 2), LR)
            assert res.loss == pytest.approx(ref_loss, rel=1e-4), f"step {step}"
        engine.synchronize()
        worst, where = max_param_rel_diff(engine, ref.model)
        assert worst < 1e-4, f"{where}: relative difference {worst:.2e}"
    finally:
        engine.close()
