/*
 * Paged decode attention, one template per kernel over the KV cache's
 * element type: a traits struct of kv_types.h (KvF32, KvF16, KvBF16, KvI8,
 * KvI4, KvE4M3, KvE5M2) says how a row's elements are read, where the next
 * head's row starts and what scale a row carries. paged_decode.cpp calls
 * attend<KV>, paged_prefill.cpp attend_rows<KV> (and attend<KV>), and each
 * translation unit holds its own instantiations.
 *
 * A key's score is scale * KV::scale * (q . raw k); a value's weight is
 * p * KV::scale: the scale is applied once per row, never per element, and
 * for the float types it is the constant 1 the compiler drops.
 * Queries, scores and outputs are float32 whatever the cache holds; only
 * the reads of K and V rows convert. Decode attention is bound by the bytes
 * it reads (every context token of every layer, once per step), so a 2-byte
 * cache halves its memory traffic; the conversion is one instruction per
 * vector.
 */
#ifndef PAGEDLLM_PAGED_ATTENTION_KV_H
#define PAGEDLLM_PAGED_ATTENTION_KV_H
#include "kv_types.h"

#if SIMD_F32X16
#define KV_ROW_TILE 4   /* query rows per register tile of attend_rows: 16 accumulators of 16 */
#define KV_OUT_CHUNK 64 /* output floats per values pass: 4 vectors of 16 */
#else
#define KV_ROW_TILE 2   /* 8 accumulators of 8 */
#define KV_OUT_CHUNK 32 /* 4 vectors of 8 */
#endif
#define KV_ROWS_MAX 1024 /* rows one attend_rows call takes */

/* the element type of a traits struct's cache */
template <class KV>
using kv_t = typename KV::T;

template <class KV>
static inline float dot_kv(const float *a, const kv_t<KV> *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * KV::elem1(b, i);
    return s;
}

template <class KV>
static inline void axpy_kv(float *y, float a, const kv_t<KV> *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * KV::elem1(x, i);
}

/* Attention of sequence b's query heads for kv heads [h0, h1). Scores go to
   `scores` (room for (h1 - h0) * group * len floats). The first `skip`
   tokens get no weight: a sliding window that starts inside the first block
   read (the caller starts `table` at the window's first block). Token rows are read
   whole (all the task's kv heads at once), so a block is one contiguous
   sweep of memory, which is what the hardware prefetcher follows best. */
template <class KV>
static inline __attribute__((always_inline)) void attend_one(
    const float *q, const kv_t<KV> *k_cache, const kv_t<KV> *v_cache, const int64_t *table, int64_t len, float *out,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int h0, int h1, float *scores,
    int64_t skip, const float *sinks) {
    const int group = num_heads / num_kv_heads;
    const int64_t hs = KV::head_stride(head_dim);         /* elements per head row */
    const int64_t row = (int64_t)num_kv_heads * hs;       /* elements per cache slot */
    const int nq = (h1 - h0) * group;                     /* query heads in this task */
    const float *qh = q + (int64_t)h0 * group * head_dim;
    const int64_t block_bytes = (int64_t)block_size * row * (int64_t)sizeof(kv_t<KV>);

    /* scores[j][t] = scale * q_j . k_t for the task's query heads j */
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t block = table[t0 / block_size];
        const int64_t n = (len - t0 < block_size) ? len - t0 : block_size;
        const kv_t<KV> *kb = k_cache + block * block_size * row;
        if (t0 + block_size < len) prefetch_block(k_cache + table[t0 / block_size + 1] * block_size * row, block_bytes);
        for (int64_t i = 0; i < n; i++) {
            const kv_t<KV> *krow = kb + i * row;
            for (int j = 0; j < nq; j++) {
                const kv_t<KV> *kh = krow + (int64_t)(h0 + j / group) * hs;
                scores[(int64_t)j * len + t0 + i] =
                    scale * KV::scale(kh, head_dim) * dot_kv<KV>(qh + (int64_t)j * head_dim, kh, head_dim);
            }
        }
    }
    /* keys before a sliding window's start: no weight (the softmax gives exp(-inf) = 0) */
    for (int j = 0; j < nq; j++)
        for (int64_t t = 0; t < skip; t++) scores[(int64_t)j * len + t] = -INFINITY;
    /* per query head, with its sink's logit in the denominator where the layer has sinks */
    for (int j = 0; j < nq; j++)
        softmax_row(scores + (int64_t)j * len, len, sinks ? sinks[h0 * group + j] : -INFINITY);
    /* out_j = sum_t p_j[t] * v_t */
    float *o = out + (int64_t)h0 * group * head_dim;
    memset(o, 0, sizeof(float) * (size_t)nq * (size_t)head_dim);
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t block = table[t0 / block_size];
        const int64_t n = (len - t0 < block_size) ? len - t0 : block_size;
        const kv_t<KV> *vb = v_cache + block * block_size * row;
        if (t0 + block_size < len) prefetch_block(v_cache + table[t0 / block_size + 1] * block_size * row, block_bytes);
        for (int64_t i = 0; i < n; i++) {
            const kv_t<KV> *vrow = vb + i * row;
            for (int j = 0; j < nq; j++) {
                const kv_t<KV> *vh = vrow + (int64_t)(h0 + j / group) * hs;
                axpy_kv<KV>(o + (int64_t)j * head_dim, scores[(int64_t)j * len + t0 + i] * KV::scale(vh, head_dim),
                            vh, head_dim);
            }
        }
    }
}

