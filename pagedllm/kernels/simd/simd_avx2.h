/*
 * The vector layer's AVX2 + FMA section (simd.h): 8-float vectors (used by
 * AVX-512 builds too, where a kernel keeps 8 lanes on purpose) and, where
 * simd.h picks 8 lanes for them, the x16 GGUF kernels' integer lanes.
 * Include simd.h, not this file.
 */
#ifndef PAGEDLLM_SIMD_AVX2_H
#define PAGEDLLM_SIMD_AVX2_H
#include <immintrin.h>

/* ---- 8 floats ---- */

typedef __m256 f32x8;
SIMD_INLINE f32x8 f32x8_load(const float *p) { return _mm256_loadu_ps(p); }
SIMD_INLINE void f32x8_store(float *p, f32x8 v) { _mm256_storeu_ps(p, v); }
SIMD_INLINE f32x8 f32x8_set1(float x) { return _mm256_set1_ps(x); }
SIMD_INLINE f32x8 f32x8_zero() { return _mm256_setzero_ps(); }
SIMD_INLINE f32x8 f32x8_add(f32x8 a, f32x8 b) { return _mm256_add_ps(a, b); }
SIMD_INLINE f32x8 f32x8_sub(f32x8 a, f32x8 b) { return _mm256_sub_ps(a, b); }
SIMD_INLINE f32x8 f32x8_mul(f32x8 a, f32x8 b) { return _mm256_mul_ps(a, b); }
SIMD_INLINE f32x8 f32x8_div(f32x8 a, f32x8 b) { return _mm256_div_ps(a, b); }
/* a * b + c, one rounding */
SIMD_INLINE f32x8 f32x8_fma(f32x8 a, f32x8 b, f32x8 c) { return _mm256_fmadd_ps(a, b, c); }

/* 8 float16 (bits) / bfloat16 (bits) at p, widened (exactly) to float32 */
#if defined(__F16C__)
SIMD_INLINE f32x8 f32x8_load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif
SIMD_INLINE f32x8 f32x8_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#if defined(__F16C__)
/* 8 fp8 bytes at p as float32 (exact), by way of float16 bits: E5M2 is a
   float16's top byte; E4M3's exponent and mantissa shifted into a float16's
   read as its value times 2^-8 (normals and subnormals; the caller scales by
   2^8). Neither holds NaN / inf here (paged_attention.h). */
SIMD_INLINE f32x8 f32x8_load_e5m2(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)p)));
}
/* E4M3: the byte in the lane's top half shifted right one (arithmetic: the
   sign stays in bit 15 and is copied into bit 14, which the mask clears) */
SIMD_INLINE f32x8 f32x8_load_e4m3(const uint8_t *p) {
    const __m128i hi = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(hi, 1), _mm_set1_epi16((short)0xBFFF)));
}
#endif
/* 8 int8 at p, widened (exactly) to float32: an int8 KV cache's values before their scale */
SIMD_INLINE f32x8 f32x8_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* 8 int4 values at p (4 bytes; value 2i in byte i's low nibble, 2i + 1 in its high one, each stored as q + 8),
   as the floats q: an int4 KV cache's values before their scale. Lane i shifts the 32 bits right by 4i. */
SIMD_INLINE f32x8 f32x8_load_u4(const uint8_t *p) {
    int32_t w;
    memcpy(&w, p, sizeof w);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i n = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), shifts), _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(n, _mm256_set1_epi32(8)));
}

/* lane-wise max / min; where a lane of a is NaN the lane of b comes out (maxps / minps return their second
   operand then), which is what fmaxf(b, a) / fminf(b, a) give when a is NaN */
