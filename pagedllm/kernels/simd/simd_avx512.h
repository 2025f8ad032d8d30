/*
 * The vector layer's AVX-512 section (simd.h): 16-float vectors and, with
 * AVX-512BW (VNNI when the build has it), the x16 GGUF kernels' integer
 * lanes, a whole 16-channel tile per vector. Include simd.h, not this file.
 */
#ifndef PAGEDLLM_SIMD_AVX512_H
#define PAGEDLLM_SIMD_AVX512_H
#include <immintrin.h>

/* ---- 16 floats ---- */

typedef __m512 f32x16;
SIMD_INLINE f32x16 f32x16_load(const float *p) { return _mm512_loadu_ps(p); }
SIMD_INLINE void f32x16_store(float *p, f32x16 v) { _mm512_storeu_ps(p, v); }
SIMD_INLINE f32x16 f32x16_set1(float x) { return _mm512_set1_ps(x); }
SIMD_INLINE f32x16 f32x16_zero() { return _mm512_setzero_ps(); }
SIMD_INLINE f32x16 f32x16_add(f32x16 a, f32x16 b) { return _mm512_add_ps(a, b); }
SIMD_INLINE f32x16 f32x16_mul(f32x16 a, f32x16 b) { return _mm512_mul_ps(a, b); }
/* a * b + c, one rounding */
SIMD_INLINE f32x16 f32x16_fma(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fmadd_ps(a, b, c); }
/* the sum of the 16 lanes (the compiler's reduction order) */
SIMD_INLINE float f32x16_hsum(f32x16 v) { return _mm512_reduce_add_ps(v); }

/* 16 float16 (bits) / bfloat16 (bits) at p, widened (exactly) to float32 */
SIMD_INLINE f32x16 f32x16_load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
SIMD_INLINE f32x16 f32x16_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* 16 fp8 bytes at p as float32 (exact), as simd_avx2.h's f32x8_load_e5m2 / _e4m3 (E4M3: value times 2^-8) */
SIMD_INLINE f32x16 f32x16_load_e5m2(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), z = _mm_setzero_si128();
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_unpackhi_epi8(z, b), _mm_unpacklo_epi8(z, b)));
}
SIMD_INLINE f32x16 f32x16_load_e4m3(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), z = _mm_setzero_si128();
    const __m256i hi = _mm256_set_m128i(_mm_unpackhi_epi8(z, b), _mm_unpacklo_epi8(z, b));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(hi, 1), _mm256_set1_epi16((short)0xBFFF)));
}
/* 16 int8 at p, widened (exactly) to float32 */
SIMD_INLINE f32x16 f32x16_load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* 16 int4 values at p (8 bytes, packed as f32x8_load_u4's), as the floats q: lanes 0-7 take the low 32 bits,
   lanes 8-15 the high ones, each shifted right by 4 * (lane % 8) */
SIMD_INLINE f32x16 f32x16_load_u4(const uint8_t *p) {
    long long w;
    memcpy(&w, p, sizeof w);
    const __m512i words = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                   _mm512_set1_epi64(w));
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i n = _mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(15));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(n, _mm512_set1_epi32(8)));
}

