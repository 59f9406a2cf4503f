"""The host's AdamW as one C loop, called without the GIL, that threads take blocks of as they go.

Why not torch's fused CPU kernel or an inductor-compiled one (benchmarks/NOTES.md "Host AdamW"):
  - the GIL: ctypes releases it for the call, so the compute thread keeps launching while
    AdamW runs. The inductor kernel held it, and beside it the GPU's backward ran twice as
    long (Qwen3-4B b8 on the H100 host: a step 1.19 s there, 1.08 s here);
  - speed alone: 5.26 G params/s on the 16-core H100 host against 4.44 for the inductor
    kernel (BF16 gradients) and 4.26 for torch's (FP32), the same loop with OpenMP's static
    schedule 4.66. Threads claim BLOCK-element blocks (dynamic schedule), so a thread
    that starts late or runs slow takes fewer. (Beside a thread that keeps a core busy
    neither schedule holds up, 3.3-3.4 G/s: a preempted thread holds the parallel region
    until it runs again; one core left free does, 4.88 with 15 threads: host_threads.)

The same loop reads BF16 gradients as they landed from the GPU (widened in registers):
26 B/param of host DRAM instead of 28, and half the gradient download (NOTES.md "Gradient downloads").

The C source below is compiled once per process with the system's C compiler (`CC`, else
gcc, else cc; -O3 -march=native -fopenmp) into a temporary shared library (its libgomp is
the one torch loaded) and called through ctypes. With no compiler, or one without
OpenMP, `load()` says so once and returns None, and callers use torch's kernel.

Arithmetic: torch's fused AdamW, ADAMW mode (decay applied to the parameter, bias
corrections in double, then FP32); results agree with torch._fused_adamw_ to within FP32
rounding (its vector code orders a few operations differently), tested.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

SCHEDULES = ("dynamic", "static")
# Elements a thread claims at a time (dynamic schedule): 128 KB of each FP32 array, ~20-80 us
# of work per claim on one core, so the shared counter costs nothing next to the loop.
BLOCK = 1 << 15
# FlatAdamW keeps tiny ranges (a norm's few thousand elements) on torch's kernel: a parallel
# region costs more than it saves there.
MIN_NATIVE = 1 << 12
GRAD_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float from_bf16(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline float from_f32(float x) { return x; }

/* s: decay, beta1, 1-beta1, beta2, 1-beta2, step size, sqrt(bias correction 2), eps, gradient scale */
/* STORE: what a kernel writes back. The split pair (params, then moments) computes the same
   m', v' from the same inputs in the same order, so it writes exactly what the full one does. */
#define STORE_ALL    p[i] = p[i] * decay - step_size * mi / denom; m[i] = mi; v[i] = vi;
#define STORE_PARAMS p[i] = p[i] * decay - step_size * mi / denom;
#define STORE_MOMENTS m[i] = mi; v[i] = vi;

/* The OpenMP loop over blocks every kernel shares (its arguments: p, m, v, g, n, s, threads, dynamic). */
#define ADAMW_LOOP_OF(BLOCK_BODY, WIDEN, STORE)                                                  \
    const float decay = s[0], beta1 = s[1], c1 = s[2], beta2 = s[3], c2 = s[4];                 \
    const float step_size = s[5], bc2_sqrt = s[6], eps = s[7], gscale = s[8];                   \
    const int64_t nblocks = (n + BLOCK - 1) / BLOCK;                                            \
    _Pragma("omp parallel num_threads(threads)")                                                \
    {                                                                                           \
        if (dynamic) {                                                                          \
            _Pragma("omp for schedule(dynamic, 1)")                                             \
            for (int64_t b = 0; b < nblocks; b++) BLOCK_BODY(WIDEN, STORE)                      \
        } else {                                                                                \
            _Pragma("omp for schedule(static)")                                                 \
            for (int64_t b = 0; b < nblocks; b++) BLOCK_BODY(WIDEN, STORE)                      \
        }                                                                                       \
    }
#define ADAMW_LOOP(WIDEN, STORE) ADAMW_LOOP_OF(BODY, WIDEN, STORE)

#define ADAMW_KERNEL(NAME, GRAD_T, WIDEN, STORE)                                                 \
void NAME(float *restrict p, float *restrict m, float *restrict v, const GRAD_T *restrict g,    \
          int64_t n, const float *s, int threads, int dynamic) { ADAMW_LOOP(WIDEN, STORE) }

#define BODY(WIDEN, STORE) {                                                                    \
    const int64_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;                         \
    for (int64_t i = lo; i < hi; i++) {                                                         \
        const float gi = WIDEN(g[i]) * gscale;                                                  \
        const float mi = m[i] * beta1 + gi * c1;                                                \
        const float vi = v[i] * beta2 + gi * gi * c2;                                           \
        const float denom = sqrtf(vi) / bc2_sqrt + eps;                                         \
        STORE                                                                                   \
    }                                                                                           \
}

/* The weights pass of clip_sweep=weights: the new parameters rounded to BF16 (round to nearest
   even, as torch's and the GPU's casts; NaN -> 0x7FC0 as torch's) into w, the upload's source;
   the master and the moments stay as they were, for the "all" pass that follows with the same
   inputs (so the master it writes rounds to exactly these BF16 values). */
static inline uint16_t to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
/* The copy w is a buffer this pass never reads: a plain store first reads each cache line
   (read for ownership), so 2 B/param written cost 4 of DRAM, and the pass moved 18 B/param like
   the split's weights pass (the 2026-11-25 probe: no faster). Whole 64-byte lines go out with
   non-temporal stores instead (16 B/param); the ragged ends of a block are stored plainly. The
   fence at each block's end orders them before the block's completion is published. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
static inline void stream_line(uint16_t *dst, const uint16_t *line) {    /* 32 BF16: one line */
#if defined(__AVX512F__)
    _mm512_stream_si512((void *)dst, _mm512_load_si512((const void *)line));
#elif defined(__AVX__)
    _mm256_stream_si256((__m256i *)dst, _mm256_load_si256((const __m256i *)line));
    _mm256_stream_si256((__m256i *)(dst + 16), _mm256_load_si256((const __m256i *)(line + 16)));
#else
    memcpy(dst, line, 64);
#endif
}
static inline void stream_fence(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_sfence();
#endif
}
#define WEIGHT_OF(WIDEN, i, OUT) {                                                              \
    const float gi = WIDEN(g[i]) * gscale;                                                      \
    const float mi = m[i] * beta1 + gi * c1;                                                    \
    const float vi = v[i] * beta2 + gi * gi * c2;                                               \
    const float denom = sqrtf(vi) / bc2_sqrt + eps;                                             \
    OUT = to_bf16(p[i] * decay - step_size * mi / denom);                                       \
}
#define WEIGHTS_BODY(WIDEN, STORE) {                                                            \
    const int64_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;                         \
    int64_t i = lo;                                                                             \
    for (; i < hi && ((uintptr_t)(w + i) & 63); i++) WEIGHT_OF(WIDEN, i, w[i])                  \
    for (; i + 32 <= hi; i += 32) {                                                             \
        uint16_t line[32] __attribute__((aligned(64)));                                         \
        for (int j = 0; j < 32; j++) WEIGHT_OF(WIDEN, i + j, line[j])                           \
        stream_line(w + i, line);                                                               \
    }                                                                                           \
    for (; i < hi; i++) WEIGHT_OF(WIDEN, i, w[i])                                               \
    stream_fence();                                                                             \
}

#define ADAMW_WEIGHTS_KERNEL(NAME, GRAD_T, WIDEN)                                                \
void NAME(float *restrict p, float *restrict m, float *restrict v, const GRAD_T *restrict g,    \
          uint16_t *restrict w, int64_t n, const float *s, int threads, int dynamic) {          \
    ADAMW_LOOP_OF(WEIGHTS_BODY, WIDEN, unused) }

ADAMW_KERNEL(adamw_f32, float, from_f32, STORE_ALL)
ADAMW_KERNEL(adamw_bf16, uint16_t, from_bf16, STORE_ALL)
ADAMW_KERNEL(adamw_params_f32, float, from_f32, STORE_PARAMS)
ADAMW_KERNEL(adamw_params_bf16, uint16_t, from_bf16, STORE_PARAMS)
ADAMW_KERNEL(adamw_moments_f32, float, from_f32, STORE_MOMENTS)
ADAMW_KERNEL(adamw_moments_bf16, uint16_t, from_bf16, STORE_MOMENTS)
ADAMW_WEIGHTS_KERNEL(adamw_weights_f32, float, from_f32)
ADAMW_WEIGHTS_KERNEL(adamw_weights_bf16, uint16_t, from_bf16)
"""

