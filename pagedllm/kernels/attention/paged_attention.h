/*
 * Decode attention of one sequence's query heads over its paged K/V,
 * reading the blocks in place. Shared by paged_decode.cpp and
 * prefill_attention.cpp (which uses the float32 dot products and the softmax).
 *
 * Layouts (all contiguous):
 *   q, out       [num_heads, head_dim]         float32 (one sequence)
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *                float32, float16 or bfloat16 (attend<KvF32> / <KvF16> / <KvBF16>),
 *                or int8 [num_blocks, block_size, num_kv_heads, head_dim + 4]
 *                (attend<KvI8>): each head's head_dim int8 values followed by
 *                their float32 scale (KV_I8_SCALE_BYTES), see kv_rows.h;
 *                fp8 bytes in int8's layout (attend<KvE4M3> / <KvE5M2>);
 *                or int4 (uint8) [..., head_dim / 2 + 4] (attend_i4_rotated):
 *                Hadamard-rotated nibbles and a float32 scale (KV_I4_*)
 *   table        [>= ceil(len / block_size)]   int64 block ids
 *   sinks        [num_heads] float32 or NULL: each query head's attention-sink
 *                logit, a term of the softmax denominator that weights no value
 */
#ifndef PAGEDLLM_PAGED_ATTENTION_H
#define PAGEDLLM_PAGED_ATTENTION_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "../simd/simd.h"

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* Blocks are scattered, so the hardware prefetcher loses the stream at
   every block boundary; ask for the next block (n_bytes from p) while the
   current one is being used, one request per 64-byte line. */
