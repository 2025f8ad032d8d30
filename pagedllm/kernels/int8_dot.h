/*
 * int8 x float32 dot products and one output tile of a weight-only int8
 * linear layer, for int8_linear.cpp's team function (step_nodes.h).
 *
 *   out[m, n] = scales[n] * sum_k x[m, k] * w[n, k]  (+ bias[n])
 */
#ifndef PAGEDLLM_INT8_DOT_H
#define PAGEDLLM_INT8_DOT_H
#include <math.h>
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h> /* before the pragma below: the intrinsics keep the default options */
#endif
/* The vector loops are written out with intrinsics; the scalar tails use
   fmaf in source order so that both dot-product paths agree bit for bit
   (the library is built with -fassociative-math for the attention kernel,
   which would otherwise let gcc regroup the tails differently). The pragma is
   gcc's: built with CC=clang the bit-for-bit agreement is not guaranteed. */
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

/* One activation row against one weight row. On AVX2 it adds in exactly the
   order dot4_i8 (below) uses for each of its rows: two 8-lane accumulators
   over 16-wide steps, then the scalar tail. So a row's result does not
   depend on whether it was computed alone or in a group of four, and a
   sequence's tokens do not depend on how many others decode beside it (up
   to SMALL_BATCH_ROWS; larger calls use the dequantized GEMM). */
static inline float dot_i8(const float *x, const int8_t *w, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + i))));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + i + 8))));
        a = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), w0, a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), w1, b);
    }
    __m256 acc = _mm256_add_ps(a, b);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    s = _mm_cvtss_f32(h);
#endif
    for (; i < n; i++) s = fmaf(x[i], (float)w[i], s);
    return s;
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}

/* Four activation rows against one weight row: each group of 8 weights is
   widened to float once and used four times, which halves the work per
   multiply-add compared with four separate dot products. */
static inline void dot4_i8(const float *x, int64_t ldx, const int8_t *w, int64_t n, float out[4]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + i))));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + i + 8))));
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i), w0, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i), w0, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + i), w0, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + i), w0, a3);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i + 8), w1, b0);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i + 8), w1, b1);
        b2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + i + 8), w1, b2);
        b3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + i + 8), w1, b3);
    }
    out[0] = hsum256(_mm256_add_ps(a0, b0));
    out[1] = hsum256(_mm256_add_ps(a1, b1));
    out[2] = hsum256(_mm256_add_ps(a2, b2));
    out[3] = hsum256(_mm256_add_ps(a3, b3));
    for (; i < n; i++) {
        const float wi = (float)w[i];
        out[0] = fmaf(x0[i], wi, out[0]);
        out[1] = fmaf(x1[i], wi, out[1]);
        out[2] = fmaf(x2[i], wi, out[2]);
        out[3] = fmaf(x3[i], wi, out[3]);
    }
}
#endif

/* Output channels are taken in tiles of TILE_N. A tile's int8 rows
   (TILE_N * in_features bytes) stay in L1/L2 while each group of four
   activation rows passes over them. Callers split the tiles over threads. */
#define TILE_N 32

static inline int64_t int8_num_tiles(int64_t out_features) { return (out_features + TILE_N - 1) / TILE_N; }

/* Rows [m0, m1) of `out` for the output channels of one tile. */
static inline void int8_linear_tile(const float *x, int64_t m0, int64_t m1, int64_t in_features, const int8_t *w,
                                    const float *scales, const float *bias, int64_t out_features, float *out,
                                    int64_t tile) {
    const int64_t n0 = tile * TILE_N;
    const int64_t n1 = n0 + TILE_N < out_features ? n0 + TILE_N : out_features;
    int64_t m = m0;
#if defined(__AVX2__) && defined(__FMA__)
    float acc[4];
    for (; m + 4 <= m1; m += 4) {
        for (int64_t n = n0; n < n1; n++) {
            dot4_i8(x + m * in_features, in_features, w + n * in_features, in_features, acc);
            const float b = bias ? bias[n] : 0.0f;
            for (int r = 0; r < 4; r++) out[(m + r) * out_features + n] = scales[n] * acc[r] + b;
        }
    }
#endif
    for (; m < m1; m++) {
        for (int64_t n = n0; n < n1; n++) {
            const float b = bias ? bias[n] : 0.0f;
            out[m * out_features + n] = scales[n] * dot_i8(x + m * in_features, w + n * in_features, in_features) + b;
        }
    }
}

#pragma GCC pop_options
#endif
