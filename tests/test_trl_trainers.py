"""Preference tuning against TRL's own trainers (issue 47): the same tiny model (fp32, CPU), the same
records, three AdamW steps of TRL's `DPOTrainer` (loss_type sigmoid and ipo), `CPOTrainer`
(loss_type simpo) and `ORPOTrainer` beside three of slidetune's slide engine (with its reference
pass for DPO and IPO): every step's loss and gradient norm, and every weight after the third step,
to the numerical contract's 1e-5.

slidetune tokenizes pairs as DPOTrainer does (tests/test_preference_data.py: the same ids).
TRL's CPO and ORPO trainers (trl.experimental) tokenize their own way (a BOS before the prompt
where the tokenizer has one), so the engine is given their token ids there: what is compared is
the objective and its training, on the same tokens.

TRL runs through the HF Trainer: torch's AdamW (betas 0.9 / 0.999, eps 1e-8, no weight decay:
the Trainer exempts biases and norms from it, slidetune does not), a constant learning rate,
clipping at 1.0, its reference model a copy of the policy. Both sides take the whole set as one
batch each step (4 pairs), so the Trainer's shuffling does not change a step's pairs.
"""
from __future__ import annotations

import math

import pytest
import torch

from reference import build_reference
from test_data import make_tokenizer
from test_equivalence import make_loaded, max_param_rel_diff
from slidetune.data.preference import collate_pairs, pair_micro_batches, parse_pair, tokenize_pair
from slidetune.engine import AdamWConfig, RuntimeConfig, build_engine
from slidetune.objectives.preference import PreferenceConfig
from slidetune.objectives.reference import reference_logps

RECORDS = [{"prompt": "a b c", "chosen": " d e", "rejected": " f"},
           {"prompt": "a", "chosen": " b", "rejected": " c d e f g h"},
           {"prompt": "h g", "chosen": " f e d", "rejected": " c b"},
           {"prompt": "b b a", "chosen": " a", "rejected": " a a"}]
LR, STEPS, BETA = 1e-3, 3, 0.3