SIMD_INLINE f32x8 f32x8_max(f32x8 a, f32x8 b) { return _mm256_max_ps(a, b); }
SIMD_INLINE f32x8 f32x8_min(f32x8 a, f32x8 b) { return _mm256_min_ps(a, b); }
/* |a|: the sign bits cleared */
SIMD_INLINE f32x8 f32x8_abs(f32x8 a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
/* a rounded to the nearest integer, ties to even: nearbyintf's result in the default rounding mode */
SIMD_INLINE f32x8 f32x8_round(f32x8 a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* the largest of the 8 lanes (none NaN) */
SIMD_INLINE float f32x8_hmax(f32x8 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* lane-wise a > b (ordered, quiet: false where either is NaN), as a mask of all-ones lanes */
SIMD_INLINE f32x8 f32x8_gt(f32x8 a, f32x8 b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
/* mask ? b : a, lane by lane (the mask's sign bits decide) */
SIMD_INLINE f32x8 f32x8_select(f32x8 a, f32x8 b, f32x8 mask) { return _mm256_blendv_ps(a, b, mask); }

/* exp of 8 floats: exp(x) = 2^n * exp(r) with n = round(x / ln 2) and
   |r| <= ln(2) / 2, exp(r) by its degree-6 Taylor polynomial (relative error
   at most 2.3e-7 over [-87, 0], about 2 ulp). ln 2 is split in a part
   exact in float and a small rest so that r keeps its precision. Inputs
   below -87 (scores far under the row's max) give 0. */
SIMD_INLINE f32x8 f32x8_exp(f32x8 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    /* operand order matters: max/min return their second operand when one is
       NaN, so a NaN input stays NaN (as expf's would) instead of becoming -87 */
    x = _mm256_max_ps(lo, x);
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n: n + 127 in the exponent bits */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* the sum of the 8 lanes: halves, then pairs, then the last two */
SIMD_INLINE float f32x8_hsum(f32x8 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- 4 floats: four reductions side by side ---- */

typedef __m128 f32x4;
SIMD_INLINE f32x4 f32x4_set1(float x) { return _mm_set1_ps(x); }
SIMD_INLINE f32x4 f32x4_mul(f32x4 a, f32x4 b) { return _mm_mul_ps(a, b); }
SIMD_INLINE void f32x4_store(float *p, f32x4 v) { _mm_storeu_ps(p, v); }
/* lane 0 */
SIMD_INLINE float f32x4_first(f32x4 v) { return _mm_cvtss_f32(v); }

/* The sums of the 8 lanes of each of a, b, c, d, as 4 floats */
SIMD_INLINE f32x4 f32x8_hsum4(f32x8 a, f32x8 b, f32x8 c, f32x8 d) {
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd); /* [a0 b0 c0 d0 | a1 b1 c1 d1] partial sums */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* ---- 8 int32s (lane indices) ---- */

typedef __m256i i32x8;
SIMD_INLINE i32x8 i32x8_zero() { return _mm256_setzero_si256(); }
SIMD_INLINE i32x8 i32x8_set1(int32_t x) { return _mm256_set1_epi32(x); }
/* 0, 1, ..., 7 */
SIMD_INLINE i32x8 i32x8_iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
SIMD_INLINE i32x8 i32x8_add(i32x8 a, i32x8 b) { return _mm256_add_epi32(a, b); }
SIMD_INLINE void i32x8_store(int32_t *p, i32x8 v) { _mm256_storeu_si256((__m256i *)p, v); }
/* 8 floats that hold integers, as int32s (exact) */
SIMD_INLINE i32x8 i32x8_from_f32(f32x8 a) { return _mm256_cvtps_epi32(a); }
/* the sum of the 8 lanes */
SIMD_INLINE int32_t i32x8_hsum(i32x8 v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}
/* a, b, c, d's 32 lanes (each in [-128, 127]) as 32 int8 at p, in that order. The packs work per 128-bit
   half, leaving the 4-lane groups as a0 b0 c0 d0 a1 b1 c1 d1 (x0: lanes 0-3, x1: lanes 4-7); one permute of
   32-bit groups puts them back in order */
SIMD_INLINE void i8x32_store_i32(int8_t *p, i32x8 a, i32x8 b, i32x8 c, i32x8 d) {
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)p, ordered);
}
/* mask ? b : a, lane by lane, with a float mask (f32x8_gt's) */
SIMD_INLINE i32x8 i32x8_select(i32x8 a, i32x8 b, f32x8 mask) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), mask));
}

/* ---- bfloat16 pairs: a 32-bit lane holding two bf16 values, low then high ---- */

