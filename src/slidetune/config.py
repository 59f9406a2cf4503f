"""The typed training configuration: one YAML file, every field also a CLI flag.

Nested dataclasses (data, runtime, optim) are flattened into flags named after the
field (`--seq-len`, `--mode`, `--lr`); a few get clearer names (`--data` for the data
path). Precedence: dataclass defaults < YAML file (--config) < explicit flags.

The YAML file may nest the sections (`data: {seq_len: 512}`) or name the fields flat,
like the flags (`seq_len: 512`, `seq-len: 512`, `data: train.jsonl`); values are
converted to the field's type (YAML reads `1e-4` as a string) and checked. The resolved
config that `train` saves (`<output_dir>/config.json`) is valid input for `--config`.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .data.config import DataConfig
from .engine.adamw import AdamWConfig
from .engine.config import RuntimeConfig


DEFAULT_CPU_STEPS = 20     # the default job on 2 CPU cores: about two and a half minutes
DEFAULT_GPU_STEPS = 300    # on a GPU the same job is seconds per 20 steps: fine-tune for real


@dataclass
class TrainConfig:
    model: str = "smollm2-135m"          # preset name, the embedded default, a .gguf file or a HF directory
    num_layers: int | None = None        # presets only: override the depth
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    batch_size: int = 4                  # sequences per micro-batch
    grad_accum: int = 1                  # micro-batches per optimizer step
    max_steps: int | None = None         # optimizer steps; None: 20 on the CPU (a few minutes on 2 cores), 300 on a GPU
    epochs: float | None = None          # if set, overrides max_steps: epochs over the training split
    lr_schedule: str = "cosine"          # cosine | linear | constant (after warmup)
    warmup_steps: int = 2                # linear warmup from lr/warmup_steps to lr over these steps
    min_lr_ratio: float = 0.1            # cosine/linear decay down to lr * min_lr_ratio
    max_grad_norm: float | None = 1.0    # global-norm clipping (0 or None: off)
    seed: int = 0                        # seeds the weights of presets, the data split and the batch order
    eval_every: int = 0                  # evaluate every N steps (0: only before and after training)
    eval_batches: int = 8                # held-out batches per evaluation (0: all)
    save_every: int = 0                  # checkpoint every N steps (0: only at the end)
    keep_last: int = 2                   # checkpoints kept (the final export is separate)
    save_dtype: str = "auto"             # dtype of the exported final/ model: auto (the checkpoint's own: bf16 for a bf16 model) | fp32 | bf16
    checkpoint_dir: str | None = None    # where resumable checkpoints go (None: <output_dir>/checkpoints); another disk when they do not fit
    output_dir: str = "runs/default"     # metrics.csv, loss.png, config.json, checkpoints/, final/
    resume: str | None = None            # None | auto | path to a checkpoint directory
    stop_after: int | None = None        # stop after this many steps in this invocation, leaving a resumable checkpoint
    log_every: int = 1                   # write metrics.csv every N steps
    check_memory: bool = True            # refuse before allocating when the estimate does not fit
    gpu_memory_limit: float | None = None  # GiB of GPU memory this run may use (a budget below the card's; None: all of it)
    progress: bool = True                # tqdm progress bar

    def resolved_max_steps(self, on_gpu: bool) -> int:
        """The step budget when neither max_steps nor epochs is given: short on the CPU."""
        if self.max_steps is not None:
            return self.max_steps
        return DEFAULT_GPU_STEPS if on_gpu else DEFAULT_CPU_STEPS

    def __post_init__(self):
        if self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("batch_size and grad_accum must be >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, not {self.max_steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"epochs must be > 0, not {self.epochs}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"stop_after must be >= 1 (or None), not {self.stop_after}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, not {self.keep_last}")
        for name in ("warmup_steps", "eval_every", "eval_batches", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, not {self.log_every}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], not {self.min_lr_ratio}")
        if self.lr_schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr_schedule must be cosine, linear or constant, not {self.lr_schedule!r}")
        if self.save_dtype not in ("auto", "fp32", "bf16"):
            raise ValueError("save_dtype must be auto, fp32 or bf16")
        if self.gpu_memory_limit is not None and self.gpu_memory_limit <= 0:
            raise ValueError(f"gpu_memory_limit must be > 0 GiB (or None: the whole GPU), not {self.gpu_memory_limit}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            self.max_grad_norm = None


# flag name overrides (field path -> flag); None hides a field (it follows another one)
_FLAG_NAMES = {"data.path": "data", "data.seed": None}
# string fields whose flag alone means a value, as a boolean flag alone means true
_BARE_FLAG = {"runtime.compile_layers": "on"}
_SECTIONS = ("data", "runtime", "optim")
_SECTION_CLASSES = {"data": DataConfig, "runtime": RuntimeConfig, "optim": AdamWConfig}
# help text where the field's own comment is missing or too terse for --help
_HELP = {
    "data.path": "training data: a .txt/.md file, a .jsonl/.ndjson file (text, messages, prompt/completion or "
                 "alpaca records) or a datasets save_to_disk directory; None: the built-in English corpus",
    "optim.beta1": "AdamW first-moment decay",
    "optim.beta2": "AdamW second-moment decay (0.95, not 0.999: the usual LLM fine-tuning choice)",
    "optim.eps": "AdamW epsilon",
}


def _leaf_fields(cls, prefix: str = ""):
    for f in dataclasses.fields(cls):
        if f.name in _SECTIONS and not prefix:
            sub = _SECTION_CLASSES[f.name]
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
        doc = _HELP.get(path) or field_docs(type(obj)).get(f.name, "")
        help_text = (f"{doc} " if doc else "") + f"[{path}] (default: {default})"
        help_text = help_text.replace("%", "%%")
        extra = {"nargs": "?", "const": True} if base is bool else {}   # `--offload-activations` alone means true
        if path in _BARE_FLAG:
            extra = {"nargs": "?", "const": _BARE_FLAG[path]}           # `--compile-layers` alone means on
        parser.add_argument("--" + flag.replace("_", "-"), dest=path, default=argparse.SUPPRESS,
                            type=lambda s, t=f.type: _parse_value(s, t), help=help_text,
                            metavar=base.__name__.upper() if isinstance(base, type) else "VALUE", **extra)


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


def _coerce(value, tp, path: str):
    """A YAML value converted to the field's type; ValueError naming the field when impossible."""
    base, optional = _base_type(tp)
    if value is None:
        if optional:
            return None
        raise ValueError(f"config field {path} cannot be null")
    try:
        if isinstance(value, str):
            return _parse_value(value, tp)
        if base is bool:
            if isinstance(value, bool):
                return value
            if value in (0, 1):
                return bool(value)
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
    raise ValueError(f"config field {path}: expected {name}{' or null' if optional else ''}, got {value!r}")


