/*
 * Decode attention that reads the paged KV cache in place (float32, CPU).
 *
 * One query token per sequence. For each (sequence, kv head) pair, the
 * kernel walks the sequence's block table and reads each key/value row
 * straight from its slot in the cache: no contiguous copy of the context
 * is ever made. The query heads that share the kv head (GQA group) are
 * handled together, so each key and value row is loaded once per group.
 *
 *   block_tables[b] = [7, 2, ...]   block_size 4   seq_len 6
 *   keys of sequence b:  cache[7][0..3], cache[2][0..1]
 *
 * Layouts (all contiguous, float32 unless noted):
 *   q, out       [num_seqs, num_heads, head_dim]
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables [num_seqs, table_stride] int64
 *   seq_lens     [num_seqs] int64
 *
 * Softmax is computed exactly (scores, max, exp, sum, then the weighted sum
 * of values), in float32, as torch's reference does. Parallel over the
 * (sequence, kv head) pairs with OpenMP; the library links the same
 * libgomp as torch, so both share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* Returns 0 on success, 1 when scratch memory could not be allocated. */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                     float *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                     int block_size, int num_threads, float scale) {
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim; /* floats per cache slot */
    int64_t max_len = 0;
    for (int b = 0; b < num_seqs; b++)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    int failed = 0;

#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int b = 0; b < num_seqs; b++) {
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
            const int64_t len = seq_lens[b];
            float *scores = (float *)malloc(sizeof(float) * (size_t)group * (size_t)(max_len > 0 ? max_len : 1));
            if (scores == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t *table = block_tables + b * table_stride;
            const float *qh = q + ((int64_t)b * num_heads + (int64_t)kvh * group) * head_dim;

            /* scores[g][t] = scale * q_g . k_t, walking blocks in table order */
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                const int64_t block = table[t0 / block_size];
                const int64_t n = (len - t0 < block_size) ? len - t0 : block_size;
                const float *k = k_cache + block * block_size * row + (int64_t)kvh * head_dim;
                for (int64_t i = 0; i < n; i++)
                    for (int g = 0; g < group; g++)
                        scores[g * len + t0 + i] = scale * dot(qh + (int64_t)g * head_dim, k + i * row, head_dim);
            }

            /* softmax per query head, then the weighted sum of value rows */
            for (int g = 0; g < group; g++) {
                float *s = scores + g * len;
                float m = -INFINITY;
                for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
                float sum = 0.0f;
                for (int64_t t = 0; t < len; t++) {
                    s[t] = expf(s[t] - m);
                    sum += s[t];
                }
                const float inv = 1.0f / sum;
                for (int64_t t = 0; t < len; t++) s[t] *= inv;
            }
            float *o = out + ((int64_t)b * num_heads + (int64_t)kvh * group) * head_dim;
            memset(o, 0, sizeof(float) * (size_t)group * (size_t)head_dim);
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                const int64_t block = table[t0 / block_size];
                const int64_t n = (len - t0 < block_size) ? len - t0 : block_size;
                const float *v = v_cache + block * block_size * row + (int64_t)kvh * head_dim;
                for (int64_t i = 0; i < n; i++)
                    for (int g = 0; g < group; g++)
                        axpy(o + (int64_t)g * head_dim, scores[g * len + t0 + i], v + i * row, head_dim);
            }
            free(scores);
        }
    }
    return failed;
}
