"""Which kernels the lean layer's RMSNorm, SwiGLU product and rotary run (`--tuning.lean_kernels`).

torch: the lean RMSNorm of models/lean_layer.py (saves its input and 1/rms) and HF's own
product and rotary, on any device. liger: Liger's Triton kernels (the optional `liger-kernel`
package, `pip install 'slidetune[liger]'`; CUDA only), each an autograd Function that saves
only what its backward needs:
  RMSNorm  LigerRMSNormFunction, casting mode "llama" (1/rms in FP32 from the FP32 upcast,
           x * 1/rms cast back to x's dtype, times the weight in that dtype: LlamaRMSNorm's
           order and roundings), offset 0; saves x and 1/rms as the torch one does; its
           backward writes dx over the incoming gradient (in_place, Liger's default for
           Llama/Qwen3: that gradient is a sum of the projections' input gradients, read by
           nothing else).
  SwiGLU   LigerSiLUMulFunction(gate, up): saves gate and up (HF: gate, SiLU(gate), up); its
           backward recomputes SiLU and writes the two gradients over gate and up.
  rotary   LigerRopeFunction: HF's rotate_half convention ([x1, x2] -> [x1 cos - x2 sin,
           x2 cos + x1 sin]) over the whole head, cos/sin [B or 1, S, hd]; writes q and k in
           place and saves only cos and sin (HF's eager rotary keeps q, k and their rotations).
Equivalence: BF16 within noise of HF's layer on the GPU (tests/test_lean_layer.py, gpu-marked).

Under torch.compile (compile_layers): each Liger call is opaque to the compiler (a graph
break around it, `torch.compiler.disable`): its kernels run as Liger ships and tests them,
and the compiled pieces between are the projections, attention and residual adds, which is
what compiling earned besides fusing the elementwise ops these kernels already fuse. Dynamo
can also trace into the Functions (user Triton kernels); `LIGER_UNDER_COMPILE = "trace"` does
that, for benchmarks/scripts/layer_memory.py's lean-liger-traced variant to measure it.
"""
from __future__ import annotations

import torch

from .lean_layer import TORCH, LeanKernels

CHOICES = ("auto", "torch", "liger")
LIGER_INSTALL = "pip install 'slidetune[liger]'"
# "around": each Liger call is a graph break under torch.compile; "trace": dynamo traces into it
LIGER_UNDER_COMPILE = "around"


def resolve_lean_kernels(choice: str, device: torch.device | str) -> LeanKernels:
    """--tuning.lean_kernels: auto -> torch (Liger's kernels are not yet measured faster on a
    GPU: benchmarks/scripts/layer_memory.py's lean-liger variants; auto takes them once they are);
    liger -> Liger's, or a ValueError saying why not here (on CPU, or the package missing)."""
    if choice not in CHOICES:
        raise ValueError(f"lean_kernels must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice in ("auto", "torch"):
        return TORCH
    if torch.device(device).type != "cuda":
        raise ValueError(f"--tuning.lean_kernels liger runs Liger's Triton kernels, on CUDA only; this run is on "
                         f"{torch.device(device).type}: use torch (or auto) here")
    return liger_kernels(LIGER_UNDER_COMPILE)


def liger_kernels(under_compile: str = "around") -> LeanKernels:
    """Liger's RMSNorm, SwiGLU product and rotary as LeanKernels (module docstring)."""
    if under_compile not in ("around", "trace"):
        raise ValueError(f"under_compile must be around or trace, not {under_compile!r}")
    try:
        from liger_kernel.ops import LigerRMSNormFunction, LigerRopeFunction, LigerSiLUMulFunction
    except Exception as e:  # noqa: BLE001 - not installed, or broken against this torch/triton
        raise ValueError(f"--tuning.lean_kernels liger needs the liger-kernel package ({LIGER_INSTALL}); "
                         f"importing it failed: {type(e).__name__}: {e}") from e

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # offset 0, casting "llama", in_place (module docstring)
        return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", True)

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return LigerSiLUMulFunction.apply(gate, up)

    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if unsqueeze_dim != 1:   # Liger's kernel reads q, k as [B, heads, S, hd], HF's unsqueeze_dim=1
            raise ValueError(f"Liger's rotary takes q and k as [B, heads, S, hd] (unsqueeze_dim 1), "
                             f"not unsqueeze_dim {unsqueeze_dim}")
        return LigerRopeFunction.apply(q, k, cos, sin, None, unsqueeze_dim)

    if under_compile == "around":
        rms_norm, silu_mul, rope = (torch.compiler.disable(f) for f in (rms_norm, silu_mul, rope))
    return LeanKernels("liger" if under_compile == "around" else "liger-traced",
                       rms_norm=rms_norm, silu_mul=silu_mul, rope=rope)
