/* Write a step's new K and V rows into their cache slots (the slot mapping).
 *
 *   k, v      [num_tokens, row] float32 with row = num_kv_heads * head_dim,
 *             rows k_stride / v_stride floats apart (views into the fused
 *             qkv output)
 *   k_cache   [num_slots, row] (a layer's cache viewed flat: slot s is row
 *             s) of kv_type float32, float16 or bfloat16; int8: slot s
 *             is num_kv_heads * (head_dim + 4) bytes, each head's int8
 *             values and then its float32 scale
 *   slots     [num_tokens] int64, slot = block_id * block_size + offset
 *
 * torch's index_copy_ does the same in two calls per layer (K, then V);
 * this is one. ops.cpp refuses a slot outside the cache before any node
 * runs. How a row is rounded to a 2-byte or int8 cache: kv_rows.h.
 */
#include <stdint.h>

#include "kv_rows.h"
#include "../step/step_nodes.h"

void write_kv_team(const WriteKvNode *n, int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        write_row(n->k_cache, n->kv_type, n->slots[t], n->k + t * n->k_stride, n->row, n->head_dim, 1);
        write_row(n->v_cache, n->kv_type, n->slots[t], n->v + t * n->v_stride, n->row, n->head_dim, 0);
    }
}
