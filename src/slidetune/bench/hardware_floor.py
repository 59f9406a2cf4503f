"""The hardware floor's GPU rates (bench.roofline): what this GPU can do on a step's work rather than
what slidetune's layer takes. The step's FLOPs, recomputation counted (telemetry.flops.StepFlops),
matmuls at the BF16 GEMM rate cuBLAS gets on the layer's own shapes and attention at SDPA's rate at
the workload's shape, both probed here (probe_hardware), priced into the compute probe's terms
(hardware_compute).
"""
from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F

from ..models.units import SplitModel
from ..telemetry.flops import (FLASH_BACKWARD_OVER_FORWARD, StepFlops, attention_width, causal_attention_flops,
                               step_flops)
from .floor_probes import _time_cuda


# Rows of the GEMM probe: the step's tokens, at most this many. Past ~64K rows a layer's GEMMs run
# at one rate (their output tiles fill the GPU's SMs many times over), and the probe's tensors stay
# small: x, dX and dY of Llama-3.1-8B's down_proj at 65536 rows, 2 x 14336 + 4096 wide, 4.3 GB.
GEMM_PROBE_MAX_ROWS = 65536


def layer_gemm_shapes(split: SplitModel, tokens: int) -> list[dict]:
    """The matrix products of one forward of decoder layer 0 over `tokens` rows (at most
    GEMM_PROBE_MAX_ROWS), one entry per distinct shape with its count: {rows, in, out, count}, an
    nn.Linear's weight W [out, in], y [rows, out] = x [rows, in] @ W^T (Qwen3-8B: q and o 4096 x
    4096, k and v 1024 x 4096, gate and up 12288 x 4096, down 4096 x 12288). An MoE layer's expert
    banks (3-D) are left out: their GEMMs run per expert group, on other shapes."""
    rows = min(tokens, GEMM_PROBE_MAX_ROWS)
    counts: dict[tuple[int, int], int] = {}
    for p in split.layer_units[0].params:
        if len(p.shape) == 2:
            counts[p.shape] = counts.get(p.shape, 0) + 1
    return [{"rows": rows, "in": n_in, "out": n_out, "count": c} for (n_out, n_in), c in counts.items()]


def probe_gemm(shapes: list[dict], dtype: torch.dtype = torch.bfloat16) -> dict:
    """What cuBLAS gets on these matrix products in `dtype` on this GPU ({rows, in, out, count}
    each, layer_gemm_shapes; a square probe is one shape), forward and backward:
      forward   y = x W^T    [rows, in] @ [in, out]
      backward  dX = dY W    [rows, out] @ [out, in], and dW = dY^T X  [out, rows] @ [rows, in]
    each the median of 5 CUDA-event-timed calls; the rates are the FLOPs over the time summed over
    the shapes with their counts (the mix one layer runs). TFLOP/s, and per shape."""
    dev = torch.device("cuda")
    per_shape, fwd_flops, fwd_s, bwd_s = [], 0.0, 0.0, 0.0
    for shape in shapes:
        rows, n_in, n_out, count = shape["rows"], shape["in"], shape["out"], shape.get("count", 1)
        x = torch.randn(rows, n_in, device=dev, dtype=dtype)             # [rows, in]
        w = torch.randn(n_out, n_in, device=dev, dtype=dtype)            # [out, in]
        dy = torch.randn(rows, n_out, device=dev, dtype=dtype)           # [rows, out]
        flops = 2.0 * rows * n_in * n_out
        t_fwd = _time_cuda(lambda: torch.nn.functional.linear(x, w))
        t_bwd = _time_cuda(lambda: (dy @ w, dy.t() @ x))
        per_shape.append({**shape, "forward_tflops": flops / t_fwd / 1e12, "backward_tflops": 2 * flops / t_bwd / 1e12})
        fwd_flops, fwd_s, bwd_s = fwd_flops + count * flops, fwd_s + count * t_fwd, bwd_s + count * t_bwd
        del x, w, dy
    return {"gemm_forward_tflops": fwd_flops / fwd_s / 1e12, "gemm_backward_tflops": 2 * fwd_flops / bwd_s / 1e12,
            "gemm_tflops": 3 * fwd_flops / (fwd_s + bwd_s) / 1e12, "gemm_dtype": str(dtype).removeprefix("torch."),
            "gemm_shapes": per_shape}


