/* Per-row argmax and logsumexp of the logits, in one native call.
 *
 * Every sampled row needs its logsumexp (log p(token) = logit - lse, for the
 * cumulative logprob) and greedy rows need the argmax. torch computes them
 * as two reductions over [rows, vocab] (1.1 ms + 0.6 ms for 40 x 49152 on
 * the 2-vCPU EPYC); here one pass finds max and argmax, a second sums
 * exp(x - max), rows split over the threads.
 *
 * Ties go to the lowest index, as torch.argmax does. A row holding NaN gets
 * a NaN logsumexp, and the caller falls back to torch for it (torch treats
 * NaN as the maximum). A row of -inf only gets lse = -inf.
 */
#include "../kernels.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "../simd/simd.h"

static void row_stats(const float *x, int64_t n, int64_t *argmax, float *lse) {
    float best = -INFINITY;
    int64_t best_i = 0;
    int64_t i = 0;
#if SIMD_F32X8
    /* lane-wise running max and the index where each lane found it */
    f32x8 vbest = f32x8_set1(-INFINITY);
    i32x8 vidx = i32x8_zero();
    i32x8 cur = i32x8_iota();
    const i32x8 step = i32x8_set1(8);
    for (; i + 8 <= n && n < INT32_MAX; i += 8) {
        f32x8 v = f32x8_load(x + i);
        f32x8 gt = f32x8_gt(v, vbest); /* strict: a lane keeps its first max */
        vbest = f32x8_select(vbest, v, gt);
        vidx = i32x8_select(vidx, cur, gt);
        cur = i32x8_add(cur, step);
    }
    float lane_best[8];
    int32_t lane_idx[8];
    f32x8_store(lane_best, vbest);
    i32x8_store(lane_idx, vidx);
    for (int l = 0; l < 8; l++)
        if (lane_best[l] > best || (lane_best[l] == best && lane_idx[l] < best_i)) {
            best = lane_best[l];
            best_i = lane_idx[l];
        }
#endif
    for (; i < n; i++)
        if (x[i] > best) {
            best = x[i];
            best_i = i;
        }
    *argmax = best_i;
    if (best == -INFINITY) { /* every logit masked: no mass anywhere, unless a NaN hid from the max */
        *lse = -INFINITY;
        for (int64_t j = 0; j < n; j++)
            if (x[j] != x[j]) {
                *lse = NAN; /* the caller redoes the row in torch */
                break;
            }
        return;
    }
    double sum = 0.0;
    i = 0;
#if SIMD_F32X8
    const f32x8 vmax = f32x8_set1(best);
    f32x8 acc0 = f32x8_zero(), acc1 = f32x8_zero();
    for (; i + 16 <= n; i += 16) {
        acc0 = f32x8_add(acc0, f32x8_exp(f32x8_sub(f32x8_load(x + i), vmax)));
        acc1 = f32x8_add(acc1, f32x8_exp(f32x8_sub(f32x8_load(x + i + 8), vmax)));
    }
    float lanes[8];
    f32x8_store(lanes, f32x8_add(acc0, acc1));
    for (int l = 0; l < 8; l++) sum += lanes[l];
#endif
    for (; i < n; i++) sum += expf(x[i] - best);
    /* NaN anywhere in the row makes the sum NaN: the caller sees it */
    *lse = best + (float)log(sum);
}

/* logits [rows, vocab] (row-major) -> argmax [rows] int64, lse [rows] float32 */
void logit_stats_f32(const float *logits, int64_t rows, int64_t vocab, int64_t *argmax, float *lse, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) row_stats(logits + r * vocab, vocab, argmax + r, lse + r);
}
