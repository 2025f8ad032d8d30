/*
 * Elementwise ops of the Llama family for float32 rows on the CPU, each one
 * pass instead of the several torch ops (and their dispatch) it replaces,
 * as team functions (step_nodes.h): rows are shared by the team that calls them.
 *
 *   add_rms_norm  x += delta (optional), y = rms_norm(x) * w
 *   qk_norm_rope  RoPE in place on the q and k heads of each row, after
 *                 their per-head RMSNorm where the model has one (Qwen3)
 *   silu_mul      out = silu(gate) * up, gate_up = [gate | up] per row
 *   row_affine_   x = x * mul + add per column, in place (either may be absent)
 *   moe_slot_sum  out = sum over slots s = 0..top_k-1, in that order, of w[s] * y[s] (each product rounded,
 *                 then added: the torch loop's arithmetic), + sigmoid(gate) * shared (or + shared)
 *   gated_rms_norm  out = rms_norm(x) * w * silu(z) per head, heads written grouped or tiled
 */
#include <math.h>

#include "elementwise.h"
#include "../step/step_nodes.h"

void add_rms_norm_team(const AddRmsNormNode *n, int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = n->x + r * n->n;
        if (n->delta != NULL) {
            const float *dr = n->delta + r * n->n;
            for (int64_t i = 0; i < n->n; i++) xr[i] += dr[i];
        }
        rms_norm_row(xr, n->weight, n->y + r * n->n, n->n, n->eps);
    }
}

/* head_dim <= 1024 (ops.cpp checks it) */
void qk_norm_rope_team(const QkNormRopeNode *n, int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float tmp[1024];
        qk_norm_rope_row(n->x + r * n->row_stride, n->num_q_heads, n->num_kv_heads, n->head_dim, n->q_norm,
                         n->k_norm, n->eps, n->cos + r * n->head_dim, n->sin + r * n->head_dim, tmp);
    }
}

void silu_mul_team(const SiluMulNode *n, int64_t rows) {
    const int64_t inter = n->inter;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(n->gate_up + r * 2 * inter, n->gate_up + r * 2 * inter + inter, n->out + r * inter, inter);
}

/* Each row's sum runs over its own slots in slot order, whatever the other rows: batch invariant. Each product
   is rounded before it is added (contraction off here: the build's -ffp-contract=fast would fuse the two into
   an FMA in the vector loop and not in its tail), so the slots' sum is the bits of the torch loop it replaces. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void moe_slot_sum_team(const MoeSlotSumNode *n, int64_t rows) {
#ifdef __clang__
#pragma clang fp contract(off) /* clang ignores GCC's optimize pragma */
#endif
    const int64_t k = n->top_k, h = n->hidden;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *y = n->y + r * k * h, *w = n->weights + r * k;
        float *out = n->out + r * h;
        for (int64_t i = 0; i < h; i++) out[i] = y[i] * w[0];
        for (int64_t s = 1; s < k; s++) {
            const float ws = w[s], *ys = y + s * h;
            for (int64_t i = 0; i < h; i++) out[i] += ys[i] * ws;
        }
        if (n->shared != NULL) {
            const float *sh = n->shared + r * h;
            if (n->gate != NULL) {
                const float g = 1.0f / (1.0f + expf(-n->gate[r]));
                for (int64_t i = 0; i < h; i++) out[i] += g * sh[i];
            } else {
                for (int64_t i = 0; i < h; i++) out[i] += sh[i];
            }
        }
    }
}
#pragma GCC pop_options

/* head_dim <= 1024 (ops.cpp checks it) */
void gated_rms_norm_team(const GatedRmsNormNode *n, int64_t rows) {
    const int64_t heads = n->num_heads, d = n->head_dim, k = n->tiled_k_heads, group = k ? heads / k : 1;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float tmp[1024];
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = k ? (h % group) * k + h / group : h;  /* grouped (h / group, h % group) -> tiled */
            rms_norm_row(n->x + r * n->x_stride + h * d, n->weight, tmp, d, n->eps);
            silu_mul_row(n->z + r * n->z_stride + h * d, tmp, n->out + (r * heads + at) * d, d);
        }
    }
}

void row_affine_team(const RowAffineNode *n, int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = n->x + r * n->row_stride;
        if (n->mul != NULL && n->add != NULL) {
            for (int64_t i = 0; i < n->n; i++) xr[i] = xr[i] * n->mul[i] + n->add[i];
        } else if (n->mul != NULL) {
            for (int64_t i = 0; i < n->n; i++) xr[i] *= n->mul[i];
        } else if (n->add != NULL) {
            for (int64_t i = 0; i < n->n; i++) xr[i] += n->add[i];
        }
    }
}