def probe_sdpa(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
               dtype: torch.dtype = torch.bfloat16) -> dict:
    """SDPA's rate on this GPU at the workload's shape, as HF's sdpa attention calls it on a batch
    without padding (is_causal=True; enable_gqa where KV heads are grouped; q, k, v transposed views
    of [B, S, H, dh] projections, as the layer passes them): the forward (no grad) and the backward
    (dQ, dK, dV of a kept forward), each the median of 5 timed calls, and the backend SDPA picks
    for the call (torch._fused_sdp_choice: flash, cuDNN, ...). FLOPs:
    telemetry.flops.causal_attention_flops, the backward FLASH_BACKWARD_OVER_FORWARD x it."""
    dev = torch.device("cuda")

    def leaf(h: int) -> torch.Tensor:                       # [B, h, S, dh], a view of [B, S, h, dh]
        return torch.randn(batch, seq, h, head_dim, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    gqa = {"enable_gqa": True} if kv_heads != heads else {}

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)                       # [B, H, S, dh]
    grad = torch.randn_like(out)
    t_fwd = _time_cuda(forward)
    t_bwd = _time_cuda(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
    flops = causal_attention_flops(batch, heads, seq, head_dim)
    bwd = FLASH_BACKWARD_OVER_FORWARD * flops
    return {"sdpa_forward_tflops": flops / t_fwd / 1e12, "sdpa_backward_tflops": bwd / t_bwd / 1e12,
            "sdpa_tflops": (flops + bwd) / (t_fwd + t_bwd) / 1e12,
            "sdpa_shape": {"batch": batch, "heads": heads, "kv_heads": kv_heads, "seq": seq, "head_dim": head_dim},
            "sdpa_backend": sdpa_backend(q, k, v, gqa)}


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: dict) -> str | None:
    """The backend SDPA's dispatcher picks for this causal call with gradients (None where this
    torch cannot say)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    try:
        index = int(choose(q, k, v, None, 0.0, True, **gqa))
    except (RuntimeError, TypeError):
        return None
    from torch.nn.attention import SDPBackend
    return next((name for name, b in SDPBackend.__members__.items() if int(b.value) == index), str(index))


def probe_hardware(split: SplitModel, batch: int, seq: int) -> dict:
    """The hardware floor's inputs for `batch` x `seq` tokens of this model: the BF16 GEMM rates on
    its layer's own shapes (probe_gemm), SDPA's at its attention shape (probe_sdpa), and the step's
    FLOPs (telemetry.flops.step_flops: per layer, one forward each), so that hardware_compute can
    price any run's recomputation and a reader can redo the arithmetic."""
    c = split.config
    heads = int(c.num_attention_heads)
    head_dim = attention_width(c) // heads
    out = probe_gemm(layer_gemm_shapes(split, batch * seq))
    out.update(probe_sdpa(batch, heads, int(getattr(c, "num_key_value_heads", None) or heads), seq, head_dim))
    torch.cuda.empty_cache()
    return {**out, "flops": step_flops(split, batch, seq).as_dict()}


def hardware_compute(hw: dict, recomputed: Collection[int]) -> dict:
    """The compute probe's terms (probe_compute's keys) at the hardware's rates (probe_hardware):
    each FLOP of the step (telemetry.flops.StepFlops; the `recomputed` layers run their forward
    twice) at the probed rate of its kind,

        compute_s = matmul forward / gemm_forward_tflops + matmul backward / gemm_backward_tflops
                  + attention forward / sdpa_forward_tflops + attention backward / sdpa_backward_tflops

    the head's logits a forward matmul, its two gradients backward ones. The embedding (a gather
    and its scatter) costs nothing here; nor does elementwise work (norms, rotary, SiLU, the
    softmax of the loss): a floor no kernel can beat. layer_forward_s is one layer's forward (the
    mean over layers), layer_recompute_backward_s the rest of a layer's share of the step, so that
    L x (layer_forward_s + layer_recompute_backward_s) + head_s = compute_s as for the probe."""
    f = StepFlops.from_dict(hw["flops"])
    rc = set(recomputed)
    gemm_f, gemm_b = hw["gemm_forward_tflops"] * 1e12, hw["gemm_backward_tflops"] * 1e12
    sdpa_f, sdpa_b = hw["sdpa_forward_tflops"] * 1e12, hw["sdpa_backward_tflops"] * 1e12
    compute_s = (f.matmul_forward(rc) / gemm_f + f.matmul_backward() / gemm_b
                 + f.attention_forward(rc) / sdpa_f + f.attention_backward() / sdpa_b)
    head_s = f.head_matmul / gemm_f + 2 * f.head_matmul / gemm_b
    L = f.num_layers
    layer_forward_s = (sum(f.layer_matmul) / gemm_f + sum(f.layer_attention) / sdpa_f) / L
    return {"compute_s": compute_s, "layer_forward_s": layer_forward_s,
            "layer_recompute_backward_s": (compute_s - head_s) / L - layer_forward_s,
            "head_s": head_s, "embed_s": 0.0, "matmul_flops": f.matmul(rc), "attention_flops": f.attention(rc),
            "recomputed_layers": len(rc)}
