"""Triton kernel: the sum of up to four micro-batches' gradients of one parameter, in one pass.

Imported lazily by ``engine/slide/grad_sum.py`` (grad_sum=fused); needs Triton and CUDA.

The reference accumulates a parameter's gradient over micro-batches in FP32, in order: the first
micro-batch's gradient widened, then each next one added (``acc = g0.float(); acc += g1; ...``),
and the slot the step's norm and update read gets ``acc`` cast to its dtype. Done with torch ops,
that is a copy (6 B/param of HBM traffic), one add per further micro-batch (10 B/param each: the
FP32 sum read and written) and a cast into the slot (6): 42 B/param for four micro-batches. This
kernel reads every part once and writes the result once, 2k + 2 B/param (10 for four), with the
same FP32 additions in the same order, so the result is the same bit for bit: each element is
``(((acc or float(g0)) + float(g1)) + float(g2)) + ...`` rounded once to the output's dtype (round
to nearest even, as torch's cast). Adds only: nothing to contract into a fused multiply-add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PARTS = 4
_BLOCK = 4096


@triton.jit
def _sum_kernel(out_ptr, acc_ptr, g0_ptr, g1_ptr, g2_ptr, g3_ptr, n,
                PARTS: tl.constexpr, HAS_ACC: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)            # int64: a parameter can pass 2**31 elements
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_ACC:
        s = tl.load(acc_ptr + offs, mask=mask, other=0.0)
        s = s + tl.load(g0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        s = tl.load(g0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 1:
        s = s + tl.load(g1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 2:
        s = s + tl.load(g2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 3:
        s = s + tl.load(g3_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, s.to(out_ptr.dtype.element_ty), mask=mask)


def sum_into(out: torch.Tensor, parts: list[torch.Tensor], acc: torch.Tensor | None = None) -> None:
    """out = ((acc or parts[0]) + parts[...]) in FP32, in order, rounded once to out's dtype.
    All contiguous CUDA tensors of out's number of elements; parts in any float dtype, acc FP32;
    out may be acc itself (each element is read before it is written, by the same thread)."""
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"sum_into takes 1 to {MAX_PARTS} parts, not {len(parts)}")
    n = out.numel()
    for t in (*parts, *([acc] if acc is not None else [])):
        if t.numel() != n or not t.is_contiguous() or t.device != out.device:
            raise ValueError("sum_into: every part must be a contiguous tensor of out's size on out's device")
    if acc is not None and acc.dtype != torch.float32:
        raise ValueError("sum_into: the running sum is FP32")
    ptrs = list(parts) + [parts[0]] * (MAX_PARTS - len(parts))     # unused slots: never loaded
    grid = (triton.cdiv(n, _BLOCK),)
    _sum_kernel[grid](out, acc if acc is not None else out, *ptrs, n,
                      PARTS=len(parts), HAS_ACC=acc is not None, BLOCK=_BLOCK)
