"""AdamW over one unit's flat FP32 master tensor, through torch's fused kernel.

`torch._fused_adamw_` is the kernel behind `torch.optim.AdamW(fused=True)` (CUDA,
and CPU since torch 2.4): 7x faster on the CPU than the for-each path. Calling it
directly on ranges of a flat tensor lets the sliding engine update a unit chunk by
chunk as its gradients arrive, with two parameter groups (decayed matrices first,
then norms and biases without decay) as contiguous ranges of the same tensor.
The arithmetic is exactly torch.optim.AdamW's (tested against it).

On the host, ranges go through native_adamw's kernel instead (kernel="dynamic" or
"static", its OpenMP schedule): one C loop called without the GIL, so the compute thread
keeps launching while it runs, and that reads BF16 gradients as they landed (torch's
kernel wants FP32 gradients for FP32 parameters). kernel="torch", or a host without a C
compiler, keeps torch's fused kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import native_adamw

KERNELS = ("dynamic", "static", "torch")


@dataclass(frozen=True)
class OptimizerState:
    """What the optimizer keeps for each parameter it updates, beside the weights the model computes
    with: the bytes the fit, the placement, the disk tier, the roofline and the save plan count.

    master: the copy of the weights the update writes ([numel] of master_dtype); moments: tensors
    of the master's length (moment_names, in state_tensors()' names and the disk tier's file order);
    step: one 0-dim tensor a unit, not a parameter."""
    master_dtype: torch.dtype
    moment_names: tuple[str, ...]
    moment_dtype: torch.dtype
    step_dtype: torch.dtype

    @property
    def master_bytes(self) -> int:
        return self.master_dtype.itemsize

    @property
    def moment_bytes(self) -> int:
        """All the moments of one parameter."""
        return len(self.moment_names) * self.moment_dtype.itemsize

    @property
    def bytes_per_param(self) -> int:
        """Master and moments: what a checkpoint writes and a host unit's RAM holds per parameter."""
        return self.master_bytes + self.moment_bytes

    @property
    def step_bytes(self) -> int:
        """The step count, once a unit."""
        return self.step_dtype.itemsize


# FlatAdamW's state: FP32 master 4 B + exp_avg 4 B + exp_avg_sq 4 B = 12 B/param, and a 4 B step a unit.
FP32_ADAMW = OptimizerState(master_dtype=torch.float32, moment_names=("exp_avg", "exp_avg_sq"),
                            moment_dtype=torch.float32, step_dtype=torch.float32)


@dataclass
class AdamWConfig:
    lr: float = 1e-5             # peak learning rate; a scheduler scales it per step
    beta1: float = 0.9
    beta2: float = 0.95          # 0.95 rather than 0.999: the usual LLM fine-tuning choice, stabler with bf16
    eps: float = 1e-8
    weight_decay: float = 0.0    # applied to matrices only (norms and biases never decay)

    def __post_init__(self) -> None:
        """torch.optim.AdamW's own rules, checked here so that a bad value is refused before the
        model loads (the kernels take NaN or a negative lr without a word: `--lr -1` diverged).
        lr 0 is allowed, as torch allows it: an update that moves no weight (the moments still
        advance), a run that measures throughput or held-out loss without changing the model."""
        rules = (("lr", math.isfinite(self.lr) and self.lr >= 0, "a finite number >= 0"),
                 ("beta1", 0.0 <= self.beta1 < 1.0, "in [0, 1)"),
                 ("beta2", 0.0 <= self.beta2 < 1.0, "in [0, 1)"),
                 ("eps", math.isfinite(self.eps) and self.eps > 0, "a finite number > 0"),
                 ("weight_decay", math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                  "a finite number >= 0"))
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(f"optimizer setting {name} (--{name.replace('_', '-')}) must be {rule}, "
                                 f"got {getattr(self, name)!r}")


