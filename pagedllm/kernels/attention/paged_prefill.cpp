/*
 * Attention of prompt tokens read from the paged KV cache, in the decode
 * kernel's order (CPU; float32 queries, any cache type paged_decode takes).
 *
 * A prompt chunk is rows [bounds[2s], bounds[2s+1]) of q, at positions
 * seq_lens[s] - q_len .. seq_lens[s] - 1 of sequence s; its K/V (and all
 * the context before it, from earlier chunks or the prefix cache) are
 * already in the cache. The token at position p attends to keys [0, p]
 * through the sequence's block table, and gets the bits paged_decode would
 * give a decode query of length p + 1 (paged_attention_kv.h, attend_rows):
 * a token's attention is then one function of its query and the cache,
 * whether it is computed fresh, in a later chunk, after a prefix-cache hit,
 * after preemption or as a decode step. That is the attention half of
 * EngineConfig.batch_invariant, here at the cost of a tiled kernel.
 *
 *   task = (sequence, kv head, tile of PP_TILE positions)
 *   rows = the kv head's query heads x the tile's positions
 *     keys [0, longest row's length), each loaded once per KV_ROW_TILE rows
 *
 * Layouts:
 *   q, out       [num_tokens, num_heads, head_dim] float32, rows q_stride /
 *                out_stride floats apart, heads contiguous within a row
 *   k/v cache    as paged_decode.cpp's
 *   block_tables [num_seqs, width] int64 (rows contiguous)
 *   bounds       [2 * num_seqs] int64: each sequence's first and one-past-last row
 *   seq_lens     [num_seqs] int64: its length after this step
 *   sinks        [num_heads] float32 or NULL: attention-sink logits, as paged_decode's
 *
 * Head sizes that are not a multiple of 64, and builds without vectors, run
 * attend (paged_decode's own function) once per token: the same bits again,
 * without the sharing. ops.cpp checks every index first.
 */
#include <omp.h>
#include <stdlib.h>

#include "../kernels.h"
#include "paged_attention.h"

#define PP_TILE 8 /* positions per task */
/* attend_rows exists for every cache type where the build has vectors and F16C (float16 and fp8 widen with it) */
#if PA_VECTOR && defined(__F16C__)
#define PP_TILED 1
#else
#define PP_TILED 0
#endif

/* One task's rows through the cache type's attend_rows, an int4 cache's queries rotated first and its
   outputs rotated back (attend_i4_rotated's steps, row by row). */