#if PA_VECTOR
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

/* The next group of up to KV_STREAMS blocks from token t0: each block's
   base in `cache` and its token count. Returns how many blocks. */
template <class KV>
static inline int block_group(const kv_t<KV> *cache, const int64_t *table, int64_t t0, int64_t len,
                              int block_size, int64_t row, const kv_t<KV> **base, int64_t *n) {
    int nb = 0;
    for (; nb < KV_STREAMS && t0 + nb * block_size < len; nb++) {
        const int64_t tb = t0 + (int64_t)nb * block_size;
        base[nb] = cache + table[tb / block_size] * block_size * row;
        n[nb] = (len - tb < block_size) ? len - tb : block_size;
    }
    return nb;
}

/* Ask for rows [r0, r1) of each block of a group (row_bytes each) to be
   brought into cache. The hardware prefetcher loses the stream at every
   block boundary and needs a while to find a new one; the kernel prefetches
   the next group of blocks a slice at a time while it works on this one. */
template <class KV>
static inline void prefetch_rows(const kv_t<KV> *const *base, const int64_t *n, int nb, int64_t r0, int64_t r1,
                                 int64_t row) {
    for (int g = 0; g < nb; g++) {
        const int64_t end = r1 < n[g] ? r1 : n[g];
        if (r0 < end) prefetch_block(base[g] + r0 * row, (end - r0) * row * (int64_t)sizeof(kv_t<KV>));
    }
}

/* q . k for four keys at once: the four dot products as 4 floats */
template <class KV>
static inline __attribute__((always_inline)) f32x4 dot4_keys(const float *qj, const kv_t<KV> *k0,
                                                             const kv_t<KV> *k1, const kv_t<KV> *k2,
                                                             const kv_t<KV> *k3, int head_dim) {
    f32x8 a0 = f32x8_zero(), a1 = f32x8_zero(), a2 = f32x8_zero(), a3 = f32x8_zero();
    int d = 0;
#if SIMD_F32X16
    /* 16 lanes where the CPU has them, folded to 8 before the reduction */
    f32x16 w0 = f32x16_zero(), w1 = f32x16_zero(), w2 = f32x16_zero(), w3 = f32x16_zero();
    for (; d + 16 <= head_dim; d += 16) {
        const f32x16 qv = f32x16_load(qj + d);
        w0 = f32x16_fma(qv, KV::load16(KV::at(k0, d)), w0);
        w1 = f32x16_fma(qv, KV::load16(KV::at(k1, d)), w1);
        w2 = f32x16_fma(qv, KV::load16(KV::at(k2, d)), w2);
        w3 = f32x16_fma(qv, KV::load16(KV::at(k3, d)), w3);
    }
    a0 = f32x16_fold8(w0);
    a1 = f32x16_fold8(w1);
    a2 = f32x16_fold8(w2);
    a3 = f32x16_fold8(w3);
#endif
    for (; d < head_dim; d += 8) {
        const f32x8 qv = f32x8_load(qj + d);
        a0 = f32x8_fma(qv, KV::load8(KV::at(k0, d)), a0);
        a1 = f32x8_fma(qv, KV::load8(KV::at(k1, d)), a1);
        a2 = f32x8_fma(qv, KV::load8(KV::at(k2, d)), a2);
        a3 = f32x8_fma(qv, KV::load8(KV::at(k3, d)), a3);
    }
    return f32x8_hsum4(a0, a1, a2, a3);
}

