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
#include "kernels.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "vec_math.h"

static void row_stats(const float *x, int64_t n, int64_t *argmax, float *lse) {
    float best = -INFINITY;
    int64_t best_i = 0;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    /* lane-wise running max and the index where each lane found it */
    __m256 vbest = _mm256_set1_ps(-INFINITY);
    __m256i vidx = _mm256_setzero_si256();
    __m256i cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    for (; i + 8 <= n && n < INT32_MAX; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 gt = _mm256_cmp_ps(v, vbest, _CMP_GT_OQ); /* strict: a lane keeps its first max */
        vbest = _mm256_blendv_ps(vbest, v, gt);
        vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
        cur = _mm256_add_epi32(cur, step);
    }
    float lane_best[8];
    int32_t lane_idx[8];
    _mm256_storeu_ps(lane_best, vbest);
    _mm256_storeu_si256((__m256i *)lane_idx, vidx);
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
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vmax = _mm256_set1_ps(best);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_add_ps(acc0, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax)));
        acc1 = _mm256_add_ps(acc1, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vmax)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(acc0, acc1));
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
