/* bfloat16 linear layer: float32 activations in and out, bf16 weights and products.
 *
 *   y[m, n] = sum_k bf16(x[m, k]) * W[n, k] (+ bias[n])   x, y float32; W bfloat16
 *
 * The same panel scheme as packed_linear.c (read its comment first), with
 * one change of layout: AVX512-BF16's dot instruction takes PAIRS of bf16
 * values per 32-bit lane (lane j: acc[j] += a[2j] * b[2j] + a[2j+1] * b[2j+1]),
 * so a panel stores two k values next to each other for every column:
 *
 *   W [N, K] row-major                 packed [num_panels, K/2, PANEL, 2]   (bf16)
 *                                      panel 0: k-pair 0: w00 w01 | w10 w11 | ... | w47,0 w47,1
 *                                               k-pair 1: w02 w03 | w12 w13 | ...
 *
 * and each activation row is rounded to bf16 once per call (denormals
 * flushed to zero, as the instruction does), then read as pairs
 * (x[k], x[k+1]), each broadcast as one 32-bit value. An odd K is padded with a
 * zero k on both sides. Per k pair a panel is PANEL * 4 bytes (3 cache lines
 * at PANEL = 48), half the bytes of the float32 panel per k, and one
 * instruction does twice the multiply-adds of a float32 FMA.
 *
 * Products of two bf16 values are exact in float32, sums are float32, so
 * the result differs from a float64 product of the bf16-rounded operands
 * only by float32 rounding of the sums (the instruction may also flush
 * denormal inputs to zero).
 *
 * Why ours and not oneDNN's bf16 matmul: activations stay float32 between
 * layers, so oneDNN needed a rounding copy before and a widening copy after
 * every call, and at decode sizes (8-64 rows) its packed matmul waits on
 * memory (packed_linear.c); measured in BENCHMARKS.md ("bfloat16 on the CPU").
 *
 * Without AVX512-BF16 a scalar loop computes the same sums (same products,
 * float32 sums); correct everywhere, fast only where the instruction exists.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "panel_units.h"

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
        /* the instruction puts its second operand in the low half */
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + j + 16), _mm512_loadu_ps(x + j));
        _mm512_storeu_si512((void *)(out + j), (__m512i)v);
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

int packed_linear_bf16_panel(void) { return BF_PANEL; }

