"""Triton kernel for one chunk of cross-entropy with the softmax gradient written in place.

Imported lazily by ``cross_entropy.py`` (impl="fused" without liger-kernel); needs
Triton and CUDA. For a chunk of logits [c, V] in the compute dtype, one program per
row:

  pass 1: one online sweep over vocabulary blocks keeps the running max m and the
          rescaled sum s of exp(x - m) (both fp32) and picks up the target logit
          x[y] as it passes by; lse = m + log(s), loss = lse - x[y].
  pass 2: (if a gradient is wanted) a second sweep writes softmax - onehot =
          exp(x - lse) - [j == y], rounded to the compute dtype, over x itself.

So the only [c, V] buffer is the logits buffer the matmul wrote: no fp32 copy, no
separate softmax. Memory traffic per chunk: 2 reads + 1 write of c*V*b bytes.

Safety of the in-place write: x[y] is taken from the block loads of pass 1 (no
separate load that a pass-2 store could race with); every pass-1 block ends in a
block-wide reduction, so all of the row's reads are done before any pass-2 store;
in pass 2 each element is loaded and stored by the same thread.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

IGNORE_INDEX = -100
_MAX_BLOCK_V = 8192  # vocab elements per block: 16 KB of bf16 per load, 32 per thread at 8 warps


@triton.jit
def _ce_inplace_kernel(
    logits_ptr,  # [c, V] compute dtype; overwritten with the gradient when COMPUTE_GRAD
    logits_row_stride,
    labels_ptr,  # [c] int64
    loss_ptr,  # [c] fp32 out: per-row loss (0 for ignored rows)
    V,
    ignore_index,
    BLOCK_V: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: c * V can pass 2**31
    row_ptr = logits_ptr + row * logits_row_stride
    y = tl.load(labels_ptr + row)
    valid = y != ignore_index
    cols = tl.arange(0, BLOCK_V)

    # pass 1: online logsumexp and the target logit
    m = float("-inf")
    s = 0.0
    x_y = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))  # finite: each block holds >= 1 real column
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        x_y += tl.sum(tl.where(offs == y, x, 0.0), axis=0)
    lse = m + tl.log(s)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_y, 0.0))

    # pass 2: softmax - onehot, in place
    if COMPUTE_GRAD:
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(offs == y, g - 1.0, g)
            g = tl.where(valid, g, 0.0)
            tl.store(row_ptr + offs, g.to(logits_ptr.dtype.element_ty), mask=mask)


def ce_chunk_inplace(logits: torch.Tensor, labels: torch.Tensor, compute_grad: bool):
    """(each row's fp32 CE [c], the gradient wrt logits in logits' buffer, or None).

    logits: [c, V] bf16/fp16/fp32 CUDA, unit stride along V (a fresh matmul output).
    labels: [c] int64; -100 rows give loss 0 and a zero gradient row.
    """
    if not logits.is_cuda or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("ce_chunk_inplace needs a 2-D CUDA logits tensor with unit column stride")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"ce_chunk_inplace supports bf16/fp16/fp32 logits, got {logits.dtype}")
    c, vocab = logits.shape
    labels = labels.contiguous().long()
    loss_rows = torch.empty(c, dtype=torch.float32, device=logits.device)
    if c == 0:
        return loss_rows, (logits if compute_grad else None)
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab))
    num_warps = 8 if block_v >= 4096 else 4
    _ce_inplace_kernel[(c,)](
        logits,
        logits.stride(0),
        labels,
        loss_rows,
        vocab,
        IGNORE_INDEX,
        BLOCK_V=block_v,
        COMPUTE_GRAD=compute_grad,
        num_warps=num_warps,
    )
    return loss_rows, (logits if compute_grad else None)
