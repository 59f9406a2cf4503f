"""The 8-bit moments' passes written out in AVX-512 (issue 46): the host kernel's CLAIM_q8
(engine/native_adamw.py COMPACT_SOURCE) for CPUs with AVX-512 F, BW, VL and VBMI (Ice Lake and
later Xeons, Zen 4), where `-march=native` defines them; elsewhere, or built with -DQ8_SCALAR,
the portable CLAIM_q8 stays. Both write the same bits (tests/test_q8_avx512.py runs one against
the other).

Why (benchmarks/NOTES.md "Compact host state"): the 8-bit moments pass is compute-bound on the
GPU host's Sapphire Rapids (4.2-4.9 G params/s at 16 threads, FP32's 7.5), its time in the table
lookups, which gcc compiles to a lane extract and a scalar load each (gathers forced on: +9%).
Here:
  - dequantizing: a codebook's 256 FP32 entries are held as four byte planes (plane b: byte b of
    every entry, 256 bytes = four 64-byte registers; blockwise8.kernel_tables builds them), so
    two vpermi2b (entries 0-127, 128-255, each by the code's low 7 bits) and a blend on its top
    bit look up one byte of 64 entries at once: 8 permutes a codebook for 64 codes, no loads;
    unpacks then put the four bytes of each float together.
  - requantizing: the bucket-table rule of the portable quantize8 (blockwise8's docstring), its
    one table read a gather of 16 entries, every other step of it in 16 lanes.
  - the arithmetic between is the FP32 kernel's, op for op, in 16 lanes (-ffp-contract=off: no
    fused multiply-adds), and the division by the block's scale stays a division (vdivps, IEEE
    like the scalar one), so each element rounds exactly as in the portable loop.
The source is appended to COMPACT_SOURCE after its CLAIM_q8 and before the kernels are
instantiated (native_adamw.compact_source); Q8_SIMDE (the tests, on a CPU without AVX-512) runs
the same code on SIMDe's portable definitions of the intrinsics.
"""
from __future__ import annotations

