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

Compact state (issue 46; engine/adamw.py OPTIMIZER_STATES): COMPACT_SOURCE's kernels
(update_compact) read and write BF16 or 8-bit blockwise moments (engine/blockwise8.py) and an
FP32 or stochastically rounded BF16 master in the same one pass, widening and narrowing in
registers, with the FP32 kernel's arithmetic between; tests/test_compact_adamw.py holds them to
a torch reference bit for bit and to torchao. They build into a library of their own on first
use (load_compact), so the FP32 default's library, source and start-up are what they were.
Where -march=native has AVX-512 F/BW/VL/VBMI their 8-bit passes are engine/q8_avx512.py's, the
same bits (tests/test_q8_avx512.py; SLIDETUNE_Q8_AVX512=0 builds the portable ones). Rates: benchmarks/scripts/compact_adamw_rate.py.
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

from . import blockwise8, q8_avx512

log = logging.getLogger(__name__)

SCHEDULES = ("dynamic", "static")
# Elements a thread claims at a time (dynamic schedule): 128 KB of each FP32 array, ~20-80 us
# of work per claim on one core, so the shared counter costs nothing next to the loop.
BLOCK = 1 << 15
# FlatAdamW keeps tiny ranges (a norm's few thousand elements) on torch's kernel: a parallel
# region costs more than it saves there.
MIN_NATIVE = 1 << 12
GRAD_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# The compact kernels' names for the master's and the moments' formats (adamw_<master>_<moments>_<grad>).
MASTER_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
MOMENT_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16", blockwise8.CODE_DTYPE: "q8"}
COMPACT = [(p, m) for p in MASTER_TYPES.values() for m in MOMENT_TYPES.values() if (p, m) != ("f32", "f32")]

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

