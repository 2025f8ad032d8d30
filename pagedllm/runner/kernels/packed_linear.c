/* Float32 linear layer over weights packed once into column panels.
 *
 *   y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n])      x: [M, K]  W: [N, K]  y: [M, N]
 *
 * The weight is reordered at load time into panels of PANEL output columns
 * (48 with AVX-512, 16 with AVX2), each stored k-major so one k step of a
 * panel is PANEL contiguous floats:
 *
 *   W [N, K] row-major                   packed [num_panels, K, PANEL]
 *   n=0   w00 w01 w02 ...                panel 0: k=0: w00 w10 ... w47,0
 *   n=1   w10 w11 w12 ...                         k=1: w01 w11 ... w47,1
 *   ...                                  panel 1: k=0: w48,0 ...
 *
 * (the last panel is padded with zero columns). A tile of MR rows (8 with
 * AVX-512, 6 with AVX2) by one panel keeps its MR x PANEL sums in registers
 * for the whole K loop: per k step it loads PANEL weights once and
 * broadcasts MR activations, so each weight load feeds MR FMAs. 8 x 48
 * measured 2-4% faster than 6 x 64 end to end: decode batches of 40 and 64
 * rows are whole 8-row chunks. Work units are (panel, MR-row chunk), panel-major,
 * split evenly over the threads, so a thread runs all row chunks of a panel
 * back to back and the panel is read from memory once, then from L2.
 *
 * Why not oneDNN's packed matmul (models/onednn_linear.py), which this
 * replaces by default: at decode sizes (8-64 rows) the first row chunk of a
 * panel waits on memory. Here, while one panel is computed, each of its row
 * chunks also prefetches a share of the next panel's cache lines into L2, one
 * line per k step, so the stream from memory overlaps the arithmetic. A
 * panel is PANEL / 16 lines per k step (3 with AVX-512), so the whole next
 * panel is covered from 3 row chunks on (17+ rows); fewer rows cover a third
 * or two thirds of it (more prefetches per k step were tried, with 64-column
 * panels, and were no faster). Measured on SmolLM2's
 * shapes (benchmarks/micro_linear.py, BENCHMARKS.md): 1.17-1.56x oneDNN from
 * 1 to 64 rows, even with it at 256-1024.
 *
 * The sum over k runs in order, one FMA per term, so results differ from
 * other GEMMs only by rounding (the order of additions).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "panel_units.h"

/* tile shape per ISA: MR rows x PANEL columns of sums stay in registers
 * (AVX-512: 8 x 3 zmm = 24 of 32 registers; AVX2: 6 x 2 ymm = 12 of 16) */
#if defined(__AVX512F__)
#define PANEL 48
#define MR 8
#define VEC_WIDTH 16
typedef __m512 vec_t;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VZERO() _mm512_setzero_ps()
#define VADD(a, b) _mm512_add_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
#define PANEL 16
#define MR 6
#define VEC_WIDTH 8
typedef __m256 vec_t;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VZERO() _mm256_setzero_ps()
#define VADD(a, b) _mm256_add_ps(a, b)
#else
#define PANEL 8
#define MR 6
#define SCALAR_PANELS 1
#endif
#define CACHE_LINE 64

/* Output columns per panel in this build; the caller sizes the packed buffer with it. */
int packed_linear_panel(void) { return PANEL; }

/* W [n, k] row-major -> packed [ceil(n / PANEL), k, PANEL], zero-padded. */
void packed_linear_pack(const float *w, int64_t n, int64_t k, float *packed) {
    int64_t num_panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < num_panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < PANEL; j++) {
                int64_t col = p * PANEL + j;
                packed[(p * k + kk) * PANEL + j] = col < n ? w[col * k + kk] : 0.0f;
            }
}

