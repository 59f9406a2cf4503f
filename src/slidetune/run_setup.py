"""A run set up once: the GPU memory limit, the model, the placement, the fit check, the engine.

`slidetune train`, `bench measure` and `bench soak` all start here, so a benchmark runs what
`train` runs: the same auto settings resolved from the same Workload, checked the same way,
before anything large is allocated. What differs between them is the request (the model, the
shape, the optimizer, whether a refusal is an error or a result) and three hooks where `train`
does its own work in the sequence:

  the compile cache (engine/compile_cache.py) -> limit GPU memory -> load the model -> after_load(loaded)             (train: the reference check)
  -> resolve the auto settings (engine.fit.place_on_ranks) -> the placement plan
  -> on_placed(prepared)                                               (train: what the autos chose)
  -> check the fit (engine.fit.check_fit_on_ranks)
  -> before_build(prepared) -> the runtime to build                    (train: the data, the output)
  -> build the engine
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .device import Device
from .engine import AdamWConfig, RuntimeConfig, build_engine
from .engine.compile_cache import CompileCache, use_compile_cache
from .engine.fit import InsufficientMemoryError, Workload, check_fit_on_ranks, place_on_ranks
from .engine.placement import PlacementPlan, unit_shapes
from .models.load import LoadedModel, load_model
from .objectives.preference import PreferenceConfig
from .parallel.ranks import RankFailure, Ranks

if TYPE_CHECKING:
    from .engine.interface import Engine
    from .telemetry.events import EventTimer


@dataclass(frozen=True)
class RunRequest:
    """What a run asks for: the model, the runtime settings as given (autos unresolved, device
    possibly "auto"), the optimizer and the step's shape."""
    model: str
    runtime: RuntimeConfig
    optim: AdamWConfig
    batch_size: int                     # rows per rank and micro-batch
    seq_len: int
    grad_accum: int = 1
    max_grad_norm: float | None = None
    padded: bool = True                 # rows may carry padding; packed or synthetic rows: False
    num_layers: int | None = None
    seed: int = 0
    with_tokenizer: bool = True         # the benchmarks' synthetic ids need none
    gpu_memory_limit_gib: float | None = None
    check_memory: bool = True           # check_fit before the engine allocates anything
    announce: bool = False              # say what the memory limit did (train's console)
    # a configuration that does not fit (check_fit's InsufficientMemoryError, a rank's refusal):
    # False raises it (train); True returns it as PreparedRun.refusal, no engine built (the
    # benchmarks record it as the run's result)
    refusal_as_result: bool = False
    objective: PreferenceConfig | None = None   # a preference objective's head (objectives/head.py); None: SFT


@dataclass
class PreparedRun:
    """A run ready to step: what each stage of prepare_run produced."""
    loaded: LoadedModel
    runtime: RuntimeConfig              # the autos resolved (device as requested: the engine's)
    plan: PlacementPlan | None          # slide mode's placement of `runtime`; None in plain mode
    work: Workload                      # the shape the autos and the fit check planned for
    engine: Engine | None = None
    refusal: str | None = None          # why it does not fit (refusal_as_result); engine None then
    build_s: float = 0.0                # seconds build_engine took
    # where compiled layers are read and written (engine/compile_cache.py); None: the run cannot compile
    compile_cache: CompileCache | None = None

    @property
    def gpu_free_bytes(self) -> int | None:
        """The GPU bytes the autos planned with (None: the device's own free memory)."""
        return self.work.gpu_free_bytes


def limit_gpu_memory(gib: float | None, device: Device, announce: bool = False) -> int | None:
    """Cap the GPU memory at `gib` GiB (--gpu-memory-limit); returns the free bytes the auto settings
    and the fit check plan with (None: theirs, the device's own free memory)."""
    if gib is None:
        return None
    if not device.is_cuda:
        if announce:
            print(f"note: --gpu-memory-limit {gib:g} has no effect on the CPU", file=sys.stderr)
        return None
    limit = device.limit_memory(gib)
    free, total = device.free_and_total()
    if announce:
        print(f"GPU memory limited to {gib:g} GiB of {total / 2**30:.1f} GiB (--gpu-memory-limit)")
    return min(free, limit)


def prepare_run(req: RunRequest, device: Device, ranks: Ranks | None = None, *,
                timer: EventTimer | None = None,
                after_load: Callable[[LoadedModel], None] | None = None,
                on_placed: Callable[[PreparedRun], None] | None = None,
                before_build: Callable[[PreparedRun], RuntimeConfig] | None = None) -> PreparedRun:
    """The run of `req` on `device` (and `ranks`), in the module docstring's order: each check
    comes before anything large is allocated, the engine last. before_build returns the runtime
    the engine is built with (train resolves compile_layers there); by default prepared.runtime."""
    ranks = ranks or Ranks.single()
    # before anything is compiled: torch reads its cache directory at the first compile. Where the
    # layers may compile: slide mode, on (or auto on CUDA: compile_policy resolves auto off elsewhere)
    may_compile = req.runtime.compile_layers == "on" or (req.runtime.compile_layers == "auto" and device.is_cuda)
    compile_cache = use_compile_cache(req.runtime.compile_cache_dir) \
        if req.runtime.mode == "slide" and may_compile else None
    gpu_free = limit_gpu_memory(req.gpu_memory_limit_gib, device, req.announce)
    loaded = load_model(req.model, num_layers=req.num_layers, seed=req.seed, with_tokenizer=req.with_tokenizer)
    if after_load is not None:
        after_load(loaded)
    # chosen on rank 0 from its GPU and shared: every rank runs the same placement (the fit check
    # verifies each rank's GPU, and the host for all of its ranks); the host's RAM is counted for
    # all of its ranks (one shared state, each rank's own buffers)
    work = Workload(batch_size=req.batch_size, seq_len=req.seq_len, grad_accum=req.grad_accum,
                    max_grad_norm=req.max_grad_norm, padded=req.padded, gpu_free_bytes=gpu_free,
                    ranks_per_host=ranks.cfg.local_world_size)
    # the autos are resolved for the device that runs (device auto -> cuda | cpu)
    asked = req.runtime if req.runtime.device != "auto" else dataclasses.replace(req.runtime,
                                                                                 device=device.device.type)
    placed = place_on_ranks(loaded.split, asked, work, ranks)
    plan = (PlacementPlan.build(unit_shapes(loaded.split), placed,
                                placed.resolved_schedule(req.grad_accum, req.max_grad_norm), ranks=ranks.cfg.world_size,
                                local_ranks=ranks.cfg.local_world_size)
            if placed.mode == "slide" else None)
    prepared = PreparedRun(loaded, dataclasses.replace(placed, device=req.runtime.device), plan, work,
                           compile_cache=compile_cache)
    if on_placed is not None:
        on_placed(prepared)
    if req.check_memory:
        try:
            # per rank: its own GPU; the host with its local ranks (the shared state once, each
            # rank's buffers each)
            check_fit_on_ranks(loaded.split, placed, work, ranks)
        except (InsufficientMemoryError, RankFailure) as e:
            if not req.refusal_as_result:
                raise
            prepared.refusal = str(e)
            return prepared
    runtime = before_build(prepared) if before_build is not None else prepared.runtime
    t0 = time.perf_counter()
    prepared.engine = build_engine(loaded, dataclasses.replace(runtime, device=req.runtime.device), req.optim,
                                   device, grad_accum=req.grad_accum, max_grad_norm=req.max_grad_norm,
                                   timer=timer, dist=ranks.dp, objective=req.objective)
    prepared.build_s = time.perf_counter() - t0
    prepared.runtime = runtime
    return prepared
