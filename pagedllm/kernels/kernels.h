/*
 * The kernels' entry points outside the step nodes (step_nodes.h), as ops.cpp calls them on
 * the data pointers of tensors it has checked. They trust their pointers and
 * sizes; every check is ops.cpp's. Status codes: 0 success, 1 (or -1) no
 * scratch memory, 2 an index outside its buffer, 3 an unknown element type.
 * The KV cache element types are paged_attention.h's KV_FLOAT32 (0),
 * KV_FLOAT16 (1), KV_BFLOAT16 (2), KV_INT8 (3), KV_INT4 (4), KV_FP8E4M3 (5)
 * and KV_FP8E5M2 (6).
 */
#ifndef PAGEDLLM_KERNELS_H
#define PAGEDLLM_KERNELS_H
#include <stdint.h>

/* packed_linear.cpp */
int packed_linear_panel(void);
void packed_linear_pack(const float *w, int64_t n, int64_t k, float *packed);

/* packed_linear_bf16.cpp */
int packed_linear_bf16_panel(void);
int packed_linear_bf16_native(void);
void packed_linear_bf16_pack(const float *w, int64_t n, int64_t k, uint16_t *packed);

/* logit_stats.cpp */
void logit_stats_f32(const float *logits, int64_t rows, int64_t vocab, int64_t *argmax, float *lse,
                     int num_threads);

/* moe_group.cpp: the pairs ids [num_pairs] (each token's top_k expert ids, pair p = token * top_k + slot)
   sorted by expert, stably: counts [num_experts], offsets [num_experts + 1], and per sorted pair its index in
   ids (order), its token (token_ids) and its expert (pair_experts); 2 for an id outside [0, num_experts) */
int moe_group_pairs(const int64_t *ids, int64_t num_pairs, int64_t top_k, int64_t num_experts, int64_t *counts,
                    int32_t *offsets, int64_t *order, int32_t *token_ids, int64_t *pair_experts);

/* prefill_attention.cpp */
int prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                          int64_t v_stride, float *out, int64_t out_stride, const int64_t *bounds, int num_seqs,
                          int num_heads, int num_kv_heads, int head_dim, float scale, const float *sinks,
                          int num_threads);
/* paged_prefill.cpp: prompt tokens read from the paged cache in paged_decode's order */
int paged_prefill_f32(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, int kv_type,
                      const int64_t *block_tables, int64_t table_stride, const int64_t *bounds,
                      const int64_t *seq_lens, float *out, int64_t out_stride, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                      float scale, const float *sinks, int num_threads);
/* shm_allreduce.cpp: 0 done, 4 timed out, 5 a peer process has exited */
int shm_all_reduce_f32(float *x, int64_t n, float *slots, int64_t capacity, int64_t *flags, const int64_t *pids,
                       int rank, int size, double timeout_s, int num_threads);
#endif
