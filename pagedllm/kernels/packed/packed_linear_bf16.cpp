/* bfloat16 linear layer: float32 activations in and out, bf16 weights and products.
 *
 *   y[m, n] = sum_k bf16(x[m, k]) * W[n, k] (+ bias[n])   x, y float32; W bfloat16
 *
 * The same panel scheme as packed_linear.cpp (read its comment first), with
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
 * memory (packed_linear.cpp); measured in BENCHMARKS.md ("bfloat16 on the CPU").
 *
 * Without AVX512-BF16, AVX2 widens the bf16 pairs to float32 in registers
 * and multiplies with FMA (panel_bf16.h): the same products, float32 sums,
 * half the weight bytes of float32 panels. Without AVX2 a scalar loop
 * computes the same sums; correct everywhere, slow.
 */
#include "../kernels.h"
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "panel_bf16.h"
#include "../step/step_nodes.h"

int packed_linear_bf16_panel(void) { return BF_PANEL; }

/* How this build multiplies: 2 with AVX512-BF16's dot instruction, 1 by widening
 * bf16 to float32 in AVX2 registers (FMA), 0 in the scalar loop */
int packed_linear_bf16_native(void) {
#if defined(__AVX512BF16__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
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

/* bf16 values of the scratch for a call's rounded activations: one block of rows */
int64_t bf16_scratch_values(int64_t rows, int64_t in_features) {
    const int64_t kpad = 2 * ((in_features + 1) / 2), block_rows = bf16_block_rows(kpad);
    return (rows < block_rows ? rows : block_rows) * kpad;
}

/* y [m, n] = bf16(x [m, k]) @ W^T (+ bias), W packed by packed_linear_bf16_pack; a team
 * function (step_nodes.h). Rows go in blocks of bf16_block_rows (as the float32 panels);
 * each block is rounded to bf16 into the shared scratch first. A bf16 row of even length
 * is exactly the pairs the tile broadcasts (x[2i] in the low half). */
void packed_linear_bf16_team(const LinearNode *n, int64_t m) {
    const int64_t k = n->in_features, k2 = (k + 1) / 2, kpad = 2 * k2;
    const int64_t block_rows = bf16_block_rows(kpad);
    uint16_t *xb = n->scratch;
    for (int64_t row0 = 0; row0 < m; row0 += block_rows) {
        const int64_t rows = m - row0 < block_rows ? m - row0 : block_rows;
        const float *xr = n->x + row0 * k;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) row_to_bf16(xr + r * k, k, kpad, xb + r * kpad);
        /* the rounding loop's closing barrier: every row is ready before any unit reads it,
           and the units' closing barrier frees the scratch for the next block */
        bf16_panel_units(xb, rows, k2, (const uint16_t *)n->weight, n->bias, n->out_features,
                         n->y + row0 * n->out_features);
    }
}