# -ffp-contract=off: no fused multiply-adds, so each element rounds as torch's elementwise
# arithmetic does (as inductor's kernel did). Contracted, the results stayed within an ulp per
# step, but a BF16 copy of a weight then rounds the other way now and then, and a 3-step
# CPU training test drifted to 2e-4 against torch's kernel (1e-5 is the contract).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared"]


@dataclass
class Kernel:
    lib: ctypes.CDLL
    compiler: str

    def fn(self, grad_dtype: torch.dtype, part: str = "all"):
        prefix = {"all": "adamw", "params": "adamw_params", "moments": "adamw_moments",
                  "weights": "adamw_weights"}[part]
        return getattr(self.lib, f"{prefix}_{GRAD_TYPES[grad_dtype]}")


_kernel: Kernel | None = None
_tried = False
_lock = threading.Lock()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build() -> Kernel:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    tmp = tempfile.mkdtemp(prefix="slidetune-adamw-")
    try:
        src, lib_path = os.path.join(tmp, "adamw.c"), os.path.join(tmp, "adamw.so")
        with open(src, "w") as f:
            f.write(f"#define BLOCK {BLOCK}\n" + SOURCE)
        done = subprocess.run([cc, *FLAGS, src, "-o", lib_path], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cc)} failed: {done.stderr.strip()[-400:]}")
        # torch is loaded with its own libgomp.so.1; the kernel's libgomp.so.1 resolves to it
        lib = ctypes.CDLL(lib_path)            # CDLL: the GIL is released during each call
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # the mapping stays valid once loaded
    f32_ptr, c_int64, c_int = ctypes.POINTER(ctypes.c_float), ctypes.c_int64, ctypes.c_int
    for name in (f"{prefix}_{g}" for prefix in ("adamw", "adamw_params", "adamw_moments") for g in ("f32", "bf16")):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 4 + [c_int64, f32_ptr, c_int, c_int]
        fn.restype = None
    for name in (f"adamw_weights_{g}" for g in ("f32", "bf16")):     # one more pointer: the BF16 weights
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 5 + [c_int64, f32_ptr, c_int, c_int]
        fn.restype = None
    return Kernel(lib, cc)


