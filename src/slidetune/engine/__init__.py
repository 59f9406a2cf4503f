"""Training engines behind one API: build_engine(loaded, runtime, optim, ...)."""
from __future__ import annotations

from ..device import Device
from ..models.load import LoadedModel
from ..telemetry.events import EventTimer
from .adamw import AdamWConfig
from .config import RuntimeConfig
from .interface import Engine
from .result import StepResult

__all__ = ["AdamWConfig", "Engine", "RuntimeConfig", "StepResult", "build_engine"]


def build_engine(loaded: LoadedModel, rt: RuntimeConfig, optim: AdamWConfig, device: Device | None = None,
                 grad_accum: int = 1, max_grad_norm: float | None = None, timer: EventTimer | None = None,
                 dist=None, objective=None) -> Engine:
    """The engine of `rt.mode` (interface.Engine: SlideEngine for slide, PlainEngine for gpu and
    ckpt). dist: a distributed.DataParallel for data parallel over several ranks (slide mode only).
    objective: a preference objective's PreferenceConfig (objectives/head.py); None: supervised."""
    device = device or Device.resolve(rt.device, waits=rt.host.cuda_waits)
    if rt.mode == "slide":
        from .slide.engine import SlideEngine
        return SlideEngine(loaded, rt, optim, device, grad_accum, max_grad_norm, timer, dist=dist, objective=objective)
    if dist is not None and dist.world_size > 1:
        raise ValueError(f"data parallel over several ranks runs in slide mode only, not mode {rt.mode!r}")
    from .plain import PlainEngine
    return PlainEngine(loaded, rt, optim, device, grad_accum, max_grad_norm, timer, objective=objective)