template <class KV>
static inline __attribute__((always_inline)) void attend_vec(
    const float *q, const kv_t<KV> *k_cache, const kv_t<KV> *v_cache, const int64_t *table, int64_t len, float *out,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int h0, int h1, float *scores,
    int64_t skip, const float *sinks) {
    const int group = num_heads / num_kv_heads;
    const int64_t hs = KV::head_stride(head_dim); /* elements per head row */
    const int64_t row = (int64_t)num_kv_heads * hs;
    const int nq = (h1 - h0) * group;
    const float *qh = q + (int64_t)h0 * group * head_dim;
    const f32x4 vscale = f32x4_set1(scale);
    const int64_t span = (int64_t)KV_STREAMS * block_size; /* tokens per group of blocks */

    /* scores[j][t] = scale * q_j . k_t */
    const kv_t<KV> *kb[KV_STREAMS], *kn[KV_STREAMS];
    int64_t n[KV_STREAMS], nn[KV_STREAMS];
    int nb = block_group<KV>(k_cache, table, 0, len, block_size, row, kb, n);
    for (int64_t t0 = 0; t0 < len; t0 += span) {
        /* the next group, prefetched row by row as this one is read */
        const int nbn = block_group<KV>(k_cache, table, t0 + span, len, block_size, row, kn, nn);
        /* all four blocks are full except, at most, the sequence's last one */
        const int64_t full = nb == KV_STREAMS ? n[KV_STREAMS - 1] : 0; /* tokens every block has */
        if (full == 0) prefetch_rows<KV>(kn, nn, nbn, 0, block_size, row);
        for (int64_t i = 0; i < full; i++) {
            prefetch_rows<KV>(kn, nn, nbn, i, i + 1, row);
            for (int j = 0; j < nq; j++) {
                const int64_t off = (int64_t)(h0 + j / group) * hs + i * row;
                float s4[4];
                f32x4_store(s4, f32x4_mul(dot4_keys<KV>(qh + (int64_t)j * head_dim, kb[0] + off,
                                                        kb[1] + off, kb[2] + off, kb[3] + off, head_dim),
                                          vscale));
                float *sj = scores + (int64_t)j * len + t0 + i;
                for (int g = 0; g < 4; g++) sj[(int64_t)g * block_size] = s4[g] * KV::scale(kb[g] + off, head_dim);
            }
        }
        /* the rest (the sequence's last group, the tokens past a partial last
           block): block by block, four tokens of one block per reduction */
        for (int g = 0; g < nb; g++) {
            for (int j = 0; j < nq; j++) {
                const float *qj = qh + (int64_t)j * head_dim;
                const kv_t<KV> *kj = kb[g] + (int64_t)(h0 + j / group) * hs;
                float *sj = scores + (int64_t)j * len + t0 + (int64_t)g * block_size;
                int64_t i = full;
                for (; i + 4 <= n[g]; i += 4) {
                    f32x4_store(sj + i, f32x4_mul(dot4_keys<KV>(qj, kj + i * row, kj + (i + 1) * row,
                                                                kj + (i + 2) * row, kj + (i + 3) * row,
                                                                head_dim),
                                                  vscale));
                    for (int u = 0; u < 4; u++) sj[i + u] *= KV::scale(kj + (i + u) * row, head_dim);
                }
                /* the last 1-3 keys: a four-key product too (its last key repeated, the extra lanes
                   dropped), so that every score is the same function of its q and k whatever the
                   length: what lets attend_rows give a prompt's tokens these bits */
                if (i < n[g]) {
                    const kv_t<KV> *kr[4];
                    for (int u = 0; u < 4; u++) kr[u] = kj + (i + u < n[g] ? i + u : n[g] - 1) * row;
                    float s4[4];
                    f32x4_store(s4, f32x4_mul(dot4_keys<KV>(qj, kr[0], kr[1], kr[2], kr[3], head_dim), vscale));
                    for (int u = 0; i + u < n[g]; u++) sj[i + u] = s4[u] * KV::scale(kr[u], head_dim);
                }
            }
        }
        for (int g = 0; g < nbn; g++) kb[g] = kn[g], n[g] = nn[g];
        nb = nbn;
    }
    /* keys before a sliding window's start: no weight (the softmax gives exp(-inf) = 0) */
    for (int j = 0; j < nq; j++)
        for (int64_t t = 0; t < skip; t++) scores[(int64_t)j * len + t] = -INFINITY;
    /* per query head, with its sink's logit in the denominator where the layer has sinks */
    for (int j = 0; j < nq; j++)
        softmax_row(scores + (int64_t)j * len, len, sinks ? sinks[h0 * group + j] : -INFINITY);
    /* out_j = sum_t p_j[t] * v_t */
    float *o = out + (int64_t)h0 * group * head_dim;
    memset(o, 0, sizeof(float) * (size_t)nq * (size_t)head_dim);
    const kv_t<KV> *vb[KV_STREAMS], *vn[KV_STREAMS];
    nb = block_group<KV>(v_cache, table, 0, len, block_size, row, vb, n);
    const int64_t rows_per_head = (block_size + nq - 1) / nq; /* next group's rows prefetched per query head */
    for (int64_t t0 = 0; t0 < len; t0 += span) {
        const int nbn = block_group<KV>(v_cache, table, t0 + span, len, block_size, row, vn, nn);
        for (int j = 0; j < nq; j++) {
            prefetch_rows<KV>(vn, nn, nbn, j * rows_per_head, (j + 1) * rows_per_head, row);
            const int64_t kv_off = (int64_t)(h0 + j / group) * hs;
            const float *pj = scores + (int64_t)j * len + t0;
            for (int d0 = 0; d0 < head_dim; d0 += 64) {
                float *oj = o + (int64_t)j * head_dim + d0;
                const int width = head_dim - d0 < 64 ? head_dim - d0 : 64;
                if (width == 64) {
#if SIMD_F32X16
                    f32x16 acc[4];
                    for (int c = 0; c < 4; c++) acc[c] = f32x16_load(oj + 16 * c);
                    for (int64_t i = 0; i < block_size; i++)
                        for (int g = 0; g < nb; g++) {
                            if (i >= n[g]) continue;
                            const kv_t<KV> *vh = vb[g] + i * row + kv_off;
                            const f32x16 p = f32x16_set1(pj[(int64_t)g * block_size + i] * KV::scale(vh, head_dim));
                            const kv_t<KV> *v = KV::at(vh, d0);
                            for (int c = 0; c < 4; c++) acc[c] = f32x16_fma(p, KV::load16(KV::at(v, 16 * c)), acc[c]);
                        }
                    for (int c = 0; c < 4; c++) f32x16_store(oj + 16 * c, acc[c]);
#else
                    f32x8 acc[8];
                    for (int c = 0; c < 8; c++) acc[c] = f32x8_load(oj + 8 * c);
                    for (int64_t i = 0; i < block_size; i++)
                        for (int g = 0; g < nb; g++) {
                            if (i >= n[g]) continue;
                            const kv_t<KV> *vh = vb[g] + i * row + kv_off;
                            const f32x8 p = f32x8_set1(pj[(int64_t)g * block_size + i] * KV::scale(vh, head_dim));
                            const kv_t<KV> *v = KV::at(vh, d0);
                            for (int c = 0; c < 8; c++) acc[c] = f32x8_fma(p, KV::load8(KV::at(v, 8 * c)), acc[c]);
                        }
                    for (int c = 0; c < 8; c++) f32x8_store(oj + 8 * c, acc[c]);
#endif
                } else {
                    for (int g = 0; g < nb; g++)
                        for (int64_t i = 0; i < n[g]; i++) {
                            const kv_t<KV> *vh = vb[g] + i * row + kv_off;
                            axpy_kv<KV>(oj, pj[(int64_t)g * block_size + i] * KV::scale(vh, head_dim),
                                        KV::at(vh, d0), width);
                        }
                }
            }
        }
        for (int g = 0; g < nbn; g++) vb[g] = vn[g], n[g] = nn[g];
        nb = nbn;
    }
}

