"""The typed training configuration: one YAML file, every field also a CLI flag.

Nested dataclasses (data, runtime, optim) are flattened into flags named after the
field (`--seq-len`, `--mode`, `--lr`); a few get clearer names (`--data` for the data
path). `--help` shows them in groups (FLAG_GROUPS: model, data, batch, optimizer,
clipping, mode, memory, offload, compile, evaluation, output). The runtime's tuning
knobs (RuntimeConfig fields declared with `tuning_field`: rings, chunk sizes, streams,
wait modes...) are one more group, as torchtitan's job config has a section per concern:
`--tuning.NAME VALUE` on the command line, a `tuning:` section in YAML, "tuning" in the
saved config.json, listed with their measured defaults by `--help-tuning`. Their old
top-level spellings (`--chunk-mb`, `chunk_mb:`) work for one more release, with a note.
Precedence: dataclass defaults < YAML file (--config) < explicit flags.

The YAML file may nest the sections (`data: {seq_len: 512}`, `tuning: {chunk_mb: 128}`)
or name the user's fields flat, like the flags (`seq_len: 512`, `seq-len: 512`, `data:
train.jsonl`); values are converted to the field's type (YAML reads `1e-4` as a string)
and checked. The resolved config that `train` saves (`<output_dir>/config.json`) is valid
input for `--config`.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import inspect
import math
import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from . import hf_names
from .config_file import read_config_file
from .data.config import DataConfig
from .data.mixture import mixture_spec
from .engine.adamw import FP32_ADAMW, AdamWConfig
from .engine.config import SECTIONS, TUNING_SECTION, RuntimeConfig, literal_choices, runtime_fields, tuning_docs
from .fields import FLAG_NAMES, FieldTypeError, base_type, check_fields
from .objectives.preference import PreferenceConfig
from .telemetry.trackers import parse_report_to


DEFAULT_CPU_STEPS = 20     # the default job on a CPU (with CPU_DEFAULT_JOB's shape): minutes on 2 cores
DEFAULT_GPU_STEPS = 300    # on a GPU the job is seconds per 20 steps: fine-tune for real
# The default job's shape on a CPU, where the user sets none of these (config_from_args): a quarter
# of the GPU job's tokens a step, so that 20 steps, both evaluations, the model's load and the export
# finish in minutes on 2 cores of a CPU without bf16 instructions too (fp32: a 2-core AVX2-only EPYC
# took 15-25 s a step at 4 x 256 tokens; benchmarks/results/train_default_cpu)
CPU_DEFAULT_JOB = {"batch_size": 2, "data.seq_len": 128, "eval_batches": 4}


@dataclass
class TrainConfig:
    model: str = "smollm2-135m"          # preset name, the embedded default, a .gguf file, a HF directory or a Hub id org/name
    num_layers: int | None = None        # presets only: override the depth
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    batch_size: int = 4                  # sequences per micro-batch
    grad_accum: int = 1                  # micro-batches per optimizer step
    max_steps: int | None = None         # optimizer steps; None: 20 on the CPU (a few minutes on 2 cores), 300 on a GPU
    epochs: float | None = None          # if set, overrides max_steps: epochs over the training split
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"     # cosine | linear | constant (after warmup)
    warmup_steps: int = 2                # linear warmup from lr/warmup_steps to lr over these steps
    # the warmup as a fraction of the run's steps instead (HF's warmup_ratio): ceil(ratio x steps)
    warmup_ratio: float | None = None
    min_lr_ratio: float = 0.1            # cosine/linear decay down to lr * min_lr_ratio
    max_grad_norm: float | None = 1.0    # global-norm clipping (0 or None: off)
    seed: int = 0                        # seeds the weights of presets, the data split and the batch order
    eval_every: int = 0                  # evaluate every N steps (0: only before and after training)
    eval_batches: int = 8                # held-out batches per evaluation (0: all)
    # a .jsonl of {"prompt"} / {"messages"} records or a .txt of one prompt per line, sampled greedily at
    # each evaluation (None: the first held-out conversations of chat data, none for other data)
    eval_prompts: str | None = None
    eval_max_new_tokens: int = 64        # tokens each eval prompt's greedy sample may add (it stops at EOS)
    save_every: int = 0                  # checkpoint every N steps (0: only at the end)
    keep_last: int = 2                   # checkpoints kept (the final export is separate)
    # auto | on | off: periodic checkpoints written in the background while training goes on (each unit's
    # next update waits only until its state is written; checkpoint/background.py). auto: on for the slide
    # engine on a GPU in one process, off on a CPU (the writer would take the cores the step runs on) and
    # where it is not possible (gpu/ckpt modes, data parallel: blocking saves); on: refused where not possible
    async_save: Literal["auto", "on", "off"] = "auto"
    save_dtype: Literal["auto", "fp32", "bf16"] = "auto"     # dtype of the exported final/ model: auto (the checkpoint's own: bf16 for a bf16 model) | fp32 | bf16
    checkpoint_dir: str | None = None    # where resumable checkpoints go (None: <output_dir>/checkpoints); another disk when they do not fit
    output_dir: str = "runs/default"     # metrics.csv, loss.png, config.json, checkpoints/, final/
    resume: str | None = None            # None | auto | path to a checkpoint directory
    stop_after: int | None = None        # stop after this many steps in this invocation, leaving a resumable checkpoint
    log_every: int = 1                   # write metrics.csv every N steps
    # where the metrics go besides metrics.csv (always written: loss.png and a resume read it): a comma
    # list of csv, tensorboard, wandb, mlflow; auto: tensorboard where it is installed
    report_to: str = "auto"
    check_memory: bool = True            # refuse before allocating when the estimate does not fit
    skip_reference_check: bool = False   # do not verify the split against transformers on a tiny copy of the model (about a second); recorded here when skipped
    gpu_memory_limit: float | None = None  # GiB of GPU memory this run may use (a budget below the card's; None: all of it)
    progress: bool = True                # tqdm progress bar
    # the loss: sft (cross-entropy on the data's target tokens), or a preference objective on pairs of
    # completions (docs/preference.md; objectives/preference.py): dpo and ipo (TRL's DPOTrainer, loss_type
    # sigmoid / ipo, against the reference log-probabilities computed once before step 1), simpo (CPOTrainer,
    # loss_type simpo) and orpo (ORPOTrainer), reference-free. With a preference objective --batch-size
    # counts pairs, each two sequences of up to --seq-len tokens
    objective: Literal["sft", "dpo", "ipo", "simpo", "orpo"] = "sft"
    beta: float = 0.1                    # TRL's beta: DPO's and IPO's temperature, SimPO's reward scale, ORPO's lambda
    label_smoothing: float = 0.0         # CPOConfig.label_smoothing: SimPO's conservative loss (0: off)
    simpo_gamma: float = 0.5             # CPOConfig.simpo_gamma: SimPO's target reward margin
    cpo_alpha: float = 1.0               # CPOConfig.cpo_alpha: the weight of the chosen completions' NLL in SimPO (0: the paper's SimPO)

    def preference(self) -> PreferenceConfig | None:
        """The preference objective's settings (objectives/preference.py), None for sft."""
        if self.objective == "sft":
            return None
        return PreferenceConfig(self.objective, beta=self.beta, label_smoothing=self.label_smoothing,
                                simpo_gamma=self.simpo_gamma, cpo_alpha=self.cpo_alpha)

    @property
    def rows_per_micro_batch(self) -> int:
        """Sequences a micro-batch holds: --batch-size, or two a pair for a preference objective."""
        return self.batch_size * (1 if self.objective == "sft" else 2)

    @property
    def padded_rows(self) -> bool:
        """Whether rows may carry [B, 1, S, S] padding masks: unpacked SFT rows. Packed rows are full
        or padded on the right without a mask, and so are a preference objective's pairs."""
        return not self.data.packed and self.objective == "sft"

    def warmup_for(self, total_steps: int) -> int:
        """The warmup steps of a run of `total_steps`: warmup_ratio's share of them where given."""
        if self.warmup_ratio is None:
            return self.warmup_steps
        return math.ceil(self.warmup_ratio * total_steps)

    def resolved_max_steps(self, on_gpu: bool) -> int:
        """The step budget when neither max_steps nor epochs is given: short on the CPU."""
        if self.max_steps is not None:
            return self.max_steps
        return DEFAULT_GPU_STEPS if on_gpu else DEFAULT_CPU_STEPS

    def __post_init__(self):
        """One validator for the flags, a YAML file and Python (fields.check_fields): each field's
        type, choices and range (_RULES), the flag named in the message. `data` may be a path (the
        --data flag's value) and each section a dict of its fields, as in a YAML file."""
        self.data = _section(self.data, DataConfig, "data", seed=self.seed, path_ok=True)
        self.runtime = _section(self.runtime, RuntimeConfig, "runtime")
        self.optim = _section(self.optim, AdamWConfig, "optim")
        check_fields(self, rules=_RULES)
        parse_report_to(self.report_to)
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            self.max_grad_norm = None
        if self.runtime.dtype == "fp16":
            # no loss scaling here: FP16's range (6.1e-5 to 65504) drops small gradients to zero and
            # overflows large activations without a word, where BF16 keeps FP32's range
            raise ValueError("--dtype fp16 would train without loss scaling, which slidetune does not do: FP16 "
                             "silently flushes small gradients to zero and overflows large activations. Use "
                             "--dtype bf16 (Ampere or newer GPUs, and CPUs with AMX or AVX512-BF16) or --dtype fp32 "
                             "(a GPU without bf16: V100, T4)")