def trl_dpo(model, ref_model, tokenizer, loss_type: str, tmp_path) -> tuple[list[float], list[float]]:
    """TRL's DPOTrainer for STEPS steps on RECORDS, `ref_model` a copy of `model` (TRL would load one from
    the model's path, which a model built in memory lacks): (each step's loss, each step's gradient norm)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(RECORDS), max_steps=STEPS,
                     learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                     max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, bf16=False, beta=BETA,
                     loss_type=loss_type, save_strategy="no", seed=0, dataset_num_proc=None)
    trainer = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=Dataset.from_list(RECORDS), processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


@pytest.mark.parametrize("objective, loss_type", [("dpo", "sigmoid"), ("ipo", "ipo")])
def test_three_steps_follow_trls_dpo_trainer(objective, loss_type, tmp_path):
    tokenizer = make_tokenizer()
    loaded = make_loaded("llama", tied=False, layers=2)
    cfg = PreferenceConfig(objective, beta=BETA)
    trl_model = build_reference(loaded)
    trl_losses, trl_norms = trl_dpo(trl_model, build_reference(loaded), tokenizer, loss_type, tmp_path)
    assert len(trl_losses) == STEPS and trl_losses[-1] < 0.75 * trl_losses[0]     # it learns: not a vacuous match
    pairs = [tokenize_pair(parse_pair(r, f"record {i}"), tokenizer) for i, r in enumerate(RECORDS)]
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", schedule="deferred", head_chunk_tokens=16)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0),
                          max_grad_norm=1.0, objective=cfg)
    try:
        ref = reference_logps(engine, pairs, cfg, tokenizer.pad_token_id, None, len(pairs))     # [4, 2]
        flat_ref = torch.cat([ref[:, 0], ref[:, 1]])
        for step in range(STEPS):
            batches = pair_micro_batches(collate_pairs(pairs, tokenizer.pad_token_id), cfg, flat_ref)
            res = engine.train_step(batches, LR)
            assert res.loss == pytest.approx(trl_losses[step], rel=1e-5), f"step {step}"
            assert res.grad_norm() == pytest.approx(trl_norms[step], rel=1e-5), f"step {step}"
            if step == 0 and objective == "dpo":
                assert res.loss == pytest.approx(math.log(2), rel=1e-6)
        engine.synchronize()
        worst, where = max_param_rel_diff(engine, trl_model)
        assert worst < 1e-5, f"{where}: relative difference {worst:.2e} after {STEPS} steps"
    finally:
        engine.close()


def trl_pairs(dataset) -> list:
    """TRL's CPO / ORPO tokenized rows as slidetune's pairs: the prompt's ids, then each side's rest."""
    from slidetune.data.preference import TokenizedPair
    out = []
    for i, r in enumerate(dataset):
        n = len(r["prompt_input_ids"])
        assert r["chosen_input_ids"][:n] == r["rejected_input_ids"][:n] == r["prompt_input_ids"]
        out.append(TokenizedPair(f"record {i}", r["prompt_input_ids"], r["chosen_input_ids"][n:],
                                 r["rejected_input_ids"][n:]))
    return out


def trl_reference_free(objective: str, model, tokenizer, tmp_path) -> tuple[list[float], list[float], list]:
    """TRL's CPOTrainer (SimPO) or ORPOTrainer for STEPS steps: (losses, gradient norms, its pairs)."""
    import warnings

    from datasets import Dataset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # trl.experimental says it is experimental
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=len(RECORDS), max_steps=STEPS,
                  learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                  logging_steps=1, report_to=[], use_cpu=True, bf16=False, beta=BETA, save_strategy="no", seed=0,
                  dataset_num_proc=None, remove_unused_columns=False)
    if objective == "simpo":
        trainer = CPOTrainer(model=model, args=CPOConfig(loss_type="simpo", cpo_alpha=0.7, simpo_gamma=0.5, **common),
                             train_dataset=Dataset.from_list(RECORDS), processing_class=tokenizer)
    else:
        trainer = ORPOTrainer(model=model, args=ORPOConfig(**common), train_dataset=Dataset.from_list(RECORDS),
                              processing_class=tokenizer)
    pairs = trl_pairs(trainer.train_dataset)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs], pairs


@pytest.mark.parametrize("objective", ["simpo", "orpo"])
def test_three_steps_follow_trls_cpo_and_orpo_trainers(objective, tmp_path):
    tokenizer = make_tokenizer()
    loaded = make_loaded("llama", tied=False, layers=2)
    cfg = PreferenceConfig(objective, beta=BETA, cpo_alpha=0.7, simpo_gamma=0.5)
    trl_model = build_reference(loaded)
    trl_losses, trl_norms, pairs = trl_reference_free(objective, trl_model, tokenizer, tmp_path)
    assert len(trl_losses) == STEPS and trl_losses[-1] < trl_losses[0]
    rt = RuntimeConfig(mode="slide", dtype="fp32", device="cpu", schedule="deferred", head_chunk_tokens=16)
    engine = build_engine(loaded, rt, AdamWConfig(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0),
                          max_grad_norm=1.0, objective=cfg)
    try:
        for step in range(STEPS):
            res = engine.train_step(pair_micro_batches(collate_pairs(pairs, tokenizer.pad_token_id), cfg), LR)
            assert res.loss == pytest.approx(trl_losses[step], rel=1e-5), f"step {step}"
            assert res.grad_norm() == pytest.approx(trl_norms[step], rel=1e-5), f"step {step}"
        engine.synchronize()
        worst, where = max_param_rel_diff(engine, trl_model)
        assert worst < 1e-5, f"{where}: relative difference {worst:.2e} after {STEPS} steps"
    finally:
        engine.close()
