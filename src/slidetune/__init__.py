"""slidetune: full-parameter fine-tuning on one small GPU by sliding layers through it.

The library (docs/library.md)::

    import slidetune
    cfg = slidetune.TrainConfig(model="/path/to/hf_dir", max_steps=100, output_dir="runs/mine")
    summary = slidetune.train(cfg, callbacks=[MyCallback()])

`train` runs (or resumes) a job as `slidetune train` does and returns a TrainSummary; a Callback
hears of each step, evaluation and save. The names are imported on first use, so `import slidetune`
alone stays light.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it (`train`: slidetune.trainer's train function).
# Imported when first asked for, not here: the package's modules import __version__ from this file, so
# importing them here would make each a cycle through the package
_EXPORTS = {
    "train": "slidetune.trainer",
    "TrainConfig": "slidetune.config",
    "TrainSummary": "slidetune.trainer",
    "TrainingError": "slidetune.trainer",
    "Callback": "slidetune.callbacks",
    "DataConfig": "slidetune.data.config",
    "RuntimeConfig": "slidetune.engine.config",
    "AdamWConfig": "slidetune.engine.adamw",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'slidetune' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
