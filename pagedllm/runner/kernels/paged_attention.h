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
#include "vec_math.h"

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

/* softmax of s[0, n) in place (the vector exp on AVX2) */
static inline void softmax_row(float *s, int64_t n) {
    float m = -INFINITY;
    for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
        _mm256_storeu_ps(s + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = _mm_cvtss_f32(hsum4x8(vsum, vsum, vsum, vsum));
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    const float inv = 1.0f / sum;
    for (t = 0; t < n; t++) s[t] *= inv;
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
    for (int j = 0; j < nq; j++) softmax_row(scores + (int64_t)j * len, len); /* per query head */
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

#if defined(__AVX2__) && defined(__FMA__)
/* attend_one with 8-wide vectors for head_dim a multiple of 8 (the same
   three passes). Scores: four keys at a time, each q . k kept as a vector
   of partial sums and the four reduced together, instead of one horizontal
   sum per dot product. Values: a 64-float slice of one head's output stays
   in registers while value rows are added into it. Where the compiler
   targets AVX-512 (-march=native on such a CPU), the inner loops use 16
   lanes.

   Blocks are taken four at a time and read side by side: the four keys of
   one reduction are token i of each of the four blocks, and values are
   added token i of each block in turn. A block is one short contiguous run
   somewhere in the cache; the memory system streams several runs at once
   only when they are read together. */
#define KV_STREAMS 4

/* The next group of up to KV_STREAMS blocks from token t0: each block's
   base in `cache` and its token count. Returns how many blocks. */
static inline int block_group(const float *cache, const int64_t *table, int64_t t0, int64_t len, int block_size,
                              int64_t row, const float **base, int64_t *n) {
    int nb = 0;
    for (; nb < KV_STREAMS && t0 + nb * block_size < len; nb++) {
        const int64_t tb = t0 + (int64_t)nb * block_size;
        base[nb] = cache + table[tb / block_size] * block_size * row;
        n[nb] = (len - tb < block_size) ? len - tb : block_size;
    }
    return nb;
}

/* q . k for four keys at once: the four dot products as 4 floats */
static inline __attribute__((always_inline)) __m128 dot4_keys(const float *qj, const float *k0, const float *k1,
                                                              const float *k2, const float *k3, int head_dim) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int d = 0;
#ifdef __AVX512F__
    /* 16 lanes where the CPU has them, folded to 8 before the reduction */
    __m512 w0 = _mm512_setzero_ps(), w1 = _mm512_setzero_ps(), w2 = _mm512_setzero_ps(), w3 = _mm512_setzero_ps();
    for (; d + 16 <= head_dim; d += 16) {
        const __m512 qv = _mm512_loadu_ps(qj + d);
        w0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + d), w0);
        w1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k1 + d), w1);
        w2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k2 + d), w2);
        w3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k3 + d), w3);
    }
    a0 = _mm256_add_ps(_mm512_castps512_ps256(w0), _mm512_extractf32x8_ps(w0, 1));
    a1 = _mm256_add_ps(_mm512_castps512_ps256(w1), _mm512_extractf32x8_ps(w1, 1));
    a2 = _mm256_add_ps(_mm512_castps512_ps256(w2), _mm512_extractf32x8_ps(w2, 1));
    a3 = _mm256_add_ps(_mm512_castps512_ps256(w3), _mm512_extractf32x8_ps(w3, 1));
#endif
    for (; d < head_dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qj + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
    }
    return hsum4x8(a0, a1, a2, a3);
}

