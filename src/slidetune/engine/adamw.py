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

from ..fields import check_fields
from . import blockwise8, native_adamw

KERNELS = ("dynamic", "static", "torch")


MASTERS = ("fp32", "bf16")              # --master
MOMENTS = ("fp32", "bf16", "8bit")      # --moments
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": blockwise8.CODE_DTYPE}


def _whole(x: float) -> int | float:
    """A byte count as an int where it is whole (FP32_ADAMW's figures stay the ints they were)."""
    return int(x) if float(x).is_integer() else x


@dataclass(frozen=True)
class StateField:
    """One tensor of a unit's optimizer state, as laid out in the disk tier's blocks and the host's
    shared mapping: `per` master elements share one of its elements (1; an 8-bit scale: BLOCK)."""
    name: str
    dtype: torch.dtype
    per: int = 1

    def count(self, numel: int) -> int:
        """Its elements for `numel` master elements (a last partial block keeps a scale of its own)."""
        return -(-numel // self.per)

    def nbytes(self, numel: int) -> int:
        return self.count(numel) * self.dtype.itemsize


@dataclass(frozen=True)
class OptimizerState:
    """What the optimizer keeps for each parameter it updates, beside the weights the model computes
    with: the bytes the fit, the placement, the disk tier, the roofline and the save plan count.

    master: the copy of the weights the update writes ([numel] of master_dtype); moments: tensors
    of the master's length (moment_names, in state_tensors()' names and the disk tier's file order),
    [numel] of moment_dtype each (FP32, BF16, or the 8-bit format's one-byte codes), and where
    moment_block > 0 one scale of scale_dtype for each moment_block elements of each moment
    ([ceil(numel / moment_block)], blockwise8); step: one 0-dim tensor a unit, not a parameter.

    One instance per combination of the flags (`optimizer_state()`); FP32_ADAMW, the default, is
    the one every reader used before the compact formats (issue 46) and keeps its int figures.
    The compact ones' figures are exact floats: 4/256 = 1/64 is a power of two."""
    master_dtype: torch.dtype
    moment_names: tuple[str, ...]
    moment_dtype: torch.dtype
    step_dtype: torch.dtype
    master: str = "fp32"                     # the --master value this is
    moments: str = "fp32"                    # the --moments value
    moment_block: int = 0                    # elements sharing one scale (8bit: blockwise8.BLOCK); 0: none
    scale_dtype: torch.dtype = torch.float32     # each block's absmax (8bit)
    # "stochastic": a BF16 master is rounded stochastically (a counter-based hash of the step and
    # the element's index: nothing stored); "nearest": FP32 keeps the update as computed
    master_rounding: str = "nearest"

    @property
    def name(self) -> str:
        return f"master {self.master}, moments {self.moments}"

    @property
    def flags(self) -> str:
        """The flags that choose this format, defaults left out: "--master bf16 --moments 8bit"."""
        return " ".join(f"--{k} {v}" for k, v in (("master", self.master), ("moments", self.moments)) if v != "fp32")

    @property
    def master_bytes(self) -> int:
        return self.master_dtype.itemsize

    @property
    def scale_bytes(self) -> float:
        """One moment's scales, amortised per parameter (8bit: 4/256 B)."""
        return self.scale_dtype.itemsize / self.moment_block if self.moment_block else 0.0

    @property
    def moment_bytes(self) -> int | float:
        """All the moments of one parameter, their scales amortised (8bit: 2 x (1 + 4/256) B)."""
        return _whole(len(self.moment_names) * (self.moment_dtype.itemsize + self.scale_bytes))

    @property
    def bytes_per_param(self) -> int | float:
        """Master and moments: what a checkpoint writes and a host unit's RAM holds per parameter."""
        return _whole(self.master_bytes + self.moment_bytes)

    @property
    def step_bytes(self) -> int:
        """The step count, once a unit."""
        return self.step_dtype.itemsize

    def update_bytes(self, grad_bytes: int = 2, part: str = "all") -> int | float:
        """Host DRAM one update moves per parameter: master and moments (with scales) read and
        written back, the gradient (BF16 as it lands: 2 B; FP32: 4) read. FP32_ADAMW: 26 B/param,
        28 with FP32 gradients (bench/roofline.py's ADAMW_BYTES, benchmarks/NOTES.md "Host AdamW").
        part: the clipped sweep's split pair (native_adamw's part): "params" reads everything and
        writes the master (FP32: 18), "moments" reads the moments and the gradient and writes the
        moments (FP32: 18)."""
        if part == "params":
            return _whole(2 * self.master_bytes + self.moment_bytes + grad_bytes)
        if part == "moments":
            return _whole(2 * self.moment_bytes + grad_bytes)
        assert part == "all", f"part is all, params or moments, not {part!r}"
        return _whole(2 * self.bytes_per_param + grad_bytes)

    @property
    def scale_names(self) -> tuple[str, ...]:
        """The 8-bit moments' block scales, one tensor per moment ("exp_avg_scales", ...); none else."""
        return tuple(f"{m}_scales" for m in self.moment_names) if self.moment_block else ()

    def fields(self, master: bool = True) -> tuple[StateField, ...]:
        """The state's tensors of a unit in their layout order (the step aside): the master (where
        `master`), the moments, then the 8-bit moments' scales. FP32_ADAMW: master, exp_avg,
        exp_avg_sq, the order the disk tier's files have always had."""
        return ((StateField("master", self.master_dtype),) if master else ()) \
            + tuple(StateField(m, self.moment_dtype) for m in self.moment_names) \
            + tuple(StateField(s, self.scale_dtype, self.moment_block) for s in self.scale_names)

    def moment_nbytes(self, numel: int) -> int:
        """One moment of a `numel`-element unit, exactly: codes and its (last partial) block's scales."""
        scales = -(-numel // self.moment_block) * self.scale_dtype.itemsize if self.moment_block else 0
        return numel * self.moment_dtype.itemsize + scales

    def nbytes(self, numel: int) -> int:
        """Master and moments of a `numel`-element unit, exactly (bytes_per_param x numel, give or
        take the last block's scale)."""
        return numel * self.master_bytes + len(self.moment_names) * self.moment_nbytes(numel)


def _state(master: str, moments: str) -> OptimizerState:
    return OptimizerState(master_dtype=_DTYPES[master], moment_names=("exp_avg", "exp_avg_sq"),
                          moment_dtype=_DTYPES[moments], step_dtype=torch.float32, master=master, moments=moments,
                          moment_block=blockwise8.BLOCK if moments == "8bit" else 0,
                          master_rounding="stochastic" if master == "bf16" else "nearest")


# FlatAdamW's state: FP32 master 4 B + exp_avg 4 B + exp_avg_sq 4 B = 12 B/param, and a 4 B step a unit.
FP32_ADAMW = _state("fp32", "fp32")
# Each combination of --master and --moments, B/param stored (master + moments) | moved a step with
# BF16 gradients (2 x stored + 2): fp32/fp32 12 | 26; fp32/bf16 8 | 18; fp32/8bit 6.03125 | 14.0625;
# bf16/fp32 10 | 22; bf16/bf16 6 | 14; bf16/8bit 4.03125 | 10.0625.
OPTIMIZER_STATES = {(m, mo): FP32_ADAMW if (m, mo) == ("fp32", "fp32") else _state(m, mo)
                    for m in MASTERS for mo in MOMENTS}


def optimizer_state(master: str = "fp32", moments: str = "fp32") -> OptimizerState:
    """The state one combination of --master and --moments keeps (FP32_ADAMW for the defaults)."""
    if (master, moments) not in OPTIMIZER_STATES:
        raise ValueError(f"--master must be one of {MASTERS} and --moments one of {MOMENTS}, "
                         f"got master={master!r}, moments={moments!r}")
    return OPTIMIZER_STATES[(master, moments)]


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
        advance), a run that measures throughput or held-out loss without changing the model.
        Their types first, as every config's (fields.py): `lr="1e-4"` is refused naming lr."""
        check_fields(self, "optim")
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

    STATE = FP32_ADAMW          # the default state format (master here or elsewhere, moments, step)

    def __init__(self, master: torch.Tensor | None, n_decay: int, cfg: AdamWConfig, kernel: str = "dynamic",
                 moments_here: bool = True, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 state_format: OptimizerState = FP32_ADAMW, seed: int = 0):
        """moments_here=False: the moments live elsewhere (the disk tier) and every update() is given
        the moments of its range.
        master None: the master lives elsewhere too (the disk tier's blocks, --tuning.disk_master)
        and every update() is given the master of its range (`params`); host only.
        state: (exp_avg, exp_avg_sq, step) to use instead of new zeros: the views of the host state
        the ranks of a host share (engine/distributed.py); they hold zeros or a state to go on from.
        state_format: a compact format (issue 46, OPTIMIZER_STATES; FP32_ADAMW the default): the
        master given in its master_dtype, the moments kept in its moment_dtype (8-bit: with one
        FP32 scale a block of each), every update through native_adamw.update_compact. Host units
        whose master and moments are both here only, on the native kernel. seed: the BF16
        master's stochastic rounding stream (native_adamw.sr_key); distinct units, distinct seeds."""
        self.state_format = state_format
        self.seed = seed
        self.exp_avg_scales = self.exp_avg_sq_scales = None       # 8-bit moments' [num_blocks] FP32
        if state_format is not FP32_ADAMW:
            self._init_compact(master, n_decay, cfg, kernel, moments_here, state)
            return
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

    def _init_compact(self, master: torch.Tensor | None, n_decay: int, cfg: AdamWConfig, kernel: str,
                      moments_here: bool, state: tuple | None) -> None:
        """A compact format's state: the master in its master_dtype (here, or None: the disk tier's
        blocks), the moments and 8-bit scales allocated here, given (`state`: the host's shared
        views, (exp_avg, exp_avg_sq, step, *scales)) or elsewhere (moments_here=False: the disk
        tier's blocks, given to every update())."""
        fmt = self.state_format
        if kernel == "torch":
            raise ValueError(f"the optimizer state '{fmt.name}' is updated by the host's native AdamW kernel, "
                             "not --tuning.host_adamw torch")
        if native_adamw.load_compact() is None:
            raise RuntimeError(f"the optimizer state '{fmt.name}' needs the host's compact AdamW kernels, which "
                               "could not be built here (a C compiler with OpenMP: gcc)")
        assert master is None or (master.dim() == 1 and master.dtype == fmt.master_dtype
                                  and master.device.type == "cpu")
        assert master is not None or not moments_here, "a master elsewhere needs the moments elsewhere too"
        self.master, self.n_decay, self.cfg, self.kernel = master, n_decay, cfg, kernel
        if state is not None:
            self.exp_avg, self.exp_avg_sq, self.step_count, *scales = state
            if fmt.moment_block:
                self.exp_avg_scales, self.exp_avg_sq_scales = scales
            return
        self.step_count = torch.zeros((), dtype=torch.float32)
        if not moments_here:
            self.exp_avg = self.exp_avg_sq = None
            return
        n = master.numel()
        self.exp_avg = torch.zeros(n, dtype=fmt.moment_dtype)          # [numel] codes or BF16/FP32
        self.exp_avg_sq = torch.zeros(n, dtype=fmt.moment_dtype)
        if fmt.moment_block:
            self.exp_avg_scales = torch.zeros(blockwise8.num_blocks(n), dtype=fmt.scale_dtype)
            self.exp_avg_sq_scales = torch.zeros(blockwise8.num_blocks(n), dtype=fmt.scale_dtype)

    def _update_compact(self, grad: torch.Tensor, lr: float, start: int, grad_scale: float | torch.Tensor,
                        part: str, moments: tuple | None, params: torch.Tensor | None,
                        scales: tuple | None) -> None:
        """update() in a compact format: one call over both decay groups (an 8-bit block may
        straddle their boundary), the range's first element on a block boundary. The moments, their
        scales and the master come from this object, or where given, from the caller (the disk
        tier's block: the range's own views)."""
        fmt, n = self.state_format, grad.numel()
        if part not in ("all", "params", "moments") or isinstance(grad_scale, torch.Tensor):
            raise ValueError(f"the optimizer state '{fmt.name}' updates host ranges with a host clip "
                             f"coefficient, part all, params or moments (got part {part!r})")
        if fmt.moment_block and start % fmt.moment_block:
            raise ValueError(f"8-bit moments are updated from a block boundary: range start {start} is not a "
                             f"multiple of {fmt.moment_block}")
        if params is None:
            if self.master is None:
                raise ValueError("this master lives elsewhere: update() needs its range (params)")
            params = self.master[start:start + n]
        if moments is None:
            if self.exp_avg is None:
                raise ValueError("these moments live elsewhere: update() needs their range (moments, scales)")
            moments = (self.exp_avg[start:start + n], self.exp_avg_sq[start:start + n])
        if fmt.moment_block and scales is None:
            first, last = start // fmt.moment_block, blockwise8.num_blocks(start + n)
            scales = (self.exp_avg_scales[first:last], self.exp_avg_sq_scales[first:last])
        native_adamw.update_compact(
            params, moments[0], moments[1], grad,
            lr=lr, beta1=self.cfg.beta1, beta2=self.cfg.beta2, eps=self.cfg.eps,
            weight_decay=self.cfg.weight_decay, step=int(self.step_count), scales=scales,
            decay_end=min(n, max(0, self.n_decay - start)), seed=self.seed, offset=start,
            schedule=self.kernel, grad_scale=float(grad_scale), part=part)

    def begin_step(self) -> None:
        """Count one optimizer step; call once before the ranges of this step are updated."""
        self.step_count += 1

    def update(self, grad: torch.Tensor, lr: float, start: int = 0,
               grad_scale: float | torch.Tensor = 1.0, part: str = "all",
               moments: tuple[torch.Tensor, torch.Tensor] | None = None,
               params: torch.Tensor | None = None, weights: torch.Tensor | None = None,
               scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
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
        (a disk unit's master in its block buffer); updated in place.
        In a compact format (state_format) the moments and master given are in its dtypes, and
        `scales` (8-bit moments: exp_avg's and exp_avg_sq's scales of the range's blocks,
        [ceil(len(grad) / BLOCK)] FP32 each) come with moments given; no `weights` pass."""
        if self.state_format is not FP32_ADAMW:
            if weights is not None:
                raise ValueError(f"the optimizer state '{self.state_format.name}' has no weights pass "
                                 "(clip_sweep=weights is FP32's)")
            self._update_compact(grad, lr, start, grad_scale, part, moments, params, scales)
            return
        assert scales is None, "FP32 moments have no scales"
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

    def state_names(self) -> tuple[str, ...]:
        """The names of state_tensors(), also where the moments live elsewhere (the disk tier)."""
        fmt = self.state_format
        return (*fmt.moment_names, *fmt.scale_names, "step")

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The moments ([numel] each, in the state format's dtype), 8-bit moments' block scales
        ([num_blocks] FP32 each: exp_avg_scales, exp_avg_sq_scales) and the step ([] FP32); None
        for the moments and scales where they live elsewhere (the disk tier's)."""
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.state_format.moment_block:
            out.update(exp_avg_scales=self.exp_avg_scales, exp_avg_sq_scales=self.exp_avg_sq_scales)
        return out | {"step": self.step_count}

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        """state_tensors()' names, in this state's own dtypes (a checkpoint of the same format)."""
        compact = self.state_format is not FP32_ADAMW      # FP32: copy_ as it always has
        for name, mine in self.state_tensors().items():
            theirs = state[name]
            if compact and (theirs.dtype != mine.dtype or theirs.numel() != mine.numel()):
                raise ValueError(f"optimizer state {name}: {tuple(theirs.shape)} {theirs.dtype} where this run "
                                 f"keeps {tuple(mine.shape)} {mine.dtype} ({self.state_format.name})")
            mine.copy_(theirs)
