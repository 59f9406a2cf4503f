"""The typed training configuration: one YAML file, every field also a CLI flag.

Nested dataclasses (data, runtime, optim) are flattened into flags named after the
field (`--seq-len`, `--mode`, `--lr`); a few get clearer names (`--data` for the data
path). Precedence: dataclass defaults < YAML file (--config) < explicit flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .data.config import DataConfig
from .engine.adamw import AdamWConfig
from .engine.config import RuntimeConfig


@dataclass
class TrainConfig:
    model: str = "smollm2-135m"          # preset name, the embedded default, a .gguf file or a HF directory
    num_layers: int | None = None        # presets only: override the depth
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    batch_size: int = 4                  # sequences per micro-batch
    grad_accum: int = 1                  # micro-batches per optimizer step
    max_steps: int = 20                  # optimizer steps (the CPU default run takes a few minutes)
    epochs: float | None = None          # if set, overrides max_steps: epochs over the training split
    lr_schedule: str = "cosine"          # cosine | linear | constant (after warmup)
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1            # cosine/linear decay down to lr * min_lr_ratio
    max_grad_norm: float | None = 1.0    # global-norm clipping (0 or None: off)
    seed: int = 0
    eval_every: int = 0                  # evaluate every N steps (0: only before and after training)
    eval_batches: int = 8                # held-out batches per evaluation (0: all)
    save_every: int = 0                  # checkpoint every N steps (0: only at the end)
    keep_last: int = 2                   # checkpoints kept (the final export is separate)
    save_dtype: str = "fp32"             # dtype of the exported final/ model: fp32 | bf16
    output_dir: str = "runs/default"
    resume: str | None = None            # None | auto | path to a checkpoint directory
    log_every: int = 1
    check_memory: bool = True            # refuse before allocating when the estimate does not fit
    progress: bool = True                # tqdm progress bar

    def __post_init__(self):
        if self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("batch_size and grad_accum must be >= 1")
        if self.lr_schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr_schedule must be cosine, linear or constant, not {self.lr_schedule!r}")
        if self.save_dtype not in ("fp32", "bf16"):
            raise ValueError("save_dtype must be fp32 or bf16")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            self.max_grad_norm = None


# flag name overrides (field path -> flag); None hides a field (it follows another one)
_FLAG_NAMES = {"data.path": "data", "data.seed": None}
_SECTIONS = ("data", "runtime", "optim")


def _leaf_fields(cls, prefix: str = ""):
    for f in dataclasses.fields(cls):
        if f.name in _SECTIONS and not prefix:
            sub = {"data": DataConfig, "runtime": RuntimeConfig, "optim": AdamWConfig}[f.name]
            yield from _leaf_fields(sub, f.name + ".")
        else:
            yield prefix + f.name, f


def _base_type(tp):
    """int | None -> (int, True)."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {})  # noqa: S307 - our own annotations
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return non_none[0], True
    return tp, False


def _parse_value(text: str, tp):
    base, optional = _base_type(tp)
    if optional and text.lower() in ("none", "null", ""):
        return None
    if base is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
    return base(text)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="YAML file with any of the fields below")
    defaults = TrainConfig()
    for path, f in _leaf_fields(TrainConfig):
        flag = _FLAG_NAMES.get(path, path.split(".")[-1])
        if flag is None:
            continue
        obj = defaults
        for part in path.split(".")[:-1]:
            obj = getattr(obj, part)
        default = getattr(obj, f.name)
        base, _ = _base_type(f.type)
        help_text = f"{path} (default: {default})"
        extra = {"nargs": "?", "const": True} if base is bool else {}   # `--offload-activations` alone means true
        parser.add_argument("--" + flag.replace("_", "-"), dest=path, default=argparse.SUPPRESS,
                            type=lambda s, t=f.type: _parse_value(s, t), help=help_text,
                            metavar=base.__name__.upper() if isinstance(base, type) else "VALUE", **extra)


def _apply(cfg_dict: dict, path: str, value) -> None:
    parts = path.split(".")
    d = cfg_dict
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    raw: dict = {}
    if getattr(ns, "config", None):
        if not ns.config.exists():
            raise FileNotFoundError(f"config file {ns.config} does not exist")
        loaded = yaml.safe_load(ns.config.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{ns.config}: expected a mapping of config fields")
        raw.update(loaded)
    known = {p for p, _ in _leaf_fields(TrainConfig)}
    for key, value in vars(ns).items():
        if key in known:
            _apply(raw, key, value)
    return build_config(raw)


def build_config(raw: dict) -> TrainConfig:
    raw = dict(raw)
    sections = {}
    for name, cls in (("data", DataConfig), ("runtime", RuntimeConfig), ("optim", AdamWConfig)):
        values = raw.pop(name, {}) or {}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown {name} fields: {sorted(unknown)}; known: {sorted(names)}")
        sections[name] = values
    top = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(raw) - top
    if unknown:
        raise ValueError(f"unknown config fields: {sorted(unknown)}")
    seed = raw.get("seed", TrainConfig.seed)
    sections["data"].setdefault("seed", seed)
    return TrainConfig(data=DataConfig(**sections["data"]), runtime=RuntimeConfig(**sections["runtime"]),
                       optim=AdamWConfig(**sections["optim"]), **raw)


def config_to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)
