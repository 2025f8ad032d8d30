/*
 * Linear layers and embedding lookups over quantized blocks: GGUF's, kept as
 * the file stores them, and pagedllm's grouped int8 / int4 (GROUP_I8,
 * GROUP_I4: float checkpoints quantized at load, quantization="int8" /
 * "int4"); gguf_blocks.h draws the formats:
 *
 *   y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n])     x: [M, K] float32
 *   W: [N, row bytes] of one block type, one row per output channel (its blocks,
 *      or its groups of group_size weights, back to back)
 *
 * Work comes in strips of STRIP output channels. A thread turns a strip's
 * blocks into float32 rows in a buffer of its own ([STRIP, K], a few KiB:
 * L1), then runs every row of x against it, TILE_M rows at a time, each
 * (row, channel) pair keeping one vector of partial sums over k:
 *
 *   strip of channels c0..c0+STRIP      x rows r0..r0+TILE_M
 *   buf[c][k..k+V]  (V-lane loads)  x  x[r][k..k+V]   -> acc[r][c] += (lanes)
 *   y[r][c0 + c] = sum of acc[r][c]'s lanes (+ bias)
 *
 * The weights stream from memory once per call in their quantized bytes (a
 * quarter to an eighth of float32's: decode is bound by them), and are
 * dequantized once per call, not once per row. Every (row, channel) sum
 * adds the same terms in the same order whatever the other rows are (one
 * row alone, which skips the buffer, too: direct_row, group_direct_row), so
 * a sequence's logits do not depend on its batch. Long inputs (prefills) go
 * in blocks of rows whose activations stay in L2, a strip dequantized again
 * per block.
 */
#include <omp.h>
#include <stdlib.h>

#include "gguf_blocks.h"
#include "gguf_moe.h"
#include "gguf_x16.h"
#include "../step/step_nodes.h"

/* strips and tiles per ISA; V: lanes of the build's widest float vector (simd.h), where it has one */
#if SIMD_F32_WIDTH == 16
#define STRIP 4
#define TILE_M 6
#else
#define STRIP 3
#define TILE_M 4
#endif
#if SIMD_F32_WIDTH
#define V SIMD_F32_WIDTH
#endif

/* activations per block of rows: TILE_M-row tiles re-read it once per strip, so it should stay in L2 */
#define BLOCK_FLOATS (64 * 1024)

/* bytes of one row of k weights of `type` (group: the group size of a grouped type, unused for GGUF's) */
static inline int64_t blocks_row_bytes(int type, int64_t k, int64_t group) {
    if (is_group_type(type)) return k / group * group_block_bytes(type, group);
    return k / gguf_block_weights(type) * gguf_block_bytes(type);
}

#ifdef V
/* 32 int8 quants (signed) as V-lane float vectors: q[0] = quants 0.. */
static inline __attribute__((always_inline)) void quants_i8(const uint8_t *qs, vf32 *q) {
#if V == 16
    q[0] = f32x16_load_i8(qs);
    q[1] = f32x16_load_i8(qs + 16);
#else
    for (int i = 0; i < 4; i++) q[i] = f32x8_load_i8(qs + 8 * i);
#endif
}

/* 32 4-bit quants (16 bytes: byte j = q[j] | q[j + 16] << 4) as V-lane float vectors */
static inline __attribute__((always_inline)) void quants_u4(const uint8_t *qs, vf32 *q) {
    const u8x16 bytes = u8x16_load(qs);
    const u8x16 low = u8x16_nib_lo(bytes);   /* weights 0..15 */
    const u8x16 high = u8x16_nib_hi(bytes);  /* weights 16..31 */
#if V == 16
    q[0] = f32x16_from_u8(low);
    q[1] = f32x16_from_u8(high);
#else
    q[0] = f32x8_from_u8(low);
    q[1] = f32x8_from_u8(u8x16_upper8(low));
    q[2] = f32x8_from_u8(high);
    q[3] = f32x8_from_u8(u8x16_upper8(high));
#endif
}

/* What a group's runs are dequantized with: GROUP_I8 its scale (a); GROUP_I4 its scale (a) and min (b),
   or on AVX-512 the 16 values its quants stand for, b[q] = fma(q, scale, min), which vpermps looks up by
   each lane's low 4 bits: two lookups per run in place of two conversions and two fmas. */
typedef struct {
    vf32 a, b;
} group_coef;

