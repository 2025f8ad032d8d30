/*
 * Decode attention that reads the paged KV cache in place (CPU; float32
 * queries, a float32, float16, bfloat16, int8, int4 or fp8 (E4M3 / E5M2) cache).
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
 *                kv_type KV_FLOAT32, KV_FLOAT16 or KV_BFLOAT16; KV_INT8:
 *                [..., head_dim + 4], each head's float32 scale after it;
 *                KV_INT4: uint8 [..., head_dim / 2 + 4], rotated nibbles
 *                and a scale (the queries rotated, the output rotated back)
 *                KV_FP8E4M3 / KV_FP8E5M2: the same with fp8 bytes
 *   block_tables [num_seqs, table_stride] int64
 *   seq_lens     [num_seqs] int64
 *   sinks        [num_heads] float32 or NULL: attention-sink logits (gpt-oss),
 *                one more term per query head in its softmax denominator
 *
 * Softmax is computed exactly (scores, max, exp, sum, then the weighted sum
 * of values), in float32, as torch's reference does; a 2-byte cache is
 * widened to float32 as it is read, an int8 one widened in registers and
 * its row's scale folded into the score (keys) or the weight (values). ops.cpp checks every block a sequence
 * reads against the cache, and the cache dtype, before the node runs.
 */
#include <omp.h>
#include <stdlib.h>

#include "paged_attention.h"
#include "../step/step_nodes.h"

/* A team function (step_nodes.h). Work is split by sequence; with fewer
   sequences than threads, by (sequence, kv head) so that one long sequence
   still uses every core. window > 0: each query sees its sequence's last
   `window` keys only (a sliding window, as transformers'
   `k_pos > q_pos - window`); 0: all of them. Each thread allocates its
   scores; where it cannot, it sets *failed and skips its tasks. */
void paged_decode_team(const PagedDecodeNode *n, int64_t num_seqs, int *failed) {
    const int num_threads = omp_get_num_threads();
    int64_t max_len = 1;
    for (int64_t b = 0; b < num_seqs; b++)
        if (n->seq_lens[b] > max_len) max_len = n->seq_lens[b];
    const int split_heads = num_seqs < 2 * num_threads;
    const int parts = split_heads ? n->num_kv_heads : 1; /* tasks per sequence */
    const int heads_per_part = n->num_kv_heads / parts;
    const int group = n->num_heads / n->num_kv_heads;
    const int num_heads = n->num_heads, num_kv_heads = n->num_kv_heads, head_dim = n->head_dim;
    const int block_size = n->block_size;
    float *scores = (float *)malloc(sizeof(float) * (size_t)heads_per_part * group * (size_t)max_len);
    /* an int4 cache's rotated queries (attend_i4_rotated) */
    float *qr = n->kv_type == KV_INT4 ? (float *)malloc(sizeof(float) * (size_t)num_heads * head_dim) : NULL;
    if (scores == NULL || (n->kv_type == KV_INT4 && qr == NULL)) {
        free(scores);
        scores = NULL;
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs * parts; task++) {
        if (scores == NULL) continue;
        const int b = (int)(task / parts), part = (int)(task % parts);
        const float *qb = n->q + (int64_t)b * num_heads * head_dim;
        float *ob = n->out + (int64_t)b * num_heads * head_dim;
        /* a window of w keys: the last w tokens, from the block holding the first of them */
        const int64_t len = n->seq_lens[b], start = n->window > 0 && len > n->window ? len - n->window : 0;
        const int64_t first_block = start / block_size, skip = start - first_block * block_size;
        const int64_t *table = n->block_tables + b * n->table_stride + first_block;
        const int64_t span = len - first_block * block_size; /* tokens read: skip of them masked */
        const int h0 = part * heads_per_part, h1 = (part + 1) * heads_per_part;
        if (n->kv_type == KV_FLOAT32)
            attend<KvF32>(qb, (const float *)n->k_cache, (const float *)n->v_cache, table, span, ob, num_heads,
                       num_kv_heads, head_dim, block_size, n->scale, h0, h1, scores, skip, n->sinks);
        else if (n->kv_type == KV_FLOAT16)
            attend<KvF16>(qb, (const uint16_t *)n->k_cache, (const uint16_t *)n->v_cache, table, span, ob, num_heads,
                       num_kv_heads, head_dim, block_size, n->scale, h0, h1, scores, skip, n->sinks);
        else if (n->kv_type == KV_INT4)
            attend_i4_rotated(qb, (const uint8_t *)n->k_cache, (const uint8_t *)n->v_cache, table, span, ob,
                              num_heads, num_kv_heads, head_dim, block_size, n->scale, h0, h1, scores, skip, qr, n->sinks);
        else if (n->kv_type == KV_FP8E4M3)
            attend<KvE4M3>(qb, (const uint8_t *)n->k_cache, (const uint8_t *)n->v_cache, table, span, ob, num_heads,
                        num_kv_heads, head_dim, block_size, n->scale, h0, h1, scores, skip, n->sinks);
        else if (n->kv_type == KV_FP8E5M2)
            attend<KvE5M2>(qb, (const uint8_t *)n->k_cache, (const uint8_t *)n->v_cache, table, span, ob, num_heads,
                        num_kv_heads, head_dim, block_size, n->scale, h0, h1, scores, skip, n->sinks);
        else if (n->kv_type == KV_INT8)
            attend<KvI8>(qb, (const int8_t *)n->k_cache, (const int8_t *)n->v_cache, table, span, ob, num_heads,
                      num_kv_heads, head_dim, block_size, n->scale, h0, h1, scores, skip, n->sinks);
        else
            attend<KvBF16>(qb, (const uint16_t *)n->k_cache, (const uint16_t *)n->v_cache, table, span, ob,
                        num_heads, num_kv_heads, head_dim, block_size, n->scale, h0, h1, scores, skip, n->sinks);
    }
    free(scores);
    free(qr);
}