# The compact formats (issue 46; engine/adamw.py OPTIMIZER_STATES): each kernel reads and writes
# its formats in one pass, converting in registers, so the bytes moved fall with the bytes stored.
# The arithmetic between a load and a store is the FP32 kernel's, element for element.
COMPACT_SOURCE = r"""
/* A compact kernel: adamw_<master>_<moments>_<gradient> (f32, bf16; f32, bf16, q8; f32, bf16).
   Its arguments beside the FP32 kernel's: sm, sv (the 8-bit moments' block scales); nd (elements
   [0, nd) of the range decay, the rest do not: one call spans the decay boundary, which an 8-bit
   block may straddle, and a block's new absmax needs all its new values); q8 (blockwise8's
   kernel_tables: codebooks, bucket tables, byte planes); key (this step's stochastic rounding stream,
   sr_key()); off (the range's first element's index in its unit). Threads claim BLOCK elements
   at a time as the FP32 kernels do, each claim one call of a claim_ function (its restrict
   pointers let gcc vectorize the loops, which it did not inside the OpenMP region). */
#define KERNEL_ARGS(P_T, M_T, GRAD_T)                                                           \
    P_T *restrict p, M_T *restrict m, M_T *restrict v, const GRAD_T *restrict g,                \
    float *restrict sm, float *restrict sv, int64_t n, int64_t nd, const float *s,              \
    const uint32_t *restrict q8, uint64_t key, int64_t off, int threads, int dynamic
#define CLAIM_ARGS(P_T, M_T, GRAD_T)                                                            \
    P_T *restrict p, M_T *restrict m, M_T *restrict v, const GRAD_T *restrict g,                \
    float *restrict sm, float *restrict sv, int64_t lo, int64_t hi, int64_t nd,                 \
    const float *restrict s, const uint32_t *restrict q8, uint64_t key, int64_t off
#define CALL_CLAIM(FN, unused)                                                                  \
    FN(p, m, v, g, sm, sv, b * BLOCK, b * BLOCK + BLOCK < n ? b * BLOCK + BLOCK : n, nd, s, q8, key, off);
#define CLAIM_SCALARS                                                                           \
    const float decay = s[0], beta1 = s[1], c1 = s[2], beta2 = s[3], c2 = s[4];                 \
    const float step_size = s[5], bc2_sqrt = s[6], eps = s[7], gscale = s[8];

/* The BF16 master's stochastic rounding: away from zero with probability (low 16 bits) / 2^16,
   torchao's rule (_fp32_to_bf16_sr), so unbiased. The 16 random bits hash the element's index in
   its unit under this step's key, two rounds of murmur3's 32-bit finaliser (32-bit multiplies
   vectorize on AVX2; SplitMix64's 64-bit ones ran the kernel at a quarter of the FP32 rate): a
   counter-based stream, the same whichever thread or claim computes the element. NaN -> 0x7FC0. */
static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; return h ^ (h >> 16);
}
static inline uint16_t sr_bf16(float f, uint64_t key, uint64_t index) {
    uint32_t u; memcpy(&u, &f, 4);
    const uint32_t r = fmix32(fmix32((uint32_t)index ^ (uint32_t)key) ^ (uint32_t)(index >> 32)
                              ^ (uint32_t)(key >> 32)) >> 16;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fc0;
    return (uint16_t)(((u & 0xffff0000u) + (r < (u & 0xffffu) ? 0x10000u : 0u)) >> 16);
}
#define P_T_f32 float
#define P_T_bf16 uint16_t
#define M_T_f32 float
#define M_T_bf16 uint16_t
#define M_T_q8 uint8_t
#define P_LOAD_f32(i)      p[i]
#define P_STORE_f32(i, x)  p[i] = (x);
#define P_LOAD_bf16(i)     from_bf16(p[i])
#define P_STORE_bf16(i, x) p[i] = sr_bf16((x), key, (uint64_t)(off + (i)));
#define M_LOAD_f32(a, i)      a[i]
#define M_STORE_f32(a, i, x)  a[i] = (x);
#define M_LOAD_bf16(a, i)     from_bf16(a[i])
#define M_STORE_bf16(a, i, x) a[i] = to_bf16(x);       /* round to nearest even */

/* The part a kernel writes, as the FP32 kernels' (update()'s part): all, or the split pair
   params (the master only) then moments (the moments only), from the same inputs; constants, so
   gcc drops the other half's loads and stores. */
#define WRITES_P_all 1
#define WRITES_P_params 1
#define WRITES_P_moments 0
#define WRITES_M_all 1
#define WRITES_M_params 0
#define WRITES_M_moments 1

/* One element's update from its widened moments mo, vo: the FP32 kernel's arithmetic, op for op;
   the new parameter goes to P_STORE where the part writes it, the new moments stay in mi, vi. */
#define COMPACT_ELEMENT(WIDEN, P, PART, i, mo, vo)                                              \
    const float gi = WIDEN(g[i]) * gscale;                                                      \
    const float mi = (mo) * beta1 + gi * c1;                                                    \
    const float vi = (vo) * beta2 + gi * gi * c2;                                               \
    if (WRITES_P_##PART) {                                                                      \
        const float denom = sqrtf(vi) / bc2_sqrt + eps;                                         \
        const float pd = P_LOAD_##P(i) * ((i) < nd ? decay : 1.0f);                             \
        P_STORE_##P(i, pd - step_size * mi / denom)                                             \
    }

/* FP32 or BF16 moments: element by element. */
#define CLAIM_f32(WIDEN, P, M, PART) CLAIM_ELEMENTWISE(WIDEN, P, M, PART)
#define CLAIM_bf16(WIDEN, P, M, PART) CLAIM_ELEMENTWISE(WIDEN, P, M, PART)
#define CLAIM_ELEMENTWISE(WIDEN, P, M, PART) {                                                  \
    CLAIM_SCALARS                                                                               \
    for (int64_t i = lo; i < hi; i++) {                                                         \
        COMPACT_ELEMENT(WIDEN, P, PART, i, M_LOAD_##M(m, i), M_LOAD_##M(v, i))                  \
        if (WRITES_M_##PART) { M_STORE_##M(m, i, mi) M_STORE_##M(v, i, vi) }                    \
    }                                                                                           \
}

/* 8-bit codes: torchao's nearest code (blockwise8.quantize_rule) from one bucket table entry:
   the bucket's first code, plus one where x's rank in the bucket reaches the entry's step. */
static inline uint32_t quantize8(const uint32_t *restrict table, float x) {
    uint32_t u; memcpy(&u, &x, 4);
    const uint32_t a = u & 0x7fffffffu, neg = u >> 31;            /* no branch on the sign: gcc */
    int32_t b = (int32_t)(a >> 16) - Q8_LOW_BUCKET;               /* made two masked gathers of it */
    b = b < 0 ? 0 : (b > Q8_TABLE - 1 ? Q8_TABLE - 1 : b);
    const uint32_t e = table[(uint32_t)b + neg * Q8_TABLE];
    const uint32_t rank = (a ^ (0u - neg)) & 0xffffu;
    const uint32_t code = (e >> 17) + (rank >= (e & 0x1ffffu));
    return x == x ? code : 0u;                     /* NaN: code 0, as the rule's comparisons give */
}
/* The absmax of a block: |x|'s bits compared as integers (the same order for non-negative floats,
   and a NaN above them all, so a NaN poisons its block's scale as torch's amax does). */
static inline uint32_t abs_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u & 0x7fffffffu; }
static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* 8-bit blockwise moments, a QBLOCK-element block at a time: dequantize (codebook[code] * scale),
   update, keep the new moments in block buffers, take their absmax (at least 1e-12, torchao's
   clip) as the new scales and requantize against them. Claims are whole blocks. The params part
   dequantizes only: the codes and scales stay as they were for the moments part. */
#define CLAIM_q8(WIDEN, P, M, PART) {                                                           \
    CLAIM_SCALARS                                                                               \
    const float *restrict qs = (const float *)q8, *restrict qu = qs + 256;                      \
    const uint32_t *restrict ts = q8 + 512, *restrict tu = ts + 2 * Q8_TABLE;                   \
    for (int64_t k = lo; k < hi; k += QBLOCK) {                                                 \
        const int64_t e = k + QBLOCK < hi ? k + QBLOCK : hi, blk = k / QBLOCK;                  \
        const float sm0 = sm[blk], sv0 = sv[blk];                                               \
        float nm[QBLOCK], nv[QBLOCK];                                                           \
        for (int64_t i = k; i < e; i++) {                                                       \
            COMPACT_ELEMENT(WIDEN, P, PART, i, qs[m[i]] * sm0, qu[v[i]] * sv0)                  \
            nm[i - k] = mi;                                                                     \
            nv[i - k] = vi;                                                                     \
        }                                                                                       \
        if (!WRITES_M_##PART) continue;                                                         \
        uint32_t am = 0, av = 0;                                                                \
        for (int64_t j = 0; j < e - k; j++) {                                                   \
            const uint32_t a = abs_bits(nm[j]), c = abs_bits(nv[j]);                            \
            am = a > am ? a : am;                                                               \
            av = c > av ? c : av;                                                               \
        }                                                                                       \
        const float fm = from_bits(am) < 1e-12f ? 1e-12f : from_bits(am);                       \
        const float fv = from_bits(av) < 1e-12f ? 1e-12f : from_bits(av);                       \
        sm[blk] = fm;                                                                           \
        sv[blk] = fv;                                                                           \
        for (int64_t j = 0; j < e - k; j++) {                                                   \
            m[k + j] = (uint8_t)quantize8(ts, nm[j] / fm);                                      \
            v[k + j] = (uint8_t)quantize8(tu, nv[j] / fv);                                      \
        }                                                                                       \
    }                                                                                           \
}

"""

