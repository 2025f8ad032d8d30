/*
 * One linear layer per expert of a mixture-of-experts block, all experts in
 * one call (gguf_moe_linear.cpp), over GGUF blocks in either layout the
 * dense op reads (file order, or x16: gguf_x16.h):
 *
 *   y[p] = x[token_ids[p]] W_e^T   for p in [expert_offsets[e], expert_offsets[e + 1])
 *   W: [num_experts * out_features, row bytes], expert e's rows e * out_features ..
 *
 * the pairs (token, expert) sorted by expert. Every row's bits are those the
 * dense op (gguf_linear) gives for the same row against W_e: the same
 * kernels on the same rows, only shared out differently.
 */
#ifndef PAGEDLLM_GGUF_MOE_H
#define PAGEDLLM_GGUF_MOE_H
#include <stdint.h>

#include "../step/step_nodes.h"

typedef struct {
    const float *x;                /* [num_tokens, in_features] */
    const uint8_t *weight;         /* [num_experts * out_features, row_bytes] of `type` */
    const int32_t *token_ids;      /* [num_pairs], each in [0, num_tokens) */
    const int32_t *expert_offsets; /* [num_experts + 1]: 0, non-decreasing, num_pairs */
    float *y;                      /* [num_pairs, out_features] */
    void *scratch;                 /* gguf_moe_scratch_bytes(type, num_tokens, num_pairs, in_features) bytes */
    int64_t num_tokens, num_pairs, num_experts, in_features, out_features, row_bytes;
    int type; /* a ggml type the dense op takes, or 512 + one (x16: out_features a multiple of 16) */
} MoeLinearArgs;

/* bytes of scratch a call needs: x16, the tokens rounded to int8 and the pairs' copies of them; file order,
   the pairs' rows of x gathered */
int64_t gguf_moe_scratch_bytes(int type, int64_t num_tokens, int64_t num_pairs, int64_t in_features);

/* y as above on num_threads threads; the arguments are trusted (ops.cpp checks them). Returns 0, or 1 when
   a thread's buffer could not be allocated. */
int gguf_moe_linear(const MoeLinearArgs *a, int num_threads);

/* File-order blocks (gguf_linear.cpp): the channels of one strip, and rows [0, rows) of n (n->x, n->y: those
   rows) against strips [s0, s1), on the calling thread, as gguf_linear_team computes them; returns 1 when the
   thread's strip buffer could not be allocated */
int64_t gguf_strip_channels(void);
int gguf_linear_strips(const LinearNode *n, int64_t rows, int64_t s0, int64_t s1);
#endif
