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

static inline float dot_i8(const float *x, const int8_t *w, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += x[i] * (float)w[i];
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
