/*
 * Weight-only int8 linear layer for a few rows of float32 activations (CPU).
 *
 *   out[m, n] = scales[n] * sum_k x[m, k] * w[n, k]  (+ bias[n])
 *
 * Decode with few sequences is bound by memory bandwidth: every weight is
 * read once per step and used for only a few rows. Reading one byte per
 * weight instead of four is the whole point; the int8 -> float conversion
 * happens in registers. The dot products and the tile loop live in
 * int8_dot.h.
 *
 * Layouts (contiguous): x [num_rows, in_features] float32,
 * w [out_features, in_features] int8, scales and bias [out_features] float32,
 * out [num_rows, out_features] float32. bias may be NULL.
 */
#include "int8_dot.h"
#include "step_nodes.h"

/* Rows are taken in chunks of ROW_CHUNK so that a chunk's activations
   (ROW_CHUNK * in_features floats) stay in L2 while the tiles pass:

       for each chunk of 64 rows:            (weights re-read once per chunk)
         parallel for each tile of 32 output channels:
           for each group of 4 rows:  4 x 32 dot products of length in_features
*/
#define ROW_CHUNK 64

void int8_linear_team(const LinearNode *n) {
    const int64_t num_tiles = int8_num_tiles(n->out_features);
    for (int64_t m0 = 0; m0 < n->rows; m0 += ROW_CHUNK) {
        const int64_t m1 = m0 + ROW_CHUNK < n->rows ? m0 + ROW_CHUNK : n->rows;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < num_tiles; tile++)
            int8_linear_tile(n->x, m0, m1, n->in_features, (const int8_t *)n->weight, n->scales, n->bias,
                             n->out_features, n->y, tile);
    }
}
