/*
 * Kernel calls as plain records ("nodes"), run by one OpenMP team.
 *
 * Every decode-path kernel (the norms, RoPE, SiLU-and-multiply, the three
 * linear kinds, the KV write, decode attention, and the row gathers, copies
 * and adds between them) is written once as a *team function*: its loops are
 * orphaned "omp for" constructs, so called inside a parallel region the team
 * shares them and meets at their closing barrier. run_step_nodes opens one
 * region and calls the team function of each node in turn:
 *
 *     eager op (ops.cpp)          one node   -> run_step_nodes(&node, 1, threads)
 *     replayed decode step        N nodes    -> run_step_nodes(nodes, N, threads)
 *     (runner/step_program.py:       recorded from the model's own forward
 *      a StepProgram)                 pass, so no layer is written here)
 *
 * so a recorded step costs one fork and one barrier per node, not one
 * parallel region (and a sleeping team to wake) per kernel, and it computes
 * exactly what the eager ops compute: the same functions on the same rows.
 *
 * Nodes trust their pointers and sizes: ops.cpp builds them from tensors it
 * has checked, and checks the indices they read (slots, block tables,
 * gathered rows) before every run.
 */
#ifndef PAGEDLLM_STEP_NODES_H
#define PAGEDLLM_STEP_NODES_H
#include <stdint.h>

#include "../ssm/ssd_scan.h"

enum StepNodeKind {
    NODE_GATHER_ROWS, /* out[r] = table[index[r]]  (embedding, cos/sin lookup) */
    NODE_COPY_ROWS,   /* dst[r] = src[r], rows src_stride / dst_stride apart (a strided view made contiguous, a part of a cat) */
    NODE_ADD,         /* x += y, elementwise (the residual stream) */
    NODE_ADD_RMS_NORM,
    NODE_QK_NORM_ROPE,
    NODE_SILU_MUL,
    NODE_LINEAR_F32_PANELS,
    NODE_LINEAR_BF16_PANELS,
    NODE_LINEAR_GGUF, /* over quantized blocks, GGUF's or the grouped int8 / int4 ones (gguf_linear.cpp) */
    NODE_GATHER_GGUF, /* out[r] = dequantized row index[r] of such a table (a quantized embedding) */
    NODE_WRITE_KV,
    NODE_PAGED_DECODE,
    NODE_ROW_AFFINE, /* x[r] = x[r] * mul + add per column, in place (an int4 cache's K/V change of variables) */
    NODE_GATED_DELTA_DECODE, /* one token per sequence through its gated delta rule state (gated_delta/) */
    NODE_CONV_DECODE,        /* one token per sequence through its causal conv1d state (conv/) */
    NODE_SSD_DECODE,         /* one token per sequence through its Mamba-2 scan state (ssm/) */
    NODE_MOE_SLOT_SUM,       /* a mixture of experts' weighted sum of each token's top-k outputs (elementwise/) */
    NODE_GATED_RMS_NORM,     /* rms_norm(x) * w * silu(z) per head (Gated DeltaNet's output norm; elementwise/) */
};

typedef struct {
    const float *table;   /* [table_rows, row_len] */
    const int64_t *index; /* [rows], each in [0, table_rows) */
    float *out;           /* [rows, row_len] */
    int64_t row_len, table_rows;
} GatherRowsNode;

typedef struct {
    const float *src; /* rows of row_len contiguous floats, src_stride apart */
    float *dst;       /* rows of row_len contiguous floats, dst_stride apart */
    int64_t row_len, src_stride, dst_stride;
} CopyRowsNode;

typedef struct {
    float *x;       /* [rows * row_len] */
    const float *y; /* [rows * row_len] */
    int64_t row_len;
} AddNode;

typedef struct {
    float *x;            /* [rows, n]; x += delta when delta is given */
    const float *delta;  /* [rows, n] or NULL */
    const float *weight; /* [n] */
    float *y;            /* [rows, n] = rms_norm(x) * weight */
    int64_t n;
    float eps;
} AddRmsNormNode;

typedef struct {
    float *x; /* rows of row_stride floats: num_q_heads q heads, then num_kv_heads k heads */
    int64_t row_stride, num_q_heads, num_kv_heads, head_dim;
    const float *q_norm, *k_norm; /* [head_dim] each, or both NULL */
    const float *cos, *sin;       /* [rows, head_dim] */
    float eps;
} QkNormRopeNode;

