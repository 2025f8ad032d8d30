/*
 * GGUF's block formats, read as they are stored (ggml's type numbers;
 * little-endian, fp16 scales). A weight row of K values is its blocks back
 * to back.
 *
 * 32 weights a block:
 *   Q8_0  34 bytes: d (fp16), qs[32] int8           w[i] = d * qs[i]
 *   Q4_0  18 bytes: d (fp16), qs[16] nibbles        w[i] = d * (q[i] - 8)
 *   Q4_1  20 bytes: d (fp16), m (fp16), qs[16]      w[i] = d * q[i] + m
 *   Q5_0  22 bytes: d, qh[4], qs[16]                w[i] = d * (q[i] - 16)
 *   Q5_1  24 bytes: d, m, qh[4], qs[16]             w[i] = d * q[i] + m
 * where the 4-bit q of a Q4 block lie as   byte j = q[j] | q[j + 16] << 4
 * (the low nibbles are weights 0..15, the high nibbles 16..31), and a Q5
 * block's q[i] is that nibble with bit i of qh (a little-endian uint32) as
 * its fifth bit.
 *
 * 256 weights a "super-block" (the k-quants of Q4_K_M / Q5_K_M files):
 *   Q4_K 144 bytes: d, dmin (fp16), scales[12], qs[128]
 *        8 sub-blocks of 32, each with a 6-bit scale s and min m packed in
 *        scales[]; w = d * s * q - dmin * m, q 4 bits. The 64 weights of
 *        sub-blocks 2j, 2j+1 are the low, then high nibbles of qs[32j..32j+32).
 *   Q5_K 176 bytes: d, dmin, scales[12], qh[32], qs[128]
 *        as Q4_K with a fifth bit: bit (2j) of qh[l] for the low nibble of
 *        sub-block 2j, bit (2j+1) for the high nibble.
 *   Q6_K 210 bytes: ql[128], qh[64], scales[16] int8, d (fp16)
 *        16 sub-blocks of 16, w = d * scale * (q - 32), q 6 bits: 4 from ql,
 *        2 from qh, in two halves of 128 weights (see gguf_q6_k_block).
 *   Q2_K  84 bytes: scales[16], qs[64], d, dmin (fp16)
 *        16 sub-blocks of 16, scales[s] = scale | min << 4, w = d * scale * q - dmin * min,
 *        q 2 bits: weight 128h + 32g + l is bits 2g, 2g + 1 of qs[32h + l] (Q3_K too).
 *   Q3_K 110 bytes: hmask[32], qs[64], scales[12], d (fp16)
 *        16 sub-blocks of 16 with 6-bit scales (low 4 bits: nibbles of scales[0..8),
 *        high 2: pairs of scales[8..12)), w = d * (scale - 32) * (q - 4 + 4 * hbit),
 *        q's low 2 bits as Q2_K's, hbit = bit n / 32 of hmask[n % 32].
 *
 * Non-linear 4-bit types, each nibble an index into a table of 16 int8 values
 * (nibbles in Q4_0's order: byte j = q[j] | q[j + 16] << 4):
 *   IQ4_NL  18 bytes (32 weights): d (fp16), qs[16]     w[i] = d * kvalues_iq4nl[q[i]]
 *   IQ4_XS 136 bytes (256 weights): d (fp16), scales_h (uint16), scales_l[4], qs[128]
 *        8 sub-blocks of 32, each a 6-bit scale ls: low 4 bits the nibble j % 2 of
 *        scales_l[j / 2], high 2 bits bits 2j, 2j + 1 of scales_h; w = d * (ls - 32) * kvalues_iq4nl[q],
 *        sub-block j's quants in qs[16j..16j + 16) as an IQ4_NL block's
 *   MXFP4   17 bytes (32 weights): e (E8M0), qs[16]     w[i] = 2^(e - 128) * kvalues_mxfp4[q[i]]
 *        (E2M1 values doubled in the table, the power of two halved: ggml's convention;
 *        e = 0 and 1 give the subnormals 2^-128, 2^-127)
 * Every weight is one exact product (d * table, and for IQ4_XS (d * s) * table: 11 + 6 + 7 bits).
 *
 * And plain 2-byte floats, F16 and BF16 (one weight a "block").
 *
 * gguf_block_vec turns one 32-weight block into float32 in registers
 * (AVX2: four 8-lane vectors); gguf_row turns a row of any type into floats.
 *
 * pagedllm's own grouped formats, for float checkpoints quantized at load
 * (layers/quantization/quantized_linear.py, quantization="int8" / "int4"), numbered past
 * ggml's types. Their blocks are groups of G weights, G a multiple of 32
 * given at run time (the group size), with float32 scales (exact, and the
 * same numbers the Python side rounds with):
 *   GROUP_I8  4 + G bytes:       scale, q[G] int8 (symmetric)            w[i] = scale * q[i]
 *   GROUP_I4  8 + G / 2 bytes:   scale, min, G / 32 runs of 16 bytes     w[i] = fma(q[i], scale, min)
 *             (asymmetric), each run 32 4-bit q laid out as in Q4_0: byte j = q[j] | q[j + 16] << 4
 */
