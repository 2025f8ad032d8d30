/*
 * The gated delta rule's chunked form for prompts (gated_delta.h), one task
 * per (sequence, value head), a chunk of C tokens at a time.
 *
 * Within a chunk, G_t is the running sum of the log decays (G_t <= G_s for
 * s <= t, so every exp(G_t - G_s) below is at most 1: nothing divides by a
 * decay) and S0 the state before the chunk. Writing u_t for the delta that
 * token t adds (S gains k_t u_t^T), the state token t reads from is
 *
 *     exp(G_t) S0 + sum_{s<t} exp(G_t - G_s) k_s u_s^T
 *
 * so u_t = beta_t (v_t - exp(G_t) S0^T k_t) - sum_{s<t} beta_t exp(G_t - G_s) (k_t . k_s) u_s:
 * a unit lower-triangular system, solved by forward substitution, one
 * vector row of head_v_dim at a time. Then
 *
 *     o_t  = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) u_s
 *     S    = exp(G_last) S0 + sum_s exp(G_last - G_s) k_s u_s^T
 *
 * The state is read once per chunk for every token's S0^T k_t and S0^T q_t
 * (one pass over its rows, each row reused by the C tokens while in L1) and
 * rewritten once, where the recurrent form streams it twice per token. The
 * state is the slot's own, updated in place (zeroed first for a sequence
 * without an initial state).
 */
#include <stdlib.h>

#include "gated_delta.h"

typedef struct {
    const float *q, *k, *v, *g, *beta;
    int64_t q_stride, k_stride, v_stride, out_stride;
    float *out;
    int num_k_heads, num_v_heads, head_k_dim, head_v_dim;
    float scale;
    int l2norm;
} GdPrompt;

/* a task's buffers: qc, kc [C, head_k_dim]; u, o [C, head_v_dim]; cum, beta, w [C] */
typedef struct {
    float *qc, *kc, *u, *o, *cum, *beta, *w;
} GdScratch;

/* the chunk's rows [t0, t0 + n) of head h: q (scaled), k, beta and the running sum of g */
static void gd_load_chunk(const GdPrompt *p, const GdScratch *b, int64_t t0, int64_t n, int h) {
    const int64_t dk = p->head_k_dim;
    const int kh = h / (p->num_v_heads / p->num_k_heads);
    float cum = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        const int64_t r = t0 + t;
        gd_load_head(b->qc + t * dk, p->q + r * p->q_stride + kh * dk, dk, p->l2norm, p->scale);
        gd_load_head(b->kc + t * dk, p->k + r * p->k_stride + kh * dk, dk, p->l2norm, 1.0f);
        cum += p->g[r * p->num_v_heads + h];
        b->cum[t] = cum;
        b->beta[t] = p->beta[r * p->num_v_heads + h];
    }
}

/* u_t = beta_t (v_t - exp(G_t) S0^T k_t), o_t = exp(G_t) S0^T q_t (S0 NULL: zero) */
static void gd_read_state(const GdPrompt *p, const GdScratch *b, const float *s0, int64_t t0, int64_t n, int h) {
    const int64_t dk = p->head_k_dim, dv = p->head_v_dim;
    memset(b->u, 0, sizeof(float) * (size_t)(n * dv));
    memset(b->o, 0, sizeof(float) * (size_t)(n * dv));
    if (s0 != NULL) {
        for (int64_t i = 0; i < dk; i++) {
            const float *row = s0 + i * dv;
            for (int64_t t = 0; t < n; t++) {
                vf32_axpy(b->u + t * dv, b->kc[t * dk + i], row, dv);
                vf32_axpy(b->o + t * dv, b->qc[t * dk + i], row, dv);
            }
        }
    }
    for (int64_t t = 0; t < n; t++) {
        const float decay = expf(b->cum[t]), beta = b->beta[t];
        const float *v = p->v + (t0 + t) * p->v_stride + h * dv;
        float *u = b->u + t * dv;
        for (int64_t j = 0; j < dv; j++) u[j] = beta * (v[j] - decay * u[j]);
        gd_scale(b->o + t * dv, decay, dv);
    }
}