typedef struct {
    const float *gate_up; /* [rows, 2 * inter]: gate, then up */
    float *out;           /* [rows, inter] */
    int64_t inter;
} SiluMulNode;

typedef struct {
    const float *x; /* [rows, in_features] */
    /* float32 panels [num_panels, in, PANEL]; bf16 panels [num_panels, ceil(in / 2), BF_PANEL, 2];
       quantized blocks [out, row bytes] */
    const void *weight;
    const float *bias;   /* [out_features] or NULL */
    float *y;            /* [rows, out_features] */
    uint16_t *scratch;   /* shared by the team: bf16 panels, bf16_scratch_values(rows, in_features) values;
                            x16 GGUF types, gguf_x16_scratch_bytes(rows, in_features) bytes (gguf_x16.h) */
    int64_t in_features, out_features;
    int weight_type;    /* quantized blocks: their type (gguf_blocks.h: a ggml type or GROUP_*); 0 otherwise */
    int64_t group_size; /* GROUP_* types: weights per group (a multiple of 32 dividing in_features) */
} LinearNode;

typedef struct {
    const uint8_t *table; /* [table_rows, row bytes] of `type` */
    const int64_t *index; /* [rows], each in [0, table_rows) */
    float *out;           /* [rows, row_len] */
    int64_t row_len, table_rows;
    int type;
    int64_t group_size; /* GROUP_* types: weights per group */
} GgufGatherNode;


typedef struct {
    const float *k, *v; /* [rows, row] with rows k_stride / v_stride floats apart */
    int64_t k_stride, v_stride;
    void *k_cache, *v_cache; /* [num_slots, row] of kv_type */
    int kv_type;
    const int64_t *slots; /* [rows], each in [0, num_slots) */
    int64_t row, num_slots;
    int head_dim; /* KV_INT8: each head's values are quantized with one scale (kv_rows.h) */
} WriteKvNode;

typedef struct {
    const float *q; /* [num_seqs, num_heads, head_dim]; num_seqs: the node's rows */
    const void *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] of kv_type */
    int kv_type;
    const int64_t *block_tables; /* [num_seqs, table_stride] */
    int64_t table_stride;
    const int64_t *seq_lens; /* [num_seqs] */
    float *out;              /* [num_seqs, num_heads, head_dim] */
    int num_heads, num_kv_heads, head_dim, block_size;
    int64_t num_blocks;  /* of the cache: every block a sequence reads is below it */
    int64_t table_width; /* columns of a table row: every length is at most table_width * block_size */
    float scale;
    int64_t window; /* 0: every key; w > 0: the last w keys */
    const float *sinks; /* [num_heads] attention-sink logits, or NULL: none */
} PagedDecodeNode;

typedef struct {
    float *x;               /* rows of n floats, row_stride apart */
    const float *mul, *add; /* [n] each, or NULL */
    int64_t n, row_stride;
} RowAffineNode;

typedef struct {
    const float *q, *k;   /* [rows, num_k_heads, head_k_dim], rows q_stride / k_stride floats apart */
    const float *v;       /* [rows, num_v_heads, head_v_dim], rows v_stride apart */
    int64_t q_stride, k_stride, v_stride;
    const float *g, *beta; /* [rows, num_v_heads]: log decay, write strength */
    float *state;          /* [num_slots, num_v_heads, head_k_dim, head_v_dim], updated in place */
    const int64_t *slots;  /* [rows], distinct, each in [0, num_slots) */
    int64_t num_slots;
    float *out; /* [rows, num_v_heads, head_v_dim], rows out_stride apart */
    int64_t out_stride;
    int num_k_heads, num_v_heads, head_k_dim, head_v_dim;
    float scale;
    int l2norm; /* q and k L2-normalised first */
} GatedDeltaDecodeNode;

typedef struct {
    const float *x;      /* [rows, dim], rows x_stride floats apart */
    int64_t x_stride;
    const float *weight; /* [dim, width] */
    const float *bias;   /* [dim] or NULL */
    float *state;        /* [num_slots, width - 1, dim], updated in place */
    const int64_t *slots; /* [rows], distinct, each in [0, num_slots) */
    int64_t num_slots;
    float *out; /* [rows, dim], contiguous */
    int64_t dim;
    int width, silu;
} ConvDecodeNode;

