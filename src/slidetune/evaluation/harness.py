"""`slidetune eval`: lm-evaluation-harness's benchmarks on a saved model (a run's final/, or any
HF model directory of config.json and safetensors weights).

lm-evaluation-harness (`lm_eval`) is an optional extra: without it the command refuses with the
install line before anything is loaded. The arguments are checked first (the tasks, --limit, the
model directory's files), so a typo is named in a second either way.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

INSTALL_LINE = "pip install 'slidetune[eval]'"


class HarnessUnavailable(ImportError):
    """lm_eval is not installed (the message holds the install line)."""


@dataclass(frozen=True)
class HarnessRequest:
    model_dir: Path
    tasks: list[str]                 # lm_eval task names, e.g. ["hellaswag", "arc_easy"]
    batch_size: str = "auto"         # rows per forward: a number, or auto (lm_eval finds the largest)
    limit: float | None = None       # examples per task (a fraction below 1); None: all
    device: str = "auto"             # auto (cuda where available, else cpu) | cpu | cuda | cuda:N
    dtype: str = "auto"              # the weights' dtype as loaded (auto: the saved one)
    output: Path | None = None       # the results as JSON (None: printed only)


def parse_tasks(spec: str) -> list[str]:
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    if not tasks:
        raise ValueError(f"--tasks {spec!r}: name at least one lm-evaluation-harness task, e.g. --tasks "
                         f"hellaswag,arc_easy")
    return tasks


def check_model_dir(path: Path) -> Path:
    """A directory from_pretrained loads: config.json and safetensors weights (ValueError naming it)."""
    if not path.is_dir():
        raise ValueError(f"--model {path}: no such directory (a saved model: a run's final/ directory)")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {path}: no config.json there; not a saved model directory (a run's final/ "
                         f"holds one)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"--model {path}: no *.safetensors weights there (a run's final/ holds them)")
    return path


def check_request(req: HarnessRequest) -> None:
    """The arguments, before anything is imported or loaded."""
    if not req.tasks:
        raise ValueError("--tasks: name at least one lm-evaluation-harness task")
    if req.limit is not None and not req.limit > 0:
        raise ValueError(f"--limit must be > 0 (examples per task, or a fraction below 1), not {req.limit}")
    if req.batch_size != "auto" and not (req.batch_size.isdigit() and int(req.batch_size) > 0):
        raise ValueError(f"--batch-size must be a number > 0 or auto, not {req.batch_size!r}")
    if req.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, not {req.dtype!r}")
    check_model_dir(req.model_dir)


def require_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise HarnessUnavailable(f"slidetune eval runs lm-evaluation-harness (lm_eval), which is not installed "
                                 f"here; install it with: {INSTALL_LINE}")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def run_harness(req: HarnessRequest) -> dict:
    """lm_eval.simple_evaluate on the model directory; the results (also written to req.output)."""
    check_request(req)
    require_lm_eval()
    import lm_eval

    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={req.model_dir},dtype={req.dtype}", tasks=req.tasks,
        batch_size=req.batch_size, limit=req.limit, device=resolve_device(req.device))
    if req.output is not None:
        req.output.parent.mkdir(parents=True, exist_ok=True)
        req.output.write_text(json.dumps({k: results.get(k) for k in ("results", "versions", "n-shot", "config")},
                                         indent=2, default=str) + "\n")
    return results


def summary_lines(results: dict) -> list[str]:
    """One line per task: its metrics (stderr columns left out)."""
    lines = []
    for task, metrics in (results.get("results") or {}).items():
        shown = [f"{name} {value:.4f}" for name, value in metrics.items()
                 if isinstance(value, float) and "stderr" not in name]
        lines.append(f"{task}: " + ", ".join(shown))
    return lines
