"""One soak run in this process: a long slide-mode run sampling its resources every step.

Run as `python -m slidetune.bench.soak SPEC.json OUT.json` (bench.baselines.proc.run_worker:
one process per variant, so one variant's page-locked or GPU memory cannot show in
another's series). The recipe is `slidetune train`'s default (TrainConfig: AdamW settings,
global-norm clipping at 1.0, which makes the slide engine's update schedule the deferred
one); the data are synthetic token ids, a fresh batch every step as the trainer's sampler
builds one, so the loop allocates what a real run allocates. The loop is the trainer's
(train.Trainer.advance): step k is issued, then step k-1 is finished (its gradient norm read,
i.e. every update of it applied), so a step's host work overlaps the next one's start as in a
real run. Sample k is taken once step k is finished; its step time is the interval between
successive finished steps (one more step is issued, not sampled, so the last sampled one is
finished as every other). Beside the resources, each sample has the wall-clock time and what
the machine's CPUs did during the step (telemetry.resources.CONTEXT: busy, stolen by the
hypervisor, waiting on I/O).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace

import psutil
import torch

from ..config import TrainConfig
from ..data import Batch
from ..device import Device
from ..engine import RuntimeConfig
from ..run_setup import RunRequest, prepare_run
from ..telemetry.machine import machine_info
from ..telemetry.resources import CpuTimesSampler, sample_resources
from .baselines.proc import worker_main
from .workload import BenchWorkload, WorkloadSpec

_RECIPE = TrainConfig()      # the default recipe: its optimizer settings and clipping


@dataclass
class SoakSpec(WorkloadSpec):
    name: str = "slide"
    # steps: every one is sampled; the first `warmup` are not fitted
    workload: BenchWorkload = field(default_factory=lambda: BenchWorkload(
        "qwen3-8b", batch_size=8, steps=250, warmup=20, lr=_RECIPE.optim.lr))
    runtime: dict = field(default_factory=dict)   # RuntimeConfig fields (mode slide unless given)
    max_grad_norm: float | None = _RECIPE.max_grad_norm
    check_memory: bool = True        # refuse (status "refused") what engine.fit says does not fit
    progress_every: int = 25         # a line on stderr every N steps (0: none)
    # each sample also goes to this JSON-lines file as it is taken (flushed): a run cut short by
    # a deadline or a crash leaves its samples (the worker's result is written only at the end)
    samples_path: str | None = None
    max_minutes: float | None = None  # stop after this long (the steps done are kept and fitted)


def _batch(gen: torch.Generator, vocab: int, batch: int, seq: int) -> Batch:
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)          # [B, S]
    labels = torch.roll(ids, -1, 1)                                      # next token; last one ignored
    labels[:, -1] = -100
    return Batch(ids, labels, None)


def soak(spec: SoakSpec) -> dict:
    """Build the engine as `train` does, run its steps, sample each; the result as a dict."""
    wl = spec.workload
    rt = RuntimeConfig(**{"mode": "slide", **spec.runtime})
    device = Device.resolve(rt.device, waits=rt.host.cuda_waits)
    rt = replace(rt, device=device.device.type)       # auto -> cuda | cpu: the result names the device that ran
    base = dict(spec=spec.to_dict(), machine=machine_info())
    # synthetic rows are full: never padded
    prepared = prepare_run(RunRequest(
        model=wl.model, runtime=rt, optim=replace(_RECIPE.optim, lr=wl.lr), batch_size=wl.batch_size,
        seq_len=wl.seq_len, max_grad_norm=spec.max_grad_norm, padded=False, num_layers=wl.num_layers, seed=wl.seed,
        with_tokenizer=False, gpu_memory_limit_gib=wl.gpu_memory_limit_gib,
        check_memory=spec.check_memory and rt.mode == "slide", refusal_as_result=True), device)
    rt, loaded, engine = prepared.runtime, prepared.loaded, prepared.engine
    if prepared.refusal is not None:
        return {**base, "runtime": rt.to_flat(), "status": "refused", "error": prepared.refusal}
    init_s = prepared.build_s
    t0 = time.perf_counter() - init_s          # the engine's build began: --max-minutes counts from there
    proc = psutil.Process()
    gen = torch.Generator().manual_seed(wl.seed)
    vocab = loaded.split.config.vocab_size
    log = open(spec.samples_path, "w") if spec.samples_path else None

    def keep(sample: dict) -> None:
        samples.append(sample)
        if log is not None:
            log.write(json.dumps(sample, default=float) + "\n")
            log.flush()

    samples: list[dict] = []
    cpu = CpuTimesSampler()
    keep({"step": 0, "step_s": 0.0, "loss": None, "time": time.time(), **sample_resources(device, proc),
          **cpu.sample()})     # before step 1
    deadline = t0 + 60 * spec.max_minutes if spec.max_minutes else None
    stopped_at = None

    def finish(step: int, res) -> float:
        """Step `step` is done (every update applied): its sample; returns when it finished."""
        nonlocal last
        res.grad_norm()
        now = time.perf_counter()
        keep({"step": step, "step_s": now - last, "loss": res.loss, "time": time.time(),
              **sample_resources(device, proc), **cpu.sample()})
        last = now
        if spec.progress_every and step % spec.progress_every == 0:
            s = samples[-1]
            print(f"[soak {spec.name}] step {step}/{wl.steps}: {s['step_s']:.3f} s, rss "
                  f"{s['rss_bytes'] / 2**30:.2f} GiB, pinned {s['pinned_bytes'] / 2**30:.2f} GiB, gpu reserved "
                  f"{s['gpu_reserved_bytes'] / 2**30:.2f} GiB, fds {s['open_fds']}, threads {s['threads']}, "
                  f"cpu steal {s['cpu_steal_pct']:.1f}%", file=sys.stderr, flush=True)
        return now

    try:
        last = time.perf_counter()
        pending = None                        # (step, result): issued, not yet finished
        # one step more than sampled: the last sampled step is finished after the next is issued,
        # as every other (finished alone, its interval would lack the next step's start)
        for step in range(1, wl.steps + 2):
            res = engine.train_step([_batch(gen, vocab, wl.batch_size, wl.seq_len)], wl.lr)
            if pending is not None:
                now = finish(*pending)
                if deadline is not None and now > deadline and pending[0] < wl.steps:
                    stopped_at = pending[0]
                    break
            pending = (step, res)
        res.grad_norm()                       # the step issued last completes; it is not sampled
    finally:
        engine.close()
        if log is not None:
            log.close()
    return {**base, "status": "ok", "runtime": rt.to_flat(), "init_s": init_s, "params": loaded.split.num_params(),
            "num_layers": loaded.split.num_layers, "samples": samples,
            "stopped_after_steps": stopped_at}      # --max-minutes ended it early (None: every step ran)


def main(argv: list[str] | None = None) -> int:
    return worker_main(lambda d: soak(SoakSpec.from_dict(d)), argv)


if __name__ == "__main__":
    sys.exit(main())
