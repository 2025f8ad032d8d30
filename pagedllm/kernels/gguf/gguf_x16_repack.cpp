/*
 * The x16 layout's load-time side (gguf_x16.h draws it): GGUF blocks, and
 * the grouped int8 / int4 of weights quantized at load, rewritten in place
 * 16 output channels at a time, and a row read back as float32 (embedding
 * lookups over a tied x16 table). Plain C: this runs once per weight, at
 * load; the matmuls over the result are gguf_x16_matmul.cpp.
 */
#include "gguf_x16.h"

#include <math.h>
#include <string.h>

/* ---- the layout (gguf_x16.h) ---- */

/* quant n (0..31) of a raw Q4 block's 16 bytes */
static inline int raw_q4(const uint8_t *qs, int n) { return n < 16 ? qs[n] & 0x0f : qs[n - 16] >> 4; }

static inline bool is_q5(int type) { return type == GGUF_Q5_0 || type == GGUF_Q5_1; }

/* quant n (0..31) of a raw Q4_0 / Q4_1 / Q5_0 / Q5_1 block, unsigned (Q5: with its fifth bit) */
static inline int raw_quant(int type, const uint8_t *blk, int n) {
    const int low = raw_q4(blk + gguf_quants_at(type), n);
    return is_q5(type) ? low | (int)((gguf_q5_high(type, blk) >> n) & 1) << 4 : low;
}

/* one tile block from the 16 raw blocks src[c] (c = 0..15) of ggml `type` */
static void interleave_block(int type, uint8_t *const *src, uint8_t *dst) {
    for (int c = 0; c < X16_TILE; c++) {
        if (type == GGUF_MXFP4) {
            dst[c] = src[c][0];                                                 // e
            continue;
        }
        memcpy(dst + 2 * c, src[c], 2);                                         // d
        if (gguf_has_min(type)) memcpy(dst + 32 + 2 * c, src[c] + 2, 2);        // m
    }
    uint8_t *qs = dst + tile_head_bytes(type);
    for (int c = 0; c < X16_TILE; c++) {
        if (type == GGUF_Q8_0) {
            const uint8_t *q = src[c] + 2;
            for (int n = 0; n < 32; n++) qs[64 * (n / 4) + 4 * c + n % 4] = (uint8_t)(q[n] ^ 0x80);
            continue;
        }
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4; i++) {
                const int lo = raw_quant(type, src[c], 8 * j + i), hi = raw_quant(type, src[c], 8 * j + 4 + i);
                qs[64 * j + 4 * c + i] = (uint8_t)((lo & 0x0f) | (hi & 0x0f) << 4);
                if (!is_q5(type)) continue;
                uint8_t *top = qs + 256 + 4 * c + i;  // the fifth bits, as a Q5_K run's (gguf_x16.h)
                if (j == 0) *top = 0;
                *top |= (uint8_t)((lo >> 4) << j | (hi >> 4) << (4 + j));
            }
    }
}

/* the raw block of channel c from a tile block (the inverse of interleave_block) */
static void raw_block(int type, const uint8_t *tile_block, int c, uint8_t *dst) {
    if (type == GGUF_MXFP4) dst[0] = tile_block[c];
    else memcpy(dst, tile_block + 2 * c, 2);
    if (gguf_has_min(type)) memcpy(dst + 2, tile_block + 32 + 2 * c, 2);
    const uint8_t *qs = tile_block + tile_head_bytes(type);
    uint8_t *q = dst + gguf_quants_at(type);
    if (type == GGUF_Q8_0) {
        for (int n = 0; n < 32; n++) q[n] = (uint8_t)(qs[64 * (n / 4) + 4 * c + n % 4] ^ 0x80);
        return;
    }
    int v[32];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) {
            const int top = is_q5(type) ? qs[256 + 4 * c + i] : 0;
            v[8 * j + i] = (qs[64 * j + 4 * c + i] & 0x0f) | ((top >> j) & 1) << 4;
            v[8 * j + 4 + i] = (qs[64 * j + 4 * c + i] >> 4) | ((top >> (4 + j)) & 1) << 4;
        }
    uint32_t qh = 0;
    for (int n = 0; n < 16; n++) q[n] = (uint8_t)((v[n] & 0x0f) | (v[n + 16] & 0x0f) << 4);
    for (int n = 0; n < 32; n++) qh |= (uint32_t)(v[n] >> 4) << n;
    if (is_q5(type)) memcpy(dst + (type == GGUF_Q5_1 ? 4 : 2), &qh, 4);
}

