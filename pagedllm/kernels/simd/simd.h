/*
 * The vector layer: where the kernels' SIMD intrinsics live.
 *
 * Each ISA has a section of its own, picked by the macros the compiler sets
 * for the build variant (kernels/__init__.py, ISA_VARIANTS):
 *
 *   simd_avx512.h   __AVX512F__ (and __AVX512BW__ for the integer lanes)
 *   simd_avx2.h     __AVX2__ and __FMA__ (and __F16C__ for the integer lanes)
 *   simd_scalar.h   everything else: plain C, one lane
 *
 * A port to another ISA (NEON) adds its file, a branch below that picks it,
 * and the same names. What the layer offers:
 *
 *   f32x8_*, f32x4_*, i32x8_*  8 (4) floats, 8 int32s: AVX2+FMA builds and
 *                    up (SIMD_F32X8). The softmax's exp, the decode
 *                    attention's dot products, the horizontal sums, the
 *                    x16 GGUF kernels' rounding of activations to int8
 *                    (max, abs, round, i8x32_store_i32).
 *   u8x16_*          16 bytes of GGUF quants: nibbles split, fifth bits
 *                    spread, widened to floats (f32x8_from_u8, ...).
 *   f32x8_load_u4, f32x16_load_u4  8 / 16 packed nibbles (an int4 KV
 *                    cache's values) as floats, less their offset of 8.
 *   f32x8_bf16_lo/hi two bfloat16s per 32-bit lane widened (the AVX2
 *                    bf16 matmul).
 *   f32x16_*         16 floats: AVX-512 builds (SIMD_F32X16); bf16x32_*
 *                    and f32x16_dot_bf16 with AVX512-BF16.
 *   vf32, vf32_*     the widest float vector of the build, SIMD_F32_WIDTH
 *                    floats (16, 8; 0 where the build has none: the
 *                    kernels then take their plain C paths): load, store,
 *                    set1, zero, add, mul, fma, horizontal sum; vf32_dot
 *                    and vf32_axpy (a dot product, y += a * x, of n floats).
 *   vq_*             the int8 dot products of the x16 GGUF kernels
 *                    (gguf_x16.h): SIMD_Q_LANES int32 lanes, one output
 *                    channel each (16, 8, or 1 in plain C), each summing
 *                    4 uint8 weights times 4 int8 inputs per step, with a
 *                    float vector of as many lanes for the scales;
 *                    vq_table / vq_lookup, a 16-byte table indexed by
 *                    nibbles (vpshufb: the IQ4 / MXFP4 values), and
 *                    vq_fe8m0, MXFP4's E8M0 exponents as float scales.
 *   simd_f16_to_f32  one float16 (bits) widened: F16C, or by hand.
 *   simd_prefetch_l1/_l2  a cache line into L1 / L2.
 *
 * Every helper is the one intrinsic (or the fixed sequence of them) the
 * kernels used before the layer existed, always inlined: a kernel written
 * on the layer runs the same instructions in the same order, so results
 * are bit-identical to the hand-written intrinsics, per variant. Which
 * width a kernel uses stays the kernel's choice (the softmax keeps 8 lanes
 * on AVX-512 builds, which fixes its summation order).
 *
 * No kernel file includes <immintrin.h> or calls an intrinsic itself: a
 * new operation goes here, in every section that can run it.
 */
#ifndef PAGEDLLM_SIMD_H
#define PAGEDLLM_SIMD_H
#include <stdint.h>
#include <string.h>

#define SIMD_INLINE static inline __attribute__((always_inline))

/* lanes of the x16 int8 dot products (vq_*): which section defines them */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SIMD_Q_LANES 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SIMD_Q_LANES 8
#else
#define SIMD_Q_LANES 1
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define SIMD_F32X8 1
#include "simd_avx2.h"
#else
#define SIMD_F32X8 0
#endif

#if defined(__AVX512F__)
#define SIMD_F32X16 1
#include "simd_avx512.h"
#else
#define SIMD_F32X16 0
#endif

#include "simd_scalar.h"

/* a cache line into L1 / L2 (prefetcht0 / prefetcht1 on x86: the panel matmuls pull in their next panel
   with the second) */
#if defined(__SSE__)
#include <xmmintrin.h>
SIMD_INLINE void simd_prefetch_l1(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }
SIMD_INLINE void simd_prefetch_l2(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }
#else
SIMD_INLINE void simd_prefetch_l1(const void *p) { __builtin_prefetch(p, 0, 3); }
SIMD_INLINE void simd_prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }
#endif

/* the widest float vector: what the tiled kernels (panel_f32.h, prefill_attention.cpp) are written in */
#if SIMD_F32X16
#define SIMD_F32_WIDTH 16
typedef f32x16 vf32;
#define vf32_load f32x16_load
#define vf32_store f32x16_store
#define vf32_set1 f32x16_set1
#define vf32_zero f32x16_zero
#define vf32_add f32x16_add
#define vf32_mul f32x16_mul
#define vf32_fma f32x16_fma
#define vf32_hsum f32x16_hsum
#elif SIMD_F32X8
#define SIMD_F32_WIDTH 8
typedef f32x8 vf32;
#define vf32_load f32x8_load
#define vf32_store f32x8_store
#define vf32_set1 f32x8_set1
#define vf32_zero f32x8_zero
#define vf32_add f32x8_add
#define vf32_mul f32x8_mul
#define vf32_fma f32x8_fma
#define vf32_hsum f32x8_hsum
#else
#define SIMD_F32_WIDTH 0
#endif


/* y += a * x over n floats (the state layers' kernels, gated_delta/ and ssm/) */
static inline void vf32_axpy(float *y, float a, const float *x, int64_t n) {
    int64_t j = 0;
#if SIMD_F32_WIDTH
    const vf32 va = vf32_set1(a);
    for (; j + SIMD_F32_WIDTH <= n; j += SIMD_F32_WIDTH)
        vf32_store(y + j, vf32_fma(va, vf32_load(x + j), vf32_load(y + j)));
#endif
    for (; j < n; j++) y[j] += a * x[j];
}

/* sum of a[i] * b[i] over n floats: vector lanes, their horizontal sum, then the tail in order (the state
   layers' kernels, gated_delta/ and ssm/, share it so their sums are summed the one same way) */
static inline float vf32_dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if SIMD_F32_WIDTH
    vf32 acc = vf32_zero();
    for (; i + SIMD_F32_WIDTH <= n; i += SIMD_F32_WIDTH) acc = vf32_fma(vf32_load(a + i), vf32_load(b + i), acc);
    sum = vf32_hsum(acc);
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#endif