#ifndef PAGEDLLM_GGUF_BLOCKS_H
#define PAGEDLLM_GGUF_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../simd/simd.h"

enum GgufType {
    GGUF_F16 = 1, GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q5_0 = 6, GGUF_Q5_1 = 7, GGUF_Q8_0 = 8, GGUF_Q2_K = 10, GGUF_Q3_K = 11,
    GGUF_Q4_K = 12, GGUF_Q5_K = 13, GGUF_Q6_K = 14, GGUF_IQ4_NL = 20, GGUF_IQ4_XS = 23, GGUF_BF16 = 30,
    GGUF_MXFP4 = 39,
};

/* the non-linear 4-bit types' tables: a nibble's int8 value (MXFP4: its E2M1 value doubled) */
static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline bool is_table_type(int type) {
    return type == GGUF_IQ4_NL || type == GGUF_IQ4_XS || type == GGUF_MXFP4;
}

/* the table of a non-linear 4-bit type */
static inline const int8_t *gguf_kvalues(int type) { return type == GGUF_MXFP4 ? KVALUES_MXFP4 : KVALUES_IQ4NL; }

/* an MXFP4 block's scale, 2^(e - 128) (ggml's E8M0 halved): the exponent bits, or a subnormal below e = 2 */
static inline float gguf_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* sub-block j's 6-bit scale (0..63, before the - 32) of an IQ4_XS super-block: h = scales_h, l = scales_l */
static inline int gguf_iq4_xs_scale(uint16_t h, const uint8_t *l, int j) {
    return ((l[j / 2] >> (4 * (j % 2))) & 0x0f) | ((h >> (2 * j)) & 3) << 4;
}
#define GGUF_BLOCK 32 /* a row's length is a multiple of this for every type the kernels take */

/* pagedllm's grouped formats (not ggml's: its type numbers stay below 256) */
enum GroupType { GROUP_I8 = 256, GROUP_I4 = 257 };

static inline bool is_group_type(int type) { return type == GROUP_I8 || type == GROUP_I4; }

/* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the k-quants Q2_K to Q6_K, GROUP_I8 and GROUP_I4 interleaved 16 rows at a time (gguf_x16.h):
   the same bytes in another order, numbered 512 + the type */
enum GgufX16Type { GGUF_X16_BASE = 512, GGUF_Q4_0_X16 = 512 + GGUF_Q4_0, GGUF_Q4_1_X16 = 512 + GGUF_Q4_1,
                   GGUF_Q5_0_X16 = 512 + GGUF_Q5_0, GGUF_Q5_1_X16 = 512 + GGUF_Q5_1,
                   GGUF_Q8_0_X16 = 512 + GGUF_Q8_0, GGUF_Q2_K_X16 = 512 + GGUF_Q2_K, GGUF_Q3_K_X16 = 512 + GGUF_Q3_K,
                   GGUF_Q4_K_X16 = 512 + GGUF_Q4_K,
                   GGUF_Q5_K_X16 = 512 + GGUF_Q5_K, GGUF_Q6_K_X16 = 512 + GGUF_Q6_K,
                   GGUF_IQ4_NL_X16 = 512 + GGUF_IQ4_NL, GGUF_IQ4_XS_X16 = 512 + GGUF_IQ4_XS,
                   GGUF_MXFP4_X16 = 512 + GGUF_MXFP4,
                   GROUP_I8_X16 = 512 + GROUP_I8, GROUP_I4_X16 = 512 + GROUP_I4 };
