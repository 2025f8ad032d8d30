/*
 * The gated delta rule (Gated DeltaNet, the linear-attention layers of
 * Qwen3-Next and Qwen3.5): row helpers on the vector layer, shared by the
 * recurrent decode kernel (gated_delta_decode.cpp) and the chunked prompt
 * kernel (gated_delta_chunk.cpp), and the prompt kernel's entry point.
 *
 * Per value head, a state S of [head_k_dim, head_v_dim] floats. A token
 * (q, k of the key head its value head reads, v, log decay g <= 0, write
 * strength beta in (0, 1)) updates and reads it:
 *
 *     S     = exp(g) * S
 *     delta = beta * (v - S^T k)         what k should read, less what it reads
 *     S     = S + k delta^T
 *     o     = S^T q * scale
 *
 * q and k are first L2-normalised (x / sqrt(sum x^2 + 1e-6)) where the model
 * asks for it. Value head h reads key head h / (num_v_heads / num_k_heads).
 */
#ifndef PAGEDLLM_GATED_DELTA_H
#define PAGEDLLM_GATED_DELTA_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../simd/simd.h"

/* the largest head sizes the kernels take (their stack rows): ops.cpp checks it */
#define GD_MAX_HEAD_DIM 512
/* the largest chunk of the prompt kernel (its scratch is chunk^2 + chunk * head sizes floats) */
#define GD_MAX_CHUNK 256
/* the L2 norm's epsilon, the models' (inside the square root) */
#define GD_L2_EPS 1e-6f

/* y *= a over n floats */
static inline void gd_scale(float *y, float a, int64_t n) {
    int64_t j = 0;
#if SIMD_F32_WIDTH
    const vf32 va = vf32_set1(a);
    for (; j + SIMD_F32_WIDTH <= n; j += SIMD_F32_WIDTH) vf32_store(y + j, vf32_mul(va, vf32_load(y + j)));
#endif
    for (; j < n; j++) y[j] *= a;
}

/* dst = src * mul, times 1 / sqrt(sum src^2 + eps) when l2norm is set */
static inline void gd_load_head(float *dst, const float *src, int64_t n, int l2norm, float mul) {
    if (l2norm) mul /= sqrtf(vf32_dot(src, src, n) + GD_L2_EPS);
    for (int64_t i = 0; i < n; i++) dst[i] = src[i] * mul;
}

/* One prompt chunk per (sequence, value head) at a time: sequence s owns rows bounds[2s] .. bounds[2s+1]-1 of
   q, k ([rows, num_k_heads, head_k_dim], rows q_stride / k_stride floats apart), v ([rows, num_v_heads,
   head_v_dim], v_stride apart), g and beta ([rows, num_v_heads], contiguous) and out ([rows, num_v_heads,
   head_v_dim], out_stride apart); its state is state[slots[s]] ([num_v_heads, head_k_dim, head_v_dim]), read
   where has_initial[s] is nonzero and zero otherwise, and left holding the state after its last row.
   The slots are distinct (ops.cpp checks it). Returns 0, or 1 when the scratch could not be allocated. */
int gated_delta_chunked_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                            int64_t v_stride, const float *g, const float *beta, float *state, const int64_t *bounds,
                            const int64_t *slots, const uint8_t *has_initial, int num_seqs, float *out,
                            int64_t out_stride, int num_k_heads, int num_v_heads, int head_k_dim, int head_v_dim,
                            float scale, int l2norm, int chunk_size, int num_threads);
#endif
