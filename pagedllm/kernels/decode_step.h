/*
 * The fused decode step's view of a model (decode_step.cpp): dimensions and
 * raw pointers to the weights, the RoPE tables and the KV caches. ops.cpp
 * fills it from tensors it has checked (the FusedDecoder class) and keeps
 * those tensors alive as long as the pointers are used.
 */
#ifndef PAGEDLLM_DECODE_STEP_H
#define PAGEDLLM_DECODE_STEP_H
#include <stdint.h>

/* how the linear layers' weights are stored; the Python side numbers them alike (runner/fused_decode.py) */
enum { LINEAR_INT8 = 0, LINEAR_F32_PANELS = 1, LINEAR_BF16_PANELS = 2 };

typedef struct {
    /* int8 [out, in]; float32 panels [num_panels, in, PANEL];
       bf16 panels [num_panels, ceil(in / 2), BF_PANEL, 2] */
    const void *weight;
    const float *scales; /* int8: [out_features]; NULL otherwise */
    const float *bias;   /* [out_features] or NULL */
} StepLinear;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim], NULL unless the model norms q and k (Qwen3) */
    StepLinear qkv, o, gate_up, down;    /* gate_up: gate outputs first, then up */
    void *k_cache, *v_cache;             /* [num_blocks, block_size, num_kv_heads, head_dim] of kv_type */
} DecodeLayer;

typedef struct {
    int64_t num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size;
    int64_t num_slots, max_position;
    int64_t block_size;
    int64_t linear_kind; /* LINEAR_* */
    int64_t kv_type;     /* KV_FLOAT32, KV_FLOAT16 or KV_BFLOAT16 */
    float norm_eps, scale;
    const float *final_norm;   /* [hidden] */
    const float *cos, *sin;    /* [max_position, head_dim]; sin carries rotate-half's signs */
    const DecodeLayer *layers; /* [num_layers] */
} DecodeModel;

/* see decode_step.cpp: 0, 1 (no scratch memory), 2 (inconsistent addressing), 3 (unknown kind or cache type) */
int decode_step(const DecodeModel *m, float *x, int64_t num_rows, const int64_t *positions, const int64_t *slots,
                const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, float *out,
                int num_threads);
#endif