# The kernels, instantiated after q8_avx512.SOURCE (which replaces CLAIM_q8 where the CPU has AVX-512).
COMPACT_INSTANCES = r"""
/* adamw_<P>_<M>_<G> (all), adamw_params_<P>_<M>_<G>, adamw_moments_<P>_<M>_<G> */
#define COMPACT_PART(NAME, P, M, PART, G, GRAD_T, WIDEN)                                        \
static __attribute__((noinline)) void claim_##NAME(CLAIM_ARGS(P_T_##P, M_T_##M, GRAD_T))       \
    CLAIM_##M(WIDEN, P, M, PART)                                                                \
void NAME(KERNEL_ARGS(P_T_##P, M_T_##M, GRAD_T)) { ADAMW_LOOP_OF(CALL_CLAIM, claim_##NAME, unused) }
#define COMPACT_KERNEL(P, M, G, GRAD_T, WIDEN)                                                   \
    COMPACT_PART(adamw_##P##_##M##_##G, P, M, all, G, GRAD_T, WIDEN)                            \
    COMPACT_PART(adamw_params_##P##_##M##_##G, P, M, params, G, GRAD_T, WIDEN)                  \
    COMPACT_PART(adamw_moments_##P##_##M##_##G, P, M, moments, G, GRAD_T, WIDEN)
#define COMPACT_KERNELS(P, M)                                                                    \
    COMPACT_KERNEL(P, M, f32, float, from_f32)                                                  \
    COMPACT_KERNEL(P, M, bf16, uint16_t, from_bf16)

COMPACT_KERNELS(f32, bf16)
COMPACT_KERNELS(f32, q8)
COMPACT_KERNELS(bf16, f32)
COMPACT_KERNELS(bf16, bf16)
COMPACT_KERNELS(bf16, q8)
"""

