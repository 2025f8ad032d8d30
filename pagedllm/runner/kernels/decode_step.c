/*
 * A whole decoder step for a few decode tokens, in one call (CPU, float32
 * activations, weight-only int8 linear layers).
 *
 * Decoding one sequence with int8 weights reads ~135 MB of weights per step
 * on SmolLM2-135M, a few milliseconds; run layer by layer from Python, the
 * same step spends longer again dispatching ~20 small torch ops and 5
 * kernel calls per layer. Here every layer of the Llama family runs in one
 * OpenMP region with the same arithmetic as the layer-by-layer path: the
 * linear layers share int8_linear_tile (int8_dot.h) with int8_linear.c and
 * attention shares attend_f32 (paged_attention.h) with paged_decode.c.
 *
 * Per layer, with x the residual stream [num_rows, hidden]:
 *
 *     h = rms_norm(x) * input_norm
 *     qkv = h @ Wqkv (+ b)            q, k: optional per-head rms_norm, then RoPE
 *     k, v -> cache[slot]             (the slot mapping of the step)
 *     x += attention(q, cache via block table) @ Wo
 *     h = rms_norm(x) * post_norm
 *     x += (silu(h @ Wgate) * (h @ Wup)) @ Wdown
 *
 * and after the last layer out = rms_norm(x) * final_norm. Norms, RoPE and
 * SiLU come from elementwise.h, as in the layer-by-layer path.
 */
#include <stdlib.h>

#include "elementwise.h"
#include "int8_dot.h"
#include "paged_attention.h"

typedef struct {
    const int8_t *weight; /* [out_features, in_features] */
    const float *scales;  /* [out_features] */
    const float *bias;    /* [out_features] or NULL */
} QLinear;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim], NULL unless the model norms q and k (Qwen3) */
    QLinear qkv, o, gate_up, down;       /* gate_up: gate rows first, then up rows */
    float *k_cache, *v_cache;            /* [num_blocks, block_size, num_kv_heads, head_dim] */
} DecodeLayer;

typedef struct {
    int64_t num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size;
    int64_t num_slots, max_position;
    int64_t block_size;
    float norm_eps, scale;
    const float *final_norm;   /* [hidden] */
    const float *cos, *sin;    /* [max_position, head_dim]; sin carries rotate-half's signs */
    const DecodeLayer *layers; /* [num_layers] */
} DecodeModel;

static void rms_norm_rows(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * n, w, y + r * n, n, eps);
}

static void linear_tiles(const QLinear *l, const float *x, int64_t rows, int64_t in_features, int64_t out_features,
                         float *out) {
    const int64_t num_tiles = int8_num_tiles(out_features);
#pragma omp for schedule(static)
    for (int64_t tile = 0; tile < num_tiles; tile++)
        int8_linear_tile(x, 0, rows, in_features, l->weight, l->scales, l->bias, out_features, out, tile);
}

/* Returns 0 on success, 1 when scratch memory could not be allocated,
   2 when the addressing is inconsistent: a position outside the RoPE table,
   a sequence length other than position + 1, a block id outside the cache or
   a slot that is not the position's place in the block table (nothing is
   written then). */