static void prefill_rows(int kv_type, const float *const *q, float *const *o, const int64_t *lens, int nr,
                         const void *k_cache, const void *v_cache, const int64_t *table, int kvh, int num_kv_heads,
                         int head_dim, int block_size, float scale, float *scores, void **rows, float *qr,
                         const float *sinks) {
#if PP_TILED
    const float *qs[KV_ROWS_MAX];
    for (int r = 0; r < nr; r++) qs[r] = q[r];
    switch (kv_type) {
    case KV_FLOAT32: {
        const int64_t hs = head_dim, row = (int64_t)num_kv_heads * hs;
        attend_rows<KvF32>(qs, o, lens, nr, (const float *)k_cache, (const float *)v_cache, table, kvh * hs, row,
                        head_dim, block_size, scale, scores, (const float **)rows, sinks);
        break;
    }
    case KV_FLOAT16:
    case KV_BFLOAT16: {
        const int64_t hs = head_dim, row = (int64_t)num_kv_heads * hs;
        if (kv_type == KV_FLOAT16)
            attend_rows<KvF16>(qs, o, lens, nr, (const uint16_t *)k_cache, (const uint16_t *)v_cache, table, kvh * hs,
                            row, head_dim, block_size, scale, scores, (const uint16_t **)rows, sinks);
        else
            attend_rows<KvBF16>(qs, o, lens, nr, (const uint16_t *)k_cache, (const uint16_t *)v_cache, table, kvh * hs,
                             row, head_dim, block_size, scale, scores, (const uint16_t **)rows, sinks);
        break;
    }
    case KV_INT8: {
        const int64_t hs = head_dim + KV_I8_SCALE_BYTES, row = (int64_t)num_kv_heads * hs;
        attend_rows<KvI8>(qs, o, lens, nr, (const int8_t *)k_cache, (const int8_t *)v_cache, table, kvh * hs, row,
                       head_dim, block_size, scale, scores, (const int8_t **)rows, sinks);
        break;
    }
    case KV_INT4: {
        const int64_t hs = head_dim / 2 + KV_I4_SCALE_BYTES, row = (int64_t)num_kv_heads * hs;
        for (int r = 0; r < nr; r++) {
            memcpy(qr + (int64_t)r * head_dim, q[r], sizeof(float) * (size_t)head_dim);
            hadamard_f32(qr + (int64_t)r * head_dim, head_dim);
            qs[r] = qr + (int64_t)r * head_dim;
        }
        attend_rows<KvI4>(qs, o, lens, nr, (const uint8_t *)k_cache, (const uint8_t *)v_cache, table, kvh * hs, row,
                       head_dim, block_size, scale, scores, (const uint8_t **)rows, sinks);
        for (int r = 0; r < nr; r++) hadamard_f32(o[r], head_dim);
        break;
    }
    default: { /* fp8: E4M3 or E5M2 */
        const int64_t hs = head_dim + KV_I8_SCALE_BYTES, row = (int64_t)num_kv_heads * hs;
        if (kv_type == KV_FP8E4M3)
            attend_rows<KvE4M3>(qs, o, lens, nr, (const uint8_t *)k_cache, (const uint8_t *)v_cache, table, kvh * hs,
                             row, head_dim, block_size, scale, scores, (const uint8_t **)rows, sinks);
        else
            attend_rows<KvE5M2>(qs, o, lens, nr, (const uint8_t *)k_cache, (const uint8_t *)v_cache, table, kvh * hs,
                             row, head_dim, block_size, scale, scores, (const uint8_t **)rows, sinks);
    }
    }
#else
    (void)kv_type, (void)q, (void)o, (void)lens, (void)nr, (void)k_cache, (void)v_cache, (void)table, (void)kvh;
    (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)scores, (void)rows, (void)qr;
    (void)sinks;
#endif
}

/* One token through paged_decode's own per-query function (the head sizes attend_rows does not take). */
static void prefill_token(int kv_type, const float *q, float *out, const void *k_cache, const void *v_cache,
                          const int64_t *table, int64_t len, int num_heads, int num_kv_heads, int head_dim,
                          int block_size, float scale, float *scores, float *qr, const float *sinks) {
    const int h1 = num_kv_heads;
    if (kv_type == KV_FLOAT32)
        attend<KvF32>(q, (const float *)k_cache, (const float *)v_cache, table, len, out, num_heads, num_kv_heads,
                   head_dim, block_size, scale, 0, h1, scores, 0, sinks);
    else if (kv_type == KV_FLOAT16)
        attend<KvF16>(q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, table, len, out, num_heads,
                   num_kv_heads, head_dim, block_size, scale, 0, h1, scores, 0, sinks);
    else if (kv_type == KV_BFLOAT16)
        attend<KvBF16>(q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, table, len, out, num_heads,
                    num_kv_heads, head_dim, block_size, scale, 0, h1, scores, 0, sinks);
    else if (kv_type == KV_INT8)
        attend<KvI8>(q, (const int8_t *)k_cache, (const int8_t *)v_cache, table, len, out, num_heads, num_kv_heads,
                  head_dim, block_size, scale, 0, h1, scores, 0, sinks);
    else if (kv_type == KV_INT4)
        attend_i4_rotated(q, (const uint8_t *)k_cache, (const uint8_t *)v_cache, table, len, out, num_heads,
                          num_kv_heads, head_dim, block_size, scale, 0, h1, scores, 0, qr, sinks);
    else if (kv_type == KV_FP8E4M3)
        attend<KvE4M3>(q, (const uint8_t *)k_cache, (const uint8_t *)v_cache, table, len, out, num_heads,
                    num_kv_heads, head_dim, block_size, scale, 0, h1, scores, 0, sinks);
    else
        attend<KvE5M2>(q, (const uint8_t *)k_cache, (const uint8_t *)v_cache, table, len, out, num_heads,
                    num_kv_heads, head_dim, block_size, scale, 0, h1, scores, 0, sinks);
}

