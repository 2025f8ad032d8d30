/*
 * The Mamba-2 selective state-space scan (SSD) of float32 rows, per
 * sequence and head: state [head_dim, state_size] of each head, carried in
 * scattered slots of a state tensor [num_slots, num_heads, head_dim,
 * state_size]. For a token with input x (head_dim), time step dt, B and C
 * (state_size, of the head's group: heads share them n_groups at a time):
 *
 *   dt    = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max)
 *   state = exp(dt * A) * state + dt * x B^T
 *   y     = state C + D * x
 *
 * ssd_decode_f32 runs one token per sequence (the recurrent form), in place
 * in its slot; ssd_prefill_f32 runs each sequence's tokens in chunks (the
 * chunked form: inside a chunk the outputs are a causal, decay-weighted sum
 * over the chunk's inputs plus the chunk's starting state read through C;
 * the state then moves a whole chunk at once), starting from its slot's
 * state or from zero, writing the final state back to the slot.
 *
 * Rows are strided (x, dt, B, C and out may be column slices of wider
 * rows): row t of x is x + t * x_stride, its heads side by side. The
 * kernels trust their pointers, sizes and slots (ops ssd_ops.cpp checks
 * them): two sequences never share a slot.
 */
#ifndef PAGEDLLM_SSD_SCAN_H
#define PAGEDLLM_SSD_SCAN_H
#include <stdint.h>

/* the per-head constants and the layer's sizes */
typedef struct {
    const float *A;        /* [num_heads], negative: -exp(A_log) */
    const float *D;        /* [num_heads], the skip */
    const float *dt_bias;  /* [num_heads] */
    float dt_min, dt_max;  /* the time step's clamp */
    int num_heads, head_dim, state_size, num_groups;
} SsdLayer;

/* the token rows and their strides (in floats) */
typedef struct {
    const float *x;   /* [tokens, num_heads * head_dim] */
    const float *dt;  /* [tokens, num_heads], before bias and softplus */
    const float *B;   /* [tokens, num_groups * state_size] */
    const float *C;   /* [tokens, num_groups * state_size] */
    float *out;       /* [tokens, num_heads * head_dim] */
    int64_t x_stride, dt_stride, b_stride, c_stride, out_stride;
} SsdRows;

/* max chunk length of ssd_prefill_f32 (its per-chunk scratch is on the stack) */
#define SSD_MAX_CHUNK 256

void ssd_decode_f32(const SsdLayer *layer, const SsdRows *rows, float *state, const int64_t *slots, int num_seqs,
                    int num_threads);
/* bounds: [num_seqs + 1] token offsets; has_initial_state: [num_seqs] (0: start from zero) */
void ssd_prefill_f32(const SsdLayer *layer, const SsdRows *rows, float *state, const int64_t *slots,
                     const int64_t *bounds, const uint8_t *has_initial_state, int num_seqs, int chunk_size,
                     int num_threads);
#endif
