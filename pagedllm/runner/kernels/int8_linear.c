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
        out[0] += x0[i] * wi;
        out[1] += x1[i] * wi;
        out[2] += x2[i] * wi;
        out[3] += x3[i] * wi;
    }
}
#endif

/* Rows are taken in chunks of ROW_CHUNK and output channels in tiles of
   TILE_N. Within a chunk, a tile's int8 rows (TILE_N * in_features bytes)
   stay in L1/L2 while each group of four activation rows passes over them,
   and the chunk's activations (ROW_CHUNK * in_features floats) stay in L2:

       for each chunk of 64 rows:            (weights re-read once per chunk)
         parallel for each tile of 32 output channels:
           for each group of 4 rows:  4 x 32 dot products of length in_features
*/
#define TILE_N 32
#define ROW_CHUNK 64

void int8_linear_f32(const float *x, int64_t num_rows, int64_t in_features, const int8_t *w,
                     const float *scales, const float *bias, int64_t out_features, float *out,
                     int num_threads) {
    const int64_t num_tiles = (out_features + TILE_N - 1) / TILE_N;
    for (int64_t m0 = 0; m0 < num_rows; m0 += ROW_CHUNK) {
        const int64_t m1 = m0 + ROW_CHUNK < num_rows ? m0 + ROW_CHUNK : num_rows;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t tile = 0; tile < num_tiles; tile++) {
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
                    out[m * out_features + n] =
                        scales[n] * dot_i8(x + m * in_features, w + n * in_features, in_features) + b;
                }
            }
        }
    }
}