# -ffp-contract=off: no fused multiply-adds, so each element rounds as torch's elementwise
# arithmetic does (as inductor's kernel did). Contracted, the results stayed within an ulp per
# step, but a BF16 copy of a weight then rounds the other way now and then, and a 3-step
# CPU training test drifted to 2e-4 against torch's kernel (1e-5 is the contract).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared"]
# SLIDETUNE_NATIVE_CFLAGS: flags appended to these (a code-generation experiment, e.g. "-mtune-ctrl=use_gather"
# on the GPU host: benchmarks/scripts/compact_adamw_rate.py); the results must stay bit for bit.
EXTRA_FLAGS_VAR = "SLIDETUNE_NATIVE_CFLAGS"
# The AVX-512 8-bit passes (q8_avx512.py), built wherever the CPU has AVX-512 F/BW/VL/VBMI; =0 builds the
# portable ones. On the H200 host's Xeon (Sapphire Rapids, 2026-11-29, device job q8avx512, 256 M params,
# 16 threads) they passed tests/test_q8_avx512.py bit for bit and ran the FP32-master 8-bit update at
# 5.15-5.50 G params/s against the portable 3.62-3.65 (the FP32 state's 4.87-5.36), its moments pass
# 8.26-8.51 against 4.00-4.51 (NOTES.md "Compact host state").
Q8_AVX512_VAR = "SLIDETUNE_Q8_AVX512"


@dataclass
class Kernel:
    lib: ctypes.CDLL
    compiler: str
    q8_avx512: bool = False     # the compact library's 8-bit passes: the AVX-512 CLAIM_q8 (engine/q8_avx512.py)

    def fn(self, grad_dtype: torch.dtype, part: str = "all"):
        prefix = {"all": "adamw", "params": "adamw_params", "moments": "adamw_moments",
                  "weights": "adamw_weights"}[part]
        return getattr(self.lib, f"{prefix}_{GRAD_TYPES[grad_dtype]}")

    def compact_fn(self, master_dtype: torch.dtype, moment_dtype: torch.dtype, grad_dtype: torch.dtype,
                   part: str = "all"):
        """The compact kernel for these formats and part (FP32 master and moments: fn(), not this)."""
        prefix = {"all": "adamw", "params": "adamw_params", "moments": "adamw_moments"}[part]
        return getattr(self.lib, f"{prefix}_{MASTER_TYPES[master_dtype]}_{MOMENT_TYPES[moment_dtype]}_"
                                 f"{GRAD_TYPES[grad_dtype]}")