SIMD_INLINE i32x8 i32x8_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* the low / high bf16 of each lane as a float32 (exact: a bf16 value is the top half of a float32) */
SIMD_INLINE f32x8 f32x8_bf16_lo(i32x8 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
SIMD_INLINE f32x8 f32x8_bf16_hi(i32x8 v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* ---- 16 bytes: a GGUF block's quants, unpacked and widened to floats ---- */

typedef __m128i u8x16;
SIMD_INLINE u8x16 u8x16_load(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
/* each byte's low / high nibble */
SIMD_INLINE u8x16 u8x16_nib_lo(u8x16 v) { return _mm_and_si128(v, _mm_set1_epi8(0x0f)); }
SIMD_INLINE u8x16 u8x16_nib_hi(u8x16 v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f)); }
SIMD_INLINE u8x16 u8x16_or(u8x16 a, u8x16 b) { return _mm_or_si128(a, b); }
/* bytes 8..15 moved to 0..7 */
SIMD_INLINE u8x16 u8x16_upper8(u8x16 v) { return _mm_srli_si128(v, 8); }
/* 16 bits as 16 bytes, 16 where bit i is set (a Q5 block's fifth bits, bit i for byte i) */
SIMD_INLINE u8x16 u8x16_bits_to_16s(uint32_t bits) {
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)bits),
                                            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m128i mask = _mm_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, mask), mask), _mm_set1_epi8(0x10));
}
/* bytes 0..7 as floats: unsigned, or 8 int8 loaded from p */
SIMD_INLINE f32x8 f32x8_from_u8(u8x16 v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
SIMD_INLINE f32x8 f32x8_load_i8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

#if SIMD_Q_LANES == 8
/* ---- the x16 GGUF kernels' lanes (simd.h, vq_*): 8 channels, a tile in two halves ---- */

/* the weights' offset the Q8 dot product needs: the kernels read the stored q ^ 0x80 as q + 128 and split it
   into two 4-bit digits (SIMD_Q_SUM16 below) */
#define SIMD_Q8_OFFSET 128
/* vpmaddubsw's 16-bit sums are kept: up to 8 of them add in 16-bit lanes before one vpmaddwd widens them
   (8 x 2 products of a 4-bit digit and an int8: |sum| <= 16 x 15 x 127 = 30480 < 2^15) */
#define SIMD_Q_SUM16 1
typedef __m256i vq_int;
typedef __m256 vq_float;
/* 32 weight bytes: 4 for each lane */
SIMD_INLINE vq_int vq_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
SIMD_INLINE vq_int vq_zero() { return _mm256_setzero_si256(); }
/* 4 int8 inputs, in every lane */
SIMD_INLINE vq_int vq_quad(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
/* each byte's low / high nibble */
SIMD_INLINE vq_int vq_nib_lo(vq_int v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
SIMD_INLINE vq_int vq_nib_hi(vq_int v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }
/* acc + the 4-byte dot products of unsigned weights w (0..127: vpmaddubsw's pairs do not saturate) and int8 x */
SIMD_INLINE vq_int vq_dot_u4(vq_int acc, vq_int w, vq_int x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
/* acc16 + the products of 4-bit digits w (0..15) and int8 x, two per 16-bit lane (no widening: vq_widen16) */
SIMD_INLINE vq_int vq_madd16(vq_int acc16, vq_int w, vq_int x) {
    return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, x));
}
/* acc + m times the sums of acc16's lane pairs, as int32 lanes (one channel each) */
SIMD_INLINE vq_int vq_widen16(vq_int acc, vq_int acc16, int16_t m) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(acc16, _mm256_set1_epi16(m)));
}
/* acc + the sums of acc16's lane pairs times m's 16-bit halves (a channel's multiplier in both: vq_pair16) */
SIMD_INLINE vq_int vq_widen16_by(vq_int acc, vq_int acc16, vq_int m) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(acc16, m));
}
/* v, pinned in a register at this point: a chain of sums kept a chain (the compiler would otherwise regroup
   it into a tree of many live products, more than AVX2's 16 registers, and spill them) */
SIMD_INLINE vq_int vq_keep(vq_int v) {
    __asm__("" : "+x"(v));
    return v;
}
/* each 32-bit lane's value (|v| < 2^15) in both of its 16-bit halves: a multiplier per channel for vq_widen16_by */
SIMD_INLINE vq_int vq_pair16(vq_int v) {
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
}
/* a table of 16 bytes (the non-linear 4-bit types' values, sign flipped as Q8 weights are stored), in both
   128-bit halves for vpshufb */