def _at_least(n: int):
    return (lambda v: v >= n, f">= {n}")


def _non_blank(what: str):
    return (lambda v: v.strip() != "", what)


# TrainConfig's ranges, by field (checked with the types by fields.check_fields; None is never
# checked: an optional field left unset). NaN fails every comparison, so `v > 0` refuses it too.
_RULES = {
    "model": _non_blank("a preset name, a .gguf file, a model directory or a Hub id"),
    "num_layers": _at_least(1), "batch_size": _at_least(1), "grad_accum": _at_least(1),
    "max_steps": _at_least(1), "stop_after": _at_least(1), "keep_last": _at_least(1),
    "log_every": _at_least(1), "eval_max_new_tokens": _at_least(1),
    "warmup_steps": _at_least(0), "eval_every": _at_least(0), "eval_batches": _at_least(0),
    "warmup_ratio": (lambda v: v is None or 0.0 <= v < 1.0, "in [0, 1)"),
    "save_every": _at_least(0),
    "epochs": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    "min_lr_ratio": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    # numpy's and torch's generators take 0 .. 2**32 - 1 (numpy refuses -1 naming no flag)
    "seed": (lambda v: 0 <= v < 2**32, "in 0 .. 2**32 - 1"),
    "gpu_memory_limit": (lambda v: math.isfinite(v) and v > 0, "> 0 GiB and finite (or None: the whole GPU)"),
    "max_grad_norm": (lambda v: not math.isnan(v), "a number (0 or None: no clipping)"),
    "beta": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    "label_smoothing": (lambda v: 0.0 <= v < 0.5, "in [0, 0.5)"),
    "simpo_gamma": (lambda v: math.isfinite(v), "a finite number"),
    "cpo_alpha": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    # "" wrote final/, checkpoints/ and metrics.csv into the working directory, unasked
    "output_dir": _non_blank('a directory\'s path (".": the working directory)'),
}