_kernel: Kernel | None = None
_tried = False
_lock = threading.Lock()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _compile(source: str, extra_args: tuple[str, ...] = ()) -> tuple[ctypes.CDLL, str]:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    tmp = tempfile.mkdtemp(prefix="slidetune-adamw-")
    try:
        src, lib_path = os.path.join(tmp, "adamw.c"), os.path.join(tmp, "adamw.so")
        with open(src, "w") as f:
            f.write(source)
        extra = os.environ.get(EXTRA_FLAGS_VAR, "").split()
        done = subprocess.run([cc, *FLAGS, *extra, *extra_args, src, "-o", lib_path], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cc)} failed: {done.stderr.strip()[-400:]}")
        # torch is loaded with its own libgomp.so.1; the kernel's libgomp.so.1 resolves to it
        return ctypes.CDLL(lib_path), cc       # CDLL: the GIL is released during each call
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # the mapping stays valid once loaded


def _build() -> Kernel:
    lib, cc = _compile(f"#define BLOCK {BLOCK}\n" + SOURCE)
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


def compact_source() -> str:
    """The compact library's C source: the FP32 kernels', the compact ones', the AVX-512 CLAIM_q8
    (compiled where -march=native has AVX-512 F/BW/VL/VBMI, unless -DQ8_SCALAR) and the instances."""
    defines = dict(BLOCK=BLOCK, QBLOCK=blockwise8.BLOCK, Q8_LOW_BUCKET=blockwise8.LOW_BUCKET, Q8_TABLE=blockwise8.TABLE)
    return ("".join(f"#define {k} {v}\n" for k, v in defines.items()) + SOURCE + COMPACT_SOURCE + q8_avx512.SOURCE
            + COMPACT_INSTANCES)


def build_compact(extra_args: tuple[str, ...] = ()) -> Kernel:
    """The compact kernels, in a library of their own: the FP32 default's stays the same source
    (the same binary), and a run on it does not wait for these (2.8 s of gcc on 2 cores, against
    1.1 s for the FP32 library). extra_args: more compiler arguments (the tests' and the rate
    script's variants: "-DQ8_SCALAR" for the portable 8-bit passes, "-DQ8_SIMDE" with SIMDe's
    include path for the AVX-512 ones emulated); load_compact() builds it with -DQ8_SCALAR where
    SLIDETUNE_Q8_AVX512=0."""
    lib, cc = _compile(compact_source(), extra_args)
    c_int64, c_int = ctypes.c_int64, ctypes.c_int
    for name in (f"{prefix}_{pm}_{mm}_{g}" for prefix in ("adamw", "adamw_params", "adamw_moments")
                 for pm, mm in COMPACT for g in ("f32", "bf16")):
        fn = getattr(lib, name)         # p, m, v, g, sm, sv, n, nd, s, q8, key, off, threads, dynamic
        fn.argtypes = [ctypes.c_void_p] * 6 + [c_int64, c_int64, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p,
                                               ctypes.c_uint64, c_int64, c_int, c_int]
        fn.restype = None
    lib.q8_avx512.restype = ctypes.c_int
    return Kernel(lib, cc, q8_avx512=bool(lib.q8_avx512()))


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


_compact: list[Kernel | None] = []       # the compact kernels once tried: [kernel or None]


def load_compact() -> Kernel | None:
    """The compact formats' kernels, built on first use; None (logged once) where they cannot be."""
    with _lock:
        if not _compact:
            try:
                _compact.append(build_compact(("-DQ8_SCALAR",) if os.environ.get(Q8_AVX512_VAR) == "0" else ()))
            except Exception as e:  # noqa: BLE001 - the caller says what it cannot run
                log.warning("slidetune: the host's compact AdamW kernels could not be built (%s)", e)
                _compact.append(None)
        return _compact[0]