int decode_step_i8(const DecodeModel *m, float *x, int64_t num_rows, const int64_t *positions, const int64_t *slots,
                   const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, float *out,
                   int num_threads) {
    const int64_t hidden = m->hidden_size, hd = m->head_dim, inter = m->intermediate_size;
    const int64_t q_size = m->num_heads * hd, kv_size = m->num_kv_heads * hd, qkv_size = q_size + 2 * kv_size;
    const int64_t group = m->num_heads / m->num_kv_heads;
    /* the pointers below are trusted, so what they must satisfy is checked
       first: few rows, cheap. Each row decodes the token at its last position,
       its slot is that position's place in its block table, and every block
       it reads is in the cache. */
    const int64_t num_blocks = m->num_slots / m->block_size;
    int64_t max_len = 1;
    for (int64_t r = 0; r < num_rows; r++) {
        const int64_t pos = positions[r], len = seq_lens[r];
        const int64_t *table = block_tables + r * table_stride;
        if (pos < 0 || pos >= m->max_position || len != pos + 1 || (len + m->block_size - 1) / m->block_size > table_stride)
            return 2;
        for (int64_t b = 0; b < (len + m->block_size - 1) / m->block_size; b++)
            if (table[b] < 0 || table[b] >= num_blocks) return 2;
        if (slots[r] != table[pos / m->block_size] * m->block_size + pos % m->block_size) return 2;
        if (len > max_len) max_len = len;
    }
    /* h [rows, hidden], qkv [rows, qkv_size], attn [rows, q_size], tmp [rows, hidden],
       gate_up [rows, 2 * inter], act [rows, inter], rope scratch [head_dim] */
    const int64_t floats = num_rows * (2 * hidden + qkv_size + q_size + 3 * inter) + hd;
    float *buf = (float *)malloc(sizeof(float) * (size_t)floats);
    if (buf == NULL) return 1;
    float *h = buf, *qkv = h + num_rows * hidden, *attn = qkv + num_rows * qkv_size;
    float *tmp = attn + num_rows * q_size, *gate_up = tmp + num_rows * hidden;
    float *act = gate_up + num_rows * 2 * inter, *rope_tmp = act + num_rows * inter;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * max_len));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        for (int64_t layer = 0; layer < m->num_layers && !failed; layer++) {
            const DecodeLayer *L = &m->layers[layer];
#pragma omp single
            rms_norm_rows(x, L->input_norm, h, num_rows, hidden, m->norm_eps);
            linear_tiles(&L->qkv, h, num_rows, hidden, qkv_size, qkv);
#pragma omp single
            for (int64_t r = 0; r < num_rows; r++) {
                float *q = qkv + r * qkv_size, *k = q + q_size, *v = k + kv_size;
                const float *cos = m->cos + positions[r] * hd, *sin = m->sin + positions[r] * hd;
                for (int64_t j = 0; j < m->num_heads + m->num_kv_heads; j++) {
                    float *head = q + j * hd; /* q heads, then k heads: they sit side by side */
                    const float *norm = j < m->num_heads ? L->q_norm : L->k_norm;
                    if (norm != NULL) rms_norm_rows(head, norm, head, 1, hd, m->norm_eps);
                    rope_head(head, cos, sin, hd, rope_tmp);
                }
                memcpy(L->k_cache + slots[r] * kv_size, k, sizeof(float) * (size_t)kv_size);
                memcpy(L->v_cache + slots[r] * kv_size, v, sizeof(float) * (size_t)kv_size);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < num_rows * m->num_kv_heads; task++) {
                const int64_t r = task / m->num_kv_heads;
                const int kvh = (int)(task % m->num_kv_heads);
                attend_f32(qkv + r * qkv_size, L->k_cache, L->v_cache, block_tables + r * table_stride, seq_lens[r],
                       attn + r * q_size, (int)m->num_heads, (int)m->num_kv_heads, (int)hd, (int)m->block_size,
                       m->scale, kvh, kvh + 1, scores);
            }
            linear_tiles(&L->o, attn, num_rows, q_size, hidden, tmp);
#pragma omp single
            {
                for (int64_t i = 0; i < num_rows * hidden; i++) x[i] += tmp[i];
                rms_norm_rows(x, L->post_norm, h, num_rows, hidden, m->norm_eps);
            }
            linear_tiles(&L->gate_up, h, num_rows, hidden, 2 * inter, gate_up);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < num_rows; r++)
                silu_mul_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, act + r * inter, inter);
            linear_tiles(&L->down, act, num_rows, inter, hidden, tmp);
#pragma omp single
            for (int64_t i = 0; i < num_rows * hidden; i++) x[i] += tmp[i];
        }
        free(scores);
    }
    if (!failed) rms_norm_rows(x, m->final_norm, out, num_rows, hidden, m->norm_eps);
    free(buf);
    return failed;
}
