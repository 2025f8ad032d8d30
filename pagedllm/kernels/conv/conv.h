/*
 * The causal depthwise conv1d with a per-sequence state (causal_conv1d.cpp),
 * as ops.cpp calls it on tensors it has checked: distinct slots inside the
 * state tensor, query_start_loc rising from 0 to the token count, width in
 * 1..CONV_MAX_WIDTH.
 */
#ifndef PAGEDLLM_CONV_H
#define PAGEDLLM_CONV_H
#include <stdbool.h>
#include <stdint.h>

#define CONV_MAX_WIDTH 8

void causal_conv1d_f32(const float *x, const float *weight, const float *bias, float *states, float *out,
                       const int64_t *query_start_loc, const int64_t *slots, const bool *has_initial_state,
                       int64_t num_seqs, int64_t dim, int width, int silu, int num_threads);
#endif