static inline __attribute__((always_inline)) group_coef group_coefs(int type, const uint8_t *blk) {
    float d, m = 0.0f;
    memcpy(&d, blk, 4);
    if (type == GROUP_I4) memcpy(&m, blk + 4, 4);
    group_coef g = {vf32_set1(d), vf32_set1(m)};
#if V == 16
    if (type == GROUP_I4)
        g.b = vf32_fma(f32x16_iota(), g.a, g.b);
#endif
    return g;
}

/* weights 32r..32r+32 of one group of a grouped type as V-lane vectors: the values group_block_scalar
   gives, one rounding each */
static inline __attribute__((always_inline)) void group_run(int type, const uint8_t *blk, int64_t r, group_coef g,
                                                            vf32 *w) {
    constexpr int NQ = GGUF_BLOCK / V;
    if (type == GROUP_I8) {
        quants_i8(blk + 4 + 32 * r, w);
        for (int i = 0; i < NQ; i++) w[i] = vf32_mul(w[i], g.a);
        return;
    }
#if V == 16
    f32x16_lookup_u4(blk + 8 + 16 * r, g.b, w);  // low nibbles: weights 0..15, high nibbles: 16..31
#else
    quants_u4(blk + 8 + 16 * r, w);
    for (int i = 0; i < NQ; i++) w[i] = vf32_fma(w[i], g.a, g.b);
#endif
}
#endif

/* the k weights of one row of a grouped type, in order */
static void group_row(int type, const uint8_t *row, int64_t k, int64_t group, float *out) {
    const int64_t block_bytes = group_block_bytes(type, group);
    for (int64_t b = 0; b < k / group; b++) {
        const uint8_t *blk = row + b * block_bytes;
#ifdef V
        const group_coef g = group_coefs(type, blk);
        for (int64_t r = 0; r < group / GGUF_BLOCK; r++) {
            vf32 w[GGUF_BLOCK / V];
            group_run(type, blk, r, g, w);
            for (int i = 0; i < GGUF_BLOCK / V; i++) vf32_store(out + b * group + r * GGUF_BLOCK + i * V, w[i]);
        }
#else
        group_block_scalar(type, blk, group, out + b * group);
#endif
    }
}

/* the k weights of one row of any type the kernels take */
static inline void blocks_row(int type, const uint8_t *row, int64_t k, int64_t group, float *out) {
    if (is_group_type(type))
        group_row(type, row, k, group, out);
    else
        gguf_row(type, row, k, out);
}

/* channels [c0, c0 + nc) as float32 rows: buf [nc, k] */
static void dequantize_strip(const LinearNode *n, int64_t c0, int nc, int64_t row_bytes, float *buf) {
    for (int c = 0; c < nc; c++)
        blocks_row(n->weight_type, (const uint8_t *)n->weight + (c0 + c) * row_bytes, n->in_features, n->group_size,
                   buf + c * n->in_features);
}

