/*
 * Decode attention that reads the paged KV cache in place (CPU; float32
 * queries, a float32, float16 or bfloat16 cache).
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
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim], of
 *                kv_type KV_FLOAT32, KV_FLOAT16 or KV_BFLOAT16
 *   block_tables [num_seqs, table_stride] int64
 *   seq_lens     [num_seqs] int64
 *
 * Softmax is computed exactly (scores, max, exp, sum, then the weighted sum
 * of values), in float32, as torch's reference does; a 2-byte cache is
 * widened to float32 as it is read. Parallel with OpenMP
 * (the library links the same libgomp as torch, so both share one thread
 * pool).
 */
#include "kernels.h"
#include <stdlib.h>

#include "paged_attention.h"

/* Returns 0 on success, 1 when scratch memory could not be allocated, 2 for
   an unknown kv_type. Work is split by sequence; with fewer sequences than
   threads, by (sequence, kv head) so that one long sequence still uses
   every core. window > 0: each query sees its sequence's last `window`
   keys only (a sliding window, as transformers' `k_pos > q_pos - window`);
   0: all of them. */
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int kv_type,
                 const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                 float *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                 int block_size, int num_threads, float scale, int64_t window) {
    if (kv_type != KV_FLOAT32 && kv_type != KV_FLOAT16 && kv_type != KV_BFLOAT16) return 2;
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
            /* a window of w keys: the last w tokens, from the block holding the first of them */
            const int64_t len = seq_lens[b], start = window > 0 && len > window ? len - window : 0;
            const int64_t first_block = start / block_size, skip = start - first_block * block_size;
            const int64_t *table = block_tables + b * table_stride + first_block;
            const int64_t span = len - first_block * block_size; /* tokens read: skip of them masked */
            const int h0 = part * heads_per_part, h1 = (part + 1) * heads_per_part;
            if (kv_type == KV_FLOAT32)
                attend_f32(qb, (const float *)k_cache, (const float *)v_cache, table, span, ob, num_heads,
                           num_kv_heads, head_dim, block_size, scale, h0, h1, scores, skip);
            else if (kv_type == KV_FLOAT16)
                attend_f16(qb, (const uint16_t *)k_cache, (const uint16_t *)v_cache, table, span, ob, num_heads,
                           num_kv_heads, head_dim, block_size, scale, h0, h1, scores, skip);
            else
                attend_bf16(qb, (const uint16_t *)k_cache, (const uint16_t *)v_cache, table, span, ob, num_heads,
                            num_kv_heads, head_dim, block_size, scale, h0, h1, scores, skip);
        }
        free(scores);
    }
    return failed;
}
