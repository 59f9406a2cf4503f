"""A TRL or HF Trainer recipe loads (hf_names.py, issue 48): their field names in a YAML or as
flags are slidetune's fields, each with a note; what slidetune does not do is refused by name."""
from __future__ import annotations

import csv
import json
import math

import pytest

from slidetune.cli import build_parser
from slidetune.config import TrainConfig, config_from_args, load_yaml
from slidetune.trainer import lr_at
from test_train_errors import run_cli

TRL_SFT = """\
# an SFTConfig recipe as TRL's documentation writes one
learning_rate: 2.0e-4
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
max_steps: 4
max_length: 32
warmup_ratio: 0.5
lr_scheduler_type: constant_with_warmup
logging_steps: 1
save_steps: 0
save_total_limit: 1
gradient_checkpointing: true
bf16: false
fp16: false
fsdp: ""
local_rank: -1
optim: adamw_torch_fused
report_to: none
seed: 3
"""


def test_a_trl_sft_recipe_runs_with_its_names_read_as_slidetunes(tmp_path):
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(TRL_SFT)
    out = tmp_path / "run"
    code, stdout, stderr = run_cli("--config", str(recipe), "--model", "tiny-llama", "--device", "cpu",
                                   "--skip-reference-check", "--progress", "false", "--eval-batches", "1",
                                   "--output-dir", str(out))
    assert code == 0, stderr[-3000:]
    saved = json.loads((out / "config.json").read_text())
    assert (saved["optim"]["lr"], saved["batch_size"], saved["grad_accum"], saved["max_steps"]) == (2e-4, 2, 2, 4)
    assert (saved["data"]["seq_len"], saved["lr_schedule"], saved["warmup_ratio"]) == (32, "constant", 0.5)
    assert (saved["log_every"], saved["save_every"], saved["keep_last"], saved["report_to"]) == (1, 0, 1, "csv")
    assert saved["runtime"]["dtype"] == "fp32" and saved["seed"] == 3
    for said in ("learning_rate 0.0002 is slidetune's lr 0.0002", "gradient_checkpointing has no effect here",
                 "lr_scheduler_type 'constant_with_warmup' is slidetune's lr_schedule 'constant'",
                 "optim 'adamw_torch_fused' is slidetune's AdamW", "report_to 'none' is slidetune's report_to 'csv'"):
        assert said in stderr, said
    # warmup_ratio 0.5 of 4 steps: 2 warmup steps, then constant
    with (out / "metrics.csv").open() as f:
        lrs = [float(r["lr"]) for r in csv.DictReader(f) if r["loss"]]
    assert lrs == pytest.approx([1e-4, 2e-4, 2e-4, 2e-4])


@pytest.mark.parametrize("line, said", [
    ("deepspeed: ds_config.json", "deepspeed is not honoured here: slidetune keeps the training state in host RAM"),
    ("lora_r: 16", "lora_r is not honoured here: slidetune fine-tunes every parameter"),
    ("fp16: true", "fp16 is not honoured here: fp16 needs loss scaling"),
    ("use_peft: true", "use_peft is not honoured here"),
    ("optim: paged_adamw_8bit", "optim 'paged_adamw_8bit' is not slidetune's: .* --moments 8bit"),
    ("optim: adafactor", "optim 'adafactor' is not slidetune's optimizer"),
    ("lr_scheduler_type: polynomial", "lr_scheduler_type 'polynomial' has no slidetune equivalent"),
])
def test_what_slidetune_does_not_do_is_refused_by_name(tmp_path, line, said):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"learning_rate: 1.0e-5\n{line}\n")
    with pytest.raises(ValueError, match=f"{recipe}: {said}"):
        load_yaml(recipe)


def test_their_flags_are_slidetunes(capsys):
    args = build_parser().parse_args(["train", "--learning_rate", "3e-5", "--per-device-train-batch-size", "3",
                                      "--gradient_accumulation_steps", "4", "--num_train_epochs", "2",
                                      "--lr_scheduler_type", "cosine_with_min_lr", "--bf16", "true",
                                      "--dataset_text_field", "content", "--max_seq_length", "128",
                                      "--warmup-ratio", "0.1"])
    cfg = config_from_args(args)
    assert (cfg.optim.lr, cfg.batch_size, cfg.grad_accum, cfg.epochs) == (3e-5, 3, 4, 2.0)
    assert (cfg.lr_schedule, cfg.runtime.dtype, cfg.data.columns, cfg.data.seq_len) == ("cosine", "bf16",
                                                                                         "content=text", 128)
    assert cfg.warmup_ratio == 0.1
    assert "--learning_rate: learning_rate '3e-5' is slidetune's lr" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--lr_scheduler_type", "polynomial"])


def test_warmup_ratio_is_a_share_of_the_run():
    cfg = TrainConfig(warmup_ratio=0.03, optim={"lr": 1.0}, lr_schedule="constant")
    assert cfg.warmup_for(1000) == 30 and cfg.warmup_for(10) == 1 and TrainConfig().warmup_for(1000) == 2
    assert [lr_at(cfg, s, 1000) for s in (0, 29, 30)] == [pytest.approx(1 / 30), 1.0, 1.0]
    assert math.isclose(lr_at(TrainConfig(warmup_ratio=0.0, optim={"lr": 1.0}), 0, 10), 1.0)
    with pytest.raises(ValueError, match="warmup_ratio"):
        TrainConfig(warmup_ratio=1.5)


def test_a_trl_dpo_recipes_names_are_slidetunes(tmp_path, capsys):
    """DPOConfig's loss_type is the objective; beta and the others are slidetune's own names."""
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text("loss_type: ipo\nbeta: 0.25\nprecompute_ref_log_probs: true\nper_device_train_batch_size: 4\n"
                      "max_length: 512\n")
    cfg = config_from_args(build_parser().parse_args(["train", "--config", str(recipe)]))
    assert (cfg.objective, cfg.beta, cfg.batch_size, cfg.data.seq_len) == ("ipo", 0.25, 4, 512)
    err = capsys.readouterr().err
    assert "loss_type 'ipo' is slidetune's objective 'ipo'" in err and "precompute_ref_log_probs has no effect" in err
    recipe.write_text("loss_type: hinge\n")
    with pytest.raises(ValueError, match="loss_type 'hinge' has no slidetune equivalent; one of 'sigmoid'"):
        config_from_args(build_parser().parse_args(["train", "--config", str(recipe)]))