SOURCE = r"""
#if defined(Q8_SIMDE)                       /* tests: the intrinsics emulated (SIMDe headers) */
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define Q8_AVX512 1
/* What SIMDe (0.7, 0.8) lacks, or does otherwise: its masked stores write zeros to the masked-off
   lanes and its masked loads read them, so the masked memory operations go lane by lane here. */
static inline void q8_simde_copy(void *dst, const void *src, uint64_t lanes, int count, int size) {
    for (int t = 0; t < count; t++)
        if ((lanes >> t) & 1) memcpy((char *)dst + t * size, (const char *)src + t * size, size);
}
static inline __m512i q8_simde_load8(__mmask64 k, const void *src) {
    uint8_t got[64] = {0}; q8_simde_copy(got, src, k, 64, 1); return _mm512_loadu_si512((const void *)got);
}
static inline __m256i q8_simde_load16(__mmask16 k, const void *src) {
    uint16_t got[16] = {0}; q8_simde_copy(got, src, k, 16, 2); return _mm256_loadu_si256((const __m256i *)got);
}
static inline __m512 q8_simde_load32(__mmask16 k, const void *src) {
    float got[16] = {0}; q8_simde_copy(got, src, k, 16, 4); return _mm512_loadu_ps(got);
}
static inline void q8_simde_store8(void *dst, __mmask16 k, __m128i x) {
    uint8_t put[16]; _mm_storeu_si128((__m128i *)put, x); q8_simde_copy(dst, put, k, 16, 1);
}
static inline void q8_simde_store16(void *dst, __mmask16 k, __m256i x) {
    uint16_t put[16]; _mm256_storeu_si256((__m256i *)put, x); q8_simde_copy(dst, put, k, 16, 2);
}
static inline void q8_simde_store32(void *dst, __mmask16 k, __m512 x) {
    float put[16]; _mm512_storeu_ps(put, x); q8_simde_copy(dst, put, k, 16, 4);
}
static inline __m512i q8_simde_gather(__m512i index, const void *base, int scale) {
    int32_t at[16], got[16];
    _mm512_storeu_si512((void *)at, index);
    for (int t = 0; t < 16; t++) memcpy(&got[t], (const char *)base + (int64_t)at[t] * scale, 4);
    return _mm512_loadu_si512((const void *)got);
}
static inline __m128i q8_simde_narrow8(__m512i x) {
    int32_t wide[16]; uint8_t narrow[16];
    _mm512_storeu_si512((void *)wide, x);
    for (int t = 0; t < 16; t++) narrow[t] = (uint8_t)wide[t];
    return _mm_loadu_si128((const __m128i *)narrow);
}
static inline __m256i q8_simde_narrow16(__m512i x) {
    int32_t wide[16]; uint16_t narrow[16];
    _mm512_storeu_si512((void *)wide, x);
    for (int t = 0; t < 16; t++) narrow[t] = (uint16_t)wide[t];
    return _mm256_loadu_si256((const __m256i *)narrow);
}
static inline __m512i q8_simde_widen16(__m256i x) {
    uint16_t narrow[16]; int32_t wide[16];
    _mm256_storeu_si256((__m256i *)narrow, x);
    for (int t = 0; t < 16; t++) wide[t] = narrow[t];
    return _mm512_loadu_si512((const void *)wide);
}
#undef _mm512_maskz_loadu_ps
#undef _mm256_maskz_loadu_epi16
#undef _mm512_mask_storeu_ps
#undef _mm256_mask_storeu_epi16
#define _mm512_maskz_loadu_epi8 q8_simde_load8
#define _mm256_maskz_loadu_epi16 q8_simde_load16
#define _mm512_maskz_loadu_ps q8_simde_load32
#define _mm512_maskz_load_ps q8_simde_load32
#define _mm_mask_storeu_epi8 q8_simde_store8
#define _mm256_mask_storeu_epi16 q8_simde_store16
#define _mm512_mask_storeu_ps q8_simde_store32
#define _mm512_i32gather_epi32 q8_simde_gather
#define _mm512_cvtepi32_epi8 q8_simde_narrow8
#define _mm512_cvtepi32_epi16 q8_simde_narrow16
#define _mm512_cvtepu16_epi32 q8_simde_widen16
#define _mm512_cmplt_epu32_mask(a, b) ((__mmask16)~_mm512_cmpge_epu32_mask(a, b))
#define _mm512_cmpgt_epu32_mask(a, b) ((__mmask16)~_mm512_cmpge_epu32_mask(b, a))
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) \
      && !defined(Q8_SCALAR)
#define Q8_AVX512 1
#else
#define Q8_AVX512 0
#endif
int q8_avx512(void) { return Q8_AVX512; }   /* which CLAIM_q8 this library runs (1: the one below) */

#if Q8_AVX512
_Static_assert(QBLOCK % 64 == 0, "the AVX-512 CLAIM_q8 dequantizes 64 codes at a time");
#define Q8_I32(x) _mm512_set1_epi32((int)(x))
typedef struct { __m512i plane[4][4]; } q8_codebook;   /* [byte b of the FP32 entry][entries 64q..64q+63] */

/* blockwise8.kernel_tables' byte planes of one map: 1024 bytes, plane b's 256 bytes in code order */
static inline void q8_load_codebook(q8_codebook *cb, const uint32_t *planes) {
    for (int b = 0; b < 4; b++)
        for (int q = 0; q < 4; q++) cb->plane[b][q] = _mm512_loadu_si512((const void *)(planes + 64 * b + 16 * q));
}

/* codebook[codes] for 64 codes (bytes) -> out[4]: 16 floats each, in the codes' order */
static inline void q8_dequantize64(const q8_codebook *cb, __m512i codes, __m512 out[4]) {
    /* The unpacks below interleave within 128-bit lanes: register k's lane L gets the floats of
       positions 16L + 4k .. 16L + 4k + 3. Transposing the codes' 4 x 4 dwords first (vpermd)
       puts code 16k + 4L + t there, so register k holds codes 16k .. 16k + 15 in order. */
    const __m512i idx = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), codes);
    const __mmask64 upper = _mm512_movepi8_mask(idx);          /* code >= 128: the upper half */
    __m512i byte[4];
    for (int b = 0; b < 4; b++) {                              /* vpermi2b: a 128-entry table */
        const __m512i lower = _mm512_permutex2var_epi8(cb->plane[b][0], idx, cb->plane[b][1]);
        const __m512i higher = _mm512_permutex2var_epi8(cb->plane[b][2], idx, cb->plane[b][3]);
        byte[b] = _mm512_mask_blend_epi8(upper, lower, higher);
    }
    const __m512i lo01 = _mm512_unpacklo_epi8(byte[0], byte[1]), hi01 = _mm512_unpackhi_epi8(byte[0], byte[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(byte[2], byte[3]), hi23 = _mm512_unpackhi_epi8(byte[2], byte[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));   /* little-endian: byte 0 lowest */
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}

/* quantize8 (the portable kernel's) in 16 lanes: the same bucket, entry, rank and NaN rule.
   finite: the block's new values are all finite, so |x| <= 1 (x = value / absmax), x is no NaN,
   and the clamp to the last bucket and the NaN test can go (a constant where inlined). */
static inline __m128i q8_quantize16(const uint32_t *table, __m512 x, const int finite) {
    const __m512i u = _mm512_castps_si512(x), zero = _mm512_setzero_si512();
    const __m512i a = _mm512_and_si512(u, Q8_I32(0x7fffffff));
    /* max(bucket - Q8_LOW_BUCKET, 0) in one op: a >> 16 < 2^15, so each dword's high word is 0 */
    __m512i b = _mm512_subs_epu16(_mm512_srli_epi32(a, 16), Q8_I32(Q8_LOW_BUCKET));
    if (!finite) b = _mm512_min_epi32(b, Q8_I32(Q8_TABLE - 1));      /* inf, NaN: the last bucket */
    const __mmask16 negative = _mm512_cmpgt_epi32_mask(zero, u);      /* the sign bit */
    b = _mm512_mask_add_epi32(b, negative, b, Q8_I32(Q8_TABLE));      /* the negative buckets follow */
    const __m512i e = _mm512_i32gather_epi32(b, (const void *)table, 4);
    const __m512i rank = _mm512_and_si512(_mm512_mask_xor_epi32(a, negative, a, Q8_I32(0xffff)),  /* negative: */
                                          Q8_I32(0xffff));                                        /* ~low bits */
    const __mmask16 up = _mm512_cmpge_epu32_mask(rank, _mm512_and_si512(e, Q8_I32(0x1ffff)));
    __m512i code = _mm512_srli_epi32(e, 17);
    code = _mm512_mask_add_epi32(code, up, code, Q8_I32(1));
    if (!finite) code = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, x, _CMP_EQ_OQ), code);   /* NaN: code 0 */
    return _mm512_cvtepi32_epi8(code);
}

/* sr_bf16 in 16 lanes: elements index .. index + 15 of the unit, the same counter-based hash */
static inline __m512i q8_fmix32(__m512i h) {
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, Q8_I32(0x85ebca6bu));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, Q8_I32(0xc2b2ae35u));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}
static inline __m256i q8_sr_bf16(__m512 x, uint64_t key, uint64_t index) {
    const __m512i low = _mm512_add_epi32(Q8_I32((uint32_t)index),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __mmask16 wrapped = _mm512_cmplt_epu32_mask(low, Q8_I32((uint32_t)index));   /* index's high half + 1 */
    __m512i high = Q8_I32((uint32_t)(index >> 32));
    high = _mm512_mask_add_epi32(high, wrapped, high, Q8_I32(1));
    const __m512i h = _mm512_xor_si512(q8_fmix32(_mm512_xor_si512(low, Q8_I32((uint32_t)key))),
                                       _mm512_xor_si512(high, Q8_I32((uint32_t)(key >> 32))));
    const __m512i r = _mm512_srli_epi32(q8_fmix32(h), 16);
    const __m512i u = _mm512_castps_si512(x);
    __m512i out = _mm512_and_si512(u, Q8_I32(0xffff0000u));
    out = _mm512_mask_add_epi32(out, _mm512_cmplt_epu32_mask(r, _mm512_and_si512(u, Q8_I32(0xffff))), out,
                                Q8_I32(0x10000));
    out = _mm512_srli_epi32(out, 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, Q8_I32(0x7fffffff)), Q8_I32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(out, nan, Q8_I32(0x7fc0)));
}

static inline __mmask16 q8_lanes(int64_t n) { return n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }
static inline __m512 q8_load(const void *src, int64_t i, __mmask16 lanes, int bf16) {     /* FP32 or widened BF16 */
    if (!bf16) return _mm512_maskz_loadu_ps(lanes, (const float *)src + i);
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, (const uint16_t *)src + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
static inline uint32_t q8_max_lane(__m512i x) {                /* the largest of 16 unsigned lanes */
    __m256i y = _mm256_max_epu32(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64(x, 1));
    __m128i z = _mm_max_epu32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
    z = _mm_max_epu32(z, _mm_shuffle_epi32(z, 0x4e));
    z = _mm_max_epu32(z, _mm_shuffle_epi32(z, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(z);
}

/* One block's new moments mi, vi (16 lanes from element i, the block's element j): the
   FP32 kernel's arithmetic (COMPACT_ELEMENT), the master written where the part writes it */
#define Q8_ELEMENTS16(dm, dv) {                                                                 \
    const __m512 gi = _mm512_mul_ps(q8_load(g, i, lanes, g_bf16), _mm512_set1_ps(gscale));      \
    const __m512 mo = _mm512_mul_ps(dm, _mm512_set1_ps(sm[blk]));                               \
    const __m512 vo = _mm512_mul_ps(dv, _mm512_set1_ps(sv[blk]));                               \
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(mo, _mm512_set1_ps(beta1)),                   \
                                    _mm512_mul_ps(gi, _mm512_set1_ps(c1)));                     \
    const __m512 vi = _mm512_add_ps(_mm512_mul_ps(vo, _mm512_set1_ps(beta2)),                   \
                                    _mm512_mul_ps(_mm512_mul_ps(gi, gi), _mm512_set1_ps(c2)));  \
    if (writes_p) {                                                                             \
        const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), _mm512_set1_ps(bc2_sqrt)), \
                                           _mm512_set1_ps(eps));                                \
        const __m512 pdecay = _mm512_mask_blend_ps(q8_lanes(nd - i), _mm512_set1_ps(1.0f),      \
                                                   _mm512_set1_ps(decay));                      \
        const __m512 pn = _mm512_sub_ps(_mm512_mul_ps(q8_load(p, i, lanes, p_bf16), pdecay),    \
                                        _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(step_size), mi), denom)); \
        if (p_bf16) _mm256_mask_storeu_epi16((uint16_t *)p + i, lanes, q8_sr_bf16(pn, key, (uint64_t)(off + i))); \
        else _mm512_mask_storeu_ps((float *)p + i, lanes, pn);                                  \
    }                                                                                           \
    if (writes_m) {                                                                             \
        _mm512_store_ps(nm + j, mi);                                                            \
        _mm512_store_ps(nv + j, vi);                                                            \
        am = _mm512_max_epu32(am, _mm512_maskz_and_epi32(lanes, _mm512_castps_si512(mi), Q8_I32(0x7fffffff))); \
        av = _mm512_max_epu32(av, _mm512_maskz_and_epi32(lanes, _mm512_castps_si512(vi), Q8_I32(0x7fffffff))); \
    }                                                                                           \
}

/* The block's new codes, 16 at a time, from its new moments over their new scales (a division,
   as the portable loop's: the same rounding) */
#define Q8_REQUANTIZE(FINITE)                                                                   \
    for (int64_t j = 0; j < len; j += 16) {                                                     \
        const __mmask16 lanes = q8_lanes(len - j);                                              \
        const __m512 xm = _mm512_div_ps(_mm512_maskz_load_ps(lanes, nm + j), _mm512_set1_ps(fm)); \
        const __m512 xv = _mm512_div_ps(_mm512_maskz_load_ps(lanes, nv + j), _mm512_set1_ps(fv)); \
        _mm_mask_storeu_epi8(m + k + j, lanes, q8_quantize16(ts, xm, FINITE));                  \
        _mm_mask_storeu_epi8(v + k + j, lanes, q8_quantize16(tu, xv, FINITE));                  \
    }

/* CLAIM_q8's work on [lo, hi), a QBLOCK-element block at a time as the portable loop: dequantize
   64 codes a moment at once, update 16 lanes at a time, then (moments, all) the block's absmax as
   its scale and the new codes. The flags are constants where it is inlined, so each kernel keeps
   only its own formats' and part's code. */
static inline __attribute__((always_inline)) void q8_claim_avx512(
        void *restrict p, uint8_t *restrict m, uint8_t *restrict v, const void *restrict g,
        float *restrict sm, float *restrict sv, int64_t lo, int64_t hi, int64_t nd, const float *restrict s,
        const uint32_t *restrict q8, uint64_t key, int64_t off,
        const int p_bf16, const int g_bf16, const int writes_p, const int writes_m) {
    CLAIM_SCALARS
    const uint32_t *restrict ts = q8 + 512, *restrict tu = ts + 2 * Q8_TABLE;    /* bucket tables */
    q8_codebook cs, cu;                                        /* the signed and unsigned map */
    q8_load_codebook(&cs, tu + 2 * Q8_TABLE);
    q8_load_codebook(&cu, tu + 2 * Q8_TABLE + 256);
    float nm[QBLOCK] __attribute__((aligned(64))), nv[QBLOCK] __attribute__((aligned(64)));
    for (int64_t k = lo; k < hi; k += QBLOCK) {
        const int64_t len = (k + QBLOCK < hi ? k + QBLOCK : hi) - k, blk = k / QBLOCK;
        __m512i am = _mm512_setzero_si512(), av = _mm512_setzero_si512();   /* |new moments|' bits */
        for (int64_t c = 0; c < len; c += 64) {
            const __mmask64 live = len - c >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (len - c)) - 1);
            __m512 dm[4], dv[4];
            q8_dequantize64(&cs, _mm512_maskz_loadu_epi8(live, m + k + c), dm);
            q8_dequantize64(&cu, _mm512_maskz_loadu_epi8(live, v + k + c), dv);
            for (int q = 0; q < 4 && c + 16 * q < len; q++) {
                const int64_t j = c + 16 * q, i = k + j;
                const __mmask16 lanes = q8_lanes(len - j);
                Q8_ELEMENTS16(dm[q], dv[q])
            }
        }
        if (!writes_m) continue;
        const uint32_t amax = q8_max_lane(am), vmax = q8_max_lane(av);
        const float bm = from_bits(amax), bv = from_bits(vmax);
        const float fm = bm < 1e-12f ? 1e-12f : bm, fv = bv < 1e-12f ? 1e-12f : bv;   /* as the portable loop */
        sm[blk] = fm;
        sv[blk] = fv;
        if (amax < 0x7f800000u && vmax < 0x7f800000u) Q8_REQUANTIZE(1)   /* no inf, no NaN: the usual */
        else Q8_REQUANTIZE(0)
    }
}

#undef CLAIM_q8
#define Q8_BF16_f32 0
#define Q8_BF16_bf16 1
#define Q8_BF16_from_f32 0
#define Q8_BF16_from_bf16 1
#define CLAIM_q8(WIDEN, P, M, PART) {                                                           \
    q8_claim_avx512(p, m, v, g, sm, sv, lo, hi, nd, s, q8, key, off,                            \
                    Q8_BF16_##P, Q8_BF16_##WIDEN, WRITES_P_##PART, WRITES_M_##PART); }
#endif
"""
