"""Preference tuning against TRL's own trainers (issue 47): the same tiny model (fp32, CPU), the same
records, TRL's `DPOTrainer` (loss_type sigmoid and ipo), `CPOTrainer` (loss_type simpo) and
`ORPOTrainer` beside slidetune's engines (with the reference pass for DPO and IPO):
- step 0: the loss and every parameter's gradient (TRL's `compute_loss` and backward on its first
  batch against the plain engine's accumulated gradient), to 1e-5;
- three AdamW steps of the slide engine: every step's loss and gradient norm, and every weight after
  the third step, to the numerical contract's 1e-5.

TRL runs through the HF Trainer: torch's AdamW (betas 0.9 / 0.999, eps 1e-8, no weight decay:
the Trainer exempts biases and norms from it, slidetune does not), a constant learning rate,
clipping at 1.0, its reference model a copy of the policy. Both sides take the whole set as one
batch each step (4 pairs), so the Trainer's shuffling does not change a step's pairs.

slidetune tokenizes pairs as DPOTrainer does (tests/test_preference_data.py: the same ids).
TRL's CPO and ORPO trainers (trl.experimental) tokenize their own way (a BOS before the prompt
where the tokenizer has one), so the engines are given their token ids there: what is compared is
the objective and its training, on the same tokens.
"""
from __future__ import annotations

import math
import warnings

import pytest

from reference import build_reference
from test_data import make_tokenizer
from test_equivalence import make_loaded, max_param_rel_diff
from slidetune.data.pair_source import reference_rows
from slidetune.data.preference import TokenizedPair, collate_pairs, pair_micro_batches, parse_pair, tokenize_pair
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.objectives.preference import PreferenceConfig
from slidetune.objectives.reference import reference_logps

RECORDS = [{"prompt": "a b c", "chosen": " d e", "rejected": " f"},
           {"prompt": "a", "chosen": " b", "rejected": " c d e f g h"},
           {"prompt": "h g", "chosen": " f e d", "rejected": " c b"},
           {"prompt": "b b a", "chosen": " a", "rejected": " a a"}]
LR, STEPS, BETA = 1e-3, 3, 0.3
OBJECTIVES = {"dpo": "sigmoid", "ipo": "ipo", "simpo": "simpo", "orpo": None}     # ours -> TRL's loss_type
TORCH_ADAMW = AdamWConfig(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def trl_trainer(objective: str, model, loaded, tokenizer, tmp_path):
    """TRL's trainer of `objective` on RECORDS (its reference model a copy of `model`, which TRL
    would load from the model's path, which a model built in memory lacks), and the pairs' token ids
    the engines take: TRL's DPOTrainer's are slidetune's own; CPO's and ORPO's their trainers'."""
    from datasets import Dataset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # trl.experimental says it is experimental
        from trl import DPOConfig, DPOTrainer
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=len(RECORDS), max_steps=STEPS,
                  learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                  logging_steps=1, report_to=[], use_cpu=True, bf16=False, beta=BETA, save_strategy="no", seed=0,
                  dataset_num_proc=None)
    data = Dataset.from_list(RECORDS)
    if objective in ("dpo", "ipo"):
        trainer = DPOTrainer(model=model, ref_model=build_reference(loaded), train_dataset=data,
                             args=DPOConfig(loss_type=OBJECTIVES[objective], **common), processing_class=tokenizer)
        return trainer, [tokenize_pair(parse_pair(r, f"record {i}"), tokenizer) for i, r in enumerate(RECORDS)]
    if objective == "simpo":
        args = CPOConfig(loss_type="simpo", cpo_alpha=0.7, simpo_gamma=0.5, remove_unused_columns=False, **common)
        trainer = CPOTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    else:
        trainer = ORPOTrainer(model=model, args=ORPOConfig(remove_unused_columns=False, **common), train_dataset=data,
                              processing_class=tokenizer)
    return trainer, trl_pairs(trainer.train_dataset)


def trl_pairs(dataset) -> list[TokenizedPair]:
    """TRL's CPO / ORPO tokenized rows as slidetune's pairs: the prompt's ids, then each side's rest."""
    out = []
    for i, r in enumerate(dataset):
        n = len(r["prompt_input_ids"])
        assert r["chosen_input_ids"][:n] == r["rejected_input_ids"][:n] == r["prompt_input_ids"]
        out.append(TokenizedPair(f"record {i}", r["prompt_input_ids"], r["chosen_input_ids"][n:],
                                 r["rejected_input_ids"][n:]))
    return out


