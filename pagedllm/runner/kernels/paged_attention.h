/*
 * Decode attention of one sequence's query heads over its paged K/V,
 * reading the blocks in place. Shared by paged_decode.c (attention only)
 * and decode_step.c (a whole decoder step).
 *
 * Layouts (all contiguous, float32):
 *   q, out       [num_heads, head_dim]         (one sequence)
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   table        [>= ceil(len / block_size)]   int64 block ids
 */
#ifndef PAGEDLLM_PAGED_ATTENTION_H
#define PAGEDLLM_PAGED_ATTENTION_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* Blocks are scattered, so the hardware prefetcher loses the stream at
   every block boundary; ask for the next block (n_floats from p) while the
   current one is being used. */
static inline void prefetch_block(const float *p, int64_t n_floats) {
    for (int64_t i = 0; i < n_floats; i += 16) __builtin_prefetch(p + i, 0, 3);
}

/* Attention of sequence b's query heads for kv heads [h0, h1). Scores go to
   `scores` (room for (h1 - h0) * group * len floats). Token rows are read
   whole (all the task's kv heads at once), so a block is one contiguous
   sweep of memory, which is what the hardware prefetcher follows best. */
static inline __attribute__((always_inline)) void attend_one(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                       int64_t len, float *out, int num_heads, int num_kv_heads, int head_dim, int block_size,
                       float scale, int h0, int h1, float *scores) {
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim; /* floats per cache slot */
    const int nq = (h1 - h0) * group;                     /* query heads in this task */
    const float *qh = q + (int64_t)h0 * group * head_dim;

    /* scores[j][t] = scale * q_j . k_t for the task's query heads j */
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t block = table[t0 / block_size];
        const int64_t n = (len - t0 < block_size) ? len - t0 : block_size;
        const float *kb = k_cache + block * block_size * row;
        if (t0 + block_size < len) prefetch_block(k_cache + table[t0 / block_size + 1] * block_size * row, block_size * row);
        for (int64_t i = 0; i < n; i++) {
            const float *krow = kb + i * row;
            for (int j = 0; j < nq; j++) {
                const int kvh = h0 + j / group;
                scores[(int64_t)j * len + t0 + i] = scale * dot(qh + (int64_t)j * head_dim, krow + (int64_t)kvh * head_dim, head_dim);
            }
        }
    }
    /* softmax per query head */
    for (int j = 0; j < nq; j++) {
        float *sj = scores + (int64_t)j * len;
        float m = -INFINITY;
        for (int64_t t = 0; t < len; t++) m = sj[t] > m ? sj[t] : m;
        float sum = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            sj[t] = expf(sj[t] - m);
            sum += sj[t];
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) sj[t] *= inv;
    }
    /* out_j = sum_t p_j[t] * v_t */
    float *o = out + (int64_t)h0 * group * head_dim;
    memset(o, 0, sizeof(float) * (size_t)nq * (size_t)head_dim);
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t block = table[t0 / block_size];
        const int64_t n = (len - t0 < block_size) ? len - t0 : block_size;
        const float *vb = v_cache + block * block_size * row;
        if (t0 + block_size < len) prefetch_block(v_cache + table[t0 / block_size + 1] * block_size * row, block_size * row);
        for (int64_t i = 0; i < n; i++) {
            const float *vrow = vb + i * row;
            for (int j = 0; j < nq; j++) {
                const int kvh = h0 + j / group;
                axpy(o + (int64_t)j * head_dim, scores[(int64_t)j * len + t0 + i], vrow + (int64_t)kvh * head_dim, head_dim);
            }
        }
    }
}

/* attend_one with the common head sizes given loops of known length, which
   gcc unrolls fully. */
static inline void attend(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                          int64_t len, float *out, int num_heads, int num_kv_heads, int head_dim, int block_size,
                          float scale, int h0, int h1, float *scores) {
    if (head_dim == 64)
        attend_one(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, 64, block_size, scale, h0, h1,
                   scores);
    else if (head_dim == 128)
        attend_one(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, 128, block_size, scale, h0, h1,
                   scores);
    else
        attend_one(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, head_dim, block_size, scale, h0,
                   h1, scores);
}
#endif
