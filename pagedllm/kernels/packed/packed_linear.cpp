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
 * Why not oneDNN's packed matmul (layers/quantization/onednn_linear.py), which this
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
#include "../kernels.h"
#include <omp.h>
#include <stdint.h>

#include "panel_f32.h"
#include "../step/step_nodes.h"

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

/* y [m, n] = x [m, k] @ W^T (+ bias), W packed by packed_linear_pack, in
 * blocks of f32_block_rows rows (long inputs: prefills); a team function (step_nodes.h). */
void packed_linear_f32_team(const LinearNode *n, int64_t m) {
    const int64_t k = n->in_features, block_rows = f32_block_rows(k);
    for (int64_t row0 = 0; row0 < m; row0 += block_rows) {
        const int64_t rows = m - row0 < block_rows ? m - row0 : block_rows;
        f32_panel_units(n->x + row0 * k, rows, k, (const float *)n->weight, n->bias, n->out_features,
                        n->y + row0 * n->out_features);
    }
}
