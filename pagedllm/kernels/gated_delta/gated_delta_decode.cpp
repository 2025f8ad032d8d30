/*
 * The gated delta rule's recurrent form for decode (gated_delta.h): one token
 * per sequence, each updating its own state slot in place, as a team function
 * (step_nodes.h) over (token, value head) pairs, so a recorded decode step
 * runs it with the other nodes.
 *
 * A pair streams its [head_k_dim, head_v_dim] state twice, one row of
 * head_v_dim floats (a vector loop) per key dimension i:
 *
 *   pass 1   S[i] *= exp(g);  kv += k[i] * S[i];  qs += q[i] * S[i]
 *   pass 2   S[i] += k[i] * delta,   delta = beta * (v - kv)
 *   output   o = qs + (k . q) * delta     (= S_new^T q, without a third pass)
 *
 * q arrives already scaled (and L2-normalised where asked), so o needs no
 * further factor.
 */
#include "gated_delta.h"
#include "../step/step_nodes.h"

/* pass 1 over one state row: row *= decay, kv += ki * row, qs += qi * row */
static inline void gd_decay_read(float *row, float decay, float ki, float qi, float *kv, float *qs, int64_t n) {
    int64_t j = 0;
#if SIMD_F32_WIDTH
    const vf32 vd = vf32_set1(decay), vk = vf32_set1(ki), vq = vf32_set1(qi);
    for (; j + SIMD_F32_WIDTH <= n; j += SIMD_F32_WIDTH) {
        const vf32 s = vf32_mul(vd, vf32_load(row + j));
        vf32_store(row + j, s);
        vf32_store(kv + j, vf32_fma(vk, s, vf32_load(kv + j)));
        vf32_store(qs + j, vf32_fma(vq, s, vf32_load(qs + j)));
    }
#endif
    for (; j < n; j++) {
        row[j] *= decay;
        kv[j] += ki * row[j];
        qs[j] += qi * row[j];
    }
}

/* one token of one value head through its state */
static void gd_decode_head(const GatedDeltaDecodeNode *n, int64_t r, int h) {
    const int64_t dk = n->head_k_dim, dv = n->head_v_dim;
    const int kh = h / (n->num_v_heads / n->num_k_heads);
    float qn[GD_MAX_HEAD_DIM], kn[GD_MAX_HEAD_DIM], kv[GD_MAX_HEAD_DIM], qs[GD_MAX_HEAD_DIM];
    gd_load_head(qn, n->q + r * n->q_stride + kh * dk, dk, n->l2norm, n->scale);
    gd_load_head(kn, n->k + r * n->k_stride + kh * dk, dk, n->l2norm, 1.0f);
    memset(kv, 0, sizeof(float) * (size_t)dv);
    memset(qs, 0, sizeof(float) * (size_t)dv);
    float *state = n->state + (n->slots[r] * n->num_v_heads + h) * dk * dv;
    const float decay = expf(n->g[r * n->num_v_heads + h]), beta = n->beta[r * n->num_v_heads + h];
    for (int64_t i = 0; i < dk; i++) gd_decay_read(state + i * dv, decay, kn[i], qn[i], kv, qs, dv);
    const float *v = n->v + r * n->v_stride + h * dv;
    float *delta = kv;  // kv is read once more, here: delta takes its place
    for (int64_t j = 0; j < dv; j++) delta[j] = beta * (v[j] - kv[j]);
    for (int64_t i = 0; i < dk; i++) vf32_axpy(state + i * dv, kn[i], delta, dv);
    float *o = n->out + r * n->out_stride + h * dv;
    memcpy(o, qs, sizeof(float) * (size_t)dv);
    vf32_axpy(o, vf32_dot(kn, qn, dk), delta, dv);
}

void gated_delta_decode_team(const GatedDeltaDecodeNode *n, int64_t rows) {
    const int num_v_heads = n->num_v_heads;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < rows * num_v_heads; p++) gd_decode_head(n, p / num_v_heads, (int)(p % num_v_heads));
}