/* forward substitution of the chunk's deltas, then each output row */
static void gd_solve_and_read(const GdPrompt *p, const GdScratch *b, int64_t t0, int64_t n, int h) {
    const int64_t dk = p->head_k_dim, dv = p->head_v_dim;
    for (int64_t t = 1; t < n; t++) {
        float *ut = b->u + t * dv;
        for (int64_t s = 0; s < t; s++) {
            const float a = b->beta[t] * expf(b->cum[t] - b->cum[s]) * vf32_dot(b->kc + t * dk, b->kc + s * dk, dk);
            vf32_axpy(ut, -a, b->u + s * dv, dv);
        }
    }
    for (int64_t t = 0; t < n; t++) {
        float *ot = b->o + t * dv;
        for (int64_t s = 0; s <= t; s++)
            vf32_axpy(ot, expf(b->cum[t] - b->cum[s]) * vf32_dot(b->qc + t * dk, b->kc + s * dk, dk), b->u + s * dv, dv);
        memcpy(p->out + (t0 + t) * p->out_stride + h * dv, ot, sizeof(float) * (size_t)dv);
    }
}

/* S = exp(G_last) S0 + sum_s exp(G_last - G_s) k_s u_s^T, in place */
static void gd_write_state(const GdPrompt *p, const GdScratch *b, float *state, int64_t n) {
    const int64_t dk = p->head_k_dim, dv = p->head_v_dim;
    const float last = b->cum[n - 1];
    for (int64_t s = 0; s < n; s++) b->w[s] = expf(last - b->cum[s]);
    const float decay = expf(last);
    for (int64_t i = 0; i < dk; i++) {
        float *row = state + i * dv;
        gd_scale(row, decay, dv);
        for (int64_t s = 0; s < n; s++) vf32_axpy(row, b->w[s] * b->kc[s * dk + i], b->u + s * dv, dv);
    }
}

/* one sequence's rows through one value head's state, chunk by chunk */
static void gd_prompt_head(const GdPrompt *p, const GdScratch *b, float *state, int64_t begin, int64_t end,
                           int has_initial, int h, int64_t chunk) {
    const int64_t state_len = (int64_t)p->head_k_dim * p->head_v_dim;
    if (!has_initial) memset(state, 0, sizeof(float) * (size_t)state_len);
    int read = has_initial;  // a zero state has nothing to read
    for (int64_t t0 = begin; t0 < end; t0 += chunk) {
        const int64_t n = end - t0 < chunk ? end - t0 : chunk;
        gd_load_chunk(p, b, t0, n, h);
        gd_read_state(p, b, read ? state : NULL, t0, n, h);
        gd_solve_and_read(p, b, t0, n, h);
        gd_write_state(p, b, state, n);
        read = 1;
    }
}

int gated_delta_chunked_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                            int64_t v_stride, const float *g, const float *beta, float *state, const int64_t *bounds,
                            const int64_t *slots, const uint8_t *has_initial, int num_seqs, float *out,
                            int64_t out_stride, int num_k_heads, int num_v_heads, int head_k_dim, int head_v_dim,
                            float scale, int l2norm, int chunk_size, int num_threads) {
    const GdPrompt p = {q, k, v, g, beta, q_stride, k_stride, v_stride, out_stride, out,
                        num_k_heads, num_v_heads, head_k_dim, head_v_dim, scale, l2norm};
    const int64_t c = chunk_size, head_state = (int64_t)head_k_dim * head_v_dim;
    const size_t floats = (size_t)(2 * c * head_k_dim + 2 * c * head_v_dim + 3 * c);
    const int64_t tasks = (int64_t)num_seqs * num_v_heads;
    int failed = 0;
#pragma omp parallel num_threads(tasks < num_threads ? (int)(tasks > 0 ? tasks : 1) : num_threads)
    {
        float *mem = (float *)malloc(sizeof(float) * floats);
        if (mem == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        GdScratch b = {mem, mem + c * head_k_dim, mem + 2 * c * head_k_dim,
                       mem + 2 * c * head_k_dim + c * head_v_dim, mem + 2 * c * head_k_dim + 2 * c * head_v_dim,
                       mem + 2 * c * head_k_dim + 2 * c * head_v_dim + c,
                       mem + 2 * c * head_k_dim + 2 * c * head_v_dim + 2 * c};
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (mem == NULL) continue;
            const int64_t s = task / num_v_heads;
            const int h = (int)(task % num_v_heads);
            float *st = state + (slots[s] * num_v_heads + h) * head_state;
            gd_prompt_head(&p, &b, st, bounds[2 * s], bounds[2 * s + 1], has_initial[s] != 0, h, c);
        }
        free(mem);
    }
    return failed;
}
