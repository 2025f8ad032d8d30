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
 * A 2-byte cache gets each value rounded to nearest, ties to even, as
 * torch's .to(float16 / bfloat16) rounds; float16 first saturates to
 * +-65504 (its largest finite value), so a large K/V never becomes inf.
 * Returns 0, 2 when a slot is out of range (nothing written then), or 3
 * for an unknown kv_type.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "paged_attention.h" /* KV_FLOAT32, KV_FLOAT16, KV_BFLOAT16 */

static inline uint16_t f32_to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (isnan(f)) return (uint16_t)0x7FC0; /* a quiet NaN, as torch makes */
    /* round to nearest even: add 0x7FFF plus the lowest kept bit, drop 16 bits */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static void write_row(void *cache, int kv_type, int64_t slot, const float *src, int64_t row) {
    if (kv_type == KV_FLOAT32) {
        memcpy((float *)cache + slot * row, src, (size_t)row * sizeof(float));
    } else if (kv_type == KV_FLOAT16) {
        _Float16 *dst = (_Float16 *)cache + slot * row;
        for (int64_t i = 0; i < row; i++) {
            float x = src[i]; /* NaN fails both tests and stays NaN */
            if (x > 65504.0f) x = 65504.0f;
            if (x < -65504.0f) x = -65504.0f;
            dst[i] = (_Float16)x;
        }
    } else {
        uint16_t *dst = (uint16_t *)cache + slot * row;
        for (int64_t i = 0; i < row; i++) dst[i] = f32_to_bf16_bits(src[i]);
    }
}

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
