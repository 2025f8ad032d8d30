/* One K or V row into its cache slot, rounded to the cache's dtype (kv_write.cpp).
 * A 2-byte cache gets each value rounded to
 * nearest, ties to even, as torch's .to(float16 / bfloat16) rounds; float16
 * first saturates to +-65504 (its largest finite value), so a large K/V
 * never becomes inf.
 *
 * An int8 cache (KV_INT8) quantizes each head's head_dim values with one
 * scale, symmetric (llama.cpp's q8_0 at head granularity):
 *   x     each value saturated to +-65504 first, as for float16 (+-inf too)
 *   scale max|x| / 127 (float32), stored after the head's values
 *   q     x / scale rounded to nearest, ties to even, in [-127, 127]
 *         (0 where the scale is 0: an all-zero head)
 * and reads back as q * scale. A NaN anywhere in a head stores the scale as
 * NaN (and zeros): the whole head row reads back NaN, as a NaN in a float
 * cache poisons the attention that reads it. layers/kv_quant.py computes
 * the same bits with torch ops.
 *
 * An int4 cache (KV_INT4, uint8) stores each head rotated (hadamard_f32,
 * paged_attention.h) and then quantized with one scale, symmetric:
 *   x     saturated to +-65504 first (before the rotation: inf - inf would be NaN)
 *   r     H x in float32
 *   scale max|r| / 7 (float32) for V; for K, max|r| * c / 7 with c the clip ratio of
 *         INT4_KEY_CLIPS (1 down to 0.6) whose levels reconstruct r with the
 *         least squared error (a largest value clipped buys finer steps for
 *         the rest); stored after the head's head_dim / 2 bytes
 *   q     r / scale rounded to nearest, ties to even, in [-7, 7], stored as
 *         the nibble q + 8 (value 2i in byte i's low nibble, 2i + 1 high)
 * and reads back as H (q * scale). A NaN stores a NaN scale and zeros, as
 * for int8. layers/kv_quant.py computes the same bits with torch ops.
 * An fp8 cache (KV_FP8E4M3, KV_FP8E5M2) follows the same rules with fp8
 * values: scale = max|x| / FMAX (448 for E4M3, 57344 for E5M2), each x /
 * scale clamped to +-FMAX and rounded to the format (nearest, ties to even,
 * subnormals kept), as torch's .to(float8_e4m3fn / float8_e5m2) rounds.
 */
#ifndef PAGEDLLM_KV_ROWS_H
#define PAGEDLLM_KV_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "paged_attention.h" /* KV_FLOAT32, KV_FLOAT16, KV_BFLOAT16, KV_INT8, KV_INT4, hadamard_f32 */

static inline uint16_t f32_to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (isnan(f)) return (uint16_t)0x7FC0; /* a quiet NaN, as torch makes */
    /* round to nearest even: add 0x7FFF plus the lowest kept bit, drop 16 bits */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* a head's scale, max|x| / qmax with max|x| saturated to 65504 (as the values are); NaN when the head holds
   a NaN, which makes the whole head row read back NaN */
static inline float head_scale(const float *src, int head_dim, float qmax) {
    float amax = 0.0f;
    int nan = 0;
    for (int i = 0; i < head_dim; i++) {
        const float x = src[i];
        if (x != x) nan = 1;
        const float a = fabsf(x);
        amax = a > amax ? a : amax;
    }
    if (amax > 65504.0f) amax = 65504.0f;
    return nan ? NAN : amax / qmax;
}

/* one head of head_dim values into dst: head_dim int8, then the float32 scale */
static inline void quantize_head_i8(int8_t *dst, const float *src, int head_dim) {
    const float scale = head_scale(src, head_dim, 127.0f);
    if (!(scale > 0.0f)) { /* an all-zero head, or a NaN one */
        memset(dst, 0, (size_t)head_dim);
    } else {
        for (int i = 0; i < head_dim; i++) {
            float x = src[i];
            if (x > 65504.0f) x = 65504.0f;
            if (x < -65504.0f) x = -65504.0f;
            float q = nearbyintf(x / scale);
            q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
            dst[i] = (int8_t)q;
        }
    }
    memcpy(dst + head_dim, &scale, sizeof scale);
}

/* the clip ratios a key row's int4 scale is chosen from after 1 (layers/kv_quant.py's INT4_KEY_CLIPS), as
   c / 7 in float32: the scale is then one multiply, which -fassociative-math cannot reorder */
static const float KV_I4_KEY_STEPS[] = {0.95f / 7.0f, 0.9f / 7.0f, 0.85f / 7.0f, 0.8f / 7.0f,
                                        0.75f / 7.0f, 0.7f / 7.0f, 0.65f / 7.0f, 0.6f / 7.0f};

static inline float i4_level(float r, float scale) {
    const float q = nearbyintf(r / scale);
    return q > 7.0f ? 7.0f : (q < -7.0f ? -7.0f : q);
}

/* the squared error of r's levels at `scale` (> 0), read back as level * scale in float32, summed in double */
static inline double i4_error(const float *r, int head_dim, float scale) {
    double e = 0.0;
    for (int i = 0; i < head_dim; i++) {
        const double d = (double)r[i] - (double)(i4_level(r[i], scale) * scale);
        e += d * d;
    }
    return e;
}