def takes(grad: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether update() handles this range: a host range of a gradient dtype it reads, not tiny."""
    return (grad.dtype in GRAD_TYPES and master.device.type == "cpu" and grad.device.type == "cpu"
            and grad.numel() >= MIN_NATIVE and load() is not None)


def _scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
             grad_scale: float):
    """The kernels' s[9]: as torch's fused kernel, bias corrections and step size in double, then FP32."""
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    return (ctypes.c_float * 9)(1 - lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2,
                                lr / bc1, math.sqrt(bc2), eps, grad_scale)


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
    scalars = _scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    pointers = [master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr()]
    if part == "weights":
        assert weights is not None and weights.dtype == torch.bfloat16 and weights.is_contiguous() \
            and weights.numel() == n
        pointers.append(weights.data_ptr())
    kernel.fn(grad.dtype, part)(*pointers, n, scalars, threads or torch.get_num_threads(), int(schedule == "dynamic"))


_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finaliser, on Python ints: a key a step from a seed."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sr_key(seed: int, step: int) -> int:
    """The stochastic rounding's 64-bit key for one step of one master: element i of the unit
    takes the top 16 bits of fmix32(fmix32(lo32(i) ^ lo32(key)) ^ hi32(i) ^ hi32(key)) (the C
    source's sr_bf16). `seed` names the run and the unit (the caller's choice: distinct units,
    distinct seeds), so a rerun, a resume at the same step or another thread count rounds every
    element the same way."""
    return _mix64((_mix64(seed & _M64) + step) & _M64)


def update_compact(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None, decay_end: int | None = None,
                   seed: int = 0, offset: int = 0, schedule: str = "dynamic", threads: int = 0,
                   grad_scale: float = 1.0, part: str = "all", kernel: Kernel | None = None) -> None:
    """One AdamW step over a range in a compact format (engine/adamw.py OPTIMIZER_STATES), read and
    written in one pass, the formats told by the dtypes: master FP32 or BF16 ([n]); moments FP32,
    BF16 or 8-bit codes (uint8, [n] each, with `scales` ([ceil(n / blockwise8.BLOCK)] FP32 each:
    exp_avg's, exp_avg_sq's)); grad FP32 or BF16 ([n], read only). FP32 master and moments go
    through update() instead. Arguments as update()'s, and:

    decay_end: elements [0, decay_end) of the range take weight_decay, the rest none (None: all):
    one call over both parameter groups, since an 8-bit block may straddle their boundary.
    offset: the range's first element's index in its unit (8-bit moments: a multiple of
    blockwise8.BLOCK, so the range's blocks are the unit's); with `seed` and `step` it picks the
    BF16 master's stochastic rounding of each element (sr_key), whatever the range or threads.

    BF16 moments round to nearest even; 8-bit ones are requantized against their block's new absmax;
    a BF16 master rounds stochastically.

    part: "all", or update()'s split pair "params" (the master only; 8-bit moments dequantized, not
    requantized) then "moments" (the moments and scales only), which leaves exactly what "all"
    does: the clipped schedule's sweep (clip_sweep=split). The weights pass (clip_sweep=weights) is
    FP32-only.

    kernel: the compact library to run (None: load_compact()'s; a build_compact() variant: the tests'
    AVX-512 against portable 8-bit passes)."""
    kernel = kernel or load_compact()
    assert kernel is not None and schedule in SCHEDULES
    n = grad.numel()
    assert master.dtype in MASTER_TYPES and exp_avg.dtype in MOMENT_TYPES and grad.dtype in GRAD_TYPES
    assert (master.dtype, exp_avg.dtype) != (torch.float32, torch.float32), "FP32 state: update()"
    for t in (master, exp_avg, exp_avg_sq, grad):
        assert t.is_contiguous() and t.numel() == n and t.device.type == "cpu"
    assert exp_avg_sq.dtype == exp_avg.dtype
    quantized = exp_avg.dtype == blockwise8.CODE_DTYPE
    if quantized:
        assert scales is not None and offset % blockwise8.BLOCK == 0, "8-bit ranges start on a block"
        for t in scales:
            assert t.dtype == blockwise8.SCALE_DTYPE and t.is_contiguous() and t.numel() == blockwise8.num_blocks(n)
    scale_ptrs = [t.data_ptr() for t in scales] if quantized else [0, 0]
    scalars = _scalars(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    assert part in ("all", "params", "moments"), f"compact kernels write all, params or moments, not {part!r}"
    kernel.compact_fn(master.dtype, exp_avg.dtype, grad.dtype, part)(
        master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(), *scale_ptrs,
        n, n if decay_end is None else decay_end, scalars, blockwise8.kernel_tables().data_ptr(),
        sr_key(seed, step), offset, threads or torch.get_num_threads(), int(schedule == "dynamic"))