def _section(value, cls, name: str, seed: int | None = None, path_ok: bool = False):
    """A TrainConfig section from what Python may pass: the section itself, a dict of its fields
    (as YAML nests them), or for `data` a path, as `--data PATH` and `data: PATH` in YAML give it
    (seeded by TrainConfig.seed, as build_config seeds it)."""
    if isinstance(value, cls):
        return value
    extra = {"seed": seed} if seed is not None and isinstance(seed, int) else {}
    if isinstance(value, dict):
        return cls(**{**extra, **value})
    if path_ok and (value is None or isinstance(value, (str, os.PathLike))):
        return cls(path=None if value is None else os.fspath(value), **extra)
    what = f"a {cls.__name__}, a dict of its fields" + (" or a path (--data)" if path_ok else "")
    raise FieldTypeError(f"{name} must be {what}, not the {type(value).__name__} {value!r}")


_FLAG_NAMES = FLAG_NAMES           # flag name overrides (field path -> flag; None: hidden), fields.py
# string fields whose flag alone means a value, as a boolean flag alone means true
_BARE_FLAG = {"runtime.compile_layers": "on", "runtime.offload_activations": "on", "data.streaming": "on"}
_SECTIONS = ("data", "runtime", "optim")
_SECTION_CLASSES = {"data": DataConfig, "runtime": RuntimeConfig, "optim": AdamWConfig}
# help text where the field's own comment is missing or too terse for --help
_HELP = {
    "eval_prompts": "prompts sampled greedily at each evaluation, to eval_samples.jsonl and the trackers: a .jsonl of "
                    "{\"prompt\"} or {\"messages\"} records, or a .txt of one prompt per line (default: the first "
                    "held-out conversations of chat data; none for other data)",
    "data.path": "training data: a .txt/.md file, a .jsonl/.ndjson file (text, messages, ShareGPT conversations, "
                 "prompt/completion or alpaca records); through `datasets`: a .parquet/.csv/.json/.arrow file or a directory of them, a "
                 "save_to_disk directory or a Hub dataset id org/name (from the local HF cache; downloaded when "
                 "not cached and HF_HUB_OFFLINE is unset); a pre-tokenized corpus read memory-mapped: a .bin (see "
                 "--token-dtype) or .npy token-id array, or a save_to_disk directory of input_ids; several "
                 "record sources mixed with weights: a.jsonl:0.7,b.jsonl:0.3; None: the built-in English corpus",
    "data.eval_path": "a separate evaluation set (any --data source but a pre-tokenized one), evaluated instead of "
                      "a held-out split of --data, which then trains whole; a Hub id or directory gives its "
                      "validation or test split",
    "data.split": "the split of a Hub dataset or data directory to train on (None: train, or the only split)",
    "data.subset": "the configuration (subset) of a Hub dataset that has several (load_dataset's name)",
    "data.columns": "the data's own column names for the record fields: COLUMN=FIELD,... e.g. content=text or "
                    "question=prompt,answer=completion (fields: messages, conversations, system, tools, instruction, "
                    "input, output, prompt, completion, text)",
    "data.streaming": "auto | on | off: read --data through datasets streaming, a chunk of records at a time, "
                      "tokenized into a token file in the cache and trained memory-mapped (for corpora larger "
                      "than RAM); auto: when its files exceed 1/100 of the available RAM (read whole, the "
                      "build takes ~44x their size)",
    "data.cache_dir": "where tokenized data is kept between runs (None: HF_DATASETS_CACHE/slidetune; off: not "
                      "kept); a second run on the same data and tokenizer does not tokenize again",
    "runtime.compile_cache_dir": "where compiled layers are kept between runs (None: $XDG_CACHE_HOME/slidetune/compile, "
                                 "else ~/.cache/slidetune/compile; off: torch's default in /tmp, emptied at reboot); "
                                 "a second run of the same model and shape reads its layers from there instead of "
                                 "compiling them again. A TORCHINDUCTOR_CACHE_DIR you set is kept",
    "data.packing": "masked: documents packed into rows of seq_len+1 tokens, each attending only to itself "
                    "(positions restart per document); causal: packed and unmasked, documents see the ones "
                    "before them in the row (pretraining corpora); off: one example per row, right-padded. "
                    "The old true/false mean masked/off",
    "optim.beta1": "AdamW first-moment decay",
    "optim.beta2": "AdamW second-moment decay (0.95, not 0.999: the usual LLM fine-tuning choice)",
    "optim.eps": "AdamW epsilon",
    "runtime.moments": "AdamW's moments of the host-updated units: fp32 (exact, the default), bf16 (4 instead of 8 "
                       "B/param of host RAM, rounded to nearest) or 8bit (blockwise 8-bit, bitsandbytes' dynamic "
                       "map, 256-element blocks with an FP32 absmax: ~2 B/param). Opt-in: they trade the FP32 "
                       "reference's trajectory for host RAM. Slide mode; in RAM, the disk tier's files (--disk-dir) "
                       "and the ranks' shared state (--gpus) alike; units updated on the GPU keep FP32 moments",
    "runtime.master": "the host-updated units' master weights: fp32 (exact, the default) or bf16 (2 instead of 4 "
                      "B/param of host RAM: each update rounded to BF16 stochastically, unbiased, from a counter "
                      "hash of the step and the element, so a resume repeats it; the uploads copy it as it is). "
                      "Opt-in, as --moments; with --moments 8bit a host unit keeps ~4 B/param instead of 12",
    "runtime.recompute": 'ckpt mode: the decoder layers that recompute their activations in the backward: '
                         'all | none | a comma list "0,3,7" | "every:k"',
    "runtime.dtype": "compute precision of weights and activations: auto | bf16 | fp32 (fp16 is refused: it needs loss "
                     "scaling, which slidetune does not do; the bench measures it). auto: bf16 where the "
                     "device computes it natively (a CUDA GPU with bf16; a CPU with AMX-BF16 or AVX512-BF16), else "
                     "fp32 (on a CPU without them bf16 is emulated, many times slower); the run prints which and why. "
                     "Master weights and AdamW's moments are FP32 whatever this is, unless --master or --moments say",
    "runtime.disk_dir": f"a directory on a local disk (NVMe ideally) where the AdamW moments of some units live, "
                        f"read ahead of their update and written behind it: {FP32_ADAMW.master_bytes} instead of "
                        f"{FP32_ADAMW.bytes_per_param} B/param of host RAM for each, "
                        f"{2 * FP32_ADAMW.moment_bytes} B/param through the disk a step (how many: "
                        f"--tuning.disk_units, auto: as few as make host RAM fit); with --tuning.disk_master their "
                        f"FP32 masters too: 2 B/param of RAM (the BF16 weights the uploads read), "
                        f"{2 * FP32_ADAMW.bytes_per_param} B/param through the disk a step (FP32 state; "
                        f"with --moments / --master the files hold that format, fewer bytes)",
}