#define X16_TILE 16 /* rows (output channels) a tile interleaves */

/* the ggml types (and grouped types) gguf_x16.h interleaves */
static inline bool x16_takes(int ggml_type) {
    switch (ggml_type) {
        case GGUF_Q4_0: case GGUF_Q4_1: case GGUF_Q5_0: case GGUF_Q5_1: case GGUF_Q8_0: case GGUF_Q2_K:
        case GGUF_Q3_K: case GGUF_Q4_K: case GGUF_Q5_K: case GGUF_Q6_K: case GROUP_I8: case GROUP_I4:
        case GGUF_IQ4_NL: case GGUF_IQ4_XS: case GGUF_MXFP4: return true;
        default: return false;
    }
}

static inline bool is_x16_type(int type) { return type > GGUF_X16_BASE && x16_takes(type - GGUF_X16_BASE); }

/* the file's type of an x16 type, or the type itself */
static inline int x16_base_type(int type) { return is_x16_type(type) ? type - GGUF_X16_BASE : type; }

/* bytes of one group of `group` weights of a grouped type */
static inline int64_t group_block_bytes(int type, int64_t group) { return type == GROUP_I8 ? 4 + group : 8 + group / 2; }

/* bytes of one block of `type`, 0 for a type with no kernel here */
static inline int64_t gguf_block_bytes(int type) {
    switch (x16_base_type(type)) {
        case GGUF_F16: case GGUF_BF16: return 2;
        case GGUF_Q4_0: return 18;
        case GGUF_Q4_1: return 20;
        case GGUF_Q5_0: return 22;
        case GGUF_Q5_1: return 24;
        case GGUF_Q8_0: return 34;
        case GGUF_Q2_K: return 84;
        case GGUF_Q3_K: return 110;
        case GGUF_Q4_K: return 144;
        case GGUF_Q5_K: return 176;
        case GGUF_Q6_K: return 210;
        case GGUF_IQ4_NL: return 18;
        case GGUF_IQ4_XS: return 136;
        case GGUF_MXFP4: return 17;
        default: return 0;
    }
}

/* weights in one block of `type` */
static inline int64_t gguf_block_weights(int type) {
    switch (x16_base_type(type)) {
        case GGUF_F16: case GGUF_BF16: return 1;
        case GGUF_Q2_K: case GGUF_Q3_K: case GGUF_Q4_K: case GGUF_Q5_K: case GGUF_Q6_K: case GGUF_IQ4_XS: return 256;
        default: return 32;
    }
}

static inline float gguf_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return simd_f16_to_f32(h);
}

/* whether a 32-weight type's blocks carry a min m after d (Q4_1, Q5_1) */
static inline bool gguf_has_min(int type) { return type == GGUF_Q4_1 || type == GGUF_Q5_1; }

/* the fifth bits of a Q5_0 / Q5_1 block, bit i for weight i */
static inline uint32_t gguf_q5_high(int type, const uint8_t *blk) {
    uint32_t qh;
    memcpy(&qh, blk + (type == GGUF_Q5_1 ? 4 : 2), 4);
    return qh;
}

/* where a 32-weight block's quants start: after d (m) (qh), or MXFP4's e */
static inline int gguf_quants_at(int type) {
    switch (type) {
        case GGUF_Q4_1: return 4;
        case GGUF_Q5_0: return 6;
        case GGUF_Q5_1: return 8;
        case GGUF_MXFP4: return 1;
        default: return 2;
    }
}