/* a vf32 (simd.h: the build's widest float vector) of cache elements, with the type's load */
template <class KV>
static inline __attribute__((always_inline)) vf32 kv_loadv(const kv_t<KV> *p) {
#if SIMD_F32X16
    return KV::load16(p);
#else
    return KV::load8(p);
#endif
}

/* ---- several queries of one kv head at once, each in attend_vec's order ----

   A prompt's tokens (paged_prefill.cpp) run here: rows are (query head,
   position) pairs of one sequence and one kv head, row r seeing keys
   [0, lens[r]). Each row gets exactly the operations attend_vec gives a
   decode query of length lens[r]: the same four-key products per score, the
   same softmax_row, the same FMAs per output lane in the same token order
   (blocks in groups of KV_STREAMS, token i of each block in turn, each
   64-float slice reloaded from `out` per group). So a token's attention has
   the same bits whether a prompt step or a decode step computes it, whatever
   else the step holds (docs/batch-invariance.md). What changes is the
   sharing: each key and value vector is loaded once for KV_ROW_TILE rows,
   and a group's values stay in L1 while every row tile runs over them.

   A row shorter than the tile's longest gets weight 0 on the keys past its
   own: fma(0, v, acc) == acc for a finite v, the only kind a cache holds. */

/* q . k of four keys for KV_ROW_TILE query rows: dot4_keys' operations per row, each key vector loaded once */
template <class KV>
static inline __attribute__((always_inline)) void dot4_keys_rows(const float *const *q, const kv_t<KV> *k0,
                                                                 const kv_t<KV> *k1, const kv_t<KV> *k2,
                                                                 const kv_t<KV> *k3, int head_dim, f32x4 *res) {
    f32x8 a[KV_ROW_TILE][4];
    for (int r = 0; r < KV_ROW_TILE; r++)
        for (int g = 0; g < 4; g++) a[r][g] = f32x8_zero();
    int d = 0;
#if SIMD_F32X16
    f32x16 w[KV_ROW_TILE][4];
    for (int r = 0; r < KV_ROW_TILE; r++)
        for (int g = 0; g < 4; g++) w[r][g] = f32x16_zero();
    for (; d + 16 <= head_dim; d += 16) {
        const f32x16 c0 = KV::load16(KV::at(k0, d)), c1 = KV::load16(KV::at(k1, d));
        const f32x16 c2 = KV::load16(KV::at(k2, d)), c3 = KV::load16(KV::at(k3, d));
#pragma GCC unroll 8
        for (int r = 0; r < KV_ROW_TILE; r++) {
            const f32x16 qv = f32x16_load(q[r] + d);
            w[r][0] = f32x16_fma(qv, c0, w[r][0]);
            w[r][1] = f32x16_fma(qv, c1, w[r][1]);
            w[r][2] = f32x16_fma(qv, c2, w[r][2]);
            w[r][3] = f32x16_fma(qv, c3, w[r][3]);
        }
    }
    for (int r = 0; r < KV_ROW_TILE; r++)
        for (int g = 0; g < 4; g++) a[r][g] = f32x16_fold8(w[r][g]);
#endif
    for (; d < head_dim; d += 8) {
        const f32x8 c0 = KV::load8(KV::at(k0, d)), c1 = KV::load8(KV::at(k1, d));
        const f32x8 c2 = KV::load8(KV::at(k2, d)), c3 = KV::load8(KV::at(k3, d));
#pragma GCC unroll 8
        for (int r = 0; r < KV_ROW_TILE; r++) {
            const f32x8 qv = f32x8_load(q[r] + d);
            a[r][0] = f32x8_fma(qv, c0, a[r][0]);
            a[r][1] = f32x8_fma(qv, c1, a[r][1]);
            a[r][2] = f32x8_fma(qv, c2, a[r][2]);
            a[r][3] = f32x8_fma(qv, c3, a[r][3]);
        }
    }
    for (int r = 0; r < KV_ROW_TILE; r++) res[r] = f32x8_hsum4(a[r][0], a[r][1], a[r][2], a[r][3]);
}

