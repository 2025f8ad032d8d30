/* Write a step's new K and V rows into their cache slots (the slot mapping).
 *
 *   k, v      [num_tokens, row] with row = num_kv_heads * head_dim floats,
 *             rows k_stride / v_stride floats apart (views into the fused
 *             qkv output)
 *   k_cache   [num_slots, row] (a layer's cache viewed flat: slot s is row s)
 *   slots     [num_tokens] int64, slot = block_id * block_size + offset
 *
 * torch's index_copy_ does the same in two calls per layer (K, then V);
 * this is one, and it refuses a slot outside the cache before writing.
 * Returns 0, or 2 when a slot is out of range (nothing written then).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

int write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache, float *v_cache,
                 const int64_t *slots, int64_t num_tokens, int64_t row, int64_t num_slots, int num_threads) {
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 2;
    const size_t bytes = (size_t)row * sizeof(float);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_tokens > 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        memcpy(k_cache + slots[t] * row, k + t * k_stride, bytes);
        memcpy(v_cache + slots[t] * row, v + t * v_stride, bytes);
    }
    return 0;
}