/* the min term of a 32-weight block: w = d q + m (Q4_0: q - 8, Q5_0: q - 16, Q8_0: signed q) */
static inline float gguf_block_min(int type, const uint8_t *blk, float d) {
    switch (type) {
        case GGUF_Q4_1: case GGUF_Q5_1: return gguf_half(blk + 2);
        case GGUF_Q4_0: return -8.0f * d;
        case GGUF_Q5_0: return -16.0f * d;
        default: return 0.0f;
    }
}

/* the 32 weights of one block, in order */
static inline void gguf_block_scalar(int type, const uint8_t *blk, float *w) {
    if (type == GGUF_Q8_0) {
        const float d = gguf_half(blk);
        for (int i = 0; i < 32; i++) w[i] = d * (float)(int8_t)blk[2 + i];
        return;
    }
    const float d = gguf_half(blk), m = gguf_block_min(type, blk, d);
    const uint8_t *qs = blk + gguf_quants_at(type);
    const uint32_t qh = type == GGUF_Q5_0 || type == GGUF_Q5_1 ? gguf_q5_high(type, blk) : 0;
    for (int j = 0; j < 16; j++) {
        w[j] = d * (float)((qs[j] & 0x0f) | ((qh >> j) & 1) << 4) + m;
        w[j + 16] = d * (float)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
    }
}

/* the `group` weights of one group of a grouped type (group a multiple of 32), in order; the vector
   paths (gguf_linear.cpp) compute the same values: one rounding each (a product, or one fma) */
static inline void group_block_scalar(int type, const uint8_t *blk, int64_t group, float *w) {
    float d, m;
    memcpy(&d, blk, 4);
    if (type == GROUP_I8) {
        for (int64_t i = 0; i < group; i++) w[i] = d * (float)(int8_t)blk[4 + i];
        return;
    }
    memcpy(&m, blk + 4, 4);
    const uint8_t *qs = blk + 8;
    for (int64_t r = 0; r < group / 32; r++, qs += 16, w += 32) {
        for (int j = 0; j < 16; j++) {
            w[j] = fmaf((float)(qs[j] & 0x0f), d, m);
            w[j + 16] = fmaf((float)(qs[j] >> 4), d, m);
        }
    }
}

/* sub-block j's 6-bit scale and min of a Q4_K / Q5_K super-block (packed in 12 bytes) */
static inline void gguf_k_scale_min(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* the 256 weights of a Q4_K (has_high = 0) or Q5_K (has_high = 1) super-block */
static inline void gguf_q45_k_block(const uint8_t *blk, int has_high, float *w) {
    const float d = gguf_half(blk), dmin = gguf_half(blk + 2);
    const uint8_t *scales = blk + 4, *qh = blk + 16, *qs = blk + (has_high ? 48 : 16);
    for (int j = 0; j < 4; j++) { /* 64 weights: sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles) */
        int s0, m0, s1, m1;
        gguf_k_scale_min(2 * j, scales, &s0, &m0);
        gguf_k_scale_min(2 * j + 1, scales, &s1, &m1);
        const float d0 = d * (float)s0, b0 = dmin * (float)m0, d1 = d * (float)s1, b1 = dmin * (float)m1;
        const uint8_t *q = qs + 32 * j;
        for (int l = 0; l < 32; l++) {
            const int hi0 = has_high ? ((qh[l] >> (2 * j)) & 1) << 4 : 0;
            const int hi1 = has_high ? ((qh[l] >> (2 * j + 1)) & 1) << 4 : 0;
            w[64 * j + l] = d0 * (float)((q[l] & 0x0f) | hi0) - b0;
            w[64 * j + 32 + l] = d1 * (float)((q[l] >> 4) | hi1) - b1;
        }
    }
}

/* the 256 weights of a Q6_K super-block: two halves of 128, each from 64 bytes of ql and 32 of qh,
   four 32-weight runs: low nibbles of ql[0..32) and ql[32..64), then their high nibbles, with the
   2-bit pairs 0, 1, 2, 3 of qh[l] on top; each run of 16 has its own int8 scale */
static inline void gguf_q6_k_block(const uint8_t *blk, float *w) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *scales = (const int8_t *)(blk + 192);
    const float d = gguf_half(blk + 208);
    for (int half = 0; half < 2; half++) {
        for (int l = 0; l < 32; l++) {
            const int s = l / 16;
            const int q0 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
            const int q1 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            w[l] = d * (float)scales[s] * (float)q0;
            w[l + 32] = d * (float)scales[s + 2] * (float)q1;
            w[l + 64] = d * (float)scales[s + 4] * (float)q2;
            w[l + 96] = d * (float)scales[s + 6] * (float)q3;
        }
        w += 128;
        ql += 64;
        qh += 32;
        scales += 8;
    }
}