/* scores[r * ld + t] for rows [0, nr) (nr <= KV_ROW_TILE; the missing rows repeat the last, their results
   dropped) and keys t < lmax, whose head rows are krow[t] */
template <class KV>
static inline void scores_rows(const float *const *q, int nr, const kv_t<KV> *const *krow, int64_t lmax,
                               int head_dim, float scale, float *scores, int64_t ld) {
    const float *qt[KV_ROW_TILE];
    for (int r = 0; r < KV_ROW_TILE; r++) qt[r] = q[r < nr ? r : nr - 1];
    const f32x4 vscale = f32x4_set1(scale);
    for (int64_t t = 0; t < lmax; t += 4) {
        const kv_t<KV> *kr[4];
        for (int u = 0; u < 4; u++) kr[u] = krow[t + u < lmax ? t + u : lmax - 1];
        f32x4 res[KV_ROW_TILE];
        dot4_keys_rows<KV>(qt, kr[0], kr[1], kr[2], kr[3], head_dim, res);
        for (int r = 0; r < nr; r++) {
            float s4[4];
            f32x4_store(s4, f32x4_mul(res[r], vscale));
            for (int u = 0; u < 4 && t + u < lmax; u++) scores[r * ld + t + u] = s4[u] * KV::scale(kr[u], head_dim);
        }
    }
}

