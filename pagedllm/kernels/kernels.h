/*
 * The kernels' entry points, one per source file, as ops.cpp calls them on
 * the data pointers of tensors it has checked. They trust their pointers and
 * sizes; every check is ops.cpp's. Status codes: 0 success, 1 (or -1) no
 * scratch memory, 2 an index outside its buffer, 3 an unknown element type.
 * The KV cache element types are paged_attention.h's KV_FLOAT32 (0),
 * KV_FLOAT16 (1) and KV_BFLOAT16 (2).
 */
#ifndef PAGEDLLM_KERNELS_H
#define PAGEDLLM_KERNELS_H
#include <stdint.h>

/* elementwise.cpp */
void add_rms_norm_f32(float *x, const float *delta, const float *w, float *y, int64_t rows, int64_t n, float eps,
                      int num_threads);
void qk_norm_rope_f32(float *x, int64_t rows, int64_t row_stride, int64_t num_q_heads, int64_t num_kv_heads,
                      int64_t head_dim, const float *q_norm, const float *k_norm, float eps, const float *cos,
                      const float *sin, int num_threads);
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads);

/* int8_linear.cpp */
void int8_linear_f32(const float *x, int64_t num_rows, int64_t in_features, const int8_t *w, const float *scales,
                     const float *bias, int64_t out_features, float *out, int num_threads);

/* packed_linear.cpp */
int packed_linear_panel(void);
void packed_linear_pack(const float *w, int64_t n, int64_t k, float *packed);
void packed_linear_f32(const float *x, int64_t m, int64_t k, const float *packed, const float *bias, int64_t n,
                       float *y, int num_threads);

/* packed_linear_bf16.cpp */
int packed_linear_bf16_panel(void);
int packed_linear_bf16_native(void);
void packed_linear_bf16_pack(const float *w, int64_t n, int64_t k, uint16_t *packed);
int packed_linear_bf16(const float *x, int64_t m, int64_t k, const uint16_t *packed, const float *bias, int64_t n,
                       float *y, int num_threads);

/* kv_write.cpp */
int write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, void *k_cache, void *v_cache,
             int kv_type, const int64_t *slots, int64_t num_tokens, int64_t row, int64_t num_slots, int num_threads);

/* logit_stats.cpp */
void logit_stats_f32(const float *logits, int64_t rows, int64_t vocab, int64_t *argmax, float *lse,
                     int num_threads);

/* paged_decode.cpp */
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int kv_type, const int64_t *block_tables,
                 int64_t table_stride, const int64_t *seq_lens, float *out, int num_seqs, int num_heads,
                 int num_kv_heads, int head_dim, int block_size, int num_threads, float scale, int64_t window);

/* prefill_attention.cpp */
int prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                          int64_t v_stride, float *out, int64_t out_stride, const int64_t *bounds, int num_seqs,
                          int num_heads, int num_kv_heads, int head_dim, float scale, int num_threads);
#endif
