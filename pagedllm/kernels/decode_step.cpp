/*
 * A whole decoder step for decode tokens, in one call (CPU, float32
 * activations). The linear layers are one of three kinds, all of one model:
 * weight-only int8 rows (int8_dot.h), float32 panels (panel_f32.h) or bf16
 * k-pair panels (panel_bf16.h); the KV cache is float32, float16 or
 * bfloat16 (kv_rows.h writes it, paged_attention.h reads it).
 *
 * A decode step of SmolLM2-135M runs 30 layers of ~5 kernel calls and ~20
 * small torch ops each; run layer by layer from Python, the dispatch between
 * them cost ~10% of the throughput workload's time (BENCHMARKS.md, "One
 * call per decode step"). Here the whole decoder runs in one OpenMP region,
 * the team meeting at a barrier between phases, with the arithmetic of the
 * layer-by-layer path: the same tile functions, the same rounding of K/V
 * and of bf16 activations, the same attention and elementwise row functions.
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
 * and after the last layer out = rms_norm(x) * final_norm.
 */
#include <omp.h>
#include <stdlib.h>

#include "decode_step.h"
#include "elementwise.h"
#include "int8_dot.h"
#include "kv_rows.h"
#include "paged_attention.h"
#include "panel_bf16.h"
#include "panel_f32.h"

/* bf16 values the scratch for rounded activations holds: the largest block of rows of any layer */
static int64_t bf16_scratch_values(int64_t num_rows, int64_t hidden, int64_t q_size, int64_t inter) {
    const int64_t ks[3] = {hidden, q_size, inter};
    int64_t most = 0;
    for (int i = 0; i < 3; i++) {
        const int64_t kpad = 2 * ((ks[i] + 1) / 2), block = bf16_block_rows(kpad);
        const int64_t values = (num_rows < block ? num_rows : block) * kpad;
        if (values > most) most = values;
    }
    return most;
}

/* y [rows, n] = x [rows, k] @ W^T (+ bias), shared by the team (every thread
   calls it); computed as the layer-by-layer kernel of the same kind computes
   it. xb: scratch for the bf16 rows of one block. */
static void team_linear(int64_t kind, const StepLinear *l, const float *x, int64_t rows, int64_t k, int64_t n,
                        float *y, uint16_t *xb) {
    if (kind == LINEAR_INT8) {
        const int64_t num_tiles = int8_num_tiles(n);
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < num_tiles; tile++)
            int8_linear_tile(x, 0, rows, k, (const int8_t *)l->weight, l->scales, l->bias, n, y, tile);
    } else if (kind == LINEAR_F32_PANELS) {
        const int64_t block_rows = f32_block_rows(k);
        for (int64_t row0 = 0; row0 < rows; row0 += block_rows) {
            const int64_t r = rows - row0 < block_rows ? rows - row0 : block_rows;
            f32_panel_units(x + row0 * k, r, k, (const float *)l->weight, l->bias, n, y + row0 * n);
        }
    } else {
        const int64_t k2 = (k + 1) / 2, kpad = 2 * k2, block_rows = bf16_block_rows(kpad);
        for (int64_t row0 = 0; row0 < rows; row0 += block_rows) {
            const int64_t r = rows - row0 < block_rows ? rows - row0 : block_rows;
#pragma omp for schedule(static)
            for (int64_t i = 0; i < r; i++) row_to_bf16(x + (row0 + i) * k, k, kpad, xb + i * kpad);
            /* the rounding loop's closing barrier: every row is ready before any unit reads it,
               and the units' closing barrier frees xb for the next block */
            bf16_panel_units(xb, r, k2, (const uint16_t *)l->weight, l->bias, n, y + row0 * n);
        }
    }
}

/* heads [h0, h1) of row r's decode attention, reading the cache in its own dtype */
static void attend_row(int64_t kv_type, const float *q, const void *k_cache, const void *v_cache,
                       const int64_t *table, int64_t len, float *out, const DecodeModel *m, int h0, int h1,
                       float *scores) {
    const int nh = (int)m->num_heads, nkv = (int)m->num_kv_heads, hd = (int)m->head_dim, bs = (int)m->block_size;
    if (kv_type == KV_FLOAT32)
        attend_f32(q, (const float *)k_cache, (const float *)v_cache, table, len, out, nh, nkv, hd, bs, m->scale, h0,
                   h1, scores, 0);
    else if (kv_type == KV_FLOAT16)
        attend_f16(q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, table, len, out, nh, nkv, hd, bs,
                   m->scale, h0, h1, scores, 0);
    else
        attend_bf16(q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, table, len, out, nh, nkv, hd, bs,
                    m->scale, h0, h1, scores, 0);
}

/* Returns 0 on success, 1 when scratch memory could not be allocated,
   2 when the addressing is inconsistent: a position outside the RoPE table,
   a sequence length other than position + 1, a block id outside the cache or
   a slot that is not the position's place in the block table (nothing is
   written then), 3 for an unknown linear kind or cache type. */
