/*
 * Causal depthwise conv1d over each sequence's new tokens, continuing from
 * that sequence's conv state slot and updating it (LFM2's short conv,
 * Qwen3.5's / Qwen3-Next's conv before the gated delta rule, Mamba-2's conv).
 *
 *   x      [num_tokens, dim]        the step's new tokens, sequence after sequence
 *   weight [dim, width]             one filter per channel; tap width - 1 multiplies the current token
 *   state  [num_slots, width - 1, dim]  row j: the input width - 1 - j tokens before the sequence's next one
 *   out[t, c] = act(bias[c] + sum_k weight[c, k] * in(t - (width - 1) + k))
 *
 * in(p) before a sequence's first new token reads its state slot, or zero
 * where the sequence starts from position 0 (has_initial_state false). After
 * the call the slot holds the last width - 1 inputs. Channels are contiguous,
 * so a block of CONV_BLOCK channels of one sequence is one task: its window of
 * width - 1 rows lives in a local buffer, the state is read once and written
 * once. Width <= CONV_MAX_WIDTH (ops.cpp checks it).
 */
#include <math.h>
#include <string.h>

#include "conv.h"
#include "../simd/simd.h"
#include "../step/step_nodes.h"

#define CONV_BLOCK 64

/* one sequence, channels [c0, c0 + nc) */
static void conv_block(const float *x, const float *weight, const float *bias, float *state, float *out,
                       int64_t first, int64_t last, int64_t dim, int width, int64_t c0, int64_t nc, int init,
                       int silu) {
    float win[CONV_MAX_WIDTH][CONV_BLOCK];  // win[j]: the input width - 1 - j tokens back
    float wt[CONV_MAX_WIDTH][CONV_BLOCK];   // the filters, tap-major
    float b[CONV_BLOCK];
    const int hist = width - 1;
    for (int k = 0; k < width; k++)
        for (int64_t c = 0; c < nc; c++) wt[k][c] = weight[(c0 + c) * width + k];
    for (int64_t c = 0; c < nc; c++) b[c] = bias != NULL ? bias[c0 + c] : 0.0f;
    for (int j = 0; j < hist; j++) {
        if (init) memcpy(win[j], state + (int64_t)j * dim + c0, sizeof(float) * (size_t)nc);
        else memset(win[j], 0, sizeof(float) * (size_t)nc);
    }
    for (int64_t t = first; t < last; t++) {
        const float *xt = x + t * dim + c0;
        float *ot = out + t * dim + c0;
        int64_t c = 0;
#if SIMD_F32X8
        for (; c + 8 <= nc; c += 8) {
            f32x8 acc = f32x8_load(b + c);
            for (int k = 0; k < hist; k++) acc = f32x8_fma(f32x8_load(wt[k] + c), f32x8_load(win[k] + c), acc);
            acc = f32x8_fma(f32x8_load(wt[hist] + c), f32x8_load(xt + c), acc);
            if (silu) acc = f32x8_div(acc, f32x8_add(f32x8_set1(1.0f), f32x8_exp(f32x8_sub(f32x8_zero(), acc))));
            f32x8_store(ot + c, acc);
        }
#endif
        for (; c < nc; c++) {
            float acc = b[c];
            for (int k = 0; k < hist; k++) acc += wt[k][c] * win[k][c];
            acc += wt[hist][c] * xt[c];
            ot[c] = silu ? acc / (1.0f + expf(-acc)) : acc;
        }
        // slide the window by one token: the oldest row leaves, x[t] comes in
        for (int j = 0; j + 1 < hist; j++) memcpy(win[j], win[j + 1], sizeof(float) * (size_t)nc);
        if (hist > 0) memcpy(win[hist - 1], xt, sizeof(float) * (size_t)nc);
    }
    for (int j = 0; j < hist; j++) memcpy(state + (int64_t)j * dim + c0, win[j], sizeof(float) * (size_t)nc);
}

void causal_conv1d_f32(const float *x, const float *weight, const float *bias, float *states, float *out,
                       const int64_t *query_start_loc, const int64_t *slots, const bool *has_initial_state,
                       int64_t num_seqs, int64_t dim, int width, int silu, int num_threads) {
    const int64_t num_blocks = (dim + CONV_BLOCK - 1) / CONV_BLOCK;
    const int64_t slot_elems = (int64_t)(width - 1) * dim;
#pragma omp parallel for schedule(static) collapse(2) num_threads(num_threads)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t blk = 0; blk < num_blocks; blk++) {
            const int64_t c0 = blk * CONV_BLOCK;
            const int64_t nc = dim - c0 < CONV_BLOCK ? dim - c0 : CONV_BLOCK;
            conv_block(x, weight, bias, states + slots[s] * slot_elems, out, query_start_loc[s],
                       query_start_loc[s + 1], dim, width, c0, nc, has_initial_state[s] ? 1 : 0, silu);
        }
    }
}

/* Decodes, one token per row continuing its slot (a step program's node, step_nodes.h): the same blocks as
   causal_conv1d_f32's, so a decode computes the same bits through either. Orphaned: the caller's team shares it. */
void conv_decode_team(const ConvDecodeNode *n, int64_t rows) {
    const int64_t num_blocks = (n->dim + CONV_BLOCK - 1) / CONV_BLOCK;
    const int64_t slot_elems = (int64_t)(n->width - 1) * n->dim;
#pragma omp for schedule(static) collapse(2)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t blk = 0; blk < num_blocks; blk++) {
            const int64_t c0 = blk * CONV_BLOCK;
            const int64_t nc = n->dim - c0 < CONV_BLOCK ? n->dim - c0 : CONV_BLOCK;
            conv_block(n->x + r * n->x_stride, n->weight, n->bias, n->state + n->slots[r] * slot_elems,
                       n->out + r * n->dim, 0, 1, n->dim, n->width, c0, nc, 1, n->silu);
        }
    }
}
