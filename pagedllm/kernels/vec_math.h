/*
 * Small vector helpers shared by the kernels (AVX2 + FMA builds only).
 */
#ifndef PAGEDLLM_VEC_MATH_H
#define PAGEDLLM_VEC_MATH_H
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp of 8 floats: exp(x) = 2^n * exp(r) with n = round(x / ln 2) and
   |r| <= ln(2) / 2, exp(r) by its degree-6 Taylor polynomial (relative error
   at most 2.3e-7 over [-87, 0], about 2 ulp). ln 2 is split in a part
   exact in float and a small rest so that r keeps its precision. Inputs
   below -87 (scores far under the row's max) give 0. */
static inline __m256 exp256(__m256 x) {
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

/* The sums of the 8 lanes of each of a, b, c, d, as 4 floats */
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd); /* [a0 b0 c0 d0 | a1 b1 c1 d1] partial sums */
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif
#endif
