/*
 * The (token, slot) pairs of a mixture-of-experts step grouped by expert (layers/fused_moe.py's contract):
 * a counting sort of the router's expert ids, stable, so within an expert the pairs keep their order
 * (by token, then slot), which is what a stable argsort of the ids gives. One pass counts, a prefix sum
 * gives each expert's first pair, a second pass places each pair. The work is O(pairs + experts) integer
 * steps, a few microseconds at decode sizes: one thread, no vector arithmetic to do.
 */
#include <stdint.h>

#include "../kernels.h"

int moe_group_pairs(const int64_t *ids, int64_t num_pairs, int64_t top_k, int64_t num_experts, int64_t *counts,
                    int32_t *offsets, int64_t *order, int32_t *token_ids, int64_t *pair_experts) {
    for (int64_t e = 0; e < num_experts; e++) counts[e] = 0;
    for (int64_t p = 0; p < num_pairs; p++) {
        if (ids[p] < 0 || ids[p] >= num_experts) return 2;  // checked before any output is read
        counts[ids[p]]++;
    }
    offsets[0] = 0;
    for (int64_t e = 0; e < num_experts; e++) offsets[e + 1] = offsets[e] + (int32_t)counts[e];
    // offsets[e] walks expert e's slots as its pairs are placed
    for (int64_t p = 0; p < num_pairs; p++) {
        const int64_t e = ids[p];
        const int64_t place = offsets[e]++;  // the expert's next slot; offsets[e] ends at offsets[e + 1]'s old value
        order[place] = p;
        token_ids[place] = (int32_t)(p / top_k);
        pair_experts[place] = e;
    }
    // offsets[e] now holds expert e's end: shift back so offsets[e] is its start again
    for (int64_t e = num_experts; e > 0; e--) offsets[e] = offsets[e - 1];
    offsets[0] = 0;
    return 0;
}
