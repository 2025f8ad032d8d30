/* One K or V row into its cache slot, rounded to the cache's dtype (kv_write.cpp).
 * A 2-byte cache gets each value rounded to
 * nearest, ties to even, as torch's .to(float16 / bfloat16) rounds; float16
 * first saturates to +-65504 (its largest finite value), so a large K/V
 * never becomes inf.
 */
#ifndef PAGEDLLM_KV_ROWS_H
#define PAGEDLLM_KV_ROWS_H

#include <math.h>
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

#endif