#if defined(__AVX512DQ__) && SIMD_F32X8
/* lanes i and i + 8 added: 8 floats, for the 8-lane reductions (f32x8_hsum4) */
SIMD_INLINE f32x8 f32x16_fold8(f32x16 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
#endif

#if SIMD_F32X8
/* the 16 bytes as floats: unsigned, or 16 int8 loaded from p */
SIMD_INLINE f32x16 f32x16_from_u8(u8x16 v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
#endif
SIMD_INLINE f32x16 f32x16_load_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 0, 1, ..., 15 */
SIMD_INLINE f32x16 f32x16_iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
/* 16 bytes at p, each two 4-bit indices into table: w[0] lane i = table[p[i] & 15], w[1] = table[p[i] >> 4]
   (vpermps reads an index's low 4 bits) */
SIMD_INLINE void f32x16_lookup_u4(const uint8_t *p, f32x16 table, f32x16 *w) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); /* lane i: byte i */
    w[0] = _mm512_permutexvar_ps(bytes, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

#if defined(__AVX512BF16__)
/* ---- 32 bfloat16s ---- */

typedef __m512bh bf16x32;
SIMD_INLINE bf16x32 bf16x32_load(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
/* a pair of bf16 values (bits: low, high) in every 32-bit lane */
SIMD_INLINE bf16x32 bf16x32_set1_pair(uint32_t pair) { return (__m512bh)_mm512_set1_epi32((int)pair); }
/* acc + the products of the pairs, lane by lane (vdpbf16ps) */
SIMD_INLINE f32x16 f32x16_dot_bf16(f32x16 acc, bf16x32 a, bf16x32 b) { return _mm512_dpbf16_ps(acc, a, b); }
/* 32 floats (lo: the first 16) rounded to bf16 (nearest even) and stored at out */
SIMD_INLINE void bf16x32_store_f32(uint16_t *out, f32x16 lo, f32x16 hi) {
    /* the instruction puts its second operand in the low half */
    const __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
    _mm512_storeu_si512((void *)out, (__m512i)v);
}
#endif

#if SIMD_Q_LANES == 16
/* ---- the x16 GGUF kernels' lanes (simd.h, vq_*): 16 channels, a whole tile ---- */

typedef __m512i vq_int;
typedef __m512 vq_float;
/* 64 weight bytes: 4 for each lane */
SIMD_INLINE vq_int vq_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
SIMD_INLINE vq_int vq_zero() { return _mm512_setzero_si512(); }
/* 4 int8 inputs, in every lane */
SIMD_INLINE vq_int vq_quad(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
/* each byte's low / high nibble */
SIMD_INLINE vq_int vq_nib_lo(vq_int v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
SIMD_INLINE vq_int vq_nib_hi(vq_int v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
#if defined(__AVX512VNNI__)
/* the weights' offset the Q8 dot product needs: vpdpbusd takes the weights as uint8, q + 128 */
#define SIMD_Q8_OFFSET 128
/* acc + the 4-byte dot products of unsigned weights w and int8 x */
SIMD_INLINE vq_int vq_dot_u4(vq_int acc, vq_int w, vq_int x) { return _mm512_dpbusd_epi32(acc, w, x); }
/* the same with int8 weights stored sign-flipped (q ^ 0x80, read as q + 128: SIMD_Q8_OFFSET) */
SIMD_INLINE vq_int vq_dot_q8(vq_int acc, vq_int w, vq_int x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
#define SIMD_Q8_OFFSET 0
/* acc + the 4-byte dot products of unsigned weights w (0..127: vpmaddubsw's pairs do not saturate) and int8 x */
SIMD_INLINE vq_int vq_dot_u4(vq_int acc, vq_int w, vq_int x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
/* the same with int8 weights stored sign-flipped (q ^ 0x80): |q| times x with q's sign (vpmaddubsw takes its
   first operand unsigned) */
SIMD_INLINE vq_int vq_dot_q8(vq_int acc, vq_int w, vq_int x) {
    const __m512i q = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    const __mmask64 neg = _mm512_movepi8_mask(q);
    const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    return _mm512_add_epi32(acc,
                            _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(q), xs), _mm512_set1_epi16(1)));
}
#endif
/* a table of 16 bytes (the non-linear 4-bit types' values, sign flipped as Q8 weights are stored), in every
   128-bit quarter for vpshufb */
typedef __m512i vq_tab;
SIMD_INLINE vq_tab vq_table(const int8_t *t16) {
    const __m128i t = _mm_xor_si128(_mm_loadu_si128((const __m128i *)t16), _mm_set1_epi8((char)0x80));
    return _mm512_broadcast_i32x4(t);
}
/* each byte (0..15) replaced by its entry of the table (vpshufb) */
SIMD_INLINE vq_int vq_lookup(vq_tab t, vq_int idx) { return _mm512_shuffle_epi8(t, idx); }
/* the lanes' E8M0 scales (a byte each at p) halved, 2^(e - 128), as floats: the exponent field e - 1, or
   below e = 2 the subnormals 2^-128, 2^-127 */
SIMD_INLINE vq_float vq_fe8m0(const uint8_t *p) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, tiny));
}
/* byte ops for the k-quants' upper bits (16-bit shifts: the masks drop what crosses a byte) */
SIMD_INLINE vq_int vq_bits(vq_int v, int s, int mask) {
    return _mm512_and_si512(_mm512_srli_epi16(v, s), _mm512_set1_epi8((char)mask));
}
SIMD_INLINE vq_int vq_shl4(vq_int v) { return _mm512_slli_epi16(v, 4); }
SIMD_INLINE vq_int vq_shl2(vq_int v) { return _mm512_slli_epi16(v, 2); }
SIMD_INLINE vq_int vq_or(vq_int a, vq_int b) { return _mm512_or_si512(a, b); }
/* 32-bit lane ops: one lane per channel */
SIMD_INLINE vq_int vq_sub1(vq_int a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
SIMD_INLINE vq_int vq_lanes_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
SIMD_INLINE vq_int vq_lanes_s8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
SIMD_INLINE vq_int vq_mul(vq_int a, vq_int b) { return _mm512_mullo_epi32(a, b); }
SIMD_INLINE vq_int vq_add(vq_int a, vq_int b) { return _mm512_add_epi32(a, b); }
/* acc + the products of a's and b's signed 16-bit halves, low with low, high with high, per 32-bit lane */
#if defined(__AVX512VNNI__)
SIMD_INLINE vq_int vq_madd_pairs(vq_int acc, vq_int a, vq_int b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
SIMD_INLINE vq_int vq_madd_pairs(vq_int acc, vq_int a, vq_int b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
SIMD_INLINE vq_int vq_set1(int32_t v) { return _mm512_set1_epi32(v); }
SIMD_INLINE vq_int vq_and1(vq_int a, int32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
SIMD_INLINE vq_int vq_srl(vq_int a, int s) { return _mm512_srli_epi32(a, s); }
SIMD_INLINE vq_int vq_sll(vq_int a, int s) { return _mm512_slli_epi32(a, s); }
/* the float side, a lane per channel */
SIMD_INLINE vq_float vq_fzero() { return _mm512_setzero_ps(); }
SIMD_INLINE vq_float vq_fset1(float v) { return _mm512_set1_ps(v); }
/* the lanes' float16 scales (bits at p), widened */
SIMD_INLINE vq_float vq_fhalves(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
SIMD_INLINE vq_float vq_fmul(vq_float a, vq_float b) { return _mm512_mul_ps(a, b); }
SIMD_INLINE vq_float vq_ffma(vq_float a, vq_float b, vq_float c) { return _mm512_fmadd_ps(a, b, c); }
SIMD_INLINE vq_float vq_fcvt(vq_int a) { return _mm512_cvtepi32_ps(a); }
SIMD_INLINE void vq_fstore(float *p, vq_float v) { _mm512_storeu_ps(p, v); }
SIMD_INLINE vq_float vq_fload(const float *p) { return _mm512_loadu_ps(p); }
SIMD_INLINE vq_float vq_fadd(vq_float a, vq_float b) { return _mm512_add_ps(a, b); }
#endif

#endif
