/*
 * Causal attention for prompts computed from scratch (nothing of them in the
 * cache yet), reading q, k and v straight from the step's qkv rows (CPU,
 * float32).
 *
 * Sequence s owns rows bounds[2s] .. bounds[2s+1]-1; query i of a sequence
 * attends to keys 0..i of the same sequence. Where the head size does not
 * fit the tiles below, each (sequence, query head) is one task that walks
 * its queries one at a time (prefill_head): the scores with the decode
 * kernel's four-keys-per-reduction dot product and softmax
 * (paged_attention.h), the weighted sum of values in registers. Either
 * way this replaces one torch SDPA call per prompt and layer (plus the K/V
 * head repeat it needs on the CPU), whose fixed cost dominates for prompts
 * of a few hundred tokens.
 *
 * Layouts: row r of q/k/v/out starts at ptr + r * *_stride; within a row,
 * heads are contiguous runs of head_dim floats (q, out: num_heads heads;
 * k, v: num_kv_heads). sinks: [num_heads] attention-sink logits or NULL, one
 * more term of each query head's softmax denominator (gpt-oss).
 *
 * Where the head size is a multiple of PF_DCHUNK, a task works like a small
 * GEMM instead (prefill_group_tiled; a task is a (sequence, kv head), or a
 * (sequence, query head) when there are too few of those for the threads):
 * the head's keys are copied transposed once, kt [head_dim][keys], so that a tile of PF_Q queries x PF_KEYS keys of
 * scores is PF_Q broadcasts and PF_Q x 2 vector FMAs per head dimension,
 * every key vector loaded once for PF_Q queries; after the softmax of each
 * query's row (zero past its own position, which is the causal mask), the
 * weighted sum of values runs the same way over PF_Q queries x PF_DCHUNK
 * dimensions. One query at a time (prefill_head) every key and value row
 * was loaded again for every query and each score needed a horizontal sum;
 * measured in BENCHMARKS.md ("Sixth round").
 *
 *     scores tile (PF_Q x PF_KEYS)      values tile (PF_Q x PF_DCHUNK)
 *     for d in head_dim:                for t in keys of the block:
 *       k = kt[d][t0 : t0 + PF_KEYS]      v = v_t[d0 : d0 + PF_DCHUNK]
 *       for each query i: s_i += q_i[d] * k       for each query i: o_i += p_i[t] * v
 */
#include "../kernels.h"
#include <stdlib.h>

#include "paged_attention.h"

/* the tiles are written in the build's widest float vector (simd.h) */
#if SIMD_F32_WIDTH == 16
#define PF_Q 8 /* queries per tile: 8 x 2 accumulators of 32 */
#elif SIMD_F32_WIDTH == 8
#define PF_Q 4 /* 4 x 2 accumulators of 16 */
#endif
#if SIMD_F32_WIDTH
#define PF_W SIMD_F32_WIDTH /* floats per vector */
#define PF_TILED 1
#else
#define PF_TILED 0
#endif

#if PF_TILED
#define PF_KEYS (2 * PF_W)   /* keys per scores tile */
#define PF_DCHUNK (2 * PF_W) /* head dimensions per values tile */

static inline int64_t pf_round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* One (sequence, kv head): every query head of its group, in tiles of PF_Q
   queries; the same products as prefill_head, summed in another order. The
   keys are transposed once for the group. kt: [head_dim][round_up(len,
   PF_KEYS)] scratch; p: [PF_Q][same] scratch. head_dim is a multiple of
   PF_DCHUNK; q, out point at the group's first query head, sinks (NULL: none)
   at its attention-sink logit. */
