/* The bf16 panel tile of packed_linear_bf16.cpp (its comment draws the
 * layout) and the activation rounding.
 */
#ifndef PAGEDLLM_PANEL_BF16_H
#define PAGEDLLM_PANEL_BF16_H

#include <stdint.h>
#include <string.h>

#include "panel_units.h"
#include "../simd/simd.h"

#define BF_PANEL 48
#define BF_MR 8
#define CACHE_LINE 64

/* float32 -> bfloat16 bits, round to nearest even, NaN kept quiet, denormals
 * flushed to a signed zero: what AVX512-BF16's conversion instruction does,
 * so the vector and scalar paths round alike. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* one row of k floats -> kpad bf16 values (kpad = k rounded up to even; the pad is zero) */
static inline void row_to_bf16(const float *x, int64_t k, int64_t kpad, uint16_t *out) {
    int64_t j = 0;
#if defined(__AVX512BF16__)
    for (; j + 32 <= k; j += 32) {
        bf16x32_store_f32(out + j, f32x16_load(x + j), f32x16_load(x + j + 16));
    }
#endif
    for (; j < k; j++) out[j] = to_bf16(x[j]);
    for (; j < kpad; j++) out[j] = 0;
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* two bf16 values as one 32-bit lane; memcpy, not a cast, since the buffer was written as uint16_t */
static inline uint32_t load_pair(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512BF16__)
#define BF_NUM_VECS (BF_PANEL / 16)

/* num_rows (<= BF_MR) bf16 rows xp [rows, 2 * k2] times one panel, a pair of k at a time. */
static inline __attribute__((always_inline)) void bf_tile(
    const uint16_t *xp, int64_t k2, const uint16_t *b, float *y, int64_t ldy, const float *bias,
    int num_cols, const int num_rows, const char *prefetch, int64_t num_prefetch) {
    f32x16 acc[BF_MR][BF_NUM_VECS];
#pragma GCC unroll 8
    for (int r = 0; r < BF_MR; r++)
#pragma GCC unroll 8
        for (int c = 0; c < BF_NUM_VECS; c++) acc[r][c] = f32x16_zero();
#pragma GCC unroll 4
    for (int64_t kk = 0; kk < k2; kk++) {
        if (kk < num_prefetch) simd_prefetch_l2(prefetch + kk * CACHE_LINE);
        bf16x32 wv[BF_NUM_VECS];
#pragma GCC unroll 8
        for (int c = 0; c < BF_NUM_VECS; c++) wv[c] = bf16x32_load(b + (kk * BF_PANEL + c * 16) * 2);
#pragma GCC unroll 8
        for (int r = 0; r < BF_MR; r++) {
            if (r < num_rows) {
                bf16x32 a = bf16x32_set1_pair(load_pair(xp + (r * k2 + kk) * 2));
#pragma GCC unroll 8
                for (int c = 0; c < BF_NUM_VECS; c++) acc[r][c] = f32x16_dot_bf16(acc[r][c], a, wv[c]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < BF_MR; r++) {
        if (r >= num_rows) continue;
        if (num_cols == BF_PANEL) {
#pragma GCC unroll 8
            for (int c = 0; c < BF_NUM_VECS; c++) {
                f32x16 v = acc[r][c];
                if (bias) v = f32x16_add(v, f32x16_load(bias + c * 16));
                f32x16_store(y + r * ldy + c * 16, v);
            }
        } else { /* the last, zero-padded panel: only its real columns are written */
            float sums[BF_PANEL];
            for (int c = 0; c < BF_NUM_VECS; c++) f32x16_store(sums + c * 16, acc[r][c]);
            for (int j = 0; j < num_cols; j++) y[r * ldy + j] = sums[j] + (bias ? bias[j] : 0.0f);
        }
    }
}
#elif SIMD_F32X8
/* AVX2 has no bf16 dot product: widen instead. A bf16 value is the top half
 * of a float32, so one 32-bit lane holding a k pair (low: even k, high: odd k)
 * gives both floats with one shift and one mask:
 *
 *   lane = [ w(k+1) | w(k) ]   even = lane << 16 = w(k)   odd = lane & 0xffff0000 = w(k+1)
 *
 * Products of two bf16 values are exact in float32, so this computes the
 * AVX512-BF16 path's sums up to float32 rounding order. The tile runs in
 * sub-tiles of num_rows x num_vecs vectors of 8 columns, sized so that the
 * accumulators, the widened weights and the broadcast pair stay in the 16 ymm
 * registers: one row takes the whole panel (6 vectors: it streams each
 * panel once, in order), more rows go 4 x 2. Both counts are compile-time
 * constants at every call, so the loops unroll and nothing spills. */
#define BF_AVX2_MAX_ROWS 4

static inline __attribute__((always_inline)) void bf_subtile_avx2(
    const uint16_t *xp, int64_t k2, const uint16_t *b, float *y, int64_t ldy, const float *bias,
    const int col0, int num_cols, const int num_rows, const int num_vecs, const char *prefetch,
    int64_t num_prefetch) {
    f32x8 acc[BF_AVX2_MAX_ROWS][BF_PANEL / 8];
#pragma GCC unroll 8
    for (int r = 0; r < num_rows; r++)
#pragma GCC unroll 8
        for (int c = 0; c < num_vecs; c++) acc[r][c] = f32x8_zero();
    for (int64_t kk = 0; kk < k2; kk++) {
        if (kk < num_prefetch) simd_prefetch_l2(prefetch + kk * CACHE_LINE);
        const uint16_t *bk = b + (kk * BF_PANEL + col0) * 2;
#pragma GCC unroll 8
        for (int r = 0; r < num_rows; r++) {
            const i32x8 pair = i32x8_set1((int32_t)load_pair(xp + (r * k2 + kk) * 2));
            const f32x8 xe = f32x8_bf16_lo(pair), xo = f32x8_bf16_hi(pair);
#pragma GCC unroll 8
            for (int c = 0; c < num_vecs; c++) {
                const i32x8 v = i32x8_load(bk + c * 16);
                acc[r][c] = f32x8_fma(xe, f32x8_bf16_lo(v), acc[r][c]);
                acc[r][c] = f32x8_fma(xo, f32x8_bf16_hi(v), acc[r][c]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < num_rows; r++) {
        float sums[BF_PANEL];
#pragma GCC unroll 8
        for (int c = 0; c < num_vecs; c++) f32x8_store(sums + c * 8, acc[r][c]);
        for (int j = 0; j < num_vecs * 8 && col0 + j < num_cols; j++)
            y[r * ldy + col0 + j] = sums[j] + (bias ? bias[col0 + j] : 0.0f);
    }
}

static inline __attribute__((always_inline)) void bf_tile(
    const uint16_t *xp, int64_t k2, const uint16_t *b, float *y, int64_t ldy, const float *bias,
    int num_cols, const int num_rows, const char *prefetch, int64_t num_prefetch) {
    if (num_rows == 1) {
        bf_subtile_avx2(xp, k2, b, y, ldy, bias, 0, num_cols, 1, BF_PANEL / 8, prefetch, num_prefetch);
        return;
    }
    /* the next panel is prefetched once, by the first sub-tile */
#pragma GCC unroll 2
    for (int r0 = 0; r0 < num_rows; r0 += BF_AVX2_MAX_ROWS) {
        const int rows = num_rows - r0 < BF_AVX2_MAX_ROWS ? num_rows - r0 : BF_AVX2_MAX_ROWS;
#pragma GCC unroll 3
        for (int col0 = 0; col0 < BF_PANEL; col0 += 16) {
            if (col0 >= num_cols) break;
            const int64_t pf = (r0 == 0 && col0 == 0) ? num_prefetch : 0;
            bf_subtile_avx2(xp + r0 * k2 * 2, k2, b, y + r0 * ldy, ldy, bias, col0, num_cols, rows, 2, prefetch, pf);
        }
    }
}
#else
static void bf_tile(const uint16_t *xp, int64_t k2, const uint16_t *b, float *y, int64_t ldy, const float *bias,
                    int num_cols, int num_rows, const char *prefetch, int64_t num_prefetch) {
    (void)prefetch;
    (void)num_prefetch;
    for (int r = 0; r < num_rows; r++)
        for (int j = 0; j < num_cols; j++) {
            float sum = 0.0f;
            for (int64_t kk = 0; kk < k2; kk++) {
                const uint16_t *xq = xp + (r * k2 + kk) * 2, *wp = b + (kk * BF_PANEL + j) * 2;
                sum += from_bf16(xq[0]) * from_bf16(wp[0]) + from_bf16(xq[1]) * from_bf16(wp[1]);
            }
            y[r * ldy + j] = sum + (bias ? bias[j] : 0.0f);
        }
}
#endif

/* Rows [0, m) of the bf16 rows xp times all panels, split into units as panel_units.h draws.
 * An orphaned "omp for": inside a parallel region the team shares the units
 * (and meets at its closing barrier); outside one, the caller runs them all. */
static inline void bf16_panel_units(const uint16_t *xp, int64_t m, int64_t k2, const uint16_t *packed,
                                    const float *bias, int64_t n, float *y) {
    const panel_split split = panel_split_of(m, n, BF_MR, BF_PANEL, k2 * BF_PANEL * 4);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < split.num_units; u++) {
        const panel_unit w = panel_unit_at(&split, u, m, n, BF_MR, BF_PANEL);
        const int64_t p = w.panel;
        const int num_rows = w.num_rows, num_cols = w.num_cols;
        const uint16_t *b = packed + p * k2 * BF_PANEL * 2;
        const float *bias_p = bias ? bias + p * BF_PANEL : NULL;
        const uint16_t *xr = xp + w.row0 * k2 * 2;
        float *yr = y + w.row0 * n + p * BF_PANEL;
        const int64_t num_prefetch = w.num_prefetch;
        const char *prefetch =
            num_prefetch ? (const char *)(packed + (p + 1) * k2 * BF_PANEL * 2) + w.first_line * CACHE_LINE : NULL;
        switch (num_rows) {
            case 8: bf_tile(xr, k2, b, yr, n, bias_p, num_cols, 8, prefetch, num_prefetch); break;
            case 7: bf_tile(xr, k2, b, yr, n, bias_p, num_cols, 7, prefetch, num_prefetch); break;
            case 6: bf_tile(xr, k2, b, yr, n, bias_p, num_cols, 6, prefetch, num_prefetch); break;
            case 5: bf_tile(xr, k2, b, yr, n, bias_p, num_cols, 5, prefetch, num_prefetch); break;
            case 4: bf_tile(xr, k2, b, yr, n, bias_p, num_cols, 4, prefetch, num_prefetch); break;
            case 3: bf_tile(xr, k2, b, yr, n, bias_p, num_cols, 3, prefetch, num_prefetch); break;
            case 2: bf_tile(xr, k2, b, yr, n, bias_p, num_cols, 2, prefetch, num_prefetch); break;
            default: bf_tile(xr, k2, b, yr, n, bias_p, num_cols, 1, prefetch, num_prefetch); break;
        }
    }
}

#define BF_BLOCK_BYTES (256 * 1024)

/* Rows per block: a block's bf16 rows (kpad values each) fit in L2 beside a panel. */
static inline int64_t bf16_block_rows(int64_t kpad) {
    int64_t rows = BF_BLOCK_BYTES / (kpad * 2) / BF_MR * BF_MR;
    return rows < 8 * BF_MR ? 8 * BF_MR : rows;
}

#endif
