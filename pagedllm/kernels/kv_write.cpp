/* Write a step's new K and V rows into their cache slots (the slot mapping).
 *
 *   k, v      [num_tokens, row] float32 with row = num_kv_heads * head_dim,
 *             rows k_stride / v_stride floats apart (views into the fused
 *             qkv output)
 *   k_cache   [num_slots, row] (a layer's cache viewed flat: slot s is row
 *             s) of kv_type float32, float16 or bfloat16
 *   slots     [num_tokens] int64, slot = block_id * block_size + offset
 *
 * torch's index_copy_ does the same in two calls per layer (K, then V);
 * this is one, and it refuses a slot outside the cache before writing.
 * How a row is rounded to a 2-byte cache: kv_rows.h.
 * Returns 0, 2 when a slot is out of range (nothing written then), or 3
 * for an unknown kv_type.
 */
#include "kernels.h"
#include <omp.h>
#include <stdint.h>

#include "kv_rows.h"

int write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, void *k_cache, void *v_cache,
             int kv_type, const int64_t *slots, int64_t num_tokens, int64_t row, int64_t num_slots, int num_threads) {
    if (kv_type != KV_FLOAT32 && kv_type != KV_FLOAT16 && kv_type != KV_BFLOAT16) return 3;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens > 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        write_row(k_cache, kv_type, slots[t], k + t * k_stride, row);
        write_row(v_cache, kv_type, slots[t], v + t * v_stride, row);
    }
    return 0;
}
