"""What a benchmark run trains, shared by the spec of each runner.

The runners (bench.measure, bench.soak, baselines.fsdp2 and deepspeed_zero3, baselines.hf_train)
each take a spec: a `BenchWorkload` beside the runner's own settings. A spec's JSON form (the
worker's SPEC.json, and each result's "spec") keeps the workload's fields at its top level, as the
result files and the readers of older results directories expect: `WorkloadSpec.to_dict` writes
it, `from_dict` reads it back.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchWorkload:
    """The model, the step's shape, the step count and the seed of one run. (engine.fit.Workload is
    the fit check's view of a run: rows, length, micro-batches and padding.)"""
    model: str                                # a preset, a local directory or a GGUF file (models.load)
    num_layers: int | None = None             # None: the model's own depth
    seq_len: int = 1024
    batch_size: int = 1                       # sequences a step (per rank; the spec says how it splits)
    steps: int = 5                            # the runner's steps (its spec says whether warm-up counts)
    warmup: int = 2                           # first steps left out of the statistics
    lr: float = 1e-5
    seed: int = 0
    gpu_memory_limit_gib: float | None = None  # emulate a smaller GPU (torch.cuda.set_per_process_memory_fraction)


WORKLOAD_FIELDS = tuple(f.name for f in dataclasses.fields(BenchWorkload))


class WorkloadSpec:
    """A runner's spec: a dataclass with `name`, a `workload: BenchWorkload` and its own fields.
    Its JSON form is flat: name, the workload's fields, then the spec's own."""

    name: str
    workload: BenchWorkload

    def to_dict(self) -> dict:
        own = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)
               if f.name not in ("name", "workload")}           # deep, as asdict: the runtime dict
        return {"name": self.name, **dataclasses.asdict(self.workload), **own}

    @classmethod
    def from_dict(cls, d: dict):
        """The spec `to_dict` wrote; a workload field it lacks keeps the spec's default."""
        d = dict(d)
        given = {k: d.pop(k) for k in WORKLOAD_FIELDS if k in d}
        return cls(**d, workload=dataclasses.replace(cls().workload, **given))