int decode_step(const DecodeModel *m, float *x, int64_t num_rows, const int64_t *positions, const int64_t *slots,
                const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, float *out,
                int num_threads) {
    const int64_t hidden = m->hidden_size, hd = m->head_dim, inter = m->intermediate_size;
    const int64_t q_size = m->num_heads * hd, kv_size = m->num_kv_heads * hd, qkv_size = q_size + 2 * kv_size;
    const int64_t group = m->num_heads / m->num_kv_heads, kind = m->linear_kind, kv_type = m->kv_type;
    if (kind != LINEAR_INT8 && kind != LINEAR_F32_PANELS && kind != LINEAR_BF16_PANELS) return 3;
    if (kv_type != KV_FLOAT32 && kv_type != KV_FLOAT16 && kv_type != KV_BFLOAT16) return 3;
    /* the pointers below are trusted, so what they must satisfy is checked
       first: a few integers per row, cheap. Each row decodes the token at its
       last position, its slot is that position's place in its block table,
       and every block it reads is in the cache. */
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
       gate_up [rows, 2 * inter], act [rows, inter]; then the bf16 scratch */
    const int64_t floats = num_rows * (2 * hidden + qkv_size + q_size + 3 * inter);
    const int64_t bf16_values = kind == LINEAR_BF16_PANELS ? bf16_scratch_values(num_rows, hidden, q_size, inter) : 0;
    float *buf = (float *)malloc(sizeof(float) * (size_t)floats + sizeof(uint16_t) * (size_t)bf16_values);
    if (buf == NULL) return 1;
    float *h = buf, *qkv = h + num_rows * hidden, *attn = qkv + num_rows * qkv_size;
    float *tmp = attn + num_rows * q_size, *gate_up = tmp + num_rows * hidden;
    float *act = gate_up + num_rows * 2 * inter;
    uint16_t *xb = (uint16_t *)(act + num_rows * inter);
    /* attention tasks as paged_decode.cpp splits them: by sequence, or by
       (sequence, kv head) when there are too few sequences to keep every thread busy */
    const int parts = num_rows < 2 * num_threads ? (int)m->num_kv_heads : 1;
    const int heads_per_part = (int)m->num_kv_heads / parts;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(heads_per_part * group * max_len));
        float *rope_tmp = (float *)malloc(sizeof(float) * (size_t)hd);
        if (scores == NULL || rope_tmp == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        for (int64_t layer = 0; layer < m->num_layers && !failed; layer++) {
            const DecodeLayer *L = &m->layers[layer];
#pragma omp for schedule(static)
            for (int64_t r = 0; r < num_rows; r++)
                rms_norm_row(x + r * hidden, L->input_norm, h + r * hidden, hidden, m->norm_eps);
            team_linear(kind, &L->qkv, h, num_rows, hidden, qkv_size, qkv, xb);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < num_rows; r++) {
                float *q = qkv + r * qkv_size, *k = q + q_size, *v = k + kv_size;
                qk_norm_rope_row(q, m->num_heads, m->num_kv_heads, hd, L->q_norm, L->k_norm, m->norm_eps,
                                 m->cos + positions[r] * hd, m->sin + positions[r] * hd, rope_tmp);
                write_row(L->k_cache, (int)kv_type, slots[r], k, kv_size);
                write_row(L->v_cache, (int)kv_type, slots[r], v, kv_size);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < num_rows * parts; task++) {
                const int64_t r = task / parts;
                const int h0 = (int)(task % parts) * heads_per_part;
                attend_row(kv_type, qkv + r * qkv_size, L->k_cache, L->v_cache, block_tables + r * table_stride,
                           seq_lens[r], attn + r * q_size, m, h0, h0 + heads_per_part, scores);
            }
            team_linear(kind, &L->o, attn, num_rows, q_size, hidden, tmp, xb);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < num_rows; r++) {
                float *xr = x + r * hidden;
                for (int64_t i = 0; i < hidden; i++) xr[i] += tmp[r * hidden + i];
                rms_norm_row(xr, L->post_norm, h + r * hidden, hidden, m->norm_eps);
            }
            team_linear(kind, &L->gate_up, h, num_rows, hidden, 2 * inter, gate_up, xb);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < num_rows; r++)
                silu_mul_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, act + r * inter, inter);
            team_linear(kind, &L->down, act, num_rows, inter, hidden, tmp, xb);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < num_rows * hidden; i++) x[i] += tmp[i];
        }
        free(scores);
        free(rope_tmp);
    }
    if (!failed)
        for (int64_t r = 0; r < num_rows; r++)
            rms_norm_row(x + r * hidden, m->final_norm, out + r * hidden, hidden, m->norm_eps);
    free(buf);
    return failed;
}
