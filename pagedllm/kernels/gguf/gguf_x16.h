/*
 * GGUF's block types interleaved 16 output channels at a time
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
 *     Q5_0  d[16] fp16 | qs: 4 chunks of 64 B | qh 64 B                       352 B
 *     Q5_1  d[16] fp16 | m[16] fp16 | qs: 4 chunks of 64 B | qh 64 B          384 B
 *
 *   chunk byte 4c + i (channel c, i = 0..3):
 *     Q4 chunk j:  low nibble q[c][8j + i], high nibble q[c][8j + 4 + i]
 *     Q8 chunk j:  q[c][4j + i] + 128 (as a uint8: the int8 quant's bits with the sign flipped)
 *     Q5 qh:       bit j = the fifth bit of q[c][8j + i], bit 4 + j that of q[c][8j + 4 + i]
 *
 * so one 64-byte load is 4 inputs of all 16 channels (Q4: 8 inputs, low and
 * high nibbles), and a dot product of 4 uint8 weights with 4 int8 inputs
 * per 32-bit lane (vpdpbusd, or vpmaddubsw + vpmaddwd) sums 16 channels at
 * once, each lane one channel, with the scales of the 16 channels loaded
 * as one vector:
 *
 *   y[r][c] = sum over blocks b of  d[c] dx[r][b] (sum_i q[c][i] qx[r][i] - o sx[r][b])  (+ m[c] dx sx, Q4_1, Q5_1)
 *
 * where the row's block b is rounded to int8 (qx = round(x / dx), dx =
 * max |x| / 127, sx = sum qx: llama.cpp's Q8 activations) and o = 8 for
 * Q4_0, 16 for Q5_0, 0 for Q4_1 and Q5_1, 128 for Q8_0 (the flipped sign), 0 where the ISA
 * multiplies signed int8 weights directly. The integer sums are exact, so
 * every variant (AVX-512 VNNI, AVX-512BW, AVX2, scalar) computes the same
 * integers and combines them with the same float operations in the same
 * order. Every row is rounded and summed alike whatever its batch.
 *
 * The k-quants' super-blocks of 256 weights go the same way, a tile
 * super-block (16 x super-block bytes) holding the 16 channels' headers side
 * by side, then the 8 runs of 32 inputs back to back (one stream of loads),
 * each run's low 4 bits in the Q4 chunk order above, then the bits above
 * those:
 *
 *     Q4_K  d[16] | dmin[16] | S[12][16] | 8 runs of: qs 4 chunks of 64 B                 2304 B
 *     Q5_K  as Q4_K, a run:                          qs 4 chunks | qh 64 B               2816 B
 *     Q6_K  d[16] | sc[16][16] int8 | 8 runs of:      qs 4 chunks | qh 2 x 64 B           3360 B
 *
 *   S[i][c]: byte i of channel c's 12 packed 6-bit scales and mins (so one
 *     vector op unpacks sub-block j's scale or min for all 16 channels);
 *   Q5_K qh run j, byte 4c + i: bit u = the fifth bit of q[c][8u + i], bit 4 + u
 *     that of q[c][8u + 4 + i] (u = chunk 0..3);
 *   Q6_K qh run j, half v, byte 4c + i: for chunk u = 2v + e, bits 4e, 4e + 1 =
 *     the top two bits of q[c][8u + i], bits 4e + 2, 4e + 3 those of q[c][8u + 4 + i];
 *   Q6_K sc[s][c]: channel c's scale of its 16-weight sub-block s.
 *
 * A row's super-block of 256 inputs is rounded on one grid: dx = its max |x| /
 * 127, the same for its 8 blocks (llama.cpp's Q8_K, where the other types
 * round each block of 32 on its own, as Q8_0). So a run sums, per channel, as a
 * Q4 run does, scaled in integers, and the super-block's runs add up in
 * integers before its one float step:
 *
 *   Q4_K / Q5_K  isacc = sum_j s_j isum_j,  imin = sum_j m_j sx_j
 *                y += float(isacc) (d dx)  +  float(imin) (-dmin dx)
 *   Q6_K         isacc = sum_j sc_2j (isum_lo - 32 sx_lo) + sc_2j+1 (isum_hi - 32 sx_hi)
 *                y += float(isacc) (d dx)
 *
 * (isum_lo / sx_lo over the run's first 16 inputs; Q6_K's isum_lo starts at
 * -32 sx_lo rather than 0, the same integer with no subtraction per row; every
 * sum fits int32, |isacc| < 2^28, and its conversion to float32 rounds once,
 * alike in every build).
 * A tile of a long input is summed a slice of about 32 KiB of its
 * super-blocks at a time, every row of the block per slice, so the slice
 * stays in L1; a row's sum goes on from where the previous slice left it
 * (stored in the output as float32 and loaded back: the same operations in
 * the same order as in one pass).
 *
 * Q2_K and Q3_K (their rows rounded per block of 32, as the 4-bit types')
 * keep their 2-bit quants four to a byte, a run's 8 chunks of
 * 4 inputs in two vectors (chunk u at bits 2 (u % 4) of vector u / 4, byte
 * 4c + i), and Q3_K each quant's third bit at bit u of a third vector:
 *
 *     Q2_K  d[16] | dmin[16] | sc[16][16] (scale | min << 4) | 8 runs of: 2 x 64 B         1344 B
 *     Q3_K  d[16] | S[12][16] (the packed 6-bit scales) | 8 runs of: 2 x 64 B | hbits 64 B  1760 B
 *
 * and a run sums its two 16-input sub-blocks apart:
 *
 *   Q2_K  y += float(sc_lo isum_lo + sc_hi isum_hi) d dx  +  float(m_lo sx_lo + m_hi sx_hi) (-dmin) dx
 *   Q3_K  y += float(s_lo (isum_lo - 4 sx_lo) + s_hi (isum_hi - 4 sx_hi)) d dx     (s = 6-bit scale - 32)
 *
 * The non-linear 4-bit types keep Q4_0's chunk order, each nibble an index
 * into the type's table of 16 int8 values:
 *
 *     IQ4_NL  d[16] fp16 (32 B) | qs: 4 chunks of 64 B                                   288 B
 *     MXFP4   e[16] E8M0 (16 B) | qs: 4 chunks of 64 B                                   272 B
 *     IQ4_XS  d[16] | S[6][16] (scales_h's 2 bytes, scales_l's 4) | 8 runs of: qs 4 chunks  2176 B
 *
 * A chunk's nibbles are looked up (one byte shuffle: vpshufb) to the table's
 * values stored as Q8 weights are (the sign flipped), and summed as Q8_0's:
 *
 *   IQ4_NL, MXFP4  y += float(isum - o sx) d dx         (MXFP4: d = 2^(e - 128))
 *   IQ4_XS         y += float((ls_j - 32) (isum - o sx)) d dx      per run j
 *
 * with o as for Q8_0 (|isum| <= 32 x 127 x 127 and |ls - 32| <= 32: exact).
 *
 * pagedllm's grouped int8 / int4 (GROUP_I8 / GROUP_I4, gguf_blocks.h) go the
 * same way, a tile group (16 x group bytes) holding the 16 channels' float32
 * scales (and mins) side by side, then the group's G / 32 runs back to back:
 *
 *     GROUP_I8  scale[16] f32 | G / 32 runs of: 8 chunks of 64 B (the Q8 chunk order)     16 (4 + G) B
 *     GROUP_I4  scale[16] f32 | min[16] f32 | G / 32 runs of: 4 chunks of 64 B (Q4's)    16 (8 + G / 2) B
 *
 * A group sums its runs per channel in float32, then scales once:
 *
 *   g = sum over runs j of float(isum_j - o sx_j) dx_j ;  y += scale g  (+ min sum_j dx_j sx_j, GROUP_I4)
 *
 * with o as for Q8_0 (GROUP_I8) or 0 (GROUP_I4).
 */