/* y rows [0, MR) x channels [0, NR) of a strip: x [MR, k] (rows k apart), buf [NR, k], y rows ldy apart */
template <int MR, int NR>
static inline __attribute__((always_inline)) void strip_tile(const float *x, int64_t k, const float *buf,
                                                             const float *bias, float *y, int64_t ldy) {
#ifdef V
    vf32 acc[MR][NR];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) acc[r][c] = vf32_zero();
    for (int64_t kk = 0; kk < k; kk += V) {
        vf32 w[NR];
        for (int c = 0; c < NR; c++) w[c] = vf32_load(buf + c * k + kk);
        for (int r = 0; r < MR; r++) {
            const vf32 xv = vf32_load(x + r * k + kk);
            for (int c = 0; c < NR; c++) acc[r][c] = vf32_fma(w[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) y[r * ldy + c] = vf32_hsum(acc[r][c]) + (bias ? bias[c] : 0.0f);
#else
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) {
            float sum = 0.0f;
            for (int64_t kk = 0; kk < k; kk++) sum += buf[c * k + kk] * x[r * k + kk];
            y[r * ldy + c] = sum + (bias ? bias[c] : 0.0f);
        }
#endif
}

/* rows [0, m) against a strip of NR channels, TILE_M rows at a time */
template <int NR>
static void strip_rows(const float *x, int64_t m, int64_t k, const float *buf, const float *bias, float *y,
                       int64_t ldy) {
    int64_t r = 0;
    for (; r + TILE_M <= m; r += TILE_M) strip_tile<TILE_M, NR>(x + r * k, k, buf, bias, y + r * ldy, ldy);
    switch (m - r) {
#if TILE_M > 4
        case 5: strip_tile<5, NR>(x + r * k, k, buf, bias, y + r * ldy, ldy); break;
        case 4: strip_tile<4, NR>(x + r * k, k, buf, bias, y + r * ldy, ldy); break;
#endif
        case 3: strip_tile<3, NR>(x + r * k, k, buf, bias, y + r * ldy, ldy); break;
        case 2: strip_tile<2, NR>(x + r * k, k, buf, bias, y + r * ldy, ldy); break;
        case 1: strip_tile<1, NR>(x + r * k, k, buf, bias, y + r * ldy, ldy); break;
        default: break;
    }
}

#ifdef V
/* The 32 weights of a Q4_0 / Q4_1 / Q8_0 block as V-lane vectors: the values gguf_block_vec stores for
 * the strip path (Q8_0 d * q, Q4_0 / Q4_1 fma(q, d, m)), one rounding each, so that a lone row sums the
 * very terms a row in a batch sums. On AVX-512 a 4-bit block's 16 possible values are computed once,
 * table[q] = fma(q, d, m) (the same rounding), and looked up by each nibble (vpermps), as group_run does
 * for int4: two lookups in place of two widenings and two fmas, which kept a lone Q4 row as fast as the
 * factored form it replaces. */
static inline __attribute__((always_inline)) void block_weights(int type, const uint8_t *blk, vf32 *w) {
    constexpr int NQ = GGUF_BLOCK / V;
    const float d = gguf_half(blk);
    const vf32 dv = vf32_set1(d);
    if (type == GGUF_Q8_0) {
        quants_i8(blk + 2, w);
        for (int i = 0; i < NQ; i++) w[i] = vf32_mul(w[i], dv);
        return;
    }
    const vf32 mv = vf32_set1(gguf_block_min(type, blk, d));
#if V == 16
    f32x16_lookup_u4(blk + gguf_quants_at(type), vf32_fma(f32x16_iota(), dv, mv), w);
#else
    quants_u4(blk + gguf_quants_at(type), w);
    for (int i = 0; i < NQ; i++) w[i] = vf32_fma(w[i], dv, mv);
#endif
}

/* One row (decode of one sequence) against a strip of NR channels of a 32-weight block type. Each weight
 * is dequantized in registers (block_weights) and summed into one V-lane accumulator per channel in k
 * order, as strip_tile sums the strip buffer: the same bits as the same row in a batch (batch invariance,
 * docs/batch-invariance.md), without the buffer's stores and loads. (Factoring each block's scale out of
 * its sum, d * sum q x + m * sum x, rounds differently: on the Zen 5 here it was level on AVX-512 and
 * 6-15% faster per layer on AVX2, docs/batch-invariance.md#cost.) */
template <int NR>
static inline __attribute__((always_inline)) void direct_row(const float *x, int64_t k, const uint8_t *w,
                                                             int64_t row_bytes, int type, const float *bias,
                                                             float *y) {
    constexpr int NQ = GGUF_BLOCK / V;
    const int64_t block_bytes = gguf_block_bytes(type);
    vf32 acc[NR];
    for (int c = 0; c < NR; c++) acc[c] = vf32_zero();
    for (int64_t b = 0; b < k / GGUF_BLOCK; b++) {
        vf32 xv[NQ];
        for (int i = 0; i < NQ; i++) xv[i] = vf32_load(x + b * GGUF_BLOCK + i * V);
        for (int c = 0; c < NR; c++) {
            const uint8_t *blk = w + c * row_bytes + b * block_bytes;
            // NR rows are read side by side, a block (18-34 bytes) at a time: ask for each row's
            // bytes a few cache lines ahead, as the hardware prefetchers follow so many streams late
            simd_prefetch_l1((const char *)blk + 6 * 64);
            vf32 wv[NQ];
            block_weights(type, blk, wv);
            for (int i = 0; i < NQ; i++) acc[c] = vf32_fma(wv[i], xv[i], acc[c]);
        }
    }
    for (int c = 0; c < NR; c++) y[c] = vf32_hsum(acc[c]) + (bias ? bias[c] : 0.0f);
}

/* One row against a strip of NR channels of a grouped type. Each weight is dequantized in registers by
 * group_run, as group_row fills the strip buffer, and summed into one V-lane accumulator per channel in
 * k order, as strip_tile sums: the same bits as the strip path, without the buffer's stores and loads. */
template <int NR>
static inline __attribute__((always_inline)) void group_direct_row(const float *x, int64_t k, const uint8_t *w,
                                                                   int64_t row_bytes, int type, int64_t group,
                                                                   const float *bias, float *y) {
    constexpr int NQ = GGUF_BLOCK / V;
    const int64_t block_bytes = group_block_bytes(type, group), run_bytes = type == GROUP_I8 ? 32 : 16;
    vf32 acc[NR];
    for (int c = 0; c < NR; c++) acc[c] = vf32_zero();
    for (int64_t b = 0; b < k / group; b++) {
        group_coef g[NR];
        for (int c = 0; c < NR; c++) g[c] = group_coefs(type, w + c * row_bytes + b * block_bytes);
        for (int64_t r = 0; r < group / GGUF_BLOCK; r++) {
            vf32 xv[NQ];
            for (int i = 0; i < NQ; i++) xv[i] = vf32_load(x + b * group + r * GGUF_BLOCK + i * V);
            for (int c = 0; c < NR; c++) {
                const uint8_t *blk = w + c * row_bytes + b * block_bytes;
                // NR rows read side by side, each asked for ahead of use: int4 a strip ahead (the same
                // bytes of the thread's next strip), int8 six lines ahead, the distances that ran fastest
                // from memory on the Zen 5 here (int8 lost a third a strip ahead, int4 a fifth 6 lines ahead)
                simd_prefetch_l1((const char *)blk + run_bytes * r +
                                 (type == GROUP_I8 ? 6 * 64 : NR * row_bytes));
                vf32 wv[NQ];
                group_run(type, blk, r, g[c], wv);
                for (int i = 0; i < NQ; i++) acc[c] = vf32_fma(wv[i], xv[i], acc[c]);
            }
        }
    }
    for (int c = 0; c < NR; c++) y[c] = vf32_hsum(acc[c]) + (bias ? bias[c] : 0.0f);
}
#endif

/* whether one row skips the strip buffer: 32-weight GGUF types and the grouped types, vector builds */
static inline bool direct_type(int type) {
#ifdef V
    return type == GGUF_Q4_0 || type == GGUF_Q4_1 || type == GGUF_Q8_0 || is_group_type(type);
#else
    (void)type;
    return false;
#endif
}

/* each thread's strip buffer, kept for the process (a pool thread lives as long) */
static thread_local float *tls_strip = NULL;
static thread_local int64_t tls_strip_floats = 0;

static float *strip_buffer(int64_t floats) {
    if (tls_strip_floats < floats) {
        free(tls_strip);
        tls_strip = (float *)aligned_alloc(64, (size_t)((floats * sizeof(float) + 63) / 64 * 64));
        tls_strip_floats = tls_strip ? floats : 0;
    }
    return tls_strip;
}

#ifdef V
/* one row of a direct_type against strip s, no buffer */
static void direct_strip(const LinearNode *n, int64_t row_bytes, int64_t s) {
    const int64_t k = n->in_features, cols = n->out_features, c0 = s * STRIP;
    const int type = n->weight_type;
    const int nc = (int)(cols - c0 < STRIP ? cols - c0 : STRIP);
    const uint8_t *w = (const uint8_t *)n->weight + c0 * row_bytes;
    const float *bias = n->bias ? n->bias + c0 : NULL;
    float *y = n->y + c0;
    if (is_group_type(type)) {
        const int64_t g = n->group_size;
        switch (nc) {
#if STRIP > 3
            case 4: group_direct_row<4>(n->x, k, w, row_bytes, type, g, bias, y); break;
#endif
            case 3: group_direct_row<3>(n->x, k, w, row_bytes, type, g, bias, y); break;
            case 2: group_direct_row<2>(n->x, k, w, row_bytes, type, g, bias, y); break;
            default: group_direct_row<1>(n->x, k, w, row_bytes, type, g, bias, y); break;
        }
        return;
    }
    switch (nc) {
#if STRIP > 3
        case 4: direct_row<4>(n->x, k, w, row_bytes, type, bias, y); break;
#endif
        case 3: direct_row<3>(n->x, k, w, row_bytes, type, bias, y); break;
        case 2: direct_row<2>(n->x, k, w, row_bytes, type, bias, y); break;
        default: direct_row<1>(n->x, k, w, row_bytes, type, bias, y); break;
    }
}

/* one row of a direct_type, strip by strip */
static void direct_team(const LinearNode *n, int64_t row_bytes) {
    const int64_t num_strips = (n->out_features + STRIP - 1) / STRIP;
#pragma omp for schedule(static)
    for (int64_t s = 0; s < num_strips; s++) direct_strip(n, row_bytes, s);
}
#endif

/* rows [row0, row0 + m) against strip s, dequantized into buf ([STRIP, k]) first */
static void one_strip(const LinearNode *n, int64_t row_bytes, int64_t s, int64_t row0, int64_t m, float *buf) {
    const int64_t k = n->in_features, cols = n->out_features, c0 = s * STRIP;
    const int nc = (int)(cols - c0 < STRIP ? cols - c0 : STRIP);
    dequantize_strip(n, c0, nc, row_bytes, buf);
    const float *x = n->x + row0 * k, *bias = n->bias ? n->bias + c0 : NULL;
    float *y = n->y + row0 * cols + c0;
    switch (nc) {
#if STRIP > 3
        case 4: strip_rows<4>(x, m, k, buf, bias, y, cols); break;
#endif
        case 3: strip_rows<3>(x, m, k, buf, bias, y, cols); break;
        case 2: strip_rows<2>(x, m, k, buf, bias, y, cols); break;
        default: strip_rows<1>(x, m, k, buf, bias, y, cols); break;
    }
}

/* rows [row0, row0 + m): each strip dequantized into the thread's buffer, then every row against it */
static void strip_team(const LinearNode *n, int64_t row_bytes, int64_t row0, int64_t m, int *failed) {
    const int64_t k = n->in_features, num_strips = (n->out_features + STRIP - 1) / STRIP;
#pragma omp for schedule(static)
    for (int64_t s = 0; s < num_strips; s++) {
        float *buf = strip_buffer(STRIP * k);  // [STRIP, k]
        if (buf == NULL) {
#pragma omp atomic write
            *failed = 1;
            continue;
        }
        one_strip(n, row_bytes, s, row0, m, buf);
    }
}

/* rows per block of a long input: its activations stay in L2 while the strips pass (BLOCK_FLOATS) */
static int64_t strip_block_rows(int64_t k) {
    const int64_t block_rows = BLOCK_FLOATS / k / TILE_M * TILE_M;
    return block_rows < TILE_M ? TILE_M : block_rows;
}

void gguf_linear_team(const LinearNode *n, int64_t rows, int *failed) {
    if (is_x16_type(n->weight_type)) {  // 8-bit activations, integer dot products (gguf_x16_matmul.cpp)
        gguf_x16_linear_team(n, rows);
        return;
    }
    const int64_t k = n->in_features;
    const int64_t row_bytes = blocks_row_bytes(n->weight_type, k, n->group_size);
#ifdef V
    if (rows == 1 && direct_type(n->weight_type)) {
        direct_team(n, row_bytes);
        return;
    }
#endif
    const int64_t block_rows = strip_block_rows(k);
    for (int64_t row0 = 0; row0 < rows; row0 += block_rows)
        strip_team(n, row_bytes, row0, rows - row0 < block_rows ? rows - row0 : block_rows, failed);
}

int64_t gguf_strip_channels(void) { return STRIP; }

int gguf_linear_strips(const LinearNode *n, int64_t rows, int64_t s0, int64_t s1) {
    const int64_t k = n->in_features, row_bytes = blocks_row_bytes(n->weight_type, k, n->group_size);
#ifdef V
    if (rows == 1 && direct_type(n->weight_type)) {  // as gguf_linear_team: no buffer for one row
        for (int64_t s = s0; s < s1; s++) direct_strip(n, row_bytes, s);
        return 0;
    }
#endif
    float *buf = strip_buffer(STRIP * k);  // [STRIP, k]
    if (buf == NULL) return 1;
    const int64_t block_rows = strip_block_rows(k);
    for (int64_t row0 = 0; row0 < rows; row0 += block_rows)
        for (int64_t s = s0; s < s1; s++) one_strip(n, row_bytes, s, row0, rows - row0 < block_rows ? rows - row0 : block_rows, buf);
    return 0;
}

/* out[r] = the dequantized row index[r] of a quantized table */
void gguf_gather_team(const GgufGatherNode *n, int64_t rows) {
    if (is_x16_type(n->type)) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) gguf_x16_row(n->type, n->table, n->index[r], n->row_len, n->group_size,
                                                           n->out + r * n->row_len);
        return;
    }
    const int64_t row_bytes = blocks_row_bytes(n->type, n->row_len, n->group_size);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        blocks_row(n->type, n->table + n->index[r] * row_bytes, n->row_len, n->group_size, n->out + r * n->row_len);
}
