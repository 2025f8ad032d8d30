/*
 * Decode attention that reads the paged KV cache in place (float32, CPU).
 *
 * One query token per sequence. For each (sequence, kv head) pair, the
 * kernel walks the sequence's block table and reads each key/value row
 * straight from its slot in the cache: no contiguous copy of the context
 * is ever made. All query heads of a task are handled together, so each
 * key and value row is loaded once and a block is read front to back.
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
 * of values), in float32, as torch's reference does. Parallel with OpenMP
 * (the library links the same libgomp as torch, so both share one thread
 * pool).
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

/* Returns 0 on success, 1 when scratch memory could not be allocated.
   Work is split by sequence; with fewer sequences than threads, by
   (sequence, kv head) so that one long sequence still uses every core. */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                     float *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                     int block_size, int num_threads, float scale) {
    int64_t max_len = 1;
    for (int b = 0; b < num_seqs; b++)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    const int split_heads = num_seqs < 2 * num_threads;
    const int parts = split_heads ? num_kv_heads : 1; /* tasks per sequence */
    const int heads_per_part = num_kv_heads / parts;
    const int group = num_heads / num_kv_heads;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)heads_per_part * group * (size_t)max_len);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < (int64_t)num_seqs * parts; task++) {
            if (scores == NULL) continue;
            const int b = (int)(task / parts), part = (int)(task % parts);
            const float *qb = q + (int64_t)b * num_heads * head_dim;
            float *ob = out + (int64_t)b * num_heads * head_dim;
            const int64_t *table = block_tables + b * table_stride;
            const int h0 = part * heads_per_part, h1 = (part + 1) * heads_per_part;
            /* the common head sizes get loops of known length, fully unrolled */
            if (head_dim == 64)
                attend_one(qb, k_cache, v_cache, table, seq_lens[b], ob, num_heads, num_kv_heads, 64, block_size,
                           scale, h0, h1, scores);
            else if (head_dim == 128)
                attend_one(qb, k_cache, v_cache, table, seq_lens[b], ob, num_heads, num_kv_heads, 128, block_size,
                           scale, h0, h1, scores);
            else
                attend_one(qb, k_cache, v_cache, table, seq_lens[b], ob, num_heads, num_kv_heads, head_dim,
                           block_size, scale, h0, h1, scores);
        }
        free(scores);
    }
    return failed;
}