typedef struct {
    SsdLayer layer;
    SsdRows rows;         /* [rows, ...] token rows (strided) and the output */
    float *state;         /* [num_slots, num_heads, head_dim, state_size], updated in place */
    const int64_t *slots; /* [rows], distinct, each in [0, num_slots) */
    int64_t num_slots;
} SsdDecodeNode;

typedef struct {
    const float *y;       /* [rows, top_k, hidden]: each token's experts' outputs, in slot order */
    const float *weights; /* [rows, top_k] */
    const float *shared;  /* [rows, hidden] a shared expert's output, added last, or NULL */
    const float *gate;    /* [rows]: its gate's logit (the output times sigmoid of it), or NULL */
    float *out;           /* [rows, hidden] */
    int64_t top_k, hidden;
} MoeSlotSumNode;

typedef struct {
    const float *x, *z;   /* [rows, num_heads, head_dim] each, rows x_stride / z_stride floats apart */
    int64_t x_stride, z_stride;
    const float *weight;  /* [head_dim] */
    float *out;           /* [rows, num_heads * head_dim], contiguous */
    int64_t num_heads, head_dim;
    int64_t tiled_k_heads; /* 0: heads out in x's order; k: head h = k' * group + g goes to g * k + k' (tiled) */
    float eps;
} GatedRmsNormNode;

/* rows: the tokens (decode attention: the sequences) the node works on, row r of every [rows, ...] buffer
   its struct points to; every kind keeps it here, so a program cuts any node to its first n rows alike */
typedef struct {
    int kind; /* StepNodeKind */
    int64_t rows;
    union {
        GatherRowsNode gather;
        CopyRowsNode copy;
        AddNode add;
        AddRmsNormNode norm;
        QkNormRopeNode rope;
        SiluMulNode silu;
        LinearNode linear;
        GgufGatherNode gguf_gather;
        WriteKvNode kv;
        PagedDecodeNode attn;
        RowAffineNode affine;
        GatedDeltaDecodeNode delta;
        ConvDecodeNode conv;
        SsdDecodeNode ssd;
        MoeSlotSumNode slot_sum;
        GatedRmsNormNode gated_norm;
    };
} StepNode;

/* Runs the nodes in order in one parallel region of num_threads threads.
   Returns 0, or 1 when a node's scratch memory could not be allocated. */
int run_step_nodes(const StepNode *nodes, int64_t num_nodes, int num_threads);

/* bf16 values a LinearNode of kind NODE_LINEAR_BF16_PANELS needs in `scratch` */
int64_t bf16_scratch_values(int64_t rows, int64_t in_features);

/* The team functions (see the top of this file), one per kind, in the files of their kernels.
   Each takes its node's rows (StepNode.rows); those that allocate set *failed (atomically) when they cannot. */
void add_rms_norm_team(const AddRmsNormNode *n, int64_t rows);                  /* elementwise.cpp */
void qk_norm_rope_team(const QkNormRopeNode *n, int64_t rows);                  /* elementwise.cpp */
void row_affine_team(const RowAffineNode *n, int64_t rows);                  /* elementwise.cpp */
void silu_mul_team(const SiluMulNode *n, int64_t rows);                         /* elementwise.cpp */
void moe_slot_sum_team(const MoeSlotSumNode *n, int64_t rows);                  /* elementwise.cpp */
void gated_rms_norm_team(const GatedRmsNormNode *n, int64_t rows);              /* elementwise.cpp */
void packed_linear_f32_team(const LinearNode *n, int64_t rows);                 /* packed_linear.cpp */
void packed_linear_bf16_team(const LinearNode *n, int64_t rows);                /* packed_linear_bf16.cpp */
void gguf_linear_team(const LinearNode *n, int64_t rows, int *failed);          /* gguf_linear.cpp */
void gguf_gather_team(const GgufGatherNode *n, int64_t rows);                   /* gguf_linear.cpp */
void write_kv_team(const WriteKvNode *n, int64_t rows);                         /* kv_write.cpp */
void paged_decode_team(const PagedDecodeNode *n, int64_t num_seqs, int *failed); /* paged_decode.cpp */
void gated_delta_decode_team(const GatedDeltaDecodeNode *n, int64_t rows); /* gated_delta_decode.cpp */
void conv_decode_team(const ConvDecodeNode *n, int64_t rows);               /* causal_conv1d.cpp */
void ssd_decode_team(const SsdDecodeNode *n, int64_t rows);                 /* ssd_scan.cpp */
#endif
