"""Which attention kernel runs causal GQA fastest on this GPU, and is it right (issue 45).

For each of SDPA's backends (flash, cuDNN, memory-efficient; torch.nn.attention.SDPBackend),
SDPA left to choose ("default": what HF's sdpa attention, and so slidetune's layer, runs; the JSON
names the backend it chose, torch._fused_sdp_choice) and FlexAttention, at each sequence length
(the batch chosen so every shape holds about the same tokens), the forward and the backward (dQ, dK, dV of a kept forward) of causal attention at a
model's attention shape (default Qwen3-8B / Llama-3.1-8B: 32 query heads, 8 KV heads, head_dim
128), each the median of 5 CUDA-event-timed calls, as TFLOP/s of the causal half
(telemetry.flops.causal_attention_flops; the backward's FLOPs 2.5x the forward's, as flash's five
matmuls against two). GQA is given to a backend natively (enable_gqa) where it takes it, else with
K and V repeated to the query heads (what HF's sdpa attention does where it cannot pass
enable_gqa), and the JSON says which.

Correctness, at the shorter lengths: each backend's output and gradients in BF16 against the math
backend's in FP32 on the same inputs; a backend is "correct" where its largest error is within
3x the flash backend's own (the BF16 noise every kernel shares), or within 3x the best backend's
where flash cannot run.

    python benchmarks/scripts/attention_backends.py OUT.json [--seq-lens 1024,...,131072]
        [--tokens 65536] [--heads 32 --kv-heads 8 --head-dim 128] [--backends default,flash,cudnn,efficient,flex]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from slidetune.bench.floor_probes import _time_cuda
from slidetune.bench.hardware_floor import sdpa_backend
from slidetune.telemetry.flops import FLASH_BACKWARD_OVER_FORWARD, causal_attention_flops
from slidetune.telemetry.machine import machine_info

_SDPA = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
         "math": "MATH"}


def _median_time(fn, device: torch.device, reps: int = 5) -> float:
    """Seconds: the median of `reps` calls, CUDA-event timed as the roofline's probes are
    (bench.roofline._time_cuda); on the CPU, wall time after one warm-up."""
    if device.type == "cuda":
        return _time_cuda(fn, reps=reps)
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def attention_fn(backend: str, heads: int, kv_heads: int, native_gqa: bool):
    """f(q, k, v) -> out for one backend: q [B, H, S, dh], k and v [B, Hkv, S, dh]."""
    groups = heads // kv_heads

    def expand(k, v):                      # [B, Hkv, S, dh] -> [B, H, S, dh]
        if groups == 1 or native_gqa:
            return k, v
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)

    gqa = {"enable_gqa": True} if native_gqa and groups > 1 else {}
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        # the timing differentiates one kept forward several times (retain_graph): the compiled
        # backward's donated buffers refuse that (2026-11-29 on the H200, every length)
        torch._functorch.config.donated_buffer = False
        compiled = torch.compile(flex_attention)
        masks: dict = {}

        def flex(q, k, v):
            s = q.shape[-2]
            if s not in masks:
                masks[s] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s, device=q.device)
            k, v = expand(k, v)
            return compiled(q, k, v, block_mask=masks[s], enable_gqa=native_gqa and groups > 1)
        return flex
    if backend == "default":
        def default(q, k, v):
            k, v = expand(k, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        return default
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = getattr(SDPBackend, _SDPA[backend])

    def sdpa(q, k, v):
        k, v = expand(k, v)
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    return sdpa


def default_choice(heads: int, kv_heads: int, seq: int, head_dim: int, batch: int, device, dtype) -> str | None:
    """The backend SDPA picks by itself for this causal GQA call with gradients (its dispatcher's
    torch._fused_sdp_choice), as HF's sdpa attention calls it: q, k, v as views [B, H, S, dh] of
    [B, S, H, dh] projections (bench.roofline.sdpa_backend, as the floor's probe records it)."""
    if device.type != "cuda":
        return None
    q = torch.empty(batch, seq, heads, head_dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.empty(batch, seq, kv_heads, head_dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    return sdpa_backend(q, k, k, {"enable_gqa": True} if kv_heads != heads else {})


def runnable(backend: str, heads: int, kv_heads: int, head_dim: int, device, dtype) -> tuple[bool | None, str]:
    """(native_gqa, "") for the first way the backend runs a small causal GQA call, or (None, why not)."""
    q = torch.randn(1, heads, 256, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, 256, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    why = ""
    for native in ((True, False) if kv_heads != heads else (False,)):
        try:
            attention_fn(backend, heads, kv_heads, native)(q, k, v).sum().backward()
            return native, ""
        except Exception as e:     # a backend that cannot take this shape, dtype or GPU says so by raising
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return None, why


def errors(backend: str, native: bool, heads: int, kv_heads: int, seq: int, head_dim: int, device, dtype) -> dict:
    """Largest |difference| of the output and of dQ, dK, dV from the math backend in FP32."""
    g = torch.Generator(device="cpu").manual_seed(seq)
    shape_q, shape_kv = (1, heads, seq, head_dim), (1, kv_heads, seq, head_dim)
    base = [torch.randn(s, generator=g) for s in (shape_q, shape_kv, shape_kv, shape_q)]
    q, k, v, dout = (t.to(device) for t in base)

    def run(fn, dt):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, dout.to(dt))
        return [out.float(), *(x.float() for x in grads)]
    ref = run(attention_fn("math", heads, kv_heads, False), torch.float32)
    got = run(attention_fn(backend, heads, kv_heads, native), dtype)
    return {name: (a - b).abs().max().item() for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}


def _leaf(batch: int, heads: int, seq: int, head_dim: int, device, dtype, layout: str) -> torch.Tensor:
    """A random [B, H, S, dh] input requiring grad: "hf", a view of [B, S, H, dh] (HF's attention
    transposes its projections' output, and cuDNN's kernel reads that layout), or "contiguous"."""
    if layout == "hf":
        return torch.randn(batch, seq, heads, head_dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    return torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)


def rate(backend: str, native: bool, heads: int, kv_heads: int, seq: int, head_dim: int, batch: int,
         device, dtype, layout: str = "hf") -> dict:
    fn = attention_fn(backend, heads, kv_heads, native)
    q, k, v = (_leaf(batch, h, seq, head_dim, device, dtype, layout) for h in (heads, kv_heads, kv_heads))
    out = fn(q, k, v)
    grad = torch.randn_like(out)

    def forward():
        with torch.no_grad():
            fn(q, k, v)
    t_fwd = _median_time(forward, device)
    t_bwd = _median_time(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), device)
    flops = causal_attention_flops(batch, heads, seq, head_dim)
    return {"forward_s": t_fwd, "backward_s": t_bwd, "forward_tflops": flops / t_fwd / 1e12,
            "backward_tflops": FLASH_BACKWARD_OVER_FORWARD * flops / t_bwd / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seq-lens", default="1024,4096,16384,65536,131072")
    ap.add_argument("--tokens", type=int, default=65536, help="batch x seq of each timed shape (at least 1 row)")
    ap.add_argument("--check-up-to", type=int, default=4096, help="correctness at lengths up to this")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backends", default="default,flash,cudnn,efficient,flex")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layout", choices=("hf", "contiguous"), default="hf",
                    help="q, k, v as HF's attention passes them (transposed views) or contiguous [B, H, S, dh]")
    a = ap.parse_args()
    device, dtype = torch.device(a.device), torch.bfloat16
    shape = dict(heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim)
    report = {"machine": machine_info(), "torch": torch.__version__, "shape": shape, "tokens": a.tokens,
              "layout": a.layout,
              "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
              "backends": {}, "rows": []}
    seqs = [int(s) for s in a.seq_lens.split(",")]
    for backend in a.backends.split(","):
        native, why = runnable(backend, a.heads, a.kv_heads, a.head_dim, device, dtype)
        report["backends"][backend] = {"runs": native is not None, "native_gqa": native, "error": why or None}
        print(f"{backend}: " + ("runs" + (", GQA native" if native else ", K/V repeated") if native is not None
                                else f"does not run ({why})"), flush=True)
        if native is None:
            continue
        for seq in seqs:
            row = {"backend": backend, "seq": seq, "batch": max(1, a.tokens // seq), "native_gqa": native}
            if backend == "default":
                row["chosen"] = default_choice(a.heads, a.kv_heads, seq, a.head_dim, row["batch"], device, dtype)
            try:
                if seq <= a.check_up_to:
                    row["max_error_vs_math_fp32"] = errors(backend, native, a.heads, a.kv_heads, seq, a.head_dim,
                                                           device, dtype)
                row.update(rate(backend, native, a.heads, a.kv_heads, seq, a.head_dim, row["batch"], device, dtype,
                                a.layout))
            except Exception as e:        # out of memory at a length, or a shape the kernel refuses
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    _judge(report)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


def _judge(report: dict) -> None:
    """Mark each checked row correct where its largest error is within 3x the reference kernel's
    (flash, else the smallest) at the same length, and name the fastest correct backend per length."""
    by_seq: dict[int, list[dict]] = {}
    for row in report["rows"]:
        by_seq.setdefault(row["seq"], []).append(row)
    best = {}
    for seq, rows in by_seq.items():
        checked = [r for r in rows if "max_error_vs_math_fp32" in r]
        if checked:
            ref = next((r for r in checked if r["backend"] == "flash"), None) or \
                min(checked, key=lambda r: max(r["max_error_vs_math_fp32"].values()))
            bound = 3 * max(ref["max_error_vs_math_fp32"].values())
            for r in checked:
                r["correct"] = max(r["max_error_vs_math_fp32"].values()) <= bound
        timed = [r for r in rows if "forward_s" in r and r.get("correct", True)]
        if timed:
            fastest = min(timed, key=lambda r: r["forward_s"] + r["backward_s"])
            best[seq] = {"backend": fastest["backend"], "forward_tflops": fastest["forward_tflops"],
                         "backward_tflops": fastest["backward_tflops"]}
    report["fastest_correct"] = best
    for seq, b in sorted(best.items()):
        print(f"seq {seq}: fastest correct {b['backend']} (forward {b['forward_tflops']:.0f}, "
              f"backward {b['backward_tflops']:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