/* rows [0, nr) of one group of blocks (tokens t0 + g * block_size + i, g < nb, i < n[g]) added into their
   outputs' slice [d0, d0 + KV_OUT_CHUNK): attend_vec's FMAs per lane, each row's weight p[r * ld + t] */
template <class KV>
static inline void values_rows(float *const *o, int nr, const float *p, int64_t ld,
                               const kv_t<KV> *const *vrow, int64_t t0, int nb, const int64_t *n,
                               int block_size, int head_dim, int d0) {
    float *ot[KV_ROW_TILE];
    const float *pt[KV_ROW_TILE];
    for (int r = 0; r < KV_ROW_TILE; r++) {
        ot[r] = o[r < nr ? r : nr - 1] + d0;
        pt[r] = p + (r < nr ? r : nr - 1) * ld + t0;
    }
    /* KV_OUT_CHUNK floats as 4 vectors of the build's widest (simd.h's vf32), as attend_vec's value loop */
    vf32 acc[KV_ROW_TILE][4];
#pragma GCC unroll 8
    for (int r = 0; r < KV_ROW_TILE; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = vf32_load(ot[r] + SIMD_F32_WIDTH * c);
    for (int64_t i = 0; i < block_size; i++)
        for (int g = 0; g < nb; g++) {
            if (i >= n[g]) continue;
            const kv_t<KV> *vh = vrow[t0 + (int64_t)g * block_size + i];
            const kv_t<KV> *v = KV::at(vh, d0);
            const vf32 c0 = kv_loadv<KV>(KV::at(v, 0)), c1 = kv_loadv<KV>(KV::at(v, SIMD_F32_WIDTH));
            const vf32 c2 = kv_loadv<KV>(KV::at(v, 2 * SIMD_F32_WIDTH));
            const vf32 c3 = kv_loadv<KV>(KV::at(v, 3 * SIMD_F32_WIDTH));
#pragma GCC unroll 8
            for (int r = 0; r < KV_ROW_TILE; r++) {
                const vf32 w = vf32_set1(pt[r][(int64_t)g * block_size + i] * KV::scale(vh, head_dim));
                acc[r][0] = vf32_fma(w, c0, acc[r][0]);
                acc[r][1] = vf32_fma(w, c1, acc[r][1]);
                acc[r][2] = vf32_fma(w, c2, acc[r][2]);
                acc[r][3] = vf32_fma(w, c3, acc[r][3]);
            }
        }
    for (int r = 0; r < nr; r++) /* the repeated rows are not stored */
        for (int c = 0; c < 4; c++) vf32_store(ot[r] + SIMD_F32_WIDTH * c, acc[r][c]);
}

/* Rows [0, nr) of one sequence and kv head: q[r] (head_dim floats) attends to keys [0, lens[r]) into o[r];
   sinks: row r's attention-sink logit sinks[r] (its query head's), or NULL for none.
   nr <= KV_ROWS_MAX, head_dim a multiple of 64. table: the sequence's block table; kv_off: the kv head's offset in a slot's
   row of `row` elements. Scratch: scores [nr][round_up(max len, 4)], rows [max len] pointers. */
template <class KV>
static __attribute__((unused)) void attend_rows(const float *const *q, float *const *o, const int64_t *lens, int nr,
                                                const kv_t<KV> *k_cache, const kv_t<KV> *v_cache,
                                                const int64_t *table, int64_t kv_off, int64_t row, int head_dim,
                                                int block_size, float scale, float *scores, const kv_t<KV> **rows,
                                                const float *sinks) {
    int64_t lmax = 1;
    for (int r = 0; r < nr; r++) lmax = lens[r] > lmax ? lens[r] : lmax;
    const int64_t ld = (lmax + 3) / 4 * 4;
    for (int64_t t = 0; t < lmax; t++)
        rows[t] = k_cache + (table[t / block_size] * block_size + t % block_size) * row + kv_off;
    /* each row tile stops at its own longest row: keys past it have weight 0 for all its rows */
    int64_t tile_len[(KV_ROWS_MAX + KV_ROW_TILE - 1) / KV_ROW_TILE];
    for (int r0 = 0; r0 < nr; r0 += KV_ROW_TILE) {
        const int n_r = nr - r0 < KV_ROW_TILE ? nr - r0 : KV_ROW_TILE;
        int64_t len = 1;
        for (int r = r0; r < r0 + n_r; r++) len = lens[r] > len ? lens[r] : len;
        tile_len[r0 / KV_ROW_TILE] = len;
        scores_rows<KV>(q + r0, n_r, rows, len, head_dim, scale, scores + r0 * ld, ld);
    }
    for (int r = 0; r < nr; r++) {
        softmax_row(scores + r * ld, lens[r], sinks ? sinks[r] : -INFINITY);
        for (int64_t t = lens[r]; t < lmax; t++) scores[r * ld + t] = 0.0f;
        memset(o[r], 0, sizeof(float) * (size_t)head_dim);
    }
    for (int64_t t = 0; t < lmax; t++)
        rows[t] = v_cache + (table[t / block_size] * block_size + t % block_size) * row + kv_off;
    const int64_t span = (int64_t)KV_STREAMS * block_size;
    for (int d0 = 0; d0 < head_dim; d0 += KV_OUT_CHUNK)
        for (int64_t t0 = 0; t0 < lmax; t0 += span)
            for (int r0 = 0; r0 < nr; r0 += KV_ROW_TILE) {
                const int64_t len = tile_len[r0 / KV_ROW_TILE];
                if (t0 >= len) continue;
                int64_t n[KV_STREAMS];
                int nb = 0;
                for (; nb < KV_STREAMS && t0 + nb * block_size < len; nb++) {
                    const int64_t tb = t0 + (int64_t)nb * block_size;
                    n[nb] = len - tb < block_size ? len - tb : block_size;
                }
                values_rows<KV>(o + r0, nr - r0 < KV_ROW_TILE ? nr - r0 : KV_ROW_TILE, scores + r0 * ld, ld,
                                rows, t0, nb, n, block_size, head_dim, d0);
            }
}
#endif /* PA_VECTOR */

/* The vector path for head sizes that are multiples of 8 where the build
   has it, attend_one otherwise; the common head sizes get loops of known
   length, which gcc unrolls fully. */
/* not inlined: paged_decode.cpp and paged_prefill.cpp each hold one copy of the same code, so a query
   gets the same operations from either */
template <class KV>
static __attribute__((noinline, unused)) void attend(const float *q, const kv_t<KV> *k_cache, const kv_t<KV> *v_cache,
                                                     const int64_t *table, int64_t len, float *out, int num_heads,
                                                     int num_kv_heads, int head_dim, int block_size, float scale,
                                                     int h0, int h1, float *scores, int64_t skip,
                                                     const float *sinks) {
#if PA_VECTOR
    if constexpr (KV::vector) {
        if (head_dim == 64)
            attend_vec<KV>(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, 64, block_size, scale, h0,
                           h1, scores, skip, sinks);
        else if (head_dim == 128)
            attend_vec<KV>(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, 128, block_size, scale,
                           h0, h1, scores, skip, sinks);
        else if (head_dim % 8 == 0)
            attend_vec<KV>(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, head_dim, block_size,
                           scale, h0, h1, scores, skip, sinks);
        else
            attend_one<KV>(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, head_dim, block_size,
                           scale, h0, h1, scores, skip, sinks);
    } else
#endif
    if (head_dim == 64)
        attend_one<KV>(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, 64, block_size, scale, h0,
                       h1, scores, skip, sinks);
    else if (head_dim == 128)
        attend_one<KV>(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, 128, block_size, scale,
                       h0, h1, scores, skip, sinks);
    else
        attend_one<KV>(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, head_dim, block_size,
                       scale, h0, h1, scores, skip, sinks);
}
#endif