typedef __m256i vq_tab;
SIMD_INLINE vq_tab vq_table(const int8_t *t16) {
    const __m128i t = _mm_xor_si128(_mm_loadu_si128((const __m128i *)t16), _mm_set1_epi8((char)0x80));
    return _mm256_broadcastsi128_si256(t);
}
/* each byte (0..15) replaced by its entry of the table (vpshufb) */
SIMD_INLINE vq_int vq_lookup(vq_tab t, vq_int idx) { return _mm256_shuffle_epi8(t, idx); }
/* a table of 16 small int8 values (|v| <= 127 - offset) plus offset, unsigned: MXFP4's values (|v| <= 12) as
   Q4_0's nibbles are, q + 8, so that one vpmaddubsw takes them */
SIMD_INLINE vq_tab vq_table_offset(const int8_t *t16, int8_t offset) {
    return _mm256_broadcastsi128_si256(_mm_add_epi8(_mm_loadu_si128((const __m128i *)t16), _mm_set1_epi8(offset)));
}
/* the table's entries split into their 4-bit digits (SIMD_Q_SUM16's weights): lo = entry & 15, hi = entry >> 4,
   so that a lookup gives a digit without splitting the looked-up bytes */
SIMD_INLINE void vq_table_digits(vq_tab t, vq_tab *lo, vq_tab *hi) {
    *lo = _mm256_and_si256(t, _mm256_set1_epi8(0x0f));
    *hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), _mm256_set1_epi8(0x0f));
}
/* the lanes' E8M0 scales (a byte each at p) halved, 2^(e - 128), as floats: the exponent field e - 1, or
   below e = 2 the subnormals 2^-128, 2^-127 */
SIMD_INLINE vq_float vq_fe8m0(const uint8_t *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}
/* byte ops for the k-quants' upper bits (16-bit shifts: the masks drop what crosses a byte) */
SIMD_INLINE vq_int vq_bits(vq_int v, int s, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(v, s), _mm256_set1_epi8((char)mask));
}
SIMD_INLINE vq_int vq_shl4(vq_int v) { return _mm256_slli_epi16(v, 4); }
SIMD_INLINE vq_int vq_shl2(vq_int v) { return _mm256_slli_epi16(v, 2); }
SIMD_INLINE vq_int vq_or(vq_int a, vq_int b) { return _mm256_or_si256(a, b); }
/* 32-bit lane ops: one lane per channel */
SIMD_INLINE vq_int vq_sub1(vq_int a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
SIMD_INLINE vq_int vq_lanes_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
SIMD_INLINE vq_int vq_lanes_s8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
SIMD_INLINE vq_int vq_mul(vq_int a, vq_int b) { return _mm256_mullo_epi32(a, b); }
SIMD_INLINE vq_int vq_add(vq_int a, vq_int b) { return _mm256_add_epi32(a, b); }
/* acc + the products of a's and b's signed 16-bit halves, low with low, high with high, per 32-bit lane */
SIMD_INLINE vq_int vq_madd_pairs(vq_int acc, vq_int a, vq_int b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
SIMD_INLINE vq_int vq_set1(int32_t v) { return _mm256_set1_epi32(v); }
SIMD_INLINE vq_int vq_and1(vq_int a, int32_t m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
SIMD_INLINE vq_int vq_srl(vq_int a, int s) { return _mm256_srli_epi32(a, s); }
SIMD_INLINE vq_int vq_sll(vq_int a, int s) { return _mm256_slli_epi32(a, s); }
/* the float side, a lane per channel */
SIMD_INLINE vq_float vq_fzero() { return _mm256_setzero_ps(); }
SIMD_INLINE vq_float vq_fset1(float v) { return _mm256_set1_ps(v); }
/* the lanes' float16 scales (bits at p), widened */
SIMD_INLINE vq_float vq_fhalves(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
SIMD_INLINE vq_float vq_fmul(vq_float a, vq_float b) { return _mm256_mul_ps(a, b); }
SIMD_INLINE vq_float vq_ffma(vq_float a, vq_float b, vq_float c) { return _mm256_fmadd_ps(a, b, c); }
SIMD_INLINE vq_float vq_fcvt(vq_int a) { return _mm256_cvtepi32_ps(a); }
SIMD_INLINE void vq_fstore(float *p, vq_float v) { _mm256_storeu_ps(p, v); }
SIMD_INLINE vq_float vq_fload(const float *p) { return _mm256_loadu_ps(p); }
SIMD_INLINE vq_float vq_fadd(vq_float a, vq_float b) { return _mm256_add_ps(a, b); }
#endif

#endif