def _section_fields(name: str) -> dict[str, dataclasses.Field]:
    """A section's fields by name; the runtime's flat (its knobs' own sections are internal)."""
    if name == "runtime":
        return runtime_fields()
    return {f.name: f for f in dataclasses.fields(_SECTION_CLASSES[name])}


def _leaf_fields(cls, prefix: str = ""):
    for f in dataclasses.fields(cls):
        if f.name in _SECTIONS and not prefix:
            for sub in _section_fields(f.name).values():
                yield f"{f.name}.{sub.name}", sub
        else:
            yield prefix + f.name, f


def _parse_value(text: str, tp):
    base, optional = base_type(tp)
    if optional and text.lower() in ("none", "null", ""):
        return None
    if base is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
    return base(text)


# The user's flags in --help, by group: (what the group decides, its field paths). The runtime's
# tuning knobs (engine/config.py's tuning_field) are the one other kind, under --tuning.NAME. A new
# field goes in one of these groups or is declared a tuning knob: tests/test_config_surface.py fails
# on a field in neither (until then --help shows it under "other").
FLAG_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "model": ("what to fine-tune, and the check that it trains as transformers runs it",
              ("model", "num_layers", "skip_reference_check")),
    "data": ("what to train on", ("data.path", "data.eval_path", "data.split", "data.subset", "data.columns",
                                  "data.streaming",
                                  "data.cache_dir", "data.token_dtype", "data.seq_len", "data.packing",
                                  "data.packing_strategy", "data.chat_template", "data.mask_prompt",
                                  "data.heldout_fraction", "data.seed", "seed")),
    "objective": ("the loss: supervised, or a preference objective on pairs of completions",
                  ("objective", "beta", "label_smoothing", "simpo_gamma", "cpo_alpha")),
    "batch": ("sequences (pairs, for a preference objective) per step, and how many steps", ("batch_size", "grad_accum", "max_steps", "epochs")),
    "optimizer": ("AdamW and its learning-rate schedule", ("optim.lr", "optim.beta1", "optim.beta2", "optim.eps",
                                                           "optim.weight_decay", "lr_schedule", "warmup_steps",
                                                           "warmup_ratio",
                                                           "min_lr_ratio", "runtime.moments", "runtime.master")),
    "clipping": ("global gradient-norm clipping", ("max_grad_norm",)),
    "mode": ("how the model trains, where, in which precision",
             ("runtime.mode", "runtime.device", "runtime.dtype", "runtime.recompute")),
    "memory": ("the memory budget: the fit check, the GPU's limit and the disk tier",
               ("check_memory", "gpu_memory_limit", "runtime.disk_dir")),
    "offload": ("what leaves the GPU besides the optimizer state", ("runtime.offload_activations",)),
    "compile": ("torch.compile of the decoder layers", ("runtime.compile_layers", "runtime.compile_cache_dir")),
    "evaluation": ("held-out loss and greedy samples during the run",
                   ("eval_every", "eval_batches", "eval_prompts", "eval_max_new_tokens")),
    "output": ("where results and checkpoints go, and resuming",
               ("output_dir", "save_every", "keep_last", "async_save", "save_dtype", "checkpoint_dir", "resume",
                "stop_after",
                "log_every", "report_to", "progress")),
}


