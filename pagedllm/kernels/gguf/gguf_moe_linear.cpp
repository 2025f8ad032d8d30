/*
 * A mixture-of-experts layer's expert matmuls in one call (gguf_moe.h):
 * every expert that has tokens multiplies them by its rows of the stacked
 * weight, in one OpenMP region.
 *
 *   1. gather (the team shares the rows out):
 *        x16:        the num_tokens rows rounded to int8 once (as the dense
 *                    op rounds a row), then each pair's copy of its token's
 *                    row, pairs in expert order: expert e's rows contiguous
 *        file order: each pair's row of x copied, in expert order
 *   2. units (taken one at a time by whichever thread is free):
 *        (expert e with tokens, a chunk of its output channels)
 *        -> expert e's rows against the chunk's tiles (x16) or strips
 *           (file order), with the dense op's kernels and row blocks
 *
 * so an expert with no tokens costs nothing, and one token routed to 8
 * experts still keeps every thread busy (8 x out_features / CHUNK units).
 * The pairs' rows are contiguous per expert, so each unit runs the very
 * functions the dense op runs on a [rows, in_features] input: a row's bits
 * do not depend on the others around it (docs/batch-invariance.md), hence
 * equal the dense op's on that expert's rows.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.h"
#include "gguf_moe.h"
#include "gguf_x16.h"

/* output channels per unit: small enough that a decode step's few experts make several units per thread,
   large enough that a unit's bookkeeping is nothing next to its weights (128 x in_features of them) */
#define MOE_CHUNK_CHANNELS 128

/* bytes of the x16 scratch's first part (the tokens' int8 rows), rounded so the pairs' part is 64-aligned */
static int64_t token_rows_bytes(int64_t num_tokens, int64_t in_features) {
    return (gguf_x16_scratch_bytes(num_tokens, in_features) + 63) / 64 * 64;
}

int64_t gguf_moe_scratch_bytes(int type, int64_t num_tokens, int64_t num_pairs, int64_t in_features) {
    if (is_x16_type(type))
        return token_rows_bytes(num_tokens, in_features) + gguf_x16_scratch_bytes(num_pairs, in_features);
    return num_pairs * in_features * (int64_t)sizeof(float);
}

/* step 1: the pairs' rows, in expert order, as the units read them (a team function) */
static void gather_team(const MoeLinearArgs *a) {
    const int64_t k = a->in_features;
    if (!is_x16_type(a->type)) {
        float *rows = (float *)a->scratch;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < a->num_pairs; p++)
            memcpy(rows + p * k, a->x + (int64_t)a->token_ids[p] * k, (size_t)k * sizeof(float));
        return;
    }
    uint8_t *tokens = (uint8_t *)a->scratch, *pairs = tokens + token_rows_bytes(a->num_tokens, k);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a->num_tokens; t++) gguf_x16_quantize_row(a->x + t * k, k, a->type, tokens, a->num_tokens, t);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < a->num_pairs; p++)
        gguf_x16_copy_row(tokens, a->num_tokens, a->token_ids[p], pairs, a->num_pairs, p, k);
}

/* step 2, one unit: expert e's rows against its channel parts [part0, part1) (tiles of 16, or strips);
   returns 1 when a strip buffer could not be allocated */
static int run_unit(const MoeLinearArgs *a, int64_t e, int64_t part0, int64_t part1) {
    const int64_t row0 = a->expert_offsets[e], rows = a->expert_offsets[e + 1] - row0, k = a->in_features;
    const uint8_t *weight = a->weight + e * a->out_features * a->row_bytes;
    if (is_x16_type(a->type)) {
        const uint8_t *pairs = (const uint8_t *)a->scratch + token_rows_bytes(a->num_tokens, k);
        // rows row0.. of the pairs' scratch into y's rows row0..: the node's y is the whole output
        const LinearNode n = {NULL, weight, NULL, a->y, NULL, k, a->out_features, a->type, 0};
        gguf_x16_tiles(&n, pairs, a->num_pairs, row0, rows, part0, part1);
        return 0;
    }
    const LinearNode n = {(const float *)a->scratch + row0 * k, weight, NULL, a->y + row0 * a->out_features, NULL,
                          k, a->out_features, a->type, 0};
    return gguf_linear_strips(&n, rows, part0, part1);
}

int gguf_moe_linear(const MoeLinearArgs *a, int num_threads) {
    int64_t *active = (int64_t *)malloc((size_t)a->num_experts * sizeof(int64_t));  // the experts with tokens
    if (active == NULL) return 1;
    int64_t num_active = 0;
    for (int64_t e = 0; e < a->num_experts; e++)
        if (a->expert_offsets[e + 1] > a->expert_offsets[e]) active[num_active++] = e;
    const bool x16 = is_x16_type(a->type);
    const int64_t part = x16 ? X16_TILE : gguf_strip_channels();  // channels of one tile / strip
    const int64_t num_parts = (a->out_features + part - 1) / part;
    const int64_t chunk = (MOE_CHUNK_CHANNELS + part - 1) / part, num_chunks = (num_parts + chunk - 1) / chunk;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        gather_team(a);
        // units differ in cost by their expert's rows: each thread takes the next one free
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < num_active * num_chunks; u++) {
            const int64_t c = u % num_chunks, part0 = c * chunk;
            if (run_unit(a, active[u / num_chunks], part0, part0 + chunk < num_parts ? part0 + chunk : num_parts)) {
#pragma omp atomic write
                failed = 1;
            }
        }
    }
    free(active);
    return failed;
}
