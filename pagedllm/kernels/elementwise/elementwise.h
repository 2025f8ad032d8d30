/*
 * The Llama family's elementwise pieces, one row at a time: RMSNorm, RoPE
 * (rotate-half, sign folded into the sin table) and SiLU-and-multiply.
 * Used by elementwise.cpp's team functions (step_nodes.h).
 */
#ifndef PAGEDLLM_ELEMENTWISE_H
#define PAGEDLLM_ELEMENTWISE_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../simd/simd.h"

/* y = w * (x / sqrt(mean(x^2) + eps)) for one row of n; y may be x */
static inline void rms_norm_row(const float *x, const float *w, float *y, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * inv);
}

/* v = v * cos + roll(v, half) * sin for one head, in place (tmp: head_dim floats) */
static inline void rope_head(float *v, const float *cos, const float *sin, int64_t head_dim, float *tmp) {
    const int64_t half = head_dim / 2;
    memcpy(tmp, v, sizeof(float) * (size_t)head_dim);
    for (int64_t i = 0; i < half; i++) v[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
    for (int64_t i = half; i < head_dim; i++) v[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

/* The q and k heads of one qkv row (num_q_heads q heads, then num_kv_heads k
   heads, side by side): each first RMS-normed with q_norm / k_norm when given
   (Qwen3), then rotated, in place. tmp: head_dim floats. */
static inline void qk_norm_rope_row(float *row, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                    const float *q_norm, const float *k_norm, float eps, const float *cos,
                                    const float *sin, float *tmp) {
    for (int64_t j = 0; j < num_q_heads + num_kv_heads; j++) {
        float *head = row + j * head_dim;
        const float *norm = j < num_q_heads ? q_norm : k_norm;
        if (norm != NULL) rms_norm_row(head, norm, head, head_dim, eps);
        rope_head(head, cos, sin, head_dim, tmp);
    }
}

/* out[c] = silu(gate[c]) * up[c] = gate[c] / (1 + exp(-gate[c])) * up[c] */
static inline void silu_mul_row(const float *gate, const float *up, float *out, int64_t n) {
    int64_t c = 0;
#if SIMD_F32X8
    const f32x8 one = f32x8_set1(1.0f);
    for (; c + 8 <= n; c += 8) {
        const f32x8 g = f32x8_load(gate + c);
        const f32x8 e = f32x8_exp(f32x8_sub(f32x8_zero(), g));
        f32x8_store(out + c, f32x8_mul(f32x8_div(g, f32x8_add(one, e)), f32x8_load(up + c)));
    }
#endif
    for (; c < n; c++) out[c] = gate[c] / (1.0f + expf(-gate[c])) * up[c];
}
#endif