static void prefill_group_tiled(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                                int64_t v_stride, float *out, int64_t out_stride, int64_t len, int head_dim,
                                int group, float scale, float *kt, float *p, const float *sinks) {
    const int64_t ld = pf_round_up(len, PF_KEYS);
    for (int64_t t = 0; t < len; t++)
        for (int d = 0; d < head_dim; d++) kt[d * ld + t] = k[t * k_stride + d];
    for (int d = 0; d < head_dim; d++)
        for (int64_t t = len; t < ld; t++) kt[d * ld + t] = 0.0f;
    const vf32 vscale = vf32_set1(scale);
    for (int g = 0; g < group; g++) {
        const float *qh = q + (int64_t)g * head_dim;
        float *oh = out + (int64_t)g * head_dim;
        const float sink = sinks ? sinks[g] : -INFINITY;
        for (int64_t i0 = 0; i0 < len; i0 += PF_Q) {
            const int nq = len - i0 < PF_Q ? (int)(len - i0) : PF_Q;
            const int64_t n = i0 + nq; /* keys [0, n) cover every query of the tile */
            const float *qrow[PF_Q];   /* a short last tile repeats its last query; those rows are dropped */
            for (int qi = 0; qi < PF_Q; qi++) qrow[qi] = qh + (i0 + (qi < nq ? qi : nq - 1)) * q_stride;
            for (int64_t t0 = 0; t0 < n; t0 += PF_KEYS) {
                vf32 acc[PF_Q][2];
#pragma GCC unroll 8
                for (int qi = 0; qi < PF_Q; qi++) acc[qi][0] = acc[qi][1] = vf32_zero();
                for (int d = 0; d < head_dim; d++) {
                    const vf32 k0 = vf32_load(kt + d * ld + t0), k1 = vf32_load(kt + d * ld + t0 + PF_W);
#pragma GCC unroll 8
                    for (int qi = 0; qi < PF_Q; qi++) {
                        const vf32 a = vf32_set1(qrow[qi][d]);
                        acc[qi][0] = vf32_fma(a, k0, acc[qi][0]);
                        acc[qi][1] = vf32_fma(a, k1, acc[qi][1]);
                    }
                }
#pragma GCC unroll 8
                for (int qi = 0; qi < PF_Q; qi++) {
                    vf32_store(p + qi * ld + t0, vf32_mul(acc[qi][0], vscale));
                    vf32_store(p + qi * ld + t0 + PF_W, vf32_mul(acc[qi][1], vscale));
                }
            }
            /* each query sees keys [0, i]: exp over those, zero weight after (the causal
               mask); the division by the sum is left to the output */
            float inv[PF_Q];
            for (int qi = 0; qi < PF_Q; qi++) {
                float *pi = p + qi * ld;
                const int64_t own = qi < nq ? i0 + qi + 1 : 0;
                inv[qi] = own ? 1.0f / exp_row(pi, own, sink) : 0.0f;
                for (int64_t t = own; t < n; t++) pi[t] = 0.0f;
            }
            for (int d0 = 0; d0 < head_dim; d0 += PF_DCHUNK) {
                vf32 acc[PF_Q][2];
#pragma GCC unroll 8
                for (int qi = 0; qi < PF_Q; qi++) acc[qi][0] = acc[qi][1] = vf32_zero();
                for (int64_t t = 0; t < n; t++) {
                    const float *vt = v + t * v_stride + d0;
                    const vf32 v0 = vf32_load(vt), v1 = vf32_load(vt + PF_W);
#pragma GCC unroll 8
                    for (int qi = 0; qi < PF_Q; qi++) {
                        const vf32 a = vf32_set1(p[qi * ld + t]);
                        acc[qi][0] = vf32_fma(a, v0, acc[qi][0]);
                        acc[qi][1] = vf32_fma(a, v1, acc[qi][1]);
                    }
                }
                for (int qi = 0; qi < nq; qi++) {
                    float *oi = oh + (i0 + qi) * out_stride + d0;
                    const vf32 vinv = vf32_set1(inv[qi]);
                    vf32_store(oi, vf32_mul(acc[qi][0], vinv));
                    vf32_store(oi + PF_W, vf32_mul(acc[qi][1], vinv));
                }
            }
        }
    }
}
#endif

/* one (sequence, query head): queries [0, len) against keys [0, i] each; sink: the head's
   attention-sink logit (-INFINITY: none) */
