/*
 * The Mamba-2 scan's row operations on the vector layer (simd.h): one state
 * row of state_size floats at a time, in the widest float vector of the
 * build, with a plain C tail (and a plain C body where the build has no
 * vector: the scalar variant).
 */
#ifndef PAGEDLLM_SSD_ROWS_H
#define PAGEDLLM_SSD_ROWS_H
#include <math.h>
#include <stdint.h>

#include "../simd/simd.h"

/* y = s * y + a * x */
static inline void ssd_scale_axpy(float *y, float s, float a, const float *x, int64_t n) {
    int64_t i = 0;
#if SIMD_F32_WIDTH
    const vf32 vs = vf32_set1(s), va = vf32_set1(a);
    for (; i + SIMD_F32_WIDTH <= n; i += SIMD_F32_WIDTH)
        vf32_store(y + i, vf32_fma(va, vf32_load(x + i), vf32_mul(vs, vf32_load(y + i))));
#endif
    for (; i < n; i++) y[i] = s * y[i] + a * x[i];
}

/* One token's step of one state row: row = decay * row + coef * b, then the
   row's dot product with c (the output's contribution), in one pass. */
static inline float ssd_step_row(float *row, float decay, float coef, const float *b, const float *c, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if SIMD_F32_WIDTH
    const vf32 vd = vf32_set1(decay), vc = vf32_set1(coef);
    vf32 acc = vf32_zero();
    for (; i + SIMD_F32_WIDTH <= n; i += SIMD_F32_WIDTH) {
        const vf32 r = vf32_fma(vc, vf32_load(b + i), vf32_mul(vd, vf32_load(row + i)));
        vf32_store(row + i, r);
        acc = vf32_fma(r, vf32_load(c + i), acc);
    }
    sum = vf32_hsum(acc);
#endif
    for (; i < n; i++) {
        row[i] = decay * row[i] + coef * b[i];
        sum += row[i] * c[i];
    }
    return sum;
}

/* the time step: softplus(raw + bias) (torch's, linear above 20), clamped to [lo, hi] */
static inline float ssd_time_step(float raw, float bias, float lo, float hi) {
    const float v = raw + bias;
    const float sp = v > 20.0f ? v : log1pf(expf(v));
    return sp < lo ? lo : (sp > hi ? hi : sp);
}
#endif