#ifndef PAGEDLLM_GGUF_X16_H
#define PAGEDLLM_GGUF_X16_H
#include <stdint.h>

#include "gguf_blocks.h"
#include "../step/step_nodes.h"

/* ---- offsets in the layout above, shared by the repacking (gguf_x16_repack.cpp) and the matmuls
   (gguf_x16_matmul.cpp) ---- */

/* bytes of a tile block's scales (and mins) ahead of its chunks: fp16 d (and m), MXFP4's E8M0 bytes */
static inline int tile_head_bytes(int type) { return gguf_has_min(type) ? 64 : (type == GGUF_MXFP4 ? 16 : 32); }

/* offsets in a tile super-block of IQ4_XS: d[16], S[6][16] (the scale bytes), then run j's 4 chunks */
#define IQ4XS_SCALES 32
static inline int iq4xs_run_offset(int j) { return 128 + 256 * j; }

/* offsets in a tile super-block: run j's low 4 bits (4 chunks of 64 B), then the bits above them,
   runs back to back after the headers (one stream of loads) */
static inline int kq_run_bytes(int type) { return type == GGUF_Q6_K ? 384 : (type == GGUF_Q5_K ? 320 : 256); }
static inline int kq_qs_offset(int type, int j) { return (type == GGUF_Q6_K ? 288 : 256) + kq_run_bytes(type) * j; }
static inline int kq_qh_offset(int type, int j) { return kq_qs_offset(type, j) + 256; }