static void prefill_head(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                         int64_t v_stride, float *out, int64_t out_stride, int64_t len, int head_dim, float scale,
                         float *scores, float sink) {
    for (int64_t i = 0; i < len; i++) {
        const float *qi = q + i * q_stride;
        const int64_t n = i + 1;
        int64_t t = 0;
#if SIMD_F32X8
        const f32x4 vscale = f32x4_set1(scale);
        /* the four-key product works on whole vectors: head sizes that are multiples of 8 */
        for (; head_dim % 8 == 0 && t + 4 <= n; t += 4) {
            const float *k0 = k + t * k_stride;
            f32x4_store(scores + t, f32x4_mul(dot4_keys<KvF32>(qi, k0, k0 + k_stride, k0 + 2 * k_stride,
                                                            k0 + 3 * k_stride, head_dim), vscale));
        }
#endif
        for (; t < n; t++) scores[t] = scale * dot(qi, k + t * k_stride, head_dim);
        softmax_row(scores, n, sink);
        float *oi = out + i * out_stride;
        memset(oi, 0, sizeof(float) * (size_t)head_dim);
        int d0 = 0;
#if SIMD_F32X8
        for (; d0 + 64 <= head_dim; d0 += 64) {
            f32x8 acc[8];
            for (int c = 0; c < 8; c++) acc[c] = f32x8_zero();
            for (t = 0; t < n; t++) {
                const f32x8 p = f32x8_set1(scores[t]);
                const float *vt = v + t * v_stride + d0;
                for (int c = 0; c < 8; c++) acc[c] = f32x8_fma(p, f32x8_load(vt + 8 * c), acc[c]);
            }
            for (int c = 0; c < 8; c++) f32x8_store(oi + d0 + 8 * c, acc[c]);
        }
#endif
        for (t = 0; t < n && d0 < head_dim; t++) axpy(oi + d0, scores[t], v + t * v_stride + d0, head_dim - d0);
    }
}

/* Returns 0 on success, 1 when scratch memory could not be allocated. */
int prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                          int64_t v_stride, float *out, int64_t out_stride, const int64_t *bounds, int num_seqs,
                          int num_heads, int num_kv_heads, int head_dim, float scale, const float *sinks,
                          int num_threads) {
    int64_t max_len = 1;
    for (int s = 0; s < num_seqs; s++)
        if (bounds[2 * s + 1] - bounds[2 * s] > max_len) max_len = bounds[2 * s + 1] - bounds[2 * s];
    const int group = num_heads / num_kv_heads;
#if PF_TILED
    const int tiled = head_dim % PF_DCHUNK == 0;
    /* scores [max_len], or kt [head_dim][ld] and p [PF_Q][ld] when tiled */
    const int64_t ld = pf_round_up(max_len, PF_KEYS);
    const int64_t scratch = tiled ? (int64_t)(head_dim + PF_Q) * ld : max_len;
#else
    const int64_t scratch = max_len;
#endif
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)scratch);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#if PF_TILED
        if (tiled) {
            /* one task per (sequence, kv head), its keys transposed once for the group; with
               too few of those to keep every thread busy (one long prompt), one per query
               head, each transposing the keys again (cheap next to the len^2 work) */
            const int per_head = (int64_t)num_seqs * num_kv_heads < 2 * (int64_t)num_threads;
            const int heads_per_task = per_head ? 1 : group;
            const int64_t num_tasks = (int64_t)num_seqs * num_heads / heads_per_task;
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < num_tasks; task++) {
                if (scores == NULL) continue;
                const int s = (int)(task / (num_heads / heads_per_task));
                const int h = (int)(task % (num_heads / heads_per_task)) * heads_per_task, kvh = h / group;
                const int64_t r0 = bounds[2 * s], len = bounds[2 * s + 1] - r0;
                prefill_group_tiled(q + r0 * q_stride + (int64_t)h * head_dim, q_stride,
                                    k + r0 * k_stride + (int64_t)kvh * head_dim, k_stride,
                                    v + r0 * v_stride + (int64_t)kvh * head_dim, v_stride,
                                    out + r0 * out_stride + (int64_t)h * head_dim, out_stride, len, head_dim,
                                    heads_per_task, scale, scores,
                                    scores + (int64_t)head_dim * pf_round_up(len, PF_KEYS), sinks ? sinks + h : NULL);
            }
        } else
#endif
        {
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < (int64_t)num_seqs * num_heads; task++) {
                if (scores == NULL) continue;
                const int s = (int)(task / num_heads), h = (int)(task % num_heads), kvh = h / group;
                const int64_t r0 = bounds[2 * s];
                prefill_head(q + r0 * q_stride + (int64_t)h * head_dim, q_stride,
                             k + r0 * k_stride + (int64_t)kvh * head_dim, k_stride,
                             v + r0 * v_stride + (int64_t)kvh * head_dim, v_stride,
                             out + r0 * out_stride + (int64_t)h * head_dim, out_stride, bounds[2 * s + 1] - r0,
                             head_dim, scale, scores, sinks ? sinks[h] : -INFINITY);
            }
        }
        free(scores);
    }
    return failed;
}