/* ---- the k-quants' layout ---- */

/* the 256 quants of a raw k-quant super-block, unsigned: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 */
static void unpack_raw_kquants(int type, const uint8_t *blk, int *q) {
    if (type == GGUF_Q6_K) {
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
            int *out = q + 128 * half;
            for (int l = 0; l < 32; l++) {
                out[l] = (ql[l] & 0x0f) | (qh[l] & 3) << 4;
                out[l + 32] = (ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4;
                out[l + 64] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
                out[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
            }
        }
        return;
    }
    const uint8_t *qs = blk + (type == GGUF_Q5_K ? 48 : 16), *qh = blk + 16;
    for (int pair = 0; pair < 4; pair++)
        for (int l = 0; l < 32; l++) {
            const int byte = qs[32 * pair + l];
            q[64 * pair + l] = byte & 0x0f;
            q[64 * pair + 32 + l] = byte >> 4;
            if (type == GGUF_Q5_K) {
                q[64 * pair + l] |= ((qh[l] >> (2 * pair)) & 1) << 4;
                q[64 * pair + 32 + l] |= ((qh[l] >> (2 * pair + 1)) & 1) << 4;
            }
        }
}

/* the quants q[256] written into a raw k-quant super-block (its quant bytes zeroed first) */
static void pack_raw_kquants(int type, const int *q, uint8_t *blk) {
    if (type == GGUF_Q6_K) {
        memset(blk, 0, 192);
        for (int n = 0; n < 256; n++) {
            const int half = n / 128, p = n % 128, l = p % 32, g = p / 32;
            blk[64 * half + l + (g & 1) * 32] |= (uint8_t)((q[n] & 0x0f) << (g < 2 ? 0 : 4));
            blk[128 + 32 * half + l] |= (uint8_t)((q[n] >> 4) << (2 * g));
        }
        return;
    }
    uint8_t *qs = blk + (type == GGUF_Q5_K ? 48 : 16);
    memset(qs, 0, 128);
    if (type == GGUF_Q5_K) memset(blk + 16, 0, 32);
    for (int n = 0; n < 256; n++) {
        const int sub = n / 32, l = n % 32;
        qs[32 * (sub / 2) + l] |= (uint8_t)((q[n] & 0x0f) << (sub % 2 ? 4 : 0));
        if (type == GGUF_Q5_K) blk[16 + l] |= (uint8_t)(((q[n] >> 4) & 1) << sub);
    }
}

/* one tile super-block from the 16 raw super-blocks raw[c] of k-quant `type` (to_tile; c0 = 0, c1 = 16),
   or back: channels [c0, c1)'s raw super-blocks from the tile's, into raw[c] */
static void move_kblock(int type, uint8_t *const *raw, uint8_t *tile, bool to_tile, int c0, int c1) {
    if (to_tile) memset(tile + kq_qs_offset(type, 0), 0, (size_t)(X16_TILE * gguf_block_bytes(type) - kq_qs_offset(type, 0)));
    for (int c = c0; c < c1; c++) {
        uint8_t *src = raw[c];
        // headers: fp16 d (and dmin), the packed scales byte by byte
        const int num_halves = type == GGUF_Q6_K ? 1 : 2, num_scales = type == GGUF_Q6_K ? 16 : 12;
        uint8_t *src_halves = type == GGUF_Q6_K ? src + 208 : src, *src_scales = type == GGUF_Q6_K ? src + 192 : src + 4;
        uint8_t *tile_scales = tile + 32 * num_halves;
        for (int i = 0; i < num_halves; i++) {
            if (to_tile) memcpy(tile + 32 * i + 2 * c, src_halves + 2 * i, 2);
            else memcpy(src_halves + 2 * i, tile + 32 * i + 2 * c, 2);
        }
        for (int i = 0; i < num_scales; i++) {
            if (to_tile) tile_scales[16 * i + c] = src_scales[i];
            else src_scales[i] = tile_scales[16 * i + c];
        }
        int q[256];
        if (to_tile) unpack_raw_kquants(type, src, q);
        for (int j = 0; j < 8; j++)
            for (int u = 0; u < 4; u++)
                for (int i = 0; i < 4; i++) {
                    int *lo = q + 32 * j + 8 * u + i, *hi = lo + 4;  // the pair one chunk byte holds
                    uint8_t *byte = tile + kq_qs_offset(type, j) + 64 * u + 4 * c + i;
                    uint8_t *top = tile + kq_qh_offset(type, j) + (type == GGUF_Q6_K ? 64 * (u / 2) : 0) + 4 * c + i;
                    const int shift = type == GGUF_Q6_K ? 4 * (u % 2) : u, bits = type == GGUF_Q6_K ? 3 : 1,
                              step = type == GGUF_Q6_K ? 2 : 4;
                    if (to_tile) {
                        *byte = (uint8_t)((*lo & 0x0f) | (*hi & 0x0f) << 4);
                        if (type != GGUF_Q4_K) *top |= (uint8_t)((*lo >> 4) << shift | (*hi >> 4) << (shift + step));
                    } else {
                        *lo = *byte & 0x0f;
                        *hi = *byte >> 4;
                        if (type != GGUF_Q4_K) {
                            *lo |= ((*top >> shift) & bits) << 4;
                            *hi |= ((*top >> (shift + step)) & bits) << 4;
                        }
                    }
                }
        if (!to_tile) pack_raw_kquants(type, q, src);
    }
}

/* ---- Q2_K and Q3_K's layout ---- */

/* a raw Q2_K / Q3_K super-block's 256 quants' low 2 bits, and (Q3_K) their high bits: weight 128h + 32g + l
   is bits 2g, 2g + 1 of qs[32h + l] and bit 4h + g of hmask[l] */
static void unpack_raw_lowk(int type, const uint8_t *blk, int *q2, int *hbit) {
    const uint8_t *qs = blk + (type == GGUF_Q3_K ? 32 : 16);
    for (int n = 0; n < 256; n++) {
        const int h = n / 128, g = n % 128 / 32, l = n % 32;
        q2[n] = (qs[32 * h + l] >> (2 * g)) & 3;
        hbit[n] = type == GGUF_Q3_K ? (blk[l] >> (4 * h + g)) & 1 : 0;
    }
}

static void pack_raw_lowk(int type, const int *q2, const int *hbit, uint8_t *blk) {
    uint8_t *qs = blk + (type == GGUF_Q3_K ? 32 : 16);
    memset(qs, 0, 64);
    if (type == GGUF_Q3_K) memset(blk, 0, 32);
    for (int n = 0; n < 256; n++) {
        const int h = n / 128, g = n % 128 / 32, l = n % 32;
        qs[32 * h + l] |= (uint8_t)(q2[n] << (2 * g));
        if (type == GGUF_Q3_K) blk[l] |= (uint8_t)(hbit[n] << (4 * h + g));
    }
}

/* one tile super-block from the 16 raw super-blocks raw[c] of Q2_K / Q3_K (to_tile; c0 = 0, c1 = 16), or
   back: channels [c0, c1)'s raw super-blocks from the tile's, into raw[c]. Q2_K: d[16] | dmin[16] |
   scales[16 sub-blocks][16]; Q3_K: d[16] | S[12][16]; then 8 runs, chunk u (inputs 4u..4u + 3) of run j
   at bits 2 (u % 4) of vector u / 4, byte 4c + i, and (Q3_K) its high bits at bit u of the third */
static void move_lowk_block(int type, uint8_t *const *raw, uint8_t *tile, bool to_tile, int c0, int c1) {
    const bool q3 = type == GGUF_Q3_K;
    if (to_tile) memset(tile + lk_run_offset(type, 0), 0, (size_t)(8 * lk_run_bytes(type)));
    for (int c = c0; c < c1; c++) {
        uint8_t *src = raw[c];
        uint8_t *halves = src + (q3 ? 108 : 80), *scales = src + (q3 ? 96 : 0);
        const int num_halves = q3 ? 1 : 2, num_scales = q3 ? 12 : 16, scales_at = 32 * num_halves;
        for (int i = 0; i < num_halves; i++) {
            if (to_tile) memcpy(tile + 32 * i + 2 * c, halves + 2 * i, 2);
            else memcpy(halves + 2 * i, tile + 32 * i + 2 * c, 2);
        }
        for (int i = 0; i < num_scales; i++) {
            if (to_tile) tile[scales_at + 16 * i + c] = scales[i];
            else scales[i] = tile[scales_at + 16 * i + c];
        }
        int q2[256], hbit[256];
        if (to_tile) unpack_raw_lowk(type, src, q2, hbit);
        for (int n = 0; n < 256; n++) {
            const int j = n / 32, u = n % 32 / 4, i = n % 4;
            uint8_t *lo = tile + lk_run_offset(type, j) + 64 * (u / 4) + 4 * c + i, *hi = tile + lk_run_offset(type, j) + 128 + 4 * c + i;
            if (to_tile) {
                *lo |= (uint8_t)(q2[n] << (2 * (u % 4)));
                if (q3) *hi |= (uint8_t)(hbit[n] << u);
            } else {
                q2[n] = (*lo >> (2 * (u % 4))) & 3;
                hbit[n] = q3 ? (*hi >> u) & 1 : 0;
            }
        }
        if (!to_tile) pack_raw_lowk(type, q2, hbit, src);
    }
}

/* ---- IQ4_XS's layout ---- */

/* one tile super-block from the 16 raw IQ4_XS super-blocks raw[c] (to_tile; c0 = 0, c1 = 16), or back:
   channels [c0, c1)'s raw super-blocks from the tile's. d[16] | S[6][16] (byte i of channel c's scales_h,
   scales_l at S[i][c]) | 8 runs, each an IQ4_NL block's 32 nibbles in Q4's chunk order */
static void move_iq4xs_block(uint8_t *const *raw, uint8_t *tile, bool to_tile, int c0, int c1) {
    for (int c = c0; c < c1; c++) {
        uint8_t *src = raw[c];
        if (to_tile) memcpy(tile + 2 * c, src, 2);
        else memcpy(src, tile + 2 * c, 2);
        for (int i = 0; i < 6; i++) {
            uint8_t *byte = tile + IQ4XS_SCALES + 16 * i + c;
            if (to_tile) *byte = src[2 + i];
            else src[2 + i] = *byte;
        }
        for (int j = 0; j < 8; j++) {
            uint8_t *qs = src + 8 + 16 * j, *run = tile + iq4xs_run_offset(j);
            int q[32];
            if (to_tile)
                for (int n = 0; n < 32; n++) q[n] = raw_q4(qs, n);
            for (int u = 0; u < 4; u++)
                for (int i = 0; i < 4; i++) {
                    uint8_t *byte = run + 64 * u + 4 * c + i;
                    if (to_tile) {
                        *byte = (uint8_t)(q[8 * u + i] | q[8 * u + 4 + i] << 4);
                    } else {
                        q[8 * u + i] = *byte & 0x0f;
                        q[8 * u + 4 + i] = *byte >> 4;
                    }
                }
            if (!to_tile)
                for (int n = 0; n < 16; n++) qs[n] = (uint8_t)(q[n] | q[n + 16] << 4);
        }
    }
}

/* the tile super-block's way in and out, by type */
static void move_block256(int type, uint8_t *const *raw, uint8_t *tile, bool to_tile, int c0, int c1) {
    if (type == GGUF_IQ4_XS) move_iq4xs_block(raw, tile, to_tile, c0, c1);
    else if (type == GGUF_Q2_K || type == GGUF_Q3_K) move_lowk_block(type, raw, tile, to_tile, c0, c1);
    else move_kblock(type, raw, tile, to_tile, c0, c1);
}

/* ---- the grouped types' layout ---- */

/* one tile group from the 16 raw groups src[c] of GROUP_I8 / GROUP_I4 `type`, `group` weights each */
static void interleave_group(int type, uint8_t *const *src, uint8_t *dst, int64_t group) {
    const int raw_head = type == GROUP_I4 ? 8 : 4, raw_run = type == GROUP_I8 ? 32 : 16;
    for (int c = 0; c < X16_TILE; c++) {
        memcpy(dst + 4 * c, src[c], 4);                                  // scale
        if (type == GROUP_I4) memcpy(dst + 64 + 4 * c, src[c] + 4, 4);   // min
        for (int64_t j = 0; j < group / GGUF_BLOCK; j++) {
            const uint8_t *q = src[c] + raw_head + raw_run * j;
            uint8_t *run = dst + group_head_bytes(type) + group_run_bytes(type) * j;
            if (type == GROUP_I8) {
                for (int n = 0; n < 32; n++) run[64 * (n / 4) + 4 * c + n % 4] = (uint8_t)(q[n] ^ 0x80);
                continue;
            }
            for (int u = 0; u < 4; u++)
                for (int i = 0; i < 4; i++)
                    run[64 * u + 4 * c + i] = (uint8_t)(raw_q4(q, 8 * u + i) | raw_q4(q, 8 * u + 4 + i) << 4);
        }
    }
}

void gguf_x16_interleave(uint8_t *weight, int type, int64_t in_features, int64_t group, int64_t tile0, int64_t tile1) {
    const bool grouped = is_group_type(type);
    const int64_t block_bytes = grouped ? group_block_bytes(type, group) : gguf_block_bytes(type);
    const int64_t num_blocks = in_features / (grouped ? group : gguf_block_weights(type));
    const int64_t row_bytes = num_blocks * block_bytes, tile_bytes = X16_TILE * row_bytes;
    uint8_t *copy = new uint8_t[tile_bytes];  // the tile's rows in their blocks' own order
    for (int64_t t = tile0; t < tile1; t++) {
        uint8_t *tile = weight + t * tile_bytes;
        memcpy(copy, tile, (size_t)tile_bytes);
        for (int64_t b = 0; b < num_blocks; b++) {
            uint8_t *src[X16_TILE], *dst = tile + b * X16_TILE * block_bytes;
            for (int c = 0; c < X16_TILE; c++) src[c] = copy + c * row_bytes + b * block_bytes;
            if (grouped)
                interleave_group(type, src, dst, group);
            else if (gguf_block_weights(type) == 256)
                move_block256(type, src, dst, true, 0, X16_TILE);
            else
                interleave_block(type, src, dst);
        }
    }
    delete[] copy;
}

/* row `row` of an x16 GROUP_I8 / GROUP_I4 table as float32: what the groups' own order gives (one rounding a
   weight: scale q, or fma(q, scale, min)) */
static void group_x16_row(int type, const uint8_t *table, int64_t row, int64_t in_features, int64_t group,
                          float *out) {
    const int64_t group_bytes = group_block_bytes(type, group), num_groups = in_features / group, c = row % X16_TILE;
    const uint8_t *tile = table + row / X16_TILE * X16_TILE * num_groups * group_bytes;
    for (int64_t g = 0; g < num_groups; g++) {
        const uint8_t *blk = tile + g * X16_TILE * group_bytes;
        float scale, min = 0.0f;
        memcpy(&scale, blk + 4 * c, 4);
        if (type == GROUP_I4) memcpy(&min, blk + 64 + 4 * c, 4);
        for (int64_t j = 0; j < group / GGUF_BLOCK; j++) {
            const uint8_t *run = blk + group_head_bytes(type) + group_run_bytes(type) * j;
            float *w = out + g * group + j * GGUF_BLOCK;
            if (type == GROUP_I8) {
                for (int n = 0; n < 32; n++) w[n] = scale * (float)(int8_t)(run[64 * (n / 4) + 4 * c + n % 4] ^ 0x80);
                continue;
            }
            for (int u = 0; u < 4; u++)
                for (int i = 0; i < 4; i++) {
                    const int byte = run[64 * u + 4 * c + i];
                    w[8 * u + i] = fmaf((float)(byte & 0x0f), scale, min);
                    w[8 * u + 4 + i] = fmaf((float)(byte >> 4), scale, min);
                }
        }
    }
}

void gguf_x16_row(int x16_type, const uint8_t *table, int64_t row, int64_t in_features, int64_t group, float *out) {
    const int type = x16_base_type(x16_type);
    if (is_group_type(type)) {
        group_x16_row(type, table, row, in_features, group, out);
        return;
    }
    const int64_t block_bytes = gguf_block_bytes(type), block_weights = gguf_block_weights(type);
    const int64_t num_blocks = in_features / block_weights, c = row % X16_TILE;
    const uint8_t *tile = table + row / X16_TILE * X16_TILE * num_blocks * block_bytes;
    uint8_t raw[210];  // channel c's raw block (Q6_K's are the largest)
    uint8_t *raws[X16_TILE];
    for (int i = 0; i < X16_TILE; i++) raws[i] = raw;
    for (int64_t b = 0; b < num_blocks; b++) {
        uint8_t *tile_block = (uint8_t *)tile + b * X16_TILE * block_bytes;
        if (block_weights == 256)
            move_block256(type, raws, tile_block, false, (int)c, (int)c + 1);
        else
            raw_block(type, tile_block, (int)c, raw);
        gguf_row(type, raw, block_weights, out + b * block_weights);
    }
}