def engine_for(objective: str, loaded, mode: str, max_grad_norm: float | None = 1.0):
    cfg = PreferenceConfig(objective, beta=BETA, cpo_alpha=0.7, simpo_gamma=0.5)
    rt = RuntimeConfig(mode=mode, dtype="fp32", device="cpu", schedule="deferred", head_chunk_tokens=16)
    return cfg, build_engine(loaded, rt, TORCH_ADAMW, max_grad_norm=max_grad_norm, objective=cfg)


def step_batches(cfg: PreferenceConfig, engine, pairs: list[TokenizedPair], pad_id: int):
    """A step's micro-batch of every pair, with the reference's sums (the engine's current weights:
    before step 1 the policy is the reference) where the objective has one."""
    ref = None
    if cfg.needs_reference:
        values = reference_logps(engine, pairs, cfg, pad_id, None, len(pairs))                # [4, 2]
        ref = reference_rows(values, list(range(len(pairs))))                                 # [8]
    return lambda: pair_micro_batches(collate_pairs(pairs, pad_id), cfg, ref)


def both_sides(objective: str, tmp_path):
    """(tokenizer, the tiny model's weights, TRL's model built from them, TRL's trainer, the pairs)."""
    tokenizer = make_tokenizer()
    loaded = make_loaded("llama", tied=False, layers=2)
    trl_model = build_reference(loaded)
    return (tokenizer, loaded, trl_model, *trl_trainer(objective, trl_model, loaded, tokenizer, tmp_path))


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_step_zeros_loss_and_every_gradient_are_trls(objective, tmp_path):
    tokenizer, loaded, trl_model, trainer, pairs = both_sides(objective, tmp_path)
    batch = next(iter(trainer.get_train_dataloader()))
    trl_model.train()
    trl_loss = trainer.compute_loss(trl_model, batch)
    trl_loss.backward()
    # the plain engine keeps its step's gradients (unclipped: clipping would scale them in place)
    cfg, engine = engine_for(objective, loaded, mode="gpu", max_grad_norm=None)
    try:
        res = engine.train_step(step_batches(cfg, engine, pairs, tokenizer.pad_token_id)(), LR)
        assert res.loss == pytest.approx(float(trl_loss), rel=1e-5)
        if objective == "dpo":
            assert res.loss == pytest.approx(math.log(2), rel=1e-6)
        trl_grads = {n: p.grad for n, p in trl_model.named_parameters()}
        checked = 0
        for unit in engine.units:                                   # each unit's gradient, flat
            for p in unit.spec.params:
                ours = unit.grad[p.offset:p.offset + p.numel].view(p.shape)
                want = trl_grads[p.full_name]
                rel = float((ours - want).norm() / want.norm().clamp(min=1e-30))
                assert rel < 1e-5, f"{p.full_name}: relative difference {rel:.2e}"
                checked += 1
        assert checked == len(trl_grads)
    finally:
        engine.close()


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_three_adamw_steps_follow_trls_trainer(objective, tmp_path):
    tokenizer, loaded, trl_model, trainer, pairs = both_sides(objective, tmp_path)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    trl_losses, trl_norms = [h["loss"] for h in logs], [h["grad_norm"] for h in logs]
    assert len(trl_losses) == STEPS and trl_losses[-1] < trl_losses[0]          # it learns: not a vacuous match
    cfg, engine = engine_for(objective, loaded, mode="slide")
    try:
        batches = step_batches(cfg, engine, pairs, tokenizer.pad_token_id)
        for step in range(STEPS):
            res = engine.train_step(batches(), LR)
            assert res.loss == pytest.approx(trl_losses[step], rel=1e-5), f"step {step}"
            assert res.grad_norm() == pytest.approx(trl_norms[step], rel=1e-5), f"step {step}"
        engine.synchronize()
        worst, where = max_param_rel_diff(engine, trl_model)
        assert worst < 1e-5, f"{where}: relative difference {worst:.2e} after {STEPS} steps"
    finally:
        engine.close()