/* the 256 weights of a Q2_K super-block (each product exact: one rounding, the subtraction). Weight
   128h + 32g + l: bits 2g, 2g + 1 of qs[32h + l], sub-block (128h + 32g + l) / 16; loops over l unit-stride */
static inline void gguf_q2_k_block(const uint8_t *blk, float *w) {
    const uint8_t *scales = blk;
    const float d = gguf_half(blk + 80), dmin = gguf_half(blk + 82);
    for (int h = 0; h < 2; h++) {
        const uint8_t *q = blk + 16 + 32 * h;
        for (int g = 0; g < 4; g++)
            for (int half = 0; half < 2; half++) {
                const uint8_t sc = scales[8 * h + 2 * g + half];
                const float dl = d * (float)(sc & 0x0f), ml = dmin * (float)(sc >> 4);
                float *out = w + 128 * h + 32 * g + 16 * half;
                for (int l = 0; l < 16; l++) out[l] = dl * (float)((q[16 * half + l] >> (2 * g)) & 3) - ml;
            }
    }
}

/* the 256 weights of a Q3_K super-block (exact products of d): as Q2_K's 2 bits, less 4 where bit 4h + g of
   hmask[l] is clear; sub-block scales 6 bits, their low 4 in nibbles of scales[0..8), high 2 in scales[8..12) */