def _flatten_yaml(loaded: dict, source: str) -> dict:
    """YAML mapping (nested sections and/or flat flag-style keys) -> {field path: value}."""
    leaves = dict(_leaf_fields(TrainConfig))
    by_name: dict[str, str] = {}          # flat name (field or flag, `_` for `-`) -> path
    for path in sorted(leaves, key=lambda p: "." in p):        # top-level fields first: they keep their name
        name = path.split(".")[-1]
        if _FLAG_NAMES.get(path, name) is None:
            continue                      # hidden: follows another field
        for key in (name, _FLAG_NAMES.get(path, name).replace("-", "_")):
            if key not in _SECTIONS:
                by_name.setdefault(key, path)
    flat: dict[str, object] = {}

    def put(path: str, value, key: str) -> None:
        if path in flat and flat[path] != value:
            raise ValueError(f"{source}: {path} is given twice ({key!r}) with different values")
        flat[path] = value

    for key, value in loaded.items():
        k = str(key).replace("-", "_")
        if k in _SECTIONS:
            if k == "data" and (value is None or isinstance(value, str)):
                put("data.path", value, key)          # `data: train.jsonl`, as the --data flag
                continue
            if not isinstance(value, dict):
                raise ValueError(f"{source}: section {k!r} must be a mapping of its fields, got {value!r}")
            cls = _SECTION_CLASSES[k]
            names = {f.name for f in dataclasses.fields(cls)}
            for sub, v in value.items():
                s2 = str(sub).replace("-", "_")
                if s2 not in names:
                    raise ValueError(f"{source}: unknown {k} field {sub!r}; known: {sorted(names)}")
                put(f"{k}.{s2}", v, f"{k}.{sub}")
        elif k in by_name:
            put(by_name[k], value, key)
        else:
            known = sorted({p.split(".")[-1] for p in leaves})
            raise ValueError(f"{source}: unknown config field {key!r}; known fields: {', '.join(known)}")
    return flat


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
    known = {p for p, _ in _leaf_fields(TrainConfig)}
    for key, value in vars(ns).items():
        if key in known:
            _apply(raw, key, value)
    return build_config(raw)


def load_yaml(path) -> dict:
    """A config file (YAML or JSON) as the nested dict `build_config` takes."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {path}: expected a mapping of config fields, got {type(loaded).__name__}")
    raw: dict = {}
    for p, value in _flatten_yaml(loaded, str(path)).items():
        _apply(raw, p, value)
    return raw


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
    types_ = {p: f.type for p, f in _leaf_fields(TrainConfig)}
    raw = {k: _coerce(v, types_[k], k) for k, v in raw.items()}
    for name in sections:
        sections[name] = {k: _coerce(v, types_[f"{name}.{k}"], f"{name}.{k}") for k, v in sections[name].items()}
    seed = raw.get("seed", TrainConfig.seed)
    sections["data"].setdefault("seed", seed)
    return TrainConfig(data=DataConfig(**sections["data"]), runtime=RuntimeConfig(**sections["runtime"]),
                       optim=AdamWConfig(**sections["optim"]), **raw)


def config_to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)