class FlatAdamW:
    """AdamW state (moments, step) for one flat master tensor with a decay range [0, n_decay)."""

    STATE = FP32_ADAMW          # what it holds per parameter (master here or elsewhere, moments, step)

    def __init__(self, master: torch.Tensor | None, n_decay: int, cfg: AdamWConfig, kernel: str = "dynamic",
                 moments_here: bool = True, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """moments_here=False: the moments live elsewhere (the disk tier) and every update() is given
        the moments of its range.
        master None: the master lives elsewhere too (the disk tier's blocks, --tuning.disk_master)
        and every update() is given the master of its range (`params`); host only.
        state: (exp_avg, exp_avg_sq, step) to use instead of new zeros: the views of the host state
        the ranks of a host share (engine/distributed.py); they hold zeros or a state to go on from."""
        assert master is None or (master.dim() == 1 and master.dtype == torch.float32)
        assert master is not None or not moments_here, "a master elsewhere needs the moments elsewhere too"
        assert kernel in KERNELS, f"kernel must be one of {KERNELS}, not {kernel!r}"
        self.master = master                                 # [numel] fp32, updated in place
        self.n_decay = n_decay
        self.cfg = cfg
        self.kernel = kernel                                 # host ranges: native_adamw's schedule, or torch
        if state is not None:
            self.exp_avg, self.exp_avg_sq, self.step_count = state
            return
        self.exp_avg = torch.zeros_like(master) if moments_here else None      # [numel] fp32
        self.exp_avg_sq = torch.zeros_like(master) if moments_here else None   # [numel] fp32
        # The kernel reads the step from a tensor on the parameters' device.
        self.step_count = torch.zeros((), dtype=torch.float32, device=master.device if master is not None else "cpu")

    def begin_step(self) -> None:
        """Count one optimizer step; call once before the ranges of this step are updated."""
        self.step_count += 1

    def update(self, grad: torch.Tensor, lr: float, start: int = 0,
               grad_scale: float | torch.Tensor = 1.0, part: str = "all",
               moments: tuple[torch.Tensor, torch.Tensor] | None = None,
               params: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> None:
        """Apply AdamW to master[start:start+len(grad)] with `grad` times `grad_scale`.

        grad_scale: the clip coefficient, a float (host) or a 0-dim FP32 tensor on the master's
        device (computed there from the device's norm, so no host sync). The gradient is widened
        to FP32 before it is scaled, as clip_grad_norm_ scales an FP32 gradient. Host ranges go
        through native_adamw's kernel (FP32 or BF16 gradients, read only, scaled in registers)
        unless kernel="torch", it cannot be built or the range is tiny; everything else through
        torch's fused kernel, after an FP32 copy (a compute-dtype gradient) or an in-place
        scaling of `grad` (an FP32 one, which the caller no longer needs).

        part: "all"; or the split pair "params" (the new parameters only) then "moments" (the new
        moments only, with the same gradient and scale), which together write exactly what "all"
        does (native_adamw.update's part). Ranges native_adamw does not take are updated in full
        by "params" and left alone by "moments". The pair "weights" then "rest" (clip_sweep=weights):
        "weights" writes only the new parameters in BF16 into `weights` ([len(grad)] BF16, the
        upload's source) and "rest" the whole update (master and moments), from the same inputs;
        ranges native_adamw does not take are updated in full by "weights" (their BF16 copy cast
        from the new master) and left alone by "rest".

        moments: (exp_avg, exp_avg_sq) of master[start:start+len(grad)], [len(grad)] FP32 each, where
        they do not live in this object (the disk tier's block buffers).
        params: master[start:start+len(grad)], [len(grad)] FP32, where the master does not live here
        (a disk unit's master in its block buffer); updated in place."""
        end = start + grad.numel()
        if self.master is None and params is None:
            raise ValueError("this master lives elsewhere: update() needs its range (params)")

        def moment_views(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
            if moments is None:
                return self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi]
            return moments[0][lo - start:hi - start], moments[1][lo - start:hi - start]

        def param_view(lo: int, hi: int) -> torch.Tensor:
            return self.master[lo:hi] if params is None else params[lo - start:hi - start]
        scaled = isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0
        for lo, hi, wd in ((start, min(end, self.n_decay), self.cfg.weight_decay),
                           (max(start, self.n_decay), end, 0.0)):
            if hi <= lo:
                continue
            g = grad[lo - start:hi - start]
            m, v = moment_views(lo, hi)
            p = param_view(lo, hi)
            w = weights[lo - start:hi - start] if weights is not None else None
            if (self.kernel != "torch" and not isinstance(grad_scale, torch.Tensor)
                    and native_adamw.takes(g, p)):
                native_adamw.update(p, m, v, g, lr=lr,
                                    beta1=self.cfg.beta1, beta2=self.cfg.beta2, eps=self.cfg.eps,
                                    weight_decay=wd, step=int(self.step_count), schedule=self.kernel,
                                    grad_scale=float(grad_scale), part="all" if part == "rest" else part,
                                    weights=w)
                continue
            if part in ("moments", "rest"):
                continue                                  # written in full by the "params"/"weights" call
            if g.dtype != p.dtype:
                g = g.float()                             # torch's kernel wants the parameters' dtype
            if scaled:
                g.mul_(grad_scale)
            torch._fused_adamw_(
                [p], [g], [m], [v], [],
                [self.step_count], lr=lr, beta1=self.cfg.beta1, beta2=self.cfg.beta2,
                weight_decay=wd, eps=self.cfg.eps, amsgrad=False, maximize=False)
            if part == "weights":
                w.copy_(p)                                # FP32 -> BF16, round to nearest even

    def update_widened(self, grad: torch.Tensor, lr: float, scratch: torch.Tensor,
                       grad_scale: float | torch.Tensor = 1.0) -> None:
        """update() over the whole master from a compute-dtype gradient [numel], widened to FP32 a
        chunk at a time into `scratch` (FP32, any length), so no gradient-sized FP32 copy is
        allocated: what the slide engine does for units updated on the GPU."""
        n, chunk = grad.numel(), scratch.numel()
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            widened = scratch[: hi - lo]                     # [hi - lo] fp32
            widened.copy_(grad[lo:hi])
            self.update(widened, lr, start=lo, grad_scale=grad_scale)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "step": self.step_count}

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.step_count.copy_(state["step"])