/* a key row's scale: amax * c / 7 for the clip ratio c with the least error (the first, largest, on a tie) */
static inline float i4_key_scale(const float *r, int head_dim, float amax) {
    float best = amax / 7.0f;
    if (!(best > 0.0f)) return best;
    double best_error = i4_error(r, head_dim, best);
    for (size_t c = 0; c < sizeof KV_I4_KEY_STEPS / sizeof KV_I4_KEY_STEPS[0]; c++) {
        const float scale = amax * KV_I4_KEY_STEPS[c];
        const double e = i4_error(r, head_dim, scale);
        if (e < best_error) best = scale, best_error = e;
    }
    return best;
}

/* one head of head_dim values (even, at most KV_I4_MAX_HEAD_DIM) into dst: head_dim / 2 bytes, then the scale;
   keys: the scale searched (i4_key_scale), not max / 7 */
static inline void quantize_head_i4(uint8_t *dst, const float *src, int head_dim, int keys) {
    float r[KV_I4_MAX_HEAD_DIM];
    int nan = 0;
    for (int i = 0; i < head_dim; i++) {
        float x = src[i];
        if (x != x) nan = 1;
        if (x > 65504.0f) x = 65504.0f;
        if (x < -65504.0f) x = -65504.0f;
        r[i] = x;
    }
    hadamard_f32(r, head_dim);
    float amax = 0.0f;
    for (int i = 0; i < head_dim; i++) amax = fabsf(r[i]) > amax ? fabsf(r[i]) : amax;
    float scale = nan ? NAN : (keys ? i4_key_scale(r, head_dim, amax) : amax / 7.0f);
    if (nan || scale == 0.0f) {
        memset(dst, 0x88, (size_t)head_dim / 2); /* q = 0 in both nibbles */
    } else {
        for (int i = 0; i < head_dim; i += 2) {
            const float q0 = i4_level(r[i], scale), q1 = i4_level(r[i + 1], scale);
            dst[i / 2] = (uint8_t)((int)q0 + 8) | (uint8_t)(((int)q1 + 8) << 4);
        }
    }
    memcpy(dst + head_dim / 2, &scale, sizeof scale);
}

/* x (|x| <= the format's largest, not NaN) as fp8 bits, rounded to nearest
   even: mbits mantissa bits, exponent bias `bias`. Below the smallest
   normal the step is fixed (2^(1 - bias - mbits)), so the value is rounded
   as an integer count of steps; a count of 2^mbits is the smallest normal,
   whose bits are that same count. */
static inline uint8_t f32_to_fp8_bits(float x, int mbits, int bias) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const float a = fabsf(x);
    if (a < ldexpf(1.0f, 1 - bias)) return (uint8_t)(sign | (uint8_t)nearbyintf(ldexpf(a, bias - 1 + mbits)));
    memcpy(&u, &a, sizeof u);
    const int drop = 23 - mbits;
    u += (1u << (drop - 1)) - 1u + ((u >> drop) & 1u); /* round to nearest even at the kept bits */
    const uint32_t e = (u >> 23) - 127u + (uint32_t)bias, m = (u >> drop) & ((1u << mbits) - 1u);
    return (uint8_t)(sign | (e << mbits) | m);
}

/* one head of head_dim values into dst: head_dim fp8 bytes, then the float32 scale */
static inline void quantize_head_fp8(uint8_t *dst, const float *src, int head_dim, int e4m3) {
    const float fmax = e4m3 ? 448.0f : 57344.0f;
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const float scale = head_scale(src, head_dim, fmax);
    if (!(scale > 0.0f)) { /* an all-zero head, or a NaN one */
        memset(dst, 0, (size_t)head_dim);
    } else {
        for (int i = 0; i < head_dim; i++) {
            float q = src[i];
            if (q > 65504.0f) q = 65504.0f;
            if (q < -65504.0f) q = -65504.0f;
            q = q / scale;
            q = q > fmax ? fmax : (q < -fmax ? -fmax : q);
            dst[i] = f32_to_fp8_bits(q, mbits, bias);
        }
    }
    memcpy(dst + head_dim, &scale, sizeof scale);
}

/* src: row floats (num_kv_heads * head_dim); slot s of the cache starts at
   s * row elements, or for KV_INT8 / KV_FP8* at s * (row / head_dim) * (head_dim + 4) bytes, KV_INT4
   (head_dim / 2 + 4); keys: src is a K row (an int4 cache searches its scale) */
static void write_row(void *cache, int kv_type, int64_t slot, const float *src, int64_t row, int head_dim,
                      int keys) {
    if (kv_type == KV_INT4) {
        const int64_t heads = row / head_dim, hs = head_dim / 2 + KV_I4_SCALE_BYTES;
        uint8_t *dst = (uint8_t *)cache + slot * heads * hs;
        for (int64_t h = 0; h < heads; h++) quantize_head_i4(dst + h * hs, src + h * head_dim, head_dim, keys);
    } else if (kv_type == KV_FP8E4M3 || kv_type == KV_FP8E5M2) {
        const int64_t heads = row / head_dim, hs = head_dim + KV_I8_SCALE_BYTES;
        uint8_t *dst = (uint8_t *)cache + slot * heads * hs;
        for (int64_t h = 0; h < heads; h++)
            quantize_head_fp8(dst + h * hs, src + h * head_dim, head_dim, kv_type == KV_FP8E4M3);
    } else if (kv_type == KV_INT8) {
        const int64_t heads = row / head_dim, hs = head_dim + KV_I8_SCALE_BYTES;
        int8_t *dst = (int8_t *)cache + slot * heads * hs;
        for (int64_t h = 0; h < heads; h++) quantize_head_i8(dst + h * hs, src + h * head_dim, head_dim);
    } else if (kv_type == KV_FLOAT32) {
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