def tuning_paths() -> dict[str, str]:
    """Field path (runtime.NAME) -> knob name, for every tuning knob."""
    return {f"runtime.{name}": name for name in tuning_docs()}


def flag_group(path: str) -> str | None:
    """The --help group of a user's field path, or None (a tuning knob, or unclassified)."""
    return next((g for g, (_, paths) in FLAG_GROUPS.items() if path in paths), None)


def _field_default(path: str):
    obj = TrainConfig()
    for part in path.split("."):
        obj = obj.setting(part) if isinstance(obj, RuntimeConfig) else getattr(obj, part)
    return obj


def _flag_parser(tp):
    """argparse's `type=` for a field of type `tp`; named after the type, as argparse's refusal
    says "invalid int value: 'x'" (a lambda made it "invalid <lambda> value")."""
    def parse(text: str):
        return _parse_value(text, tp)
    parse.__name__ = getattr(base_type(tp)[0], "__name__", "value")
    return parse


def _value_spec(path: str, f: dataclasses.Field) -> dict:
    """argparse keywords that parse a field's value (type, metavar, a bare flag's meaning, and the
    choices of a Literal field, engine.config's one list of them)."""
    base, _ = base_type(f.type)
    spec = {"type": _flag_parser(f.type),
            "metavar": base.__name__.upper() if isinstance(base, type) else "VALUE"}
    choices = None if f.metadata.get("normalize") else literal_choices(f.type)
    if choices:
        spec.update(choices=choices, metavar="{" + ",".join(map(str, choices)) + "}")
    if base is bool:
        spec.update(nargs="?", const=True)                       # a bool flag alone means true
    if path in _BARE_FLAG:
        spec.update(nargs="?", const=_BARE_FLAG[path])           # `--compile-layers` alone means on
    return spec


_DEPRECATION_NOTED: set[str] = set()     # old spellings already noted in this process


def _note_deprecated(old: str, new: str) -> None:
    """Say once per process that a moved knob's old spelling still works but is going."""
    if old in _DEPRECATION_NOTED:
        return
    _DEPRECATION_NOTED.add(old)
    print(f"slidetune: note: {old} is deprecated and goes in the next release: use {new} "
          f"(slidetune train --help-tuning lists the tuning knobs)", file=sys.stderr, flush=True)


class _DeprecatedSpelling(argparse.Action):
    """A tuning knob's old top-level flag (`--chunk-mb`): stores the value, notes the new spelling."""

    def __call__(self, parser, namespace, values, option_string=None):
        _note_deprecated(option_string, f"--{TUNING_SECTION}.{self.dest.split('.')[-1]}")
        setattr(namespace, self.dest, values)


class _TheirName(argparse.Action):
    """A TRL / HF Trainer flag (`--learning_rate 2e-5`, hf_names.py): slidetune's field, with a note."""

    def __init__(self, option_strings, dest, their: str = "", parse=None, **kw):
        self.their, self.parse = their, parse
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        renamed = hf_names.RENAMED.get(self.their)
        value = values
        if renamed is not None and renamed.values is not None:     # their spelling of a value: "true" -> True
            value = {str(k).lower(): k for k in renamed.values}.get(str(values).lower(), values)
        try:
            _, mapped = hf_names.translate(self.their, value, option_string)
        except ValueError as e:
            parser.error(str(e))
        setattr(namespace, self.dest, self.parse(mapped) if isinstance(mapped, str) else mapped)