def load() -> Kernel | None:
    """The kernel, built on first use; None (logged once) where it cannot be built."""
    global _kernel, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _kernel = _build()
            except Exception as e:  # noqa: BLE001 - any failure means: torch's kernel instead
                log.warning("slidetune: the host AdamW kernel could not be built (%s); using torch's "
                            "fused AdamW (a static split across threads, and BF16 gradients widened "
                            "into a scratch buffer first)", e)
        return _kernel


def takes(grad: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether update() handles this range: a host range of a gradient dtype it reads, not tiny."""
    return (grad.dtype in GRAD_TYPES and master.device.type == "cpu" and grad.device.type == "cpu"
            and grad.numel() >= MIN_NATIVE and load() is not None)


def update(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
           lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
           schedule: str = "dynamic", threads: int = 0, grad_scale: float = 1.0, part: str = "all",
           weights: torch.Tensor | None = None) -> None:
    """One AdamW step over equal-length contiguous 1-D CPU ranges (master and moments FP32,
    updated in place; grad FP32 or BF16, read only), on `threads` OpenMP threads (0: the calling
    thread's torch.get_num_threads()). Only for ranges that takes() accepts.

    grad_scale: each gradient element is widened to FP32 and then multiplied by it, as
    clip_grad_norm_ multiplies an FP32 gradient by its clip coefficient (x * 1.0f is x: the
    unclipped path is unchanged). The held BF16 gradient of the deferred schedule is never
    rounded by the scaling.

    part: "all" writes the parameters and both moments (26 B/param with BF16 gradients);
    "params" writes only the parameters (18 B/param: the new moments stay in registers) and
    "moments" only the moments (18 B/param), from the same inputs, so "params" then "moments"
    leaves exactly what "all" does. The deferred schedule runs "params" where the next forward
    waits for it and "moments" later, where the host is idle (engine/slide/engine.py).
    "weights" (clip_sweep=weights) writes only the new parameters rounded to BF16 into `weights`
    ([n] BF16, the upload's source; 16 B/param) and leaves master and moments alone: "all" then
    writes them from the same inputs, and the master's BF16 rounding is exactly `weights`."""
    kernel = load()
    assert kernel is not None and schedule in SCHEDULES
    n = grad.numel()
    for t in (master, exp_avg, exp_avg_sq):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.numel() == n
    assert grad.is_contiguous()
    # torch's fused kernel: bias corrections and step size in double, then cast to FP32
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    scalars = (ctypes.c_float * 9)(1 - lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2,
                                   lr / bc1, math.sqrt(bc2), eps, grad_scale)
    pointers = [master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr()]
    if part == "weights":
        assert weights is not None and weights.dtype == torch.bfloat16 and weights.is_contiguous() \
            and weights.numel() == n
        pointers.append(weights.data_ptr())
    kernel.fn(grad.dtype, part)(*pointers, n, scalars, threads or torch.get_num_threads(), int(schedule == "dynamic"))