static inline void gguf_q3_k_block(const uint8_t *blk, float *w) {
    const uint8_t *hmask = blk, *sc = blk + 96;
    const float d = gguf_half(blk + 108);
    for (int h = 0; h < 2; h++) {
        const uint8_t *q = blk + 32 + 32 * h;
        for (int g = 0; g < 4; g++)
            for (int half = 0; half < 2; half++) {
                const int s = 8 * h + 2 * g + half;
                const int low = s < 8 ? sc[s] & 0x0f : sc[s - 8] >> 4;
                const float dl = d * (float)((low | ((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4) - 32);
                float *out = w + 128 * h + 32 * g + 16 * half;
                const uint8_t *hm = hmask + 16 * half;
                for (int l = 0; l < 16; l++) {
                    const int v = ((q[16 * half + l] >> (2 * g)) & 3) - (((hm[l] >> (4 * h + g)) & 1) ? 0 : 4);
                    out[l] = dl * (float)v;
                }
            }
    }
}

/* 32 weights of a non-linear 4-bit type from their 16 bytes of nibbles: w[i] = scale * table[q[i]] (exact) */
static inline void gguf_table_run(const int8_t *table, float scale, const uint8_t *qs, float *w) {
    for (int j = 0; j < 16; j++) {
        w[j] = scale * (float)table[qs[j] & 0x0f];
        w[j + 16] = scale * (float)table[qs[j] >> 4];
    }
}

/* the k weights of a row of IQ4_NL, IQ4_XS or MXFP4 */
static inline void gguf_table_row(int type, const uint8_t *row, int64_t k, float *out) {
    const int8_t *table = gguf_kvalues(type);
    if (type == GGUF_IQ4_XS) {
        for (int64_t b = 0; b < k / 256; b++) {
            const uint8_t *blk = row + b * 136;
            const float d = gguf_half(blk);
            uint16_t h;
            memcpy(&h, blk + 2, 2);
            for (int j = 0; j < 8; j++)
                gguf_table_run(table, d * (float)(gguf_iq4_xs_scale(h, blk + 4, j) - 32), blk + 8 + 16 * j,
                               out + b * 256 + 32 * j);
        }
        return;
    }
    const int64_t block_bytes = gguf_block_bytes(type), at = type == GGUF_MXFP4 ? 1 : 2;
    for (int64_t b = 0; b < k / 32; b++) {
        const uint8_t *blk = row + b * block_bytes;
        gguf_table_run(table, type == GGUF_MXFP4 ? gguf_e8m0_half(blk[0]) : gguf_half(blk), blk + at, out + b * 32);
    }
}

#if SIMD_F32X8
#define GGUF_VECTOR 1
/* the 32 weights of one block as four 8-lane vectors: w[0] = weights 0..7, ... w[3] = 24..31 */
static inline __attribute__((always_inline)) void gguf_block_vec(int type, const uint8_t *blk, f32x8 w[4]) {
    const f32x8 d = f32x8_set1(gguf_half(blk));
    if (type == GGUF_Q8_0) {
        for (int c = 0; c < 4; c++) {
            w[c] = f32x8_mul(d, f32x8_load_i8(blk + 2 + 8 * c));
        }
        return;
    }
    const f32x8 m = f32x8_set1(gguf_block_min(type, blk, gguf_half(blk)));
    const u8x16 bytes = u8x16_load(blk + gguf_quants_at(type));
    u8x16 low = u8x16_nib_lo(bytes);   /* weights 0..15 */
    u8x16 high = u8x16_nib_hi(bytes);  /* weights 16..31 */
    if (type == GGUF_Q5_0 || type == GGUF_Q5_1) {
        const uint32_t qh = gguf_q5_high(type, blk);
        low = u8x16_or(low, u8x16_bits_to_16s(qh & 0xffff));
        high = u8x16_or(high, u8x16_bits_to_16s(qh >> 16));
    }
    const u8x16 parts[4] = {low, u8x16_upper8(low), high, u8x16_upper8(high)};
    for (int c = 0; c < 4; c++) w[c] = f32x8_fma(f32x8_from_u8(parts[c]), d, m);
}

#endif

/* the k weights of one row of `type` (k a multiple of GGUF_BLOCK, and of 256 for the k-quants) */
static inline void gguf_row(int type, const uint8_t *row, int64_t k, float *out) {
    if (is_table_type(type)) {
        gguf_table_row(type, row, k, out);
        return;
    }
    switch (type) {
        case GGUF_Q2_K:
            for (int64_t b = 0; b < k / 256; b++) gguf_q2_k_block(row + b * 84, out + b * 256);
            return;
        case GGUF_Q3_K:
            for (int64_t b = 0; b < k / 256; b++) gguf_q3_k_block(row + b * 110, out + b * 256);
            return;
        case GGUF_Q4_K:
        case GGUF_Q5_K:
            for (int64_t b = 0; b < k / 256; b++) gguf_q45_k_block(row + b * gguf_block_bytes(type), type == GGUF_Q5_K, out + b * 256);
            return;
        case GGUF_Q6_K:
            for (int64_t b = 0; b < k / 256; b++) gguf_q6_k_block(row + b * 210, out + b * 256);
            return;
        case GGUF_F16:
            for (int64_t i = 0; i < k; i++) out[i] = gguf_half(row + 2 * i);
            return;
        case GGUF_BF16:
            for (int64_t i = 0; i < k; i++) {
                const uint32_t bits = (uint32_t)(row[2 * i] | (row[2 * i + 1] << 8)) << 16;
                memcpy(out + i, &bits, 4);
            }
            return;
        default:
            break;
    }
    const int64_t block_bytes = gguf_block_bytes(type);
    for (int64_t b = 0; b < k / GGUF_BLOCK; b++) {
#ifdef GGUF_VECTOR
        f32x8 wv[4];
        gguf_block_vec(type, row + b * block_bytes, wv);
        for (int i = 0; i < 4; i++) f32x8_store(out + b * GGUF_BLOCK + 8 * i, wv[i]);
#else
        gguf_block_scalar(type, row + b * block_bytes, out + b * GGUF_BLOCK);
#endif
    }
}

#endif