def _add_their_names(parser: argparse.ArgumentParser, leaves: dict) -> None:
    """TRL's and the HF Trainer's names for slidetune's flags (hf_names.RENAMED, dataset_text_field),
    hidden from --help: `--learning_rate` and `--learning-rate` are --lr."""
    names = {**{k: r.path for k, r in hf_names.RENAMED.items()}, "dataset_text_field": "data.columns"}
    for their, path in names.items():
        flags = sorted({f"--{their}", f"--{their.replace('_', '-')}"})
        parser.add_argument(*flags, dest=path, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                            action=_TheirName, their=their, parse=_flag_parser(leaves[path].type))


class _HelpTuning(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(tuning_help())
        parser.exit()


def tuning_help() -> str:
    """The --help-tuning text: every knob with its type, measured default, what it is and when to touch it."""
    intro = (f"Pipeline tuning knobs: --{TUNING_SECTION}.NAME VALUE on the command line, or a `{TUNING_SECTION}:` "
             f'section of the YAML config; the run\'s config.json lists them under "{TUNING_SECTION}". The '
             "defaults were measured (benchmarks/NOTES.md) and the auto ones resolve per machine at the start of "
             "a run (`slidetune plan` shows what they resolve to): leave them unless a profile or the `when` line "
             "says otherwise.")
    lines = [textwrap.fill(intro, 100)]
    docs = tuning_docs()
    for section, cls in SECTIONS.items():          # the component that reads them (engine/config.py)
        lines += ["", f"{section} ({cls.__name__}):"]
        for f in dataclasses.fields(cls):
            metavar = _value_spec(f"runtime.{f.name}", f)["metavar"]
            lines += [f"  --{TUNING_SECTION}.{f.name} {metavar} (default: {_field_default(f'runtime.{f.name}')})",
                      f"      {docs[f.name].help}", f"      when: {docs[f.name].when}"]
    return "\n".join(lines)


def unknown_tuning_message(names: list[str]) -> str:
    valid = ", ".join(tuning_docs())
    return (f"unknown tuning knob{'s' if len(names) > 1 else ''} {', '.join(names)}; valid names: {valid} "
            f"(--help-tuning says what each does)")


class ConfigArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser for the config flags: `--tuning.some-name` is read as `--tuning.some_name`,
    and an unknown `--tuning.NAME` is an error that lists the valid names (argparse alone would only
    say "unrecognized arguments"). Subparsers made from it are of this class too."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        prefix = f"--{TUNING_SECTION}."
        args = [_underscored_knob(a, prefix) if a.startswith(prefix) else a for a in args]
        namespace, extras = super().parse_known_args(args, namespace)
        unknown = [a.split("=", 1)[0] for a in extras if a.startswith(prefix)]
        if unknown:
            self.error(unknown_tuning_message(unknown))
        return namespace, extras


def _underscored_knob(arg: str, prefix: str) -> str:
    name, eq, value = arg[len(prefix):].partition("=")
    return prefix + name.replace("-", "_") + eq + value


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    general = parser.add_argument_group("config")
    general.add_argument("--config", type=Path, help="YAML file with any of the fields below (sections or flat "
                                                     f"names) and a `{TUNING_SECTION}:` section")
    general.add_argument("--help-tuning", action=_HelpTuning,
                         help=f"list the pipeline's tuning knobs (--{TUNING_SECTION}.NAME VALUE), each with its "
                              "measured default and when to touch it, and exit")
    groups = {name: parser.add_argument_group(name, desc) for name, (desc, _) in FLAG_GROUPS.items()}
    knobs = tuning_paths()
    leaves = dict(_leaf_fields(TrainConfig))
    # in --help's order (the usage line follows it): the groups', then the knobs and any unclassified
    in_groups = [p for _, paths in FLAG_GROUPS.values() for p in paths if p in leaves]
    for path in in_groups + [p for p in leaves if p not in in_groups]:
        f = leaves[path]
        spec = _value_spec(path, f)
        if path in knobs:
            # shown by --help-tuning, not --help; the old top-level spelling still parses, with a note
            parser.add_argument(f"--{TUNING_SECTION}.{knobs[path]}", dest=path, default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS, **spec)
            parser.add_argument("--" + knobs[path].replace("_", "-"), dest=path, default=argparse.SUPPRESS,
                                action=_DeprecatedSpelling, help=argparse.SUPPRESS, **spec)
            continue
        flag = _FLAG_NAMES.get(path, path.split(".")[-1])
        if flag is None:
            continue
        group = flag_group(path)
        if group not in groups:
            groups[group] = parser.add_argument_group("other", "not yet given a group in config.FLAG_GROUPS")
        default = _field_default(path)
        obj_cls = TrainConfig if "." not in path else _SECTION_CLASSES[path.split(".")[0]]
        doc = _HELP.get(path) or field_docs(obj_cls).get(f.name, "")
        help_text = (f"{doc} " if doc else "") + f"[{path}] (default: {default})"
        groups[group].add_argument("--" + flag.replace("_", "-"), dest=path, default=argparse.SUPPRESS,
                                   help=help_text.replace("%", "%%"), **spec)
    _add_their_names(parser, leaves)


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """Field name -> its comment in the dataclass source (trailing `# ...` or the comment lines above)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    above: list[str] = []
    pattern = re.compile(r"^\s+(\w+)\s*:\s*[^=#]+(?:=.*?)?(?:#\s*(.*))?$")
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        m = pattern.match(line) if stripped and not stripped.startswith(("def ", "@", "class ")) else None
        if m and m.group(1) not in docs:
            trailing = (m.group(2) or "").strip()
            text = trailing or " ".join(above)
            if text:
                docs[m.group(1)] = " ".join(text.split())
        above = []
    return docs


def _coerce(value, tp, path: str, source: str | None = None):
    """A YAML value converted to the field's type, by the flags' rules; ValueError naming the field
    (and `source`, the file it came from) when impossible."""
    base, optional = base_type(tp)
    where = f"{source}: " if source else ""
    if value is None:
        if optional:
            return None
        raise ValueError(f"{where}config field {path} cannot be null")
    try:
        if isinstance(value, str):
            return _parse_value(value, tp)
        if base is bool:
            if isinstance(value, bool):
                return value
            if type(value) is int and value in (0, 1):     # as the flag takes 1 and 0
                return value == 1
            raise ValueError
        if base is str and isinstance(value, bool):
            return str(value).lower()     # YAML reads `packing: off` as false: the field maps it
        if isinstance(value, bool):
            # YAML's true/yes/on where a number belongs (`max_steps: true` ran one step): Python's
            # bool is an int, so the checks below would take it; the flag refuses "true" too
            raise ValueError
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base is int and isinstance(value, (int, float)) and not isinstance(value, bool):
            if float(value) != int(value):
                raise ValueError
            return int(value)
        if base is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(base, type) and isinstance(value, base):
            return value
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        pass
    name = base.__name__ if isinstance(base, type) else str(base)
    raise ValueError(f"{where}config field {path}: expected {name}{' or null' if optional else ''}, got {value!r}")


def _flatten_yaml(loaded: dict, source: str) -> dict:
    """YAML mapping (nested sections and/or flat flag-style keys) -> {field path: value}."""
    leaves = dict(_leaf_fields(TrainConfig))
    knobs = tuning_paths()
    by_name: dict[str, str] = {}          # flat name (field or flag, `_` for `-`) -> path
    for path in sorted(leaves, key=lambda p: "." in p):        # top-level fields first: they keep their name
        name = path.split(".")[-1]
        if _FLAG_NAMES.get(path, name) is None:
            continue                      # hidden: follows another field
        for key in (name, _FLAG_NAMES.get(path, name).replace("-", "_")):
            if key not in _SECTIONS:
                by_name.setdefault(key, path)
    flat: dict[str, object] = {}
    moved: list[str] = []                 # tuning knobs given in their old place (flat, or under runtime:)

    def put(path: str, value, key: str) -> None:
        if path in flat and flat[path] != value:
            raise ValueError(f"{source}: {path} is given twice ({key!r}) with different values")
        flat[path] = value
        if path in knobs and not key.startswith(f"{TUNING_SECTION}."):
            moved.append(key)

    for key, value in loaded.items():
        k = str(key).replace("-", "_")
        if k == TUNING_SECTION:
            if not isinstance(value, dict):
                raise ValueError(f"{source}: section {TUNING_SECTION!r} must be a mapping of knob names to "
                                 f"values, got {value!r}")
            for sub, v in value.items():
                name = str(sub).replace("-", "_")
                if f"runtime.{name}" not in knobs:
                    raise ValueError(f"{source}: {unknown_tuning_message([repr(sub)])}")
                put(f"runtime.{name}", v, f"{TUNING_SECTION}.{sub}")
        elif k == "optim" and isinstance(value, str):     # the HF Trainer's optimizer name, not the section
            hf_names.translate(k, value, source)
        elif k in _SECTIONS:
            if k == "data" and (value is None or isinstance(value, (str, list))):
                put("data.path", _data_path(value, source), key)     # `data: train.jsonl`, as --data
                continue
            if not isinstance(value, dict):
                raise ValueError(f"{source}: section {k!r} must be a mapping of its fields, got {value!r}")
            names = set(_section_fields(k))
            for sub, v in value.items():
                s2 = str(sub).replace("-", "_")
                if s2 not in names:
                    raise ValueError(f"{source}: unknown {k} field {sub!r}; known: {sorted(names)}")
                put(f"{k}.{s2}", _data_path(v, source) if f"{k}.{s2}" == "data.path" else v, f"{k}.{sub}")
        elif hf_names.is_theirs(k):               # TRL's / the HF Trainer's name (hf_names.py)
            path, mapped = hf_names.translate(k, value, source)
            if path is not None:
                put(path, mapped, key)
        elif k in by_name:
            put(by_name[k], value, key)
        else:
            known = sorted({p.split(".")[-1] for p in leaves if p not in knobs})
            raise ValueError(f"{source}: unknown config field {key!r}; known fields: {', '.join(known)}, "
                             f"and the {TUNING_SECTION}: section (slidetune train --help-tuning)")
    if moved:            # an old config.json has every knob under runtime: name a few
        named = ", ".join(moved[:4]) + (f" and {len(moved) - 4} more" if len(moved) > 4 else "")
        _note_deprecated(f"{source}: placing tuning knobs ({named}) outside the `{TUNING_SECTION}:` section",
                         f"`{TUNING_SECTION}: {{{moved[0].split('.')[-1]}: ...}}`")
    return flat


def _data_path(value, source: str):
    """data.path as a config file gives it: a path, or a mixture's list of sources (mixture.py)."""
    return mixture_spec(value, source) if isinstance(value, list) else value


def _apply(cfg_dict: dict, path: str, value) -> None:
    parts = path.split(".")
    d = cfg_dict
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    raw: dict = {}
    if getattr(ns, "config", None):
        raw = load_yaml(ns.config)
    from_file = copy.deepcopy(raw)
    known = {p for p, _ in _leaf_fields(TrainConfig)}
    for key, value in vars(ns).items():
        if key in known:
            _apply(raw, key, value)
    if _runs_on_cpu(raw):
        given = {f"{k}.{sub}" if isinstance(v, dict) else k for k, v in raw.items()
                 for sub in (v if isinstance(v, dict) else [None])}
        for path, value in CPU_DEFAULT_JOB.items():
            if path not in given:
                _apply(raw, path, value)
    try:
        return build_config(raw)
    except ValueError as e:
        if from_file and _refuses(from_file, str(e)):    # the file's own value (no flag replaced it)
            raise ValueError(f"config file {ns.config}: {e}") from None
        raise


def _refuses(raw: dict, message: str) -> bool:
    """Whether `build_config(raw)` fails with this message."""
    try:
        build_config(raw)
    except ValueError as e:
        return str(e) == message
    return False


def _runs_on_cpu(raw: dict) -> bool:
    """Whether a config (build_config's nested dict) runs on the CPU: --device cpu, or auto here
    without a GPU."""
    import torch
    device = str((raw.get("runtime") or {}).get("device") or "auto")
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def load_yaml(path) -> dict:
    """A config file (YAML or JSON) as the nested dict `build_config` takes, each value converted to
    its field's type (_coerce)."""
    path = Path(path)
    loaded = read_config_file(path)        # config_file.py: no aliases, no key given twice
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {path}: expected a mapping of config fields, got {type(loaded).__name__}")
    raw: dict = {}
    types_ = {p: f.type for p, f in _leaf_fields(TrainConfig)}
    for p, value in _flatten_yaml(loaded, str(path)).items():
        _apply(raw, p, _coerce(value, types_[p], p, source=str(path)))     # here, where the file is known
    return raw


def build_config(raw: dict) -> TrainConfig:
    """A TrainConfig from a nested dict (sections as dicts; tuning knobs under "tuning" or "runtime")."""
    raw = dict(raw)
    tuning = raw.pop(TUNING_SECTION, None) or {}
    unknown = sorted(set(tuning) - set(tuning_docs()))
    if unknown:
        raise ValueError(unknown_tuning_message(unknown))
    if tuning:
        raw["runtime"] = {**(raw.get("runtime") or {}), **tuning}
    sections = {}
    for name in _SECTIONS:
        values = raw.pop(name, {}) or {}
        names = set(_section_fields(name))
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown {name} fields: {sorted(unknown)}; known: {sorted(names)}")
        sections[name] = values
    top = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(raw) - top
    if unknown:
        raise ValueError(f"unknown config fields: {sorted(unknown)}")
    types_ = {p: f.type for p, f in _leaf_fields(TrainConfig)}
    raw = {k: _coerce(v, types_[k], k) for k, v in raw.items()}
    for name in sections:
        sections[name] = {k: _coerce(v, types_[f"{name}.{k}"], f"{name}.{k}") for k, v in sections[name].items()}
    seed = raw.get("seed", TrainConfig.seed)
    sections["data"].setdefault("seed", seed)
    return TrainConfig(data=DataConfig(**sections["data"]), runtime=RuntimeConfig(**sections["runtime"]),
                       optim=AdamWConfig(**sections["optim"]), **raw)


def config_to_dict(cfg: TrainConfig) -> dict:
    """The config as saved in config.json: sections nested, the tuning knobs as their own flat group
    (their sections in RuntimeConfig are internal: the names are unique, as on the command line)."""
    return group_tuning({**dataclasses.asdict(cfg), "runtime": cfg.runtime.to_flat()})


def group_tuning(d: dict) -> dict:
    """A config dict with the tuning knobs moved from "runtime" into a "tuning" group right after it
    (a config.json saved before the knobs had a group reads the same way)."""
    runtime = dict(d.get("runtime") or {})
    tuning = {**{name: runtime.pop(name) for name in tuning_docs() if name in runtime},
              **(d.get(TUNING_SECTION) or {})}
    out = {}
    for key, value in d.items():
        if key == TUNING_SECTION:
            continue
        out[key] = runtime if key == "runtime" else value
        if key == "runtime":
            out[TUNING_SECTION] = tuning
    return out