/* 1 where this build has the AVX512-BF16 dot instruction, 0 where it runs the scalar loop */
int packed_linear_bf16_native(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* W [n, k] float32 row-major -> packed [ceil(n / PANEL), ceil(k / 2), PANEL, 2] bf16, zero-padded. */
void packed_linear_bf16_pack(const float *w, int64_t n, int64_t k, uint16_t *packed) {
    int64_t num_panels = (n + BF_PANEL - 1) / BF_PANEL;
    int64_t k2 = (k + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < num_panels; p++)
        for (int64_t kk = 0; kk < k2; kk++)
            for (int j = 0; j < BF_PANEL; j++)
                for (int h = 0; h < 2; h++) {
                    int64_t col = p * BF_PANEL + j, kidx = 2 * kk + h;
                    float v = (col < n && kidx < k) ? w[col * k + kidx] : 0.0f;
                    packed[((p * k2 + kk) * BF_PANEL + j) * 2 + h] = to_bf16(v);
                }
}

#if defined(__AVX512BF16__)
#define NUM_VECS (BF_PANEL / 16)

/* num_rows (<= BF_MR) bf16 rows xp [rows, 2 * k2] times one panel, a pair of k at a time. */
static inline __attribute__((always_inline)) void bf_tile(
    const uint16_t *xp, int64_t k2, const uint16_t *b, float *y, int64_t ldy, const float *bias,
    int num_cols, const int num_rows, const char *prefetch, int64_t num_prefetch) {
    __m512 acc[BF_MR][NUM_VECS];
#pragma GCC unroll 8
    for (int r = 0; r < BF_MR; r++)
#pragma GCC unroll 8
        for (int c = 0; c < NUM_VECS; c++) acc[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int64_t kk = 0; kk < k2; kk++) {
        if (kk < num_prefetch) _mm_prefetch(prefetch + kk * CACHE_LINE, _MM_HINT_T1);
        __m512bh wv[NUM_VECS];
#pragma GCC unroll 8
        for (int c = 0; c < NUM_VECS; c++)
            wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(b + (kk * BF_PANEL + c * 16) * 2));
#pragma GCC unroll 8
        for (int r = 0; r < BF_MR; r++) {
            if (r < num_rows) {
                __m512bh a = (__m512bh)_mm512_set1_epi32((int)load_pair(xp + (r * k2 + kk) * 2));
#pragma GCC unroll 8
                for (int c = 0; c < NUM_VECS; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, wv[c]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < BF_MR; r++) {
        if (r >= num_rows) continue;
        if (num_cols == BF_PANEL) {
#pragma GCC unroll 8
            for (int c = 0; c < NUM_VECS; c++) {
                __m512 v = acc[r][c];
                if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c * 16));
                _mm512_storeu_ps(y + r * ldy + c * 16, v);
            }
        } else { /* the last, zero-padded panel: only its real columns are written */
            float sums[BF_PANEL];
            for (int c = 0; c < NUM_VECS; c++) _mm512_storeu_ps(sums + c * 16, acc[r][c]);
            for (int j = 0; j < num_cols; j++) y[r * ldy + j] = sums[j] + (bias ? bias[j] : 0.0f);
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

/* Rows [0, m) of the bf16 rows xp times all panels, split into units as panel_units.h draws. */
static void bf_row_block(const uint16_t *xp, int64_t m, int64_t k2, const uint16_t *packed, const float *bias,
                         int64_t n, float *y, int num_threads) {
    const panel_split split = panel_split_of(m, n, BF_MR, BF_PANEL, k2 * BF_PANEL * 4);
#pragma omp parallel for schedule(static) num_threads(num_threads)
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
/* below this many activations a block is rounded by one thread: a parallel region costs more */
#define BF_PARALLEL_CONVERT 32768

/* y [m, n] = bf16(x [m, k]) @ W^T (+ bias), W packed by packed_linear_bf16_pack.
 * Rows go in blocks whose bf16 rows fit in L2 beside a panel (as packed_linear_f32);
 * each block is rounded to bf16 into a scratch buffer first. A bf16 row of
 * even length is exactly the pairs the tile broadcasts (x[2i] in the low half).
 * Returns 0, or -1 when the scratch buffer cannot be allocated. */
int packed_linear_bf16(const float *x, int64_t m, int64_t k, const uint16_t *packed, const float *bias,
                       int64_t n, float *y, int num_threads) {
    int64_t k2 = (k + 1) / 2, kpad = 2 * k2;
    int64_t block_rows = BF_BLOCK_BYTES / (kpad * 2) / BF_MR * BF_MR;
    if (block_rows < 8 * BF_MR) block_rows = 8 * BF_MR;
    int64_t scratch_rows = m < block_rows ? m : block_rows;
    uint16_t *xb = (uint16_t *)malloc((size_t)(scratch_rows * kpad) * sizeof(uint16_t));
    if (xb == NULL) return -1;
    for (int64_t row0 = 0; row0 < m; row0 += block_rows) {
        int64_t rows = m - row0 < block_rows ? m - row0 : block_rows;
        const float *xr = x + row0 * k;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * k >= BF_PARALLEL_CONVERT)
        for (int64_t r = 0; r < rows; r++) row_to_bf16(xr + r * k, k, kpad, xb + r * kpad);
        bf_row_block(xb, rows, k2, packed, bias, n, y + row0 * n, num_threads);
    }
    free(xb);
    return 0;
}