int paged_prefill_f32(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, int kv_type,
                      const int64_t *block_tables, int64_t table_stride, const int64_t *bounds,
                      const int64_t *seq_lens, float *out, int64_t out_stride, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                      float scale, const float *sinks, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int tiled = PP_TILED && head_dim % 64 == 0 && group * PP_TILE <= KV_ROWS_MAX;
    int64_t max_len = 1, num_tasks = 0;
    for (int s = 0; s < num_seqs; s++) {
        max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
        num_tasks += tiled ? (bounds[2 * s + 1] - bounds[2 * s] + PP_TILE - 1) / PP_TILE * num_kv_heads : bounds[2 * s + 1] - bounds[2 * s];
    }
    /* task -> (sequence, first row): tasks numbered sequence by sequence */
    int64_t *first_task = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (first_task == NULL) return 1;
    first_task[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int64_t q_len = bounds[2 * s + 1] - bounds[2 * s];
        first_task[s + 1] = first_task[s] + (tiled ? (q_len + PP_TILE - 1) / PP_TILE * num_kv_heads : q_len);
    }
    const int64_t rows_max = tiled ? (int64_t)group * PP_TILE : num_heads;
    const int64_t ld = (max_len + 3) / 4 * 4;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(rows_max * ld));
        void **rows = (void **)malloc(sizeof(void *) * (size_t)max_len);
        float *qr = (float *)malloc(sizeof(float) * (size_t)(rows_max * head_dim));
        if (scores == NULL || rows == NULL || qr == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (scores == NULL || rows == NULL || qr == NULL) continue;
            int s = 0;
            while (first_task[s + 1] <= task) s++;
            const int64_t local = task - first_task[s], q_len = bounds[2 * s + 1] - bounds[2 * s];
            const int64_t start = seq_lens[s] - q_len; /* position of the chunk's first token */
            const int64_t *table = block_tables + (int64_t)s * table_stride;
            if (!tiled) {
                const int64_t r = bounds[2 * s] + local;
                prefill_token(kv_type, q + r * q_stride, out + r * out_stride, k_cache, v_cache,
                              table, start + local + 1, num_heads, num_kv_heads, head_dim, block_size, scale, scores,
                              qr, sinks);
                continue;
            }
            /* the sequence's last tiles first: the longest rows start early, which balances the threads */
            const int64_t num_tiles = (q_len + PP_TILE - 1) / PP_TILE;
            const int kvh = (int)(local % num_kv_heads);
            const int64_t tile = num_tiles - 1 - local / num_kv_heads;
            const int64_t p0 = tile * PP_TILE, p1 = p0 + PP_TILE < q_len ? p0 + PP_TILE : q_len;
            const float *qrow[KV_ROWS_MAX];
            float *orow[KV_ROWS_MAX];
            int64_t lens[KV_ROWS_MAX];
            float row_sinks[KV_ROWS_MAX]; /* each row's query head's sink logit */
            int nr = 0;
            for (int j = 0; j < group; j++)
                for (int64_t i = p0; i < p1; i++, nr++) {
                    const int64_t r = bounds[2 * s] + i, h = (int64_t)kvh * group + j;
                    qrow[nr] = q + r * q_stride + h * head_dim;
                    orow[nr] = out + r * out_stride + h * head_dim;
                    lens[nr] = start + i + 1;
                    row_sinks[nr] = sinks ? sinks[h] : -INFINITY;
                }
            prefill_rows(kv_type, qrow, orow, lens, nr, k_cache, v_cache, table, kvh, num_kv_heads, head_dim,
                         block_size, scale, scores, rows, qr, sinks ? row_sinks : NULL);
        }
        free(scores);
        free(rows);
        free(qr);
    }
    free(first_task);
    return failed;
}