/* offsets in a tile super-block of Q2_K / Q3_K: run j's two vectors of 2-bit quants, then (Q3_K)
   its vector of high bits */
static inline int lk_run_bytes(int type) { return type == GGUF_Q3_K ? 192 : 128; }
static inline int lk_run_offset(int type, int j) { return (type == GGUF_Q3_K ? 224 : 320) + lk_run_bytes(type) * j; }

/* offsets in a tile group of GROUP_I8 / GROUP_I4: the scales (and mins), then run j */
static inline int64_t group_head_bytes(int type) { return type == GROUP_I4 ? 128 : 64; }
static inline int64_t group_run_bytes(int type) { return type == GROUP_I8 ? 512 : 256; }

/* ---- entry points ---- */

/* bytes the team needs in LinearNode.scratch for `rows` rows of `in_features` inputs: the rows in int8,
   then each block's dx (float32), sx (int32), sum of its first 16 quants (int32), dx sx (float32, the min
   terms' factor) and -32 times its two half sums (int32 x 2, where Q6_K's integer sums start) */
int64_t gguf_x16_scratch_bytes(int64_t rows, int64_t in_features);

/* rows [tile0 * 16, tile1 * 16) of a [rows, row bytes] tensor of `type` (x16_takes: a ggml type, or
   GROUP_I8 / GROUP_I4 in groups of `group` weights; `group` is unused for the others), rewritten in place in
   the x16 order of that type */
void gguf_x16_interleave(uint8_t *weight, int type, int64_t in_features, int64_t group, int64_t tile0, int64_t tile1);

/* the in_features weights of row `row` of an x16 table, as float32: the values gguf_row (or, for the grouped
   types of `group` weights, blocks_row) gives for the row's blocks in their own order */
void gguf_x16_row(int x16_type, const uint8_t *table, int64_t row, int64_t in_features, int64_t group, float *out);

/* y = x W^T (+ bias) over an x16 weight, `rows` rows (a team function, step_nodes.h); needs n->scratch. This and
   gguf_x16_scratch_bytes are gguf_x16_matmul.cpp; the interleave and the row read back, gguf_x16_repack.cpp */
void gguf_x16_linear_team(const LinearNode *n, int64_t rows);

/* The pieces of a grouped-expert matmul (gguf_moe_linear.cpp), each on the calling thread, over scratches of
   gguf_x16_scratch_bytes(rows, k) bytes:
   gguf_x16_quantize_row: the k inputs x rounded to int8 into row `row` of a scratch of `rows` rows, as
     gguf_x16_linear_team rounds each of its rows for a weight of `type`;
   gguf_x16_copy_row: row src_row of one scratch (its int8 inputs and block sums) to row dst_row of another;
   gguf_x16_tiles: rows [row0, row0 + m) of a scratch of `rows` rows against tiles [t0, t1) of n's weight,
     into n->y's rows row0.. (n->x and n->scratch unused), with gguf_x16_linear_team's kernels and blocks */
void gguf_x16_quantize_row(const float *x, int64_t k, int type, void *scratch, int64_t rows, int64_t row);
void gguf_x16_copy_row(const void *src, int64_t src_rows, int64_t src_row, void *dst, int64_t dst_rows,
                       int64_t dst_row, int64_t k);
void gguf_x16_tiles(const LinearNode *n, const void *scratch, int64_t rows, int64_t row0, int64_t m, int64_t t0,
                    int64_t t1);
#endif
