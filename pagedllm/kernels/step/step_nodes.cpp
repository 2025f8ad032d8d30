/*
 * run_step_nodes: one parallel region, the team function of each node in
 * turn (step_nodes.h), and the small team functions of the nodes that move
 * rows between kernels (gathers, strided copies, the residual add).
 *
 *     #pragma omp parallel                       thread 0        thread 1
 *       node 0: omp for over its work      ->    rows 0..r/2     rows r/2..r
 *               (closing barrier)                ------------ barrier -----------
 *       node 1: ...                              ...             ...
 *
 * Each node's work-sharing loop closes with a barrier, so a node reads what
 * the nodes before it wrote, as ops called one after another would.
 */
#include <omp.h>
#include <string.h>

#include "step_nodes.h"

static void gather_rows_team(const GatherRowsNode *n, int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        memcpy(n->out + r * n->row_len, n->table + n->index[r] * n->row_len, sizeof(float) * (size_t)n->row_len);
}

static void copy_rows_team(const CopyRowsNode *n, int64_t rows) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        memcpy(n->dst + r * n->dst_stride, n->src + r * n->src_stride, sizeof(float) * (size_t)n->row_len);
}

/* x += y in chunks of whole cache lines */
static void add_team(const AddNode *n, int64_t rows) {
    const int64_t numel = rows * n->row_len, chunk = 4096, num_chunks = (numel + chunk - 1) / chunk;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t end = (c + 1) * chunk < numel ? (c + 1) * chunk : numel;
        for (int64_t i = c * chunk; i < end; i++) n->x[i] += n->y[i];
    }
}

static void run_node(const StepNode *node, int *failed) {
    const int64_t rows = node->rows;
    switch (node->kind) {
        case NODE_GATHER_ROWS: gather_rows_team(&node->gather, rows); break;
        case NODE_COPY_ROWS: copy_rows_team(&node->copy, rows); break;
        case NODE_ADD: add_team(&node->add, rows); break;
        case NODE_ADD_RMS_NORM: add_rms_norm_team(&node->norm, rows); break;
        case NODE_QK_NORM_ROPE: qk_norm_rope_team(&node->rope, rows); break;
        case NODE_SILU_MUL: silu_mul_team(&node->silu, rows); break;
        case NODE_LINEAR_F32_PANELS: packed_linear_f32_team(&node->linear, rows); break;
        case NODE_LINEAR_BF16_PANELS: packed_linear_bf16_team(&node->linear, rows); break;
        case NODE_LINEAR_GGUF: gguf_linear_team(&node->linear, rows, failed); break;
        case NODE_GATHER_GGUF: gguf_gather_team(&node->gguf_gather, rows); break;
        case NODE_WRITE_KV: write_kv_team(&node->kv, rows); break;
        case NODE_PAGED_DECODE: paged_decode_team(&node->attn, rows, failed); break;
        case NODE_ROW_AFFINE: row_affine_team(&node->affine, rows); break;
        case NODE_GATED_DELTA_DECODE: gated_delta_decode_team(&node->delta, rows); break;
        case NODE_CONV_DECODE: conv_decode_team(&node->conv, rows); break;
        case NODE_SSD_DECODE: ssd_decode_team(&node->ssd, rows); break;
        case NODE_MOE_SLOT_SUM: moe_slot_sum_team(&node->slot_sum, rows); break;
        case NODE_GATED_RMS_NORM: gated_rms_norm_team(&node->gated_norm, rows); break;
        default: break; /* ops.cpp makes no other kind */
    }
}

/* A node that could not allocate its scratch left its output unwritten: the team stops there, every
   thread alike (each reads the flag after the node's closing barrier), rather than let later nodes
   compute, and write K/V, from it. */
int run_step_nodes(const StepNode *nodes, int64_t num_nodes, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    for (int64_t i = 0; i < num_nodes; i++) {
        run_node(&nodes[i], &failed);
        int stop;
#pragma omp atomic read
        stop = failed;
        if (stop) break;
    }
    return failed;
}