static inline void prefetch_block(const void *p, int64_t n_bytes) {
    for (int64_t i = 0; i < n_bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

/* exp(s[t] - max) in place for t < n (the vector exp on AVX2); returns their
   sum: the softmax without its division, which a caller may fold elsewhere.
   sink: an attention sink's logit (gpt-oss), one more term of the denominator
   that weights no value; -INFINITY for none, which leaves every bit as it was
   (the max starts at -inf either way and the sum gains exp(-inf) = +0). */
static inline float exp_row(float *s, int64_t n, float sink) {
    float m = sink;
    for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
    int64_t t = 0;
#if SIMD_F32X8
    /* 8 lanes on AVX-512 builds too: the order of the sum is part of the results */
    const f32x8 vm = f32x8_set1(m);
    f32x8 vsum = f32x8_zero();
    for (; t + 8 <= n; t += 8) {
        const f32x8 e = f32x8_exp(f32x8_sub(f32x8_load(s + t), vm));
        f32x8_store(s + t, e);
        vsum = f32x8_add(vsum, e);
    }
    sum = f32x4_first(f32x8_hsum4(vsum, vsum, vsum, vsum));
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    return sum + expf(sink - m);
}

/* softmax of s[0, n) in place, with an attention sink's logit in the denominator (-INFINITY: none); not inlined, so that every kernel that calls it runs one and the same code
   (the compiler may vectorise the scalar tail differently in different callers) */
static __attribute__((noinline, unused)) void softmax_row(float *s, int64_t n, float sink) {
    const float inv = 1.0f / exp_row(s, n, sink);
    for (int64_t t = 0; t < n; t++) s[t] *= inv;
}


/* KV cache element types, as the Python side numbers them */
enum { KV_FLOAT32 = 0, KV_FLOAT16 = 1, KV_BFLOAT16 = 2, KV_INT8 = 3, KV_INT4 = 4, KV_FP8E4M3 = 5, KV_FP8E5M2 = 6 };

/* An int8 cache's head row: head_dim int8 values, then their float32 scale
   (value = int8 * scale). The scale sits in the block's own bytes, so
   whatever moves a block (copy-on-write, release) moves its scales. */
#define KV_I8_SCALE_BYTES 4

static inline float kv_i8_scale(const int8_t *head, int head_dim) {
    float s;
    memcpy(&s, head + head_dim, sizeof s);
    return s;
}

/* An int4 cache's head row (uint8): head_dim / 2 bytes of nibbles (byte i: value 2i in the low nibble, 2i + 1
   in the high one, each stored as q + 8 for q in [-7, 7]), then the float32 scale; the values are the head's
   K or V rotated by hadamard_f32 (kv_rows.h, layers/kv_quant.py) */
#define KV_I4_SCALE_BYTES 4
/* the largest head an int4 cache takes (the write rotates a head in a stack buffer; ops.cpp checks) */
#define KV_I4_MAX_HEAD_DIM 1024

static inline float kv_i4_scale(const uint8_t *head, int head_dim) {
    float s;
    memcpy(&s, head + head_dim / 2, sizeof s);
    return s;
}

/* element i of an int4 head row as a float (the nibble less 8; the scale is applied per row) */
static inline float kv_i4_elem(const uint8_t *head, int i) {
    return (float)((head[i >> 1] >> ((i & 1) * 4)) & 15) - 8.0f;
}

/* The int4 cache's rotation, in place on head_dim floats: a Walsh-Hadamard
   transform in blocks of b values, b the largest power of two dividing
   head_dim, normalised by 1 / sqrt(b). Stages of (a + c, a - c) on pairs h
   apart (h = 1, 2, 4, ...), then one multiply: the float32 operations
   layers/kv_quant.py's hadamard runs, in its order, so both give the same
   bits. Its own inverse. */
static inline void hadamard_f32(float *x, int head_dim) {
    const int b = head_dim & -head_dim;
    for (int base = 0; base < head_dim; base += b)
        for (int h = 1; h < b; h *= 2)
            for (int j0 = base; j0 < base + b; j0 += 2 * h)
                for (int j = j0; j < j0 + h; j++) {
                    const float a = x[j], c = x[j + h];
                    x[j] = a + c;
                    x[j + h] = a - c;
                }
    const float norm = (float)(1.0 / sqrt((double)b));
    for (int i = 0; i < head_dim; i++) x[i] *= norm;
}

/* An fp8 cache's head row: the same layout as int8's, with fp8 bytes */
static inline float kv_fp8_scale(const uint8_t *head, int head_dim) {
    float s;
    memcpy(&s, head + head_dim, sizeof s);
    return s;
}

static inline float f16_bits_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}

/* an E4M3 byte as float16 bits worth its value times 2^-8: exponent and
   mantissa moved up 7 bits (4-bit exponent, bias 7, into float16's 5-bit
   one, bias 15: 2^-8 for normals and subnormals alike), the sign to bit 15 */
static inline uint16_t fp8e4m3_f16_bits(uint8_t b) {
    return (uint16_t)(((b & 0x7Fu) << 7) | ((b & 0x80u) << 8));
}

static inline float bf16_bits_to_f32(uint16_t h) {
    /* bfloat16 is the top half of a float32: widening is exact */
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if SIMD_F32X8
#define PA_VECTOR 1
#define KV_STREAMS 4 /* blocks read side by side (see attend_vec) */
#else
#define PA_VECTOR 0
#endif

/* the kernels, templates over the cache's element type (kv_types.h): attend<KvF32>, attend_rows<KvF16>, ... */
#include "paged_attention_kv.h"

/* attend_i4 with the rotation: the task's query heads rotated into qr
   (room for num_heads * head_dim floats), attention over the rotated rows
   (q . k = Hq . Hk), and the output heads rotated back (out = H sum p Hv). */
static inline void attend_i4_rotated(const float *q, const uint8_t *k_cache, const uint8_t *v_cache,
                                     const int64_t *table, int64_t len, float *out, int num_heads, int num_kv_heads,
                                     int head_dim, int block_size, float scale, int h0, int h1, float *scores,
                                     int64_t skip, float *qr, const float *sinks) {
    const int group = num_heads / num_kv_heads;
    const int64_t first = (int64_t)h0 * group * head_dim, count = (int64_t)(h1 - h0) * group * head_dim;
    memcpy(qr + first, q + first, sizeof(float) * (size_t)count);
    for (int64_t i = first; i < first + count; i += head_dim) hadamard_f32(qr + i, head_dim);
    attend<KvI4>(qr, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, head_dim, block_size, scale, h0,
                 h1, scores, skip, sinks);
    for (int64_t i = first; i < first + count; i += head_dim) hadamard_f32(out + i, head_dim);
}

#endif