static inline __attribute__((always_inline)) void attend_vec(const float *q, const float *k_cache, const float *v_cache,
                       const int64_t *table, int64_t len, float *out, int num_heads, int num_kv_heads, int head_dim,
                       int block_size, float scale, int h0, int h1, float *scores) {
    const int group = num_heads / num_kv_heads;
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    const int nq = (h1 - h0) * group;
    const float *qh = q + (int64_t)h0 * group * head_dim;
    const __m128 vscale = _mm_set1_ps(scale);
    const int64_t span = (int64_t)KV_STREAMS * block_size; /* tokens per group of blocks */

    /* scores[j][t] = scale * q_j . k_t */
    for (int64_t t0 = 0; t0 < len; t0 += span) {
        const float *kb[KV_STREAMS];
        int64_t n[KV_STREAMS];
        const int nb = block_group(k_cache, table, t0, len, block_size, row, kb, n);
        /* all four blocks are full except, at most, the sequence's last one */
        const int64_t full = nb == KV_STREAMS ? n[KV_STREAMS - 1] : 0; /* tokens every block has */
        for (int64_t i = 0; i < full; i++) {
            for (int j = 0; j < nq; j++) {
                const int64_t off = (int64_t)(h0 + j / group) * head_dim + i * row;
                float s4[4];
                _mm_storeu_ps(s4, _mm_mul_ps(dot4_keys(qh + (int64_t)j * head_dim, kb[0] + off, kb[1] + off,
                                                       kb[2] + off, kb[3] + off, head_dim), vscale));
                float *sj = scores + (int64_t)j * len + t0 + i;
                for (int g = 0; g < 4; g++) sj[(int64_t)g * block_size] = s4[g];
            }
        }
        /* the rest (the sequence's last group, the tokens past a partial last
           block): block by block, four tokens of one block per reduction */
        for (int g = 0; g < nb; g++) {
            for (int j = 0; j < nq; j++) {
                const float *qj = qh + (int64_t)j * head_dim;
                const float *kj = kb[g] + (int64_t)(h0 + j / group) * head_dim;
                float *sj = scores + (int64_t)j * len + t0 + (int64_t)g * block_size;
                int64_t i = full;
                for (; i + 4 <= n[g]; i += 4)
                    _mm_storeu_ps(sj + i, _mm_mul_ps(dot4_keys(qj, kj + i * row, kj + (i + 1) * row,
                                                               kj + (i + 2) * row, kj + (i + 3) * row, head_dim),
                                                     vscale));
                for (; i < n[g]; i++) sj[i] = scale * dot(qj, kj + i * row, head_dim);
            }
        }
    }
    for (int j = 0; j < nq; j++) softmax_row(scores + (int64_t)j * len, len); /* per query head */
    /* out_j = sum_t p_j[t] * v_t */
    float *o = out + (int64_t)h0 * group * head_dim;
    memset(o, 0, sizeof(float) * (size_t)nq * (size_t)head_dim);
    for (int64_t t0 = 0; t0 < len; t0 += span) {
        const float *vb[KV_STREAMS];
        int64_t n[KV_STREAMS];
        const int nb = block_group(v_cache, table, t0, len, block_size, row, vb, n);
        for (int j = 0; j < nq; j++) {
            const int64_t kv_off = (int64_t)(h0 + j / group) * head_dim;
            const float *pj = scores + (int64_t)j * len + t0;
            for (int d0 = 0; d0 < head_dim; d0 += 64) {
                float *oj = o + (int64_t)j * head_dim + d0;
                const int width = head_dim - d0 < 64 ? head_dim - d0 : 64;
                if (width == 64) {
#ifdef __AVX512F__
                    __m512 acc[4];
                    for (int c = 0; c < 4; c++) acc[c] = _mm512_loadu_ps(oj + 16 * c);
                    for (int64_t i = 0; i < block_size; i++)
                        for (int g = 0; g < nb; g++) {
                            if (i >= n[g]) continue;
                            const __m512 p = _mm512_set1_ps(pj[(int64_t)g * block_size + i]);
                            const float *v = vb[g] + i * row + kv_off + d0;
                            for (int c = 0; c < 4; c++) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * c), acc[c]);
                        }
                    for (int c = 0; c < 4; c++) _mm512_storeu_ps(oj + 16 * c, acc[c]);
#else
                    __m256 acc[8];
                    for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(oj + 8 * c);
                    for (int64_t i = 0; i < block_size; i++)
                        for (int g = 0; g < nb; g++) {
                            if (i >= n[g]) continue;
                            const __m256 p = _mm256_set1_ps(pj[(int64_t)g * block_size + i]);
                            const float *v = vb[g] + i * row + kv_off + d0;
                            for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
                        }
                    for (int c = 0; c < 8; c++) _mm256_storeu_ps(oj + 8 * c, acc[c]);
#endif
                } else {
                    for (int g = 0; g < nb; g++)
                        for (int64_t i = 0; i < n[g]; i++)
                            axpy(oj, pj[(int64_t)g * block_size + i], vb[g] + i * row + kv_off + d0, width);
                }
            }
        }
    }
}
#endif


/* The vector path on AVX2 for head sizes that are multiples of 8, attend_one
   otherwise; the common head sizes get loops of known length, which gcc
   unrolls fully. */
static inline void attend(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                          int64_t len, float *out, int num_heads, int num_kv_heads, int head_dim, int block_size,
                          float scale, int h0, int h1, float *scores) {
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim == 64)
        attend_vec(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, 64, block_size, scale, h0, h1,
                   scores);
    else if (head_dim == 128)
        attend_vec(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, 128, block_size, scale, h0, h1,
                   scores);
    else if (head_dim % 8 == 0)
        attend_vec(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, head_dim, block_size, scale, h0,
                   h1, scores);
    else
#else
    if (head_dim == 64)
        attend_one(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, 64, block_size, scale, h0, h1,
                   scores);
    else if (head_dim == 128)
        attend_one(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, 128, block_size, scale, h0, h1,
                   scores);
    else
#endif
        attend_one(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, head_dim, block_size, scale, h0,
                   h1, scores);
}
#endif
