"""TRL's and the HF Trainer's field names in a slidetune config: a recipe written for `SFTConfig` /
`TrainingArguments` loads (issue 48).

Each of their names is one of three kinds:
  RENAMED   the same setting under another name (`learning_rate` is `optim.lr`), its value mapped
            where their spelling differs (`lr_scheduler_type: constant_with_warmup` is `constant`,
            `max_steps: -1` is "no limit", `dataset_text_field: content` a column map);
  IGNORED   nothing to set here (`logging_dir`, `gradient_checkpointing`: slidetune recomputes
            every layer anyway): accepted, with a note saying why it has no effect;
  REFUSED   a setting slidetune does not do and would silently not honour (`deepspeed`, `fsdp`,
            LoRA, quantized loading, another optimizer, fp16): refused by name with what to use.
Each name read prints one note line at the start of the run (`config.load_yaml` for a YAML file,
the flag's action on the command line: `--learning_rate 2e-5` is `--lr 2e-5`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

_SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant",
              "cosine_with_min_lr": "cosine"}


@dataclass(frozen=True)
class Renamed:
    """One of their names for one of slidetune's fields (a field path)."""
    path: str
    values: dict[Any, Any] | None = field(default=None)   # their value -> ours; a value not listed: refused
    why: dict[Any, str] | None = None                      # their value -> what the mapping means, said in the note


RENAMED: dict[str, Renamed] = {
    "learning_rate": Renamed("optim.lr"),
    "per_device_train_batch_size": Renamed("batch_size"),
    "gradient_accumulation_steps": Renamed("grad_accum"),
    "num_train_epochs": Renamed("epochs"),
    "max_length": Renamed("data.seq_len"),
    "max_seq_length": Renamed("data.seq_len"),
    "lr_scheduler_type": Renamed("lr_schedule", _SCHEDULES,
                                 {"constant_with_warmup": "constant after the warmup, as slidetune's constant",
                                  "cosine_with_min_lr": "cosine down to lr x min_lr_ratio, as slidetune's cosine"}),
    "logging_steps": Renamed("log_every"),
    "save_steps": Renamed("save_every"),
    "save_total_limit": Renamed("keep_last"),
    "eval_steps": Renamed("eval_every"),
    "adam_beta1": Renamed("optim.beta1"),
    "adam_beta2": Renamed("optim.beta2"),
    "adam_epsilon": Renamed("optim.eps"),
    "completion_only_loss": Renamed("data.mask_prompt"),
    "assistant_only_loss": Renamed("data.mask_prompt"),
    "bf16": Renamed("runtime.dtype", {True: "bf16", False: "fp32"}),
    # DPOConfig's and CPOConfig's loss_type: the objective (ORPOTrainer has none; --objective orpo)
    "loss_type": Renamed("objective", {"sigmoid": "dpo", "ipo": "ipo", "simpo": "simpo"},
                         {"sigmoid": "DPO's sigmoid loss, slidetune's --objective dpo"}),
}

_RECOMPUTED = "slidetune recomputes every layer in the backward already"
_NOT_PUSHED = "nothing is pushed: upload final/ yourself"
IGNORED: dict[str, str] = {
    "gradient_checkpointing": _RECOMPUTED,
    "gradient_checkpointing_kwargs": _RECOMPUTED,
    "logging_dir": "the trackers write into the output directory (--report-to)",
    "run_name": "the output directory names the run",
    "overwrite_output_dir": "a run refuses a directory in use, resumes with --resume, and starts fresh elsewhere",
    "do_train": "`slidetune train` trains",
    "do_eval": "the held-out evaluation runs before and after (--eval-every)",
    "eval_strategy": "--eval-every sets when evaluations run",
    "evaluation_strategy": "--eval-every sets when evaluations run",
    "logging_strategy": "--log-every sets it",
    "logging_first_step": "every step is logged (--log-every 1)",
    "save_strategy": "--save-every sets it",
    "per_device_eval_batch_size": "evaluation uses --batch-size",
    "dataloader_num_workers": "the data is tokenized once, before training",
    "dataloader_pin_memory": "the engine pins what it copies",
    "remove_unused_columns": "records keep only the fields their format reads",
    "tf32": "matmuls run in BF16 or FP32 as --dtype says",
    "save_safetensors": "checkpoints are safetensors",
    "save_only_model": "final/ is the model; checkpoints keep the optimizer to resume",
    "disable_tqdm": "--progress sets it",
    "push_to_hub": _NOT_PUSHED,
    "hub_model_id": _NOT_PUSHED,
    "torch_compile": "--tuning.compile_layers sets it",
    "use_liger_kernel": "--tuning.lean_kernels liger sets it",
    "dataset_num_proc": "tokenized data is cached",
    "ddp_find_unused_parameters": "data parallel is slidetune's own (--gpus)",
    "precompute_ref_log_probs": "the reference's log-probabilities are always computed once before step 1, and cached",
}

