/*
 * The vector layer's plain C section (simd.h): builds without AVX2 (the
 * "scalar" variant, or a CPU the other sections do not cover). Float
 * kernels have no vectors here (SIMD_F32_WIDTH 0: they take their plain C
 * paths); the x16 GGUF kernels run one lane, a channel at a time, a
 * "vector" of bytes being the channel's 4 bytes of a chunk. The integer
 * sums are exact, so these compute the same integers as the wide sections.
 * Include simd.h, not this file.
 */
#ifndef PAGEDLLM_SIMD_SCALAR_H
#define PAGEDLLM_SIMD_SCALAR_H
#include <math.h>

/* float16 bits as a float32 (exact): F16C's instruction where the build has it, by hand otherwise */
#if defined(__F16C__)
#include <immintrin.h>
SIMD_INLINE float simd_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else
SIMD_INLINE float simd_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        int e = -1;
        uint32_t m = mant;
        do { m <<= 1; e++; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

#if SIMD_Q_LANES == 1
/* ---- the x16 GGUF kernels' lanes (simd.h, vq_*): one channel ---- */

#define SIMD_Q8_OFFSET 0
typedef int32_t vq_int;
typedef float vq_float;
SIMD_INLINE vq_int vq_load(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
SIMD_INLINE vq_int vq_zero() { return 0; }
SIMD_INLINE vq_int vq_quad(const int8_t *p) { return vq_load((const uint8_t *)p); }
SIMD_INLINE vq_int vq_nib_lo(vq_int v) { return (int32_t)((uint32_t)v & 0x0f0f0f0fu); }
SIMD_INLINE vq_int vq_nib_hi(vq_int v) { return (int32_t)(((uint32_t)v >> 4) & 0x0f0f0f0fu); }
SIMD_INLINE vq_int vq_dot_u4(vq_int acc, vq_int w, vq_int x) {
    for (int i = 0; i < 4; i++)
        acc += (int32_t)(uint8_t)((uint32_t)w >> (8 * i)) * (int32_t)(int8_t)((uint32_t)x >> (8 * i));
    return acc;
}
SIMD_INLINE vq_int vq_dot_q8(vq_int acc, vq_int w, vq_int x) {
    for (int i = 0; i < 4; i++)
        acc += (int32_t)(int8_t)(((uint32_t)w >> (8 * i)) ^ 0x80u) * (int32_t)(int8_t)((uint32_t)x >> (8 * i));
    return acc;
}
/* a table of 16 bytes (the non-linear 4-bit types' values, sign flipped as Q8 weights are stored) */
typedef struct {
    uint8_t b[16];
} vq_tab;
SIMD_INLINE vq_tab vq_table(const int8_t *t16) {
    vq_tab t;
    for (int i = 0; i < 16; i++) t.b[i] = (uint8_t)t16[i] ^ 0x80u;
    return t;
}
/* each of the 4 bytes (0..15) replaced by its entry of the table */
SIMD_INLINE vq_int vq_lookup(vq_tab t, vq_int idx) {
    uint32_t out = 0;
    for (int i = 0; i < 4; i++) out |= (uint32_t)t.b[((uint32_t)idx >> (8 * i)) & 0x0f] << (8 * i);
    return (int32_t)out;
}
/* the lane's E8M0 scale halved, 2^(e - 128): the exponent field e - 1, or below e = 2 the subnormals */
SIMD_INLINE vq_float vq_fe8m0(const uint8_t *p) {
    const uint32_t e = p[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
SIMD_INLINE vq_int vq_bits(vq_int v, int s, int mask) {
    return (int32_t)(((uint32_t)v >> s) & ((uint32_t)mask * 0x01010101u));
}
SIMD_INLINE vq_int vq_shl4(vq_int v) { return (int32_t)((uint32_t)v << 4); }
SIMD_INLINE vq_int vq_shl2(vq_int v) { return (int32_t)((uint32_t)v << 2); }
SIMD_INLINE vq_int vq_or(vq_int a, vq_int b) { return a | b; }
SIMD_INLINE vq_int vq_sub1(vq_int a, int32_t b) { return a - b; }
SIMD_INLINE vq_int vq_lanes_u8(const uint8_t *p) { return p[0]; }
SIMD_INLINE vq_int vq_lanes_s8(const uint8_t *p) { return (int8_t)p[0]; }
SIMD_INLINE vq_int vq_mul(vq_int a, vq_int b) { return a * b; }
SIMD_INLINE vq_int vq_add(vq_int a, vq_int b) { return a + b; }
/* acc + the products of a's and b's signed 16-bit halves, low with low, high with high (vpmaddwd's pairs) */
SIMD_INLINE vq_int vq_madd_pairs(vq_int acc, vq_int a, vq_int b) {
    return acc + (int32_t)(int16_t)(a & 0xffff) * (int16_t)(b & 0xffff) + (int32_t)(int16_t)(a >> 16) * (int16_t)(b >> 16);
}
SIMD_INLINE vq_int vq_set1(int32_t v) { return v; }
SIMD_INLINE vq_int vq_and1(vq_int a, int32_t m) { return a & m; }
SIMD_INLINE vq_int vq_srl(vq_int a, int s) { return (int32_t)((uint32_t)a >> s); }
SIMD_INLINE vq_int vq_sll(vq_int a, int s) { return (int32_t)((uint32_t)a << s); }
SIMD_INLINE vq_float vq_fzero() { return 0.0f; }
SIMD_INLINE vq_float vq_fset1(float v) { return v; }
SIMD_INLINE vq_float vq_fhalves(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return simd_f16_to_f32(h);
}
SIMD_INLINE vq_float vq_fmul(vq_float a, vq_float b) { return a * b; }
/* fmaf: one rounding, as the vector sections' fma */
SIMD_INLINE vq_float vq_ffma(vq_float a, vq_float b, vq_float c) { return fmaf(a, b, c); }
SIMD_INLINE vq_float vq_fcvt(vq_int a) { return (float)a; }
SIMD_INLINE void vq_fstore(float *p, vq_float v) { *p = v; }
SIMD_INLINE vq_float vq_fload(const float *p) { return *p; }
SIMD_INLINE vq_float vq_fadd(vq_float a, vq_float b) { return a + b; }
#endif

#endif
