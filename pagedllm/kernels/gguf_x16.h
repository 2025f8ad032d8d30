/*
 * GGUF's 32-weight block types interleaved 16 output channels at a time
 * ("x16"), and multiplied with integer dot products on 8-bit activations.
 *
 * The same bits as the file's blocks, in another order: a tensor of
 * [rows, row bytes] (rows a multiple of 16) keeps its shape and size, and
 * each tile of 16 rows holds, for each block b of 32 inputs in turn, the 16
 * channels' block b side by side:
 *
 *   tile block (16 x block bytes):
 *     Q4_0  d[16] fp16 (32 B) | qs: 4 chunks of 64 B                          288 B
 *     Q4_1  d[16] fp16 | m[16] fp16 (32 B) | qs: 4 chunks of 64 B              320 B
 *     Q8_0  d[16] fp16 | qs: 8 chunks of 64 B                                 544 B
 *
 *   chunk byte 4c + i (channel c, i = 0..3):
 *     Q4 chunk j:  low nibble q[c][8j + i], high nibble q[c][8j + 4 + i]
 *     Q8 chunk j:  q[c][4j + i] + 128 (as a uint8: the int8 quant's bits with the sign flipped)
 *
 * so one 64-byte load is 4 inputs of all 16 channels (Q4: 8 inputs, low and
 * high nibbles), and a dot product of 4 uint8 weights with 4 int8 inputs
 * per 32-bit lane (vpdpbusd, or vpmaddubsw + vpmaddwd) sums 16 channels at
 * once, each lane one channel, with the scales of the 16 channels loaded
 * as one vector:
 *
 *   y[r][c] = sum over blocks b of  d[c] dx[r][b] (sum_i q[c][i] qx[r][i] - o sx[r][b])  (+ m[c] dx sx, Q4_1)
 *
 * where the row's block b is rounded to int8 (qx = round(x / dx), dx =
 * max |x| / 127, sx = sum qx: llama.cpp's Q8 activations) and o = 8 for
 * Q4_0, 0 for Q4_1, 128 for Q8_0 (the flipped sign), 0 where the ISA
 * multiplies signed int8 weights directly. The integer sums are exact, so
 * every variant (AVX-512 VNNI, AVX-512BW, AVX2, scalar) computes the same
 * integers and combines them with the same float operations in the same
 * order. Every row is rounded and summed alike whatever its batch.
 */
#ifndef PAGEDLLM_GGUF_X16_H
#define PAGEDLLM_GGUF_X16_H
#include <stdint.h>

#include "gguf_blocks.h"
#include "step_nodes.h"


/* bytes the team needs in LinearNode.scratch for `rows` rows of `in_features` inputs: the rows in int8,
   then each block's dx (float32) and sx (int32) */
int64_t gguf_x16_scratch_bytes(int64_t rows, int64_t in_features);

/* rows [tile0 * 16, tile1 * 16) of a [rows, in_features / 32 * block bytes] tensor of ggml `type`
   (Q4_0, Q4_1, Q8_0), rewritten in place in the x16 order of that type */
void gguf_x16_interleave(uint8_t *weight, int type, int64_t in_features, int64_t tile0, int64_t tile1);

/* the in_features weights of row `row` of an x16 table, as float32: the values gguf_row gives for the
   row's blocks in the file's order */
void gguf_x16_row(int x16_type, const uint8_t *table, int64_t row, int64_t in_features, float *out);

/* y = x W^T (+ bias) over an x16 weight (a team function, step_nodes.h); needs n->scratch */
void gguf_x16_linear_team(const LinearNode *n);
#endif
