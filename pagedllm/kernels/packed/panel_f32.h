/* The float32 panel tile of packed_linear.cpp (its comment draws the layout).
 */
#ifndef PAGEDLLM_PANEL_F32_H
#define PAGEDLLM_PANEL_F32_H

#include <stdint.h>

#include "panel_units.h"
#include "../simd/simd.h"

/* tile shape per ISA: MR rows x PANEL columns of sums stay in registers, in the build's widest float vector
 * (simd.h; AVX-512: 8 x 3 zmm = 24 of 32 registers; AVX2: 6 x 2 ymm = 12 of 16) */
#if SIMD_F32_WIDTH == 16
#define PANEL 48
#define MR 8
#elif SIMD_F32_WIDTH == 8
#define PANEL 16
#define MR 6
#else
#define PANEL 8
#define MR 6
#define SCALAR_PANELS 1
#endif
#define CACHE_LINE 64

#ifdef SCALAR_PANELS
static void f32_tile(const float *x, int64_t ldx, const float *b, int64_t k, float *y, int64_t ldy,
                 const float *bias, int num_cols, int num_rows, const char *prefetch, int64_t num_prefetch) {
    (void)prefetch;
    (void)num_prefetch;
    for (int r = 0; r < num_rows; r++)
        for (int j = 0; j < num_cols; j++) {
            float sum = 0.0f;
            for (int64_t kk = 0; kk < k; kk++) sum += x[r * ldx + kk] * b[kk * PANEL + j];
            y[r * ldy + j] = sum + (bias ? bias[j] : 0.0f);
        }
}
#else
#define F32_NUM_VECS (PANEL / SIMD_F32_WIDTH)

/* num_rows (<= MR) rows of x times one panel. Always inlined with a constant
 * num_rows, so the row loops unroll and the sums stay in registers.
 * prefetch / num_prefetch: cache lines of the next panel to pull into L2, one
 * per k step. */
static inline __attribute__((always_inline)) void f32_tile(
    const float *x, int64_t ldx, const float *b, int64_t k, float *y, int64_t ldy, const float *bias,
    int num_cols, const int num_rows, const char *prefetch, int64_t num_prefetch) {
    vf32 acc[MR][F32_NUM_VECS];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int c = 0; c < F32_NUM_VECS; c++) acc[r][c] = vf32_zero();
    for (int64_t kk = 0; kk < k; kk++) {
        if (kk < num_prefetch) simd_prefetch_l2(prefetch + kk * CACHE_LINE);
        vf32 wv[F32_NUM_VECS];
#pragma GCC unroll 8
        for (int c = 0; c < F32_NUM_VECS; c++) wv[c] = vf32_load(b + kk * PANEL + c * SIMD_F32_WIDTH);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < num_rows) {
                vf32 a = vf32_set1(x[r * ldx + kk]);
#pragma GCC unroll 8
                for (int c = 0; c < F32_NUM_VECS; c++) acc[r][c] = vf32_fma(a, wv[c], acc[r][c]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        if (r >= num_rows) continue;
        if (num_cols == PANEL) {
#pragma GCC unroll 8
            for (int c = 0; c < F32_NUM_VECS; c++) {
                vf32 v = acc[r][c];
                if (bias) v = vf32_add(v, vf32_load(bias + c * SIMD_F32_WIDTH));
                vf32_store(y + r * ldy + c * SIMD_F32_WIDTH, v);
            }
        } else { /* the last, zero-padded panel: only its real columns are written */
            float sums[PANEL];
            for (int c = 0; c < F32_NUM_VECS; c++) vf32_store(sums + c * SIMD_F32_WIDTH, acc[r][c]);
            for (int j = 0; j < num_cols; j++) y[r * ldy + j] = sums[j] + (bias ? bias[j] : 0.0f);
        }
    }
}
#endif

/* Rows [0, m) of x times all panels, split into units as panel_units.h draws.
 * An orphaned "omp for": inside a parallel region the team shares the units
 * (and meets at its closing barrier); outside one, the caller runs them all. */
static inline void f32_panel_units(const float *x, int64_t m, int64_t k, const float *packed, const float *bias,
                                   int64_t n, float *y) {
    const panel_split split = panel_split_of(m, n, MR, PANEL, k * PANEL * (int64_t)sizeof(float));
#pragma omp for schedule(static)
    for (int64_t u = 0; u < split.num_units; u++) {
        const panel_unit w = panel_unit_at(&split, u, m, n, MR, PANEL);
        const int64_t p = w.panel;
        const int num_rows = w.num_rows, num_cols = w.num_cols;
        const float *b = packed + p * k * PANEL;
        const float *bias_p = bias ? bias + p * PANEL : NULL;
        const float *xr = x + w.row0 * k;
        float *yr = y + w.row0 * n + p * PANEL;
        const int64_t num_prefetch = w.num_prefetch;
        const char *prefetch = num_prefetch ? (const char *)(packed + (p + 1) * k * PANEL) + w.first_line * CACHE_LINE : NULL;
        switch (num_rows) {
#if MR > 6
            case 8: f32_tile(xr, k, b, k, yr, n, bias_p, num_cols, 8, prefetch, num_prefetch); break;
            case 7: f32_tile(xr, k, b, k, yr, n, bias_p, num_cols, 7, prefetch, num_prefetch); break;
#endif
            case 6: f32_tile(xr, k, b, k, yr, n, bias_p, num_cols, 6, prefetch, num_prefetch); break;
            case 5: f32_tile(xr, k, b, k, yr, n, bias_p, num_cols, 5, prefetch, num_prefetch); break;
            case 4: f32_tile(xr, k, b, k, yr, n, bias_p, num_cols, 4, prefetch, num_prefetch); break;
            case 3: f32_tile(xr, k, b, k, yr, n, bias_p, num_cols, 3, prefetch, num_prefetch); break;
            case 2: f32_tile(xr, k, b, k, yr, n, bias_p, num_cols, 2, prefetch, num_prefetch); break;
            default: f32_tile(xr, k, b, k, yr, n, bias_p, num_cols, 1, prefetch, num_prefetch); break;
        }
    }
}


#ifndef BLOCK_BYTES
#define BLOCK_BYTES (256 * 1024)
#endif

/* Rows per block: a block's activations fit in L2 with room for a panel
 * (otherwise every panel would stream all of x again from memory; measured:
 * 257 GFLOP/s over 8192-row prefills unblocked). */
static inline int64_t f32_block_rows(int64_t k) {
    int64_t rows = BLOCK_BYTES / (k * (int64_t)sizeof(float)) / MR * MR;
    return rows < 8 * MR ? 8 * MR : rows;
}

#endif
