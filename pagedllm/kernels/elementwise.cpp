/*
 * Elementwise ops of the Llama family for float32 rows on the CPU, each one
 * pass instead of the several torch ops (and their dispatch) it replaces:
 *
 *   add_rms_norm_f32  x += delta (optional), y = rms_norm(x) * w
 *   qk_norm_rope_f32  RoPE in place on the q and k heads of each row, after
 *                     their per-head RMSNorm where the model has one (Qwen3)
 *   silu_mul_f32      out = silu(gate) * up, gate_up = [gate | up] per row
 *
 * Rows are split over threads when there are enough of them to pay for it.
 */
#include "kernels.h"
#include "elementwise.h"

/* below this many floats a call stays on one thread */
#define PARALLEL_MIN_FLOATS 32768

void add_rms_norm_f32(float *x, const float *delta, const float *w, float *y, int64_t rows, int64_t n, float eps,
                      int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * n;
        if (delta != NULL) {
            const float *dr = delta + r * n;
            for (int64_t i = 0; i < n; i++) xr[i] += dr[i];
        }
        rms_norm_row(xr, w, y + r * n, n, eps);
    }
}

/* x: rows of row_stride floats starting with num_q_heads q heads and
   num_kv_heads k heads; each head is RMS-normed first with q_norm / k_norm
   ([head_dim], or NULL: no norm), then rotated. cos, sin: [rows, head_dim].
   head_dim <= 1024. */
void qk_norm_rope_f32(float *x, int64_t rows, int64_t row_stride, int64_t num_q_heads, int64_t num_kv_heads,
                      int64_t head_dim, const float *q_norm, const float *k_norm, float eps, const float *cos,
                      const float *sin, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * (num_q_heads + num_kv_heads) * head_dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float tmp[1024];
        qk_norm_rope_row(x + r * row_stride, num_q_heads, num_kv_heads, head_dim, q_norm, k_norm, eps,
                         cos + r * head_dim, sin + r * head_dim, tmp);
    }
}

void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, out + r * inter, inter);
}
