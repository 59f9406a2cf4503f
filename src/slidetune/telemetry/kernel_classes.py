"""GPU time by kind of kernel, from a torch.profiler trace: where a layer's time goes besides its GEMMs.

Classes (`kernel_class`, by the kernel's demangled name; the first rule that matches wins):
  copy         memcpy / memset, and aten's copy and cast kernels (`.contiguous()`, `.to()`, cat)
  triton       Triton kernels: inductor's (triton_poi_ / triton_red_ / triton_per_ ...) and
               hand-written ones named after their Python function (Liger's _rms_norm_forward_kernel)
  attention    flash / memory-efficient / cuDNN SDPA and FlexAttention kernels
  gemm         cuBLAS(Lt) / CUTLASS GEMMs (sm90_xmma_gemm_..., nvjet_..., cutlass...), split-K
               reductions, inductor's GEMM templates
  elementwise  aten's own elementwise and reduction kernels (at::native::vectorized_elementwise_kernel, reduce_kernel)
  other        the rest
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

KERNEL_CLASSES = ("gemm", "attention", "triton", "elementwise", "copy", "other")

_ATTENTION = ("flash", "fmha", "attention", "sdpa", "cudnn")
_GEMM = ("gemm", "gemv", "cublas", "cutlass", "nvjet", "xmma", "splitkreduce")


def kernel_class(name: str) -> str:
    """One of KERNEL_CLASSES for a GPU kernel's (or memcpy's / memset's) name."""
    n = name.lower()
    if n.startswith(("memcpy", "memset")):
        return "copy"
    if n.startswith("triton_"):
        # inductor names a kernel after the aten ops it fuses; its templates (triton_tem_) are GEMMs
        # or FlexAttention, its pointwise / reduction kernels may carry an SDPA op's name
        if n.startswith("triton_tem_"):
            return "attention" if "attention" in n else "gemm" if "mm" in n else "triton"
        return "triton"
    if any(k in n for k in _ATTENTION):
        return "attention"
    if any(k in n for k in _GEMM):
        return "gemm"
    if n.startswith("_") and not n.startswith("_z"):       # a Triton JIT function (not a mangled C++ name)
        return "triton"
    if "at::native" in n and "copy" in n:            # direct_copy_kernel_cuda (casts too), CatArrayBatchedCopy
        return "copy"
    if "at::native" in n or "elementwise" in n or "reduce_kernel" in n:
        return "elementwise"
    return "other"


def trace_kernels(trace_path: Path | str) -> list[tuple[str, float]]:
    """(name, duration us) of every GPU kernel, memcpy and memset in a torch.profiler Chrome
    trace (`prof.export_chrome_trace`), in trace order; CPU ops and GPU annotations left out."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    return [(ev.get("name", ""), float(ev["dur"])) for ev in events
            if ev.get("ph") == "X" and "dur" in ev and ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def kernel_breakdown(kernels: Iterable[tuple[str, float]], top: int = 15, name_chars: int = 200) -> dict:
    """{"kernel_ms": all launches' time, "classes": {class: ms} (every class, in KERNEL_CLASSES'
    order), "top": the `top` kernels by total time: [{"name", "class", "ms", "calls"}]} from
    (name, duration us) per launch. Names are cut to `name_chars` (templates run to kilobytes)."""
    classes = dict.fromkeys(KERNEL_CLASSES, 0.0)
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        classes[kernel_class(name)] += us / 1e3
        acc = by_name.setdefault(name, [0.0, 0])
        acc[0] += us / 1e3
        acc[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernel_ms": sum(classes.values()), "classes": classes,
            "top": [{"name": name[:name_chars], "class": kernel_class(name), "ms": ms, "calls": calls}
                    for name, (ms, calls) in ranked]}


def profile_call(fn: Callable[[], object], top: int = 15) -> dict:
    """torch.profiler over one call of `fn` on the GPU: kernel_breakdown of its kernels (their time by
    class and the `top` kernels). The benchmark scripts' one way of profiling a call."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return kernel_breakdown(trace_kernels(trace), top=top)
