"""The sum of a unit's parameter gradients over a step's micro-batches, on the device.

The reference (gradient accumulation in torch) sums FP32 gradients in micro-batch order, and
the step's gradient slot gets that sum cast to its dtype. Two ways to the same bits:
  torch   the first micro-batch's gradients copied to FP32, each next one added with
          `_foreach_add_`, the sum copied into the slot: 6 + 10 (k - 1) + 6 B/param of HBM
          traffic (42 for k = 4, ~2.3 ms a Qwen3-8B layer on the H100: the GPU gaps between the
          micro-batches' recomputes in a clip+accum4 step, NOTES.md "Accumulation");
  fused   the compute-dtype gradients of up to MAX_HELD micro-batches kept as autograd returned
          them and summed by one Triton pass a parameter (ops/triton_grad_sum.py), the last
          straight into the slot: 2k + 2 B/param for k <= MAX_HELD (10 for k = 4); more
          micro-batches fold into an FP32 running sum MAX_HELD at a time.
"fused" holds more gradients at once: accumulation_bytes() is the rule the fit uses.
"""
from __future__ import annotations

import torch

MAX_HELD = 4          # micro-batch gradients held before they fold into an FP32 running sum


def fused_available(device: torch.device | str) -> bool:
    """Whether the fused sum can run here: CUDA with Triton."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure: the torch sum
        return False
    return True


def resolve(choice: str, device: torch.device | str) -> str:
    """--tuning.grad_sum: auto -> fused where it can run (CUDA with Triton), else torch."""
    if choice not in ("auto", "fused", "torch"):
        raise ValueError(f"grad_sum must be auto, fused or torch, not {choice!r}")
    if choice == "auto":
        return "fused" if fused_available(device) else "torch"
    if choice == "fused" and not fused_available(device):
        raise ValueError("--tuning.grad_sum fused needs CUDA and Triton; use auto or torch here")
    return choice


def accumulation_bytes(how: str, micro_batches: int, params: int) -> int:
    """Device bytes a unit's summing holds beyond the one gradient autograd has just returned
    (which the layer's working set counts): torch, an FP32 sum; fused, up to MAX_HELD - 1 earlier
    compute-dtype (2-byte) gradients, and an FP32 sum where more micro-batches fold into one."""
    if micro_batches <= 1:
        return 0
    if how == "torch":
        return 4 * params
    held = min(micro_batches, MAX_HELD) - 1
    return 2 * held * params + (4 * params if micro_batches > MAX_HELD else 0)


def accumulate(acc: list[torch.Tensor] | None, grads, micro_batches: int) -> list[torch.Tensor]:
    """The torch way, one micro-batch at a time: the running sum after `grads` (FP32 when there are
    several micro-batches, the reference's; the backward's own tensors when one)."""
    if acc is None:
        if micro_batches == 1:
            return list(grads)
        return [g.to(torch.float32, copy=True) for g in grads]
    torch._foreach_add_(acc, list(grads))
    return acc


class GradSum:
    """One unit's gradients over `micro_batches` micro-batches: add() each micro-batch's list (in
    parameter order), then write() the sum into the slot's views."""

    def __init__(self, micro_batches: int, how: str):
        self.k, self.how = micro_batches, how
        self.added = 0
        self.held: list[list[torch.Tensor]] = []     # fused: micro-batches not yet folded
        self.acc: list[torch.Tensor] | None = None   # the running sum (FP32 past one micro-batch)
        self.failed: str | None = None               # the Triton pass's error, if it raised (torch did it)

    def add(self, grads) -> None:
        self.added += 1
        if self.k == 1 or self.how == "torch":
            self.acc = accumulate(self.acc, grads, self.k)
        else:
            self.held.append(list(grads))
            if len(self.held) == MAX_HELD and self.added < self.k:
                self._fold(None)

    def write(self, views: list[torch.Tensor], check: bool = False) -> bool:
        """The sum into `views` (the slot's, any float dtype), each rounded once. check (fused, at
        most MAX_HELD micro-batches): the torch sum is computed too and compared bit for bit; on
        a difference it is what the views get, and False says the fused sum must not be used."""
        if self.added != self.k:
            raise RuntimeError(f"GradSum: {self.added} of {self.k} micro-batches added")
        same = True
        if self.k == 1 or self.how == "torch":
            torch._foreach_copy_(views, self.acc)
        else:
            ref = None
            if check and self.acc is None:       # the torch way's sums of the same held gradients
                for grads in self.held:
                    ref = accumulate(ref, grads, self.k)
            self._fold(views)
            if ref is not None:
                want = [r.to(v.dtype) for r, v in zip(ref, views)]
                same = all(torch.equal(w.view(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
                           for w, v in zip(want, views))
                if not same:
                    torch._foreach_copy_(views, want)
        self.held, self.acc = [], None
        return same

    def _fold(self, out: list[torch.Tensor] | None) -> None:
        """Sum the held micro-batches (after the running sum, if any) into `out`, or, None, into
        the FP32 running sum."""
        from ...ops.triton_grad_sum import sum_into      # lazy: Triton, CUDA only
        parts = list(zip(*self.held))                    # per parameter: its held gradients
        if self.acc is None and out is None:
            self.acc = [torch.empty_like(p[0], dtype=torch.float32) for p in parts]
            acc_in = [None] * len(parts)
        else:
            acc_in = self.acc or [None] * len(parts)
        for j, p in enumerate(parts):
            target = out[j] if out is not None else self.acc[j]
            if self.failed is None and all(t.is_contiguous() for t in (target, *p)):
                try:
                    sum_into(target, list(p), acc=acc_in[j])
                    continue
                except Exception as e:  # noqa: BLE001 - a Triton that cannot compile or launch here
                    self.failed = repr(e)
            # a strided view, or no working pass: the same additions with torch ops
            s = acc_in[j].clone() if acc_in[j] is not None else p[0].to(torch.float32, copy=True)
            for g in p[0 if acc_in[j] is not None else 1:]:
                s.add_(g)
            target.copy_(s)
        self.held = []
