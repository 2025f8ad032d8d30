/*
 * The Mamba-2 scan kernels (ssd_scan.h): one task per (sequence, head),
 * shared by the threads. A head's state ([head_dim, state_size], 32 KiB at
 * 64 x 128) stays in the core's cache while its task runs.
 */
#include "ssd_scan.h"

#include <math.h>
#include <string.h>

#include "ssd_rows.h"
#include "../step/step_nodes.h"

namespace {

/* where head h's state of the sequence in slot lives */
inline float *head_state(const SsdLayer *l, float *state, int64_t slot, int h) {
    return state + (slot * l->num_heads + h) * (int64_t)l->head_dim * l->state_size;
}

/* the group whose B and C head h reads */
inline int group_of(const SsdLayer *l, int h) { return h / (l->num_heads / l->num_groups); }

void decode_head(const SsdLayer *l, const SsdRows *r, float *state, int64_t slot, int64_t t, int h) {
    const int64_t P = l->head_dim, N = l->state_size, g = group_of(l, h);
    const float *x = r->x + t * r->x_stride + h * P;
    const float *b = r->B + t * r->b_stride + g * N;
    const float *c = r->C + t * r->c_stride + g * N;
    float *y = r->out + t * r->out_stride + h * P;
    const float dt = ssd_time_step(r->dt[t * r->dt_stride + h], l->dt_bias[h], l->dt_min, l->dt_max);
    const float decay = expf(dt * l->A[h]);
    float *s = head_state(l, state, slot, h);
    for (int64_t p = 0; p < P; p++) y[p] = ssd_step_row(s + p * N, decay, dt * x[p], b, c, N) + l->D[h] * x[p];
}

/* One chunk of n tokens from token t0 of head h: outputs, then the state moved past the chunk.
   log_decay[i]: the sum of dt * A over the chunk's tokens 0..i; dts[i]: token i's time step. */
void chunk_head(const SsdLayer *l, const SsdRows *r, float *s, int64_t t0, int n, int h, float *log_decay,
                float *dts) {
    const int64_t P = l->head_dim, N = l->state_size, g = group_of(l, h);
    float acc = 0.0f;
    for (int i = 0; i < n; i++) {
        dts[i] = ssd_time_step(r->dt[(t0 + i) * r->dt_stride + h], l->dt_bias[h], l->dt_min, l->dt_max);
        acc += dts[i] * l->A[h];
        log_decay[i] = acc;
    }
    for (int i = 0; i < n; i++) {
        const int64_t t = t0 + i;
        const float *x = r->x + t * r->x_stride + h * P;
        const float *c = r->C + t * r->c_stride + g * N;
        float *y = r->out + t * r->out_stride + h * P;
        // the state at the chunk's start, decayed to token i and read through C_i
        const float start = expf(log_decay[i]);
        for (int64_t p = 0; p < P; p++) y[p] = start * vf32_dot(s + p * N, c, N) + l->D[h] * x[p];
        // the chunk's tokens j <= i: decay from j to i (a difference of sums: at most 0, no overflow)
        for (int j = 0; j <= i; j++) {
            const float *bj = r->B + (t0 + j) * r->b_stride + g * N;
            const float w = expf(log_decay[i] - log_decay[j]) * dts[j] * vf32_dot(c, bj, N);
            vf32_axpy(y, w, r->x + (t0 + j) * r->x_stride + h * P, P);
        }
    }
    // state = decay over the chunk * state + sum_j (decay from j to the end) * dt_j * x_j B_j^T
    const float whole = expf(log_decay[n - 1]);
    for (int j = 0; j < n; j++) dts[j] *= expf(log_decay[n - 1] - log_decay[j]);
    for (int64_t p = 0; p < P; p++) {
        float *row = s + p * N;
        for (int j = 0; j < n; j++) {
            const float xj = r->x[(t0 + j) * r->x_stride + h * P + p];
            ssd_scale_axpy(row, j == 0 ? whole : 1.0f, dts[j] * xj, r->B + (t0 + j) * r->b_stride + g * N, N);
        }
    }
}

}  // namespace

void ssd_decode_f32(const SsdLayer *layer, const SsdRows *rows, float *state, const int64_t *slots, int num_seqs,
                    int num_threads) {
    const int64_t tasks = (int64_t)num_seqs * layer->num_heads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tasks > 1)
    for (int64_t k = 0; k < tasks; k++) {
        const int64_t seq = k / layer->num_heads;
        decode_head(layer, rows, state, slots[seq], seq, (int)(k % layer->num_heads));
    }
}

/* ssd_decode_f32's tasks as a step program's node (step_nodes.h): the same head function, so the same bits;
   orphaned, the caller's team shares it */
void ssd_decode_team(const SsdDecodeNode *n, int64_t rows) {
    const int64_t tasks = rows * n->layer.num_heads;
#pragma omp for schedule(static)
    for (int64_t k = 0; k < tasks; k++) {
        const int64_t seq = k / n->layer.num_heads;
        decode_head(&n->layer, &n->rows, n->state, n->slots[seq], seq, (int)(k % n->layer.num_heads));
    }
}

void ssd_prefill_f32(const SsdLayer *layer, const SsdRows *rows, float *state, const int64_t *slots,
                     const int64_t *bounds, const uint8_t *has_initial_state, int num_seqs, int chunk_size,
                     int num_threads) {
    const int64_t tasks = (int64_t)num_seqs * layer->num_heads;
    const int64_t head_floats = (int64_t)layer->head_dim * layer->state_size;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (tasks > 1)
    for (int64_t k = 0; k < tasks; k++) {
        float log_decay[SSD_MAX_CHUNK], dts[SSD_MAX_CHUNK];
        const int64_t seq = k / layer->num_heads;
        const int h = (int)(k % layer->num_heads);
        float *s = head_state(layer, state, slots[seq], h);
        if (!has_initial_state[seq]) memset(s, 0, sizeof(float) * (size_t)head_floats);
        for (int64_t t0 = bounds[seq]; t0 < bounds[seq + 1]; t0 += chunk_size) {
            const int64_t left = bounds[seq + 1] - t0;
            chunk_head(layer, rows, s, t0, (int)(left < chunk_size ? left : chunk_size), h, log_decay, dts);
        }
    }
}
