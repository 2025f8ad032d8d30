/*
 * Causal attention for prompts computed from scratch (nothing of them in the
 * cache yet), reading q, k and v straight from the step's qkv rows (CPU,
 * float32).
 *
 * Sequence s owns rows bounds[2s] .. bounds[2s+1]-1; query i of a sequence
 * attends to keys 0..i of the same sequence. Each (sequence, query head) is
 * one task; a task walks its queries, computes the scores with the decode
 * kernel's four-keys-per-reduction dot product and softmax (paged_attention.h),
 * and the weighted sum of values in registers. This replaces one torch
 * SDPA call per prompt and layer (plus the K/V head repeat it needs on the
 * CPU), whose fixed cost dominates for prompts of a few hundred tokens.
 *
 * Layouts: row r of q/k/v/out starts at ptr + r * *_stride; within a row,
 * heads are contiguous runs of head_dim floats (q, out: num_heads heads;
 * k, v: num_kv_heads).
 */
#include <stdlib.h>

#include "paged_attention.h"

/* one (sequence, query head): queries [0, len) against keys [0, i] each */
static void prefill_head(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                         int64_t v_stride, float *out, int64_t out_stride, int64_t len, int head_dim, float scale,
                         float *scores) {
    for (int64_t i = 0; i < len; i++) {
        const float *qi = q + i * q_stride;
        const int64_t n = i + 1;
        int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m128 vscale = _mm_set1_ps(scale);
        /* the four-key product works on whole vectors: head sizes that are multiples of 8 */
        for (; head_dim % 8 == 0 && t + 4 <= n; t += 4) {
            const float *k0 = k + t * k_stride;
            _mm_storeu_ps(scores + t, _mm_mul_ps(dot4_keys_f32(qi, k0, k0 + k_stride, k0 + 2 * k_stride,
                                                           k0 + 3 * k_stride, head_dim), vscale));
        }
#endif
        for (; t < n; t++) scores[t] = scale * dot(qi, k + t * k_stride, head_dim);
        softmax_row(scores, n);
        float *oi = out + i * out_stride;
        memset(oi, 0, sizeof(float) * (size_t)head_dim);
        int d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; d0 + 64 <= head_dim; d0 += 64) {
            __m256 acc[8];
            for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
            for (t = 0; t < n; t++) {
                const __m256 p = _mm256_set1_ps(scores[t]);
                const float *vt = v + t * v_stride + d0;
                for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vt + 8 * c), acc[c]);
            }
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(oi + d0 + 8 * c, acc[c]);
        }
#endif
        for (t = 0; t < n && d0 < head_dim; t++) axpy(oi + d0, scores[t], v + t * v_stride + d0, head_dim - d0);
    }
}

/* Returns 0 on success, 1 when scratch memory could not be allocated. */
int prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                          int64_t v_stride, float *out, int64_t out_stride, const int64_t *bounds, int num_seqs,
                          int num_heads, int num_kv_heads, int head_dim, float scale, int num_threads) {
    int64_t max_len = 1;
    for (int s = 0; s < num_seqs; s++)
        if (bounds[2 * s + 1] - bounds[2 * s] > max_len) max_len = bounds[2 * s + 1] - bounds[2 * s];
    const int group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)max_len);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < (int64_t)num_seqs * num_heads; task++) {
            if (scores == NULL) continue;
            const int s = (int)(task / num_heads), h = (int)(task % num_heads), kvh = h / group;
            const int64_t r0 = bounds[2 * s];
            prefill_head(q + r0 * q_stride + (int64_t)h * head_dim, q_stride, k + r0 * k_stride + (int64_t)kvh * head_dim,
                         k_stride, v + r0 * v_stride + (int64_t)kvh * head_dim, v_stride,
                         out + r0 * out_stride + (int64_t)h * head_dim, out_stride, bounds[2 * s + 1] - r0, head_dim,
                         scale, scores);
        }
        free(scores);
    }
    return failed;
}
