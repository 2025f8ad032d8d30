/*
 * Weight-only int8 linear layer for a few rows of float32 activations (CPU).
 *
 *   out[m, n] = scales[n] * sum_k x[m, k] * w[n, k]  (+ bias[n])
 *
 * Decode with few sequences is bound by memory bandwidth: every weight is
 * read once per step and used for only a few rows. Reading one byte per
 * weight instead of four is the whole point; the int8 -> float conversion
 * happens in registers (gcc vectorises the loop with -O3 -march=native).
 * Each weight row is loaded once and applied to every activation row while
 * it is still in L1.
 *
 * Layouts (contiguous): x [num_rows, in_features] float32,
 * w [out_features, in_features] int8, scales and bias [out_features] float32,
 * out [num_rows, out_features] float32. bias may be NULL.
 */
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline float dot_i8(const float *x, const int8_t *w, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    /* four independent accumulators: one FMA chain would wait on its own
       latency instead of on memory */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
#define LOAD_W8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), LOAD_W8(w + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), LOAD_W8(w + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), LOAD_W8(w + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), LOAD_W8(w + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), LOAD_W8(w + i), acc0);
#undef LOAD_W8
    __m256 acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_shuffle_ps(half, half, 1));
    s = _mm_cvtss_f32(half);
#endif
    for (; i < n; i++) s += x[i] * (float)w[i];
    return s;
}

void int8_linear_f32(const float *x, int64_t num_rows, int64_t in_features, const int8_t *w,
                     const float *scales, const float *bias, int64_t out_features, float *out,
                     int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < out_features; n++) {
        const int8_t *wn = w + n * in_features;
        const float b = bias ? bias[n] : 0.0f;
        for (int64_t m = 0; m < num_rows; m++)
            out[m * out_features + n] = scales[n] * dot_i8(x + m * in_features, wn, in_features) + b;
    }
}