#ifdef SCALAR_PANELS
static void tile(const float *x, int64_t ldx, const float *b, int64_t k, float *y, int64_t ldy,
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
#define NUM_VECS (PANEL / VEC_WIDTH)

/* num_rows (<= MR) rows of x times one panel. Always inlined with a constant
 * num_rows, so the row loops unroll and the sums stay in registers.
 * prefetch / num_prefetch: cache lines of the next panel to pull into L2, one
 * per k step. */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t ldx, const float *b, int64_t k, float *y, int64_t ldy, const float *bias,
    int num_cols, const int num_rows, const char *prefetch, int64_t num_prefetch) {
    vec_t acc[MR][NUM_VECS];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int c = 0; c < NUM_VECS; c++) acc[r][c] = VZERO();
    for (int64_t kk = 0; kk < k; kk++) {
        if (kk < num_prefetch) _mm_prefetch(prefetch + kk * CACHE_LINE, _MM_HINT_T1);
        vec_t wv[NUM_VECS];
#pragma GCC unroll 8
        for (int c = 0; c < NUM_VECS; c++) wv[c] = VLOAD(b + kk * PANEL + c * VEC_WIDTH);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < num_rows) {
                vec_t a = VSET1(x[r * ldx + kk]);
#pragma GCC unroll 8
                for (int c = 0; c < NUM_VECS; c++) acc[r][c] = VFMA(a, wv[c], acc[r][c]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        if (r >= num_rows) continue;
        if (num_cols == PANEL) {
#pragma GCC unroll 8
            for (int c = 0; c < NUM_VECS; c++) {
                vec_t v = acc[r][c];
                if (bias) v = VADD(v, VLOAD(bias + c * VEC_WIDTH));
                VSTORE(y + r * ldy + c * VEC_WIDTH, v);
            }
        } else { /* the last, zero-padded panel: only its real columns are written */
            float sums[PANEL];
            for (int c = 0; c < NUM_VECS; c++) VSTORE(sums + c * VEC_WIDTH, acc[r][c]);
            for (int j = 0; j < num_cols; j++) y[r * ldy + j] = sums[j] + (bias ? bias[j] : 0.0f);
        }
    }
}
#endif

/* Rows [row0, row0 + m) of x times all panels, split into units as panel_units.h draws. */
static void row_block(const float *x, int64_t m, int64_t k, const float *packed, const float *bias,
                      int64_t n, float *y, int num_threads) {
    const panel_split split = panel_split_of(m, n, MR, PANEL, k * PANEL * (int64_t)sizeof(float));
#pragma omp parallel for schedule(static) num_threads(num_threads)
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
            case 8: tile(xr, k, b, k, yr, n, bias_p, num_cols, 8, prefetch, num_prefetch); break;
            case 7: tile(xr, k, b, k, yr, n, bias_p, num_cols, 7, prefetch, num_prefetch); break;
#endif
            case 6: tile(xr, k, b, k, yr, n, bias_p, num_cols, 6, prefetch, num_prefetch); break;
            case 5: tile(xr, k, b, k, yr, n, bias_p, num_cols, 5, prefetch, num_prefetch); break;
            case 4: tile(xr, k, b, k, yr, n, bias_p, num_cols, 4, prefetch, num_prefetch); break;
            case 3: tile(xr, k, b, k, yr, n, bias_p, num_cols, 3, prefetch, num_prefetch); break;
            case 2: tile(xr, k, b, k, yr, n, bias_p, num_cols, 2, prefetch, num_prefetch); break;
            default: tile(xr, k, b, k, yr, n, bias_p, num_cols, 1, prefetch, num_prefetch); break;
        }
    }
}

#ifndef BLOCK_BYTES
#define BLOCK_BYTES (256 * 1024)
#endif

/* y [m, n] = x [m, k] @ W^T (+ bias), W packed by packed_linear_pack.
 * Long inputs (prefills) go in blocks of rows whose activations fit in L2
 * with room for a panel: otherwise every panel would stream all of x again
 * from memory (measured: 257 GFLOP/s over 8192-row prefills unblocked). */
void packed_linear_f32(const float *x, int64_t m, int64_t k, const float *packed, const float *bias,
                       int64_t n, float *y, int num_threads) {
    int64_t block_rows = BLOCK_BYTES / (k * (int64_t)sizeof(float)) / MR * MR;
    if (block_rows < 8 * MR) block_rows = 8 * MR;
    for (int64_t row0 = 0; row0 < m; row0 += block_rows) {
        int64_t rows = m - row0 < block_rows ? m - row0 : block_rows;
        row_block(x + row0 * k, rows, k, packed, bias, n, y + row0 * n, num_threads);
    }
}