_FULL = "slidetune fine-tunes every parameter, not LoRA adapters"
_WEIGHTS = "slidetune trains the weights, not a quantized model"
_GPUS = "slidetune trains the whole model on each GPU's host state; for several GPUs use --gpus N"
REFUSED: dict[str, str] = {
    "deepspeed": "slidetune keeps the training state in host RAM itself; drop deepspeed",
    "fsdp": _GPUS,
    "fsdp_config": _GPUS,
    "use_peft": _FULL,
    "peft_config": _FULL,
    "lora_r": _FULL,
    "lora_alpha": _FULL,
    "lora_dropout": _FULL,
    "lora_target_modules": _FULL,
    "load_in_4bit": _WEIGHTS,
    "load_in_8bit": _WEIGHTS,
    "fp16": "fp16 needs loss scaling, which slidetune does not do: use bf16: true (or neither, fp32)",
    "neftune_noise_alpha": "slidetune adds no noise to the embeddings",
    "label_smoothing_factor": "slidetune's loss is plain cross-entropy",
    "local_rank": "torchrun sets the ranks: use --gpus N",
}

# HF's `optim`: the AdamW ones are slidetune's optimizer; the 8-bit ones have its compact state
_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused")
_ADAMW_8BIT = ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit", "adamw_torch_4bit", "paged_adamw_32bit")


def is_theirs(name: str) -> bool:
    """Whether `name` is a TRL / HF Trainer field this module answers for."""
    return name in RENAMED or name in IGNORED or name in REFUSED or name in (
        "optim", "max_steps", "dataset_text_field", "report_to", "resume_from_checkpoint")


def _off(value: Any) -> bool:
    """A refused setting left at its off value (HF writes `fsdp: ""`, `local_rank: -1`, `fp16: false`)."""
    return value is None or value is False or value in (0, -1, "") or value == [] or value == {}


def translate(name: str, value: Any, where: str) -> tuple[str | None, Any]:
    """Their field `name` with `value` -> (slidetune's field path, its value), or (None, None) for
    one that sets nothing here. ValueError naming it (and `where`) for one refused. A note is
    printed for each."""
    if name in REFUSED and not _off(value):
        raise ValueError(f"{where}: {name} is not honoured here: {REFUSED[name]}")
    if name in REFUSED or name in IGNORED:
        note(f"{where}: {name} has no effect here ({IGNORED.get(name) or 'off'})")
        return None, None
    if name == "optim":
        return _optimizer(value, where)
    if name == "max_steps":                    # HF's -1: no limit (the epochs decide)
        return "max_steps", None if value == -1 else value
    if name == "resume_from_checkpoint":       # theirs: a path, or true for the newest checkpoint
        ours = "auto" if value is True or str(value).lower() == "true" else value
        note(f"{where}: resume_from_checkpoint {value!r} is slidetune's resume {ours!r}")
        return "resume", ours
    if name == "report_to":                    # theirs: none / all / a list; ours: csv (always) / auto / a comma list
        ours = {"none": "csv", "all": "auto"}.get(value, value) if isinstance(value, str) else \
            ",".join(map(str, value)) if isinstance(value, list) else value
        if ours != value:
            note(f"{where}: report_to {value!r} is slidetune's report_to {ours!r}")
        return "report_to", ours
    if name == "dataset_text_field":
        note(f"{where}: dataset_text_field {value!r} is --data-columns {value}=text")
        return "data.columns", None if value == "text" else f"{value}=text"
    renamed = RENAMED[name]
    ours = value
    if renamed.values is not None:
        if value not in renamed.values:
            raise ValueError(f"{where}: {name} {value!r} has no slidetune equivalent; one of "
                             f"{', '.join(map(repr, renamed.values))}")
        ours = renamed.values[value]
    why = (renamed.why or {}).get(value)
    note(f"{where}: {name} {value!r} is slidetune's {renamed.path.split('.')[-1]} {ours!r}" + (f" ({why})" if why else ""))
    return renamed.path, ours


def _optimizer(value: Any, where: str) -> tuple[str | None, Any]:
    if value in _ADAMW:
        note(f"{where}: optim {value!r} is slidetune's AdamW")
        return None, None
    if value in _ADAMW_8BIT:
        raise ValueError(f"{where}: optim {value!r} is not slidetune's: its AdamW keeps compact state with "
                         f"--moments 8bit (and --master bf16), opt-in; drop optim")
    raise ValueError(f"{where}: optim {value!r} is not slidetune's optimizer (AdamW; --moments and --master "
                     f"make its state compact)")


_NOTED: set[str] = set()


def note(message: str) -> None:
    """One line on stderr, once per message in a process."""
    if message not in _NOTED:
        _NOTED.add(message)
        print(f"slidetune: note: {message}", file=sys.stderr, flush=True)
