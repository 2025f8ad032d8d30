/*
 * The kernels as typed torch ops: the schemas (TORCH_LIBRARY), their CPU
 * implementations (TORCH_LIBRARY_IMPL) and the step program (a torch custom
 * class, step_program.h) that runs a recorded decode step's kernel calls in
 * one parallel region. The decode-path ops build a node (step_nodes.h) and
 * run it alone; a step program runs the same nodes back to back. Every kernel trusts its pointers and sizes;
 * this file is where what they trust is checked, so a bad tensor raises a
 * Python ValueError (TORCH_CHECK_VALUE) instead of reading outside a buffer.
 * A kernel's allocation failure raises torch.OutOfMemoryError (a
 * RuntimeError).
 *
 * Only this file includes <torch/library.h> (about 15 s to compile); the
 * kernel files are plain C++ and compile in parallel next to it.
 *
 * The kernels parallelise with OpenMP. The library is linked with -fopenmp
 * against libgomp.so.1 by soname, and torch's wheel ships its own
 * libgomp.so.1 (torch/lib) that is already loaded when this library is, so
 * the dynamic linker binds both to that one runtime and one thread pool
 * (checked in /proc/<pid>/maps: a single libgomp mapping, torch's).
 */
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "gguf/gguf_blocks.h"
#include "gguf/gguf_moe.h"
#include "gguf/gguf_x16.h"
#include "kernels.h"
#include "attention/paged_attention.h"
#include "conv/conv.h"
#include "gated_delta/gated_delta.h"
#include "packed/panel_bf16.h"
#include "packed/panel_f32.h"
#include "step/step_nodes.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

/* dtype names as Python spells them, for the error messages */
std::string dtype_name(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return "float32";
        case at::kDouble: return "float64";
        case at::kHalf: return "float16";
        case at::kBFloat16: return "bfloat16";
        case at::kLong: return "int64";
        case at::kInt: return "int32";
        case at::kChar: return "int8";
        case at::kByte: return "uint8";
        case at::kShort: return "int16";
        case at::kFloat8_e4m3fn: return "float8_e4m3fn";
        case at::kFloat8_e5m2: return "float8_e5m2";
        default: return c10::toString(t);
    }
}

std::string shape_of(const Tensor &t) { return c10::str(t.sizes()); }

int num_threads() { return at::get_num_threads(); }

/* a CPU tensor of dtype, contiguous, of exactly the given shape */
void check_tensor(const Tensor &t, at::ScalarType dtype, at::IntArrayRef shape, const char *op, const char *name) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype, op, ": ", name, " must be a ",
                      dtype_name(dtype), " CPU tensor, got ", dtype_name(t.scalar_type()), " on ", t.device());
    TORCH_CHECK_VALUE(t.sizes() == shape, op, ": ", name, " must be of shape ", shape, ", got ", shape_of(t));
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_optional(const OptTensor &t, at::ScalarType dtype, at::IntArrayRef shape, const char *op,
                    const char *name) {
    if (t.has_value()) check_tensor(*t, dtype, shape, op, name);
}

template <typename T>
const T *ptr_or_null(const OptTensor &t) {
    return t.has_value() ? t->data_ptr<T>() : nullptr;
}

/* rows of row_len contiguous float32 values: [rows, row_len], contiguous */
void check_f32_rows(const Tensor &t, int64_t row_len, const char *op, const char *name) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, " takes float32 CPU tensors, got ",
                      dtype_name(t.scalar_type()), " on ", t.device(), " for ", name);
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(1) == row_len, op, ": expected ", name, " as rows of ", row_len,
                      " floats, got ", shape_of(t));
    TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

/* the kernels' numbering of KV cache element types (paged_attention.h), -1 for others */
int kv_type_of(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return KV_FLOAT32;
        case at::kHalf: return KV_FLOAT16;
        case at::kBFloat16: return KV_BFLOAT16;
        case at::kChar: return KV_INT8;
        case at::kByte: return KV_INT4;
        case at::kFloat8_e4m3fn: return KV_FP8E4M3;
        case at::kFloat8_e5m2: return KV_FP8E5M2;
        default: return -1;
    }
}

/* whether a cache's head rows carry a float32 scale after their values (int8, fp8) */
bool kv_scaled(int kv_type) { return kv_type == KV_INT8 || kv_type == KV_FP8E4M3 || kv_type == KV_FP8E5M2; }

/* K and V caches [num_blocks, block_size, num_kv_heads, head_dim] of one dtype the kernels read; its KV_* code */
int check_caches(const Tensor &k_cache, const Tensor &v_cache, const char *op) {
    const int kv_type = kv_type_of(k_cache.scalar_type());
    TORCH_CHECK_VALUE(kv_type >= 0 && v_cache.scalar_type() == k_cache.scalar_type(), op,
                      " reads float32, float16, bfloat16, int8, int4 (uint8) or float8 caches of one dtype, got ",
                      dtype_name(k_cache.scalar_type()), " / ", dtype_name(v_cache.scalar_type()));
    TORCH_CHECK_VALUE(k_cache.device().is_cpu() && v_cache.device().is_cpu(), op, ": the caches must be on the CPU");
    TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), op,
                      ": K and V caches must be [num_blocks, block_size, num_kv_heads, head_dim] of one shape, got ",
                      shape_of(k_cache), " and ", shape_of(v_cache));
    TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), op, " needs contiguous K and V caches");
    TORCH_CHECK_VALUE(!kv_scaled(kv_type) || k_cache.size(3) > KV_I8_SCALE_BYTES, op,
                      ": an int8 / fp8 cache's last dimension ",
                      "is head_dim + ", KV_I8_SCALE_BYTES, " (the values, then their float32 scale), got ",
                      shape_of(k_cache));
    if (kv_type == KV_INT4) {
        const int64_t head_dim = 2 * (k_cache.size(3) - KV_I4_SCALE_BYTES);
        TORCH_CHECK_VALUE(head_dim >= 2 && head_dim <= KV_I4_MAX_HEAD_DIM, op, ": an int4 cache's last dimension is ",
                          "head_dim / 2 + ", KV_I4_SCALE_BYTES, " (the nibbles, then their float32 scale) for a head_dim ",
                          "of at most ", KV_I4_MAX_HEAD_DIM, ", got ", shape_of(k_cache));
    }
    return kv_type;
}

/* the head size a cache holds: its last dimension, less the scale's bytes of an int8 / fp8 cache; an int4
   cache's bytes hold two values each */
int64_t cache_head_dim(const Tensor &cache, int kv_type) {
    if (kv_type == KV_INT4) return 2 * (cache.size(3) - KV_I4_SCALE_BYTES);
    return cache.size(3) - (kv_scaled(kv_type) ? KV_I8_SCALE_BYTES : 0);
}

/* [num_tokens, heads, head_dim] float32 whose rows hold whole, contiguous heads (any row stride) */
void check_head_rows(const Tensor &t, int64_t heads, int64_t head_dim, const char *op, const char *name) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, " takes float32 CPU tensors, got ",
                      dtype_name(t.scalar_type()), " on ", t.device(), " for ", name);
    TORCH_CHECK_VALUE(t.dim() == 3 && t.size(1) == heads && t.size(2) == head_dim, op, ": ", name, " must be [",
                      "num_tokens, ", heads, ", ", head_dim, "], got ", shape_of(t));
    TORCH_CHECK_VALUE(t.stride(2) == 1 && t.stride(1) == head_dim && (t.size(0) <= 1 || t.stride(0) >= heads * head_dim),
                      op, ": ", name, " needs rows of whole, contiguous heads");
}

/* an int64 CPU vector of n values, contiguous */
void check_index_vector(const Tensor &t, int64_t n, const char *op, const char *name) {
    check_tensor(t, at::kLong, {n}, op, name);
}

[[noreturn]] void out_of_memory(const char *op) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, op, ": out of memory for its scratch buffers");
}

/* state slots [n] each inside a state of num_slots and none twice (two writers of one slot would race) */
void check_state_slots(const int64_t *slots, int64_t n, int64_t num_slots, const char *op) {
    std::vector<char> taken((size_t)num_slots, 0);
    for (int64_t i = 0; i < n; i++) {
        TORCH_CHECK_VALUE(slots[i] >= 0 && slots[i] < num_slots, op, ": state slot ", slots[i],
                          " is outside the ", num_slots, " slots of the state");
        TORCH_CHECK_VALUE(!taken[(size_t)slots[i]], op, ": state slot ", slots[i], " is given twice");
        taken[(size_t)slots[i]] = 1;
    }
}

/* The indices a node reads through, which its kernel trusts: gathered rows inside their table, slots inside
   the cache, each sequence's length within its block table and every block it reads inside the cache.
   Checked before every run: they are the step's values, not the tensors' shapes. */
void check_node_indices(const StepNode &node) {
    if (node.kind == NODE_GATHER_ROWS) {
        const GatherRowsNode &g = node.gather;
        for (int64_t r = 0; r < node.rows; r++)
            TORCH_CHECK_VALUE(g.index[r] >= 0 && g.index[r] < g.table_rows, "index ", g.index[r],
                              " is outside the table of ", g.table_rows, " rows it looks up");
    } else if (node.kind == NODE_GATHER_GGUF) {
        const GgufGatherNode &g = node.gguf_gather;
        for (int64_t r = 0; r < node.rows; r++)
            TORCH_CHECK_VALUE(g.index[r] >= 0 && g.index[r] < g.table_rows, "index ", g.index[r],
                              " is outside the table of ", g.table_rows, " rows it looks up");
    } else if (node.kind == NODE_WRITE_KV) {
        for (int64_t t = 0; t < node.rows; t++)
            TORCH_CHECK_VALUE(node.kv.slots[t] >= 0 && node.kv.slots[t] < node.kv.num_slots,
                              "slot mapping points outside the KV cache");
    } else if (node.kind == NODE_GATED_DELTA_DECODE) {
        check_state_slots(node.delta.slots, node.rows, node.delta.num_slots, "gated_delta_decode");
    } else if (node.kind == NODE_CONV_DECODE) {
        check_state_slots(node.conv.slots, node.rows, node.conv.num_slots, "causal_conv1d_decode");
    } else if (node.kind == NODE_SSD_DECODE) {
        check_state_slots(node.ssd.slots, node.rows, node.ssd.num_slots, "ssd_decode");
    } else if (node.kind == NODE_PAGED_DECODE) {
        const PagedDecodeNode &a = node.attn;
        const int64_t width = a.table_width, block_size = a.block_size;
        for (int64_t b = 0; b < node.rows; b++) {
            const int64_t len = a.seq_lens[b];
            TORCH_CHECK_VALUE(len >= 1 && len <= width * block_size, "paged_decode: sequence ", b, " of length ", len,
                              " does not fit its block table of ", width, " blocks");
            for (int64_t i = 0; i < (len + block_size - 1) / block_size; i++) {
                const int64_t block = a.block_tables[b * a.table_stride + i];
                TORCH_CHECK_VALUE(block >= 0 && block < a.num_blocks, "paged_decode: block ", block, " of sequence ",
                                  b, " is outside the cache of ", a.num_blocks, " blocks");
            }
        }
    }
}

/* the threads an eager op's node runs on: below PARALLEL_MIN_FLOATS of work, one (a team costs more) */
constexpr int64_t PARALLEL_MIN_FLOATS = 32768;

int threads_for(int64_t work) { return work >= PARALLEL_MIN_FLOATS ? num_threads() : 1; }

/* runs one node as an eager op does: the same team function a recorded step runs */
void run_node(const StepNode &node, int threads, const char *op) {
    if (run_step_nodes(&node, 1, threads) != 0) out_of_memory(op);
}

// --- elementwise ------------------------------------------------------------

StepNode add_rms_norm_node(const Tensor &x, const OptTensor &delta, const Tensor &weight, double eps,
                           const Tensor &y) {
    const char *op = "native rms_norm";
    const int64_t hidden = weight.numel();
    check_f32_rows(x, hidden, op, "x");
    check_tensor(weight, at::kFloat, {hidden}, op, "weight");
    if (delta.has_value()) {
        check_f32_rows(*delta, hidden, op, "delta");
        TORCH_CHECK_VALUE(delta->sizes() == x.sizes(), "native rms_norm: delta must be contiguous and shaped like x");
    }
    check_tensor(y, at::kFloat, x.sizes(), op, "the output");
    StepNode node{NODE_ADD_RMS_NORM, x.size(0)};
    node.norm = {x.data_ptr<float>(), ptr_or_null<float>(delta), weight.data_ptr<float>(), y.data_ptr<float>(),
                 hidden, (float)eps};
    return node;
}

Tensor add_rms_norm(const Tensor &x, const OptTensor &delta, const Tensor &weight, double eps) {
    Tensor y = at::empty_like(x);  // [num_tokens, hidden]
    const StepNode node = add_rms_norm_node(x, delta, weight, eps, y);
    run_node(node, threads_for(x.numel()), "native rms_norm");
    return y;
}

StepNode qk_norm_rope_node(const Tensor &x, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                           const Tensor &cos, const Tensor &sin, const OptTensor &q_norm, const OptTensor &k_norm,
                           double eps) {
    const char *op = "native rope";
    const int64_t num_heads = num_q_heads + num_kv_heads;
    TORCH_CHECK_VALUE(head_dim > 0 && head_dim <= 1024 && head_dim % 2 == 0 && num_q_heads >= 0 && num_kv_heads >= 0,
                      op, ": head_dim must be even and <= 1024, got ", head_dim);
    TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                          x.size(1) >= num_heads * head_dim && (x.size(0) <= 1 || x.stride(0) >= x.size(1)),
                      op, ": x of shape ", shape_of(x), " does not hold ", num_heads, " float32 heads of ", head_dim);
    for (const Tensor *t : {&cos, &sin}) {
        TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                              t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == head_dim,
                          op, ": cos and sin must be contiguous float32 [num_tokens, head_dim]");
    }
    TORCH_CHECK_VALUE(q_norm.has_value() == k_norm.has_value(), op, ": give both q and k norm weights, or neither");
    for (const OptTensor *w : {&q_norm, &k_norm}) {
        TORCH_CHECK_VALUE(!w->has_value() || ((*w)->sizes() == at::IntArrayRef{head_dim} &&
                                              (*w)->scalar_type() == at::kFloat && (*w)->device().is_cpu() &&
                                              (*w)->is_contiguous()),
                          op, ": a head norm weight must be contiguous float32 [", head_dim, "]");
    }
    StepNode node{NODE_QK_NORM_ROPE, x.size(0)};
    node.rope = {x.data_ptr<float>(), x.stride(0), num_q_heads, num_kv_heads, head_dim,
                 ptr_or_null<float>(q_norm), ptr_or_null<float>(k_norm), cos.data_ptr<float>(),
                 sin.data_ptr<float>(), (float)eps};
    return node;
}

void qk_norm_rope(const Tensor &x, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, const Tensor &cos,
                  const Tensor &sin, const OptTensor &q_norm, const OptTensor &k_norm, double eps) {
    const StepNode node = qk_norm_rope_node(x, num_q_heads, num_kv_heads, head_dim, cos, sin, q_norm, k_norm, eps);
    run_node(node, threads_for(x.size(0) * (num_q_heads + num_kv_heads) * head_dim), "native rope");
}

StepNode silu_mul_node(const Tensor &gate_up, const Tensor &out) {
    TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
                      "native silu_mul: gate_up must be [num_tokens, 2 * inter], got ", shape_of(gate_up));
    const int64_t inter = gate_up.size(1) / 2;
    check_f32_rows(gate_up, 2 * inter, "native silu_mul", "gate_up");
    check_tensor(out, at::kFloat, {gate_up.size(0), inter}, "native silu_mul", "the output");
    StepNode node{NODE_SILU_MUL, gate_up.size(0)};
    node.silu = {gate_up.data_ptr<float>(), out.data_ptr<float>(), inter};
    return node;
}

Tensor silu_mul(const Tensor &gate_up) {
    TORCH_CHECK_VALUE(gate_up.dim() == 2, "native silu_mul: gate_up must be [num_tokens, 2 * inter], got ",
                      shape_of(gate_up));
    Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());  // [num_tokens, inter]
    const StepNode node = silu_mul_node(gate_up, out);
    run_node(node, threads_for(out.numel()), "native silu_mul");
    return out;
}

/* out [rows, hidden] = sum over slots, in order, of weights[r, s] * y[r, s] (+ sigmoid(gate[r]) * shared[r], or
   + shared[r] with no gate): a mixture of experts' weighted sum of each token's top-k outputs (elementwise.cpp) */
StepNode moe_slot_sum_node(const Tensor &y, const Tensor &weights, const OptTensor &shared, const OptTensor &gate,
                           const Tensor &out) {
    const char *op = "native moe_slot_sum";
    TORCH_CHECK_VALUE(y.dim() == 3 && y.size(1) >= 1, op, ": y must be [num_tokens, top_k, hidden], got ", shape_of(y));
    const int64_t rows = y.size(0), top_k = y.size(1), hidden = y.size(2);
    check_tensor(y, at::kFloat, y.sizes(), op, "y");
    TORCH_CHECK_VALUE(y.is_contiguous(), op, ": y must be contiguous");
    check_tensor(weights, at::kFloat, {rows, top_k}, op, "weights");
    TORCH_CHECK_VALUE(weights.is_contiguous(), op, ": weights must be contiguous");
    TORCH_CHECK_VALUE(shared.has_value() || !gate.has_value(), op, ": a gate needs a shared expert's output");
    if (shared.has_value()) check_f32_rows(*shared, hidden, op, "shared");
    TORCH_CHECK_VALUE(!shared.has_value() || shared->size(0) == rows, op, ": shared must have ", rows, " rows");
    if (gate.has_value()) {
        check_tensor(*gate, at::kFloat, {rows, 1}, op, "gate");
        TORCH_CHECK_VALUE(gate->is_contiguous(), op, ": gate must be contiguous");
    }
    check_tensor(out, at::kFloat, {rows, hidden}, op, "the output");
    StepNode node{NODE_MOE_SLOT_SUM, rows};
    node.slot_sum = {y.data_ptr<float>(), weights.data_ptr<float>(),
                     shared.has_value() ? shared->data_ptr<float>() : nullptr,
                     gate.has_value() ? gate->data_ptr<float>() : nullptr, out.data_ptr<float>(), top_k, hidden};
    return node;
}

Tensor moe_slot_sum(const Tensor &y, const Tensor &weights, const OptTensor &shared, const OptTensor &gate) {
    TORCH_CHECK_VALUE(y.dim() == 3, "native moe_slot_sum: y must be [num_tokens, top_k, hidden], got ", shape_of(y));
    Tensor out = at::empty({y.size(0), y.size(2)}, y.options());  // [num_tokens, hidden]
    const StepNode node = moe_slot_sum_node(y, weights, shared, gate, out);
    run_node(node, threads_for(y.numel()), "native moe_slot_sum");
    return out;
}

/* out [rows, num_heads * head_dim] = rms_norm(x) * weight * silu(z) per head of x, z [rows, num_heads, head_dim]
   (each row contiguous, rows any stride apart); tiled_k_heads > 0 writes the heads tiled over that many key heads
   (elementwise.cpp) */
StepNode gated_rms_norm_node(const Tensor &x, const Tensor &z, const Tensor &weight, double eps,
                             int64_t tiled_k_heads, const Tensor &out) {
    const char *op = "native gated_rms_norm";
    TORCH_CHECK_VALUE(x.dim() == 3 && z.dim() == 3 && x.sizes() == z.sizes(), op,
                      ": x and z must be [num_tokens, num_heads, head_dim] alike, got ", shape_of(x), " and ",
                      shape_of(z));
    const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
    TORCH_CHECK_VALUE(d >= 1 && d <= 1024, op, ": head_dim must be in [1, 1024], got ", d);
    for (const Tensor *t : {&x, &z}) {
        TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->stride(2) == 1 &&
                              t->stride(1) == d && (rows <= 1 || t->stride(0) >= heads * d),
                          op, ": x and z must be float32 rows of contiguous heads, got ", shape_of(*t));
    }
    check_tensor(weight, at::kFloat, {d}, op, "weight");
    TORCH_CHECK_VALUE(weight.is_contiguous(), op, ": weight must be contiguous");
    TORCH_CHECK_VALUE(tiled_k_heads >= 0 && (tiled_k_heads == 0 || heads % tiled_k_heads == 0), op,
                      ": tiled_k_heads must be 0 or divide the ", heads, " heads, got ", tiled_k_heads);
    check_tensor(out, at::kFloat, {rows, heads * d}, op, "the output");
    TORCH_CHECK_VALUE(out.is_contiguous(), op, ": the output must be contiguous");
    StepNode node{NODE_GATED_RMS_NORM, rows};
    node.gated_norm = {x.data_ptr<float>(), z.data_ptr<float>(), x.stride(0), z.stride(0), weight.data_ptr<float>(),
                       out.data_ptr<float>(), heads, d, tiled_k_heads, (float)eps};
    return node;
}

Tensor gated_rms_norm(const Tensor &x, const Tensor &z, const Tensor &weight, double eps, int64_t tiled_k_heads) {
    TORCH_CHECK_VALUE(x.dim() == 3, "native gated_rms_norm: x must be [num_tokens, num_heads, head_dim], got ",
                      shape_of(x));
    Tensor out = at::empty({x.size(0), x.size(1) * x.size(2)}, x.options());  // [num_tokens, num_heads * head_dim]
    const StepNode node = gated_rms_norm_node(x, z, weight, eps, tiled_k_heads, out);
    run_node(node, threads_for(out.numel()), "native gated_rms_norm");
    return out;
}

StepNode row_affine_node(const Tensor &x, const OptTensor &mul, const OptTensor &add) {
    const char *op = "native row_affine_";
    TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                          (x.size(0) <= 1 || x.stride(0) >= x.size(1)),
                      op, ": x must be float32 rows [num_tokens, n], each contiguous, got ", shape_of(x));
    const int64_t n = x.size(1);
    for (const OptTensor *t : {&mul, &add}) {
        TORCH_CHECK_VALUE(!t->has_value() || ((*t)->sizes() == at::IntArrayRef{n} && (*t)->scalar_type() == at::kFloat &&
                                              (*t)->device().is_cpu() && (*t)->is_contiguous()),
                          op, ": mul and add must be contiguous float32 [", n, "]");
    }
    StepNode node{NODE_ROW_AFFINE, x.size(0)};
    node.affine = {x.data_ptr<float>(), ptr_or_null<float>(mul), ptr_or_null<float>(add), n,
                   x.size(0) <= 1 ? n : x.stride(0)};
    return node;
}

void row_affine_(const Tensor &x, const OptTensor &mul, const OptTensor &add) {
    const StepNode node = row_affine_node(x, mul, add);
    run_node(node, threads_for(x.numel()), "native row_affine_");
}

// --- linear layers ------------------------------------------------------------

/* a weight to pack: float32 [out, in], contiguous, both sizes positive */
void check_weight_to_pack(const Tensor &w, const char *op) {
    TORCH_CHECK_VALUE(w.dim() == 2, op, ": expected a 2-D weight [out, in], got shape ", shape_of(w));
    TORCH_CHECK_VALUE(w.size(0) > 0 && w.size(1) > 0, op, ": the weight is empty, shape ", shape_of(w));
    check_tensor(w, at::kFloat, w.sizes(), op, "weight");
}

Tensor pack_panels(const Tensor &w) {
    check_weight_to_pack(w, "pack_panels");
    const int64_t n = w.size(0), k = w.size(1), num_panels = (n + PANEL - 1) / PANEL;
    Tensor packed = at::empty({num_panels, k, PANEL}, w.options());  // [num_panels, in, PANEL]
    packed_linear_pack(w.data_ptr<float>(), n, k, packed.data_ptr<float>());
    return packed;
}

Tensor pack_panels_bf16(const Tensor &w) {
    check_weight_to_pack(w, "pack_panels_bf16");
    const int64_t n = w.size(0), k = w.size(1), num_panels = (n + BF_PANEL - 1) / BF_PANEL;
    // [num_panels, ceil(in / 2) k pairs, BF_PANEL, 2]
    Tensor packed = at::empty({num_panels, (k + 1) / 2, BF_PANEL, 2}, w.options().dtype(at::kBFloat16));
    packed_linear_bf16_pack(w.data_ptr<float>(), n, k, reinterpret_cast<uint16_t *>(packed.data_ptr()));
    return packed;
}

/* x [rows, in] float32 activations of a packed linear layer */
void check_activations(const Tensor &x, int64_t in_features, const char *op) {
    TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat, op,
                      " takes float32 activations on the CPU, got ", dtype_name(x.scalar_type()), " on ", x.device());
    TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == in_features, op, ": input has ", x.size(-1),
                      " features, the weight expects ", in_features);
    TORCH_CHECK_VALUE(x.is_contiguous(), op, ": the activations must be contiguous");
}

StepNode packed_linear_node(const Tensor &x, const Tensor &packed, const OptTensor &bias, int64_t out_features,
                            const Tensor &out) {
    const char *op = "packed_linear";
    // the kernel trusts the buffer's size: a weight packed for another panel
    // width (another CPU) or fewer outputs would be read past its end
    TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(2) == PANEL && packed.size(1) >= 1 && out_features >= 0 &&
                          packed.size(0) * PANEL >= out_features,
                      "packed weight ", shape_of(packed), " does not fit this build's ", PANEL, "-column panels and ",
                      out_features, " outputs; pack it here with pack_weight_panels");
    check_tensor(packed, at::kFloat, packed.sizes(), op, "the packed weight");
    const int64_t in_features = packed.size(1);
    check_activations(x, in_features, op);
    check_optional(bias, at::kFloat, {out_features}, op, "bias");
    check_tensor(out, at::kFloat, {x.size(0), out_features}, op, "the output");
    StepNode node{NODE_LINEAR_F32_PANELS, x.size(0)};
    node.linear = {x.data_ptr<float>(), packed.data_ptr<float>(), ptr_or_null<float>(bias), out.data_ptr<float>(),
                   nullptr, in_features, out_features};
    return node;
}

Tensor packed_linear(const Tensor &x, const Tensor &packed, const OptTensor &bias, int64_t out_features) {
    Tensor out = at::empty({x.dim() == 2 ? x.size(0) : 0, out_features}, x.options());  // [num_rows, out_features]
    const StepNode node = packed_linear_node(x, packed, bias, out_features, out);
    run_node(node, num_threads(), "packed_linear");
    return out;
}

/* scratch: bf16_scratch_values(rows, in_features) values for the rounded activations, set by the caller */
StepNode packed_linear_bf16_node(const Tensor &x, const Tensor &packed, const OptTensor &bias, int64_t out_features,
                                 const Tensor &out) {
    const char *op = "packed_linear_bf16";
    TORCH_CHECK_VALUE(x.dim() == 2, op, ": expected activations [num_rows, in], got ", shape_of(x));
    const int64_t in_features = x.size(1);
    TORCH_CHECK_VALUE(packed.dim() == 4 && packed.size(2) == BF_PANEL && packed.size(3) == 2 && in_features >= 1 &&
                          packed.size(1) == (in_features + 1) / 2 && out_features >= 0 &&
                          packed.size(0) * BF_PANEL >= out_features,
                      "packed bf16 weight ", shape_of(packed), " does not fit ", out_features, "x", in_features,
                      " in this build's ", BF_PANEL, "-column panels");
    check_tensor(packed, at::kBFloat16, packed.sizes(), op, "the packed weight");
    check_activations(x, in_features, op);
    check_optional(bias, at::kFloat, {out_features}, op, "bias");
    check_tensor(out, at::kFloat, {x.size(0), out_features}, op, "the output");
    StepNode node{NODE_LINEAR_BF16_PANELS, x.size(0)};
    node.linear = {x.data_ptr<float>(), packed.data_ptr(), ptr_or_null<float>(bias), out.data_ptr<float>(), nullptr,
                   in_features, out_features};
    return node;
}

Tensor packed_linear_bf16_op(const Tensor &x, const Tensor &packed, const OptTensor &bias, int64_t out_features) {
    Tensor out = at::empty({x.dim() == 2 ? x.size(0) : 0, out_features}, x.options());  // [num_rows, out_features]
    StepNode node = packed_linear_bf16_node(x, packed, bias, out_features, out);
    if (x.size(0) == 0) return out;
    // [scratch values] of bf16 bits: one block of rounded activation rows
    Tensor scratch = at::empty({bf16_scratch_values(x.size(0), x.size(1))}, x.options().dtype(at::kBFloat16));
    node.linear.scratch = reinterpret_cast<uint16_t *>(scratch.data_ptr());
    run_node(node, num_threads(), "packed_linear_bf16");
    return out;
}

/* a GGUF weight: uint8 [rows, in_features / block weights * block bytes] of `type`, contiguous; the bytes
   of one row */
int64_t check_gguf_weight(const Tensor &w, int64_t type, int64_t in_features, const char *op) {
    const int64_t block_bytes = gguf_block_bytes((int)type), block_weights = gguf_block_weights((int)type);
    TORCH_CHECK_VALUE(block_bytes > 0, op, ": no kernel for GGUF tensor type ", type, " (kernels exist for F16 (1), ",
                      "Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), ",
                      "Q6_K (14), IQ4_NL (20), IQ4_XS (23), BF16 (30) and MXFP4 (39), and all but F16 and BF16 ",
                      "interleaved by gguf_interleave_ (512 + the type))");
    const int64_t multiple = block_weights > GGUF_BLOCK ? block_weights : GGUF_BLOCK;
    TORCH_CHECK_VALUE(in_features > 0 && in_features % multiple == 0, op, ": in_features must be a positive ",
                      "multiple of ", multiple, " for GGUF type ", type, ", got ", in_features);
    const int64_t row_bytes = in_features / block_weights * block_bytes;
    TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == row_bytes, op, ": a weight of ", in_features,
                      " inputs in GGUF type ", type, " has rows of ", row_bytes, " bytes, got shape ", shape_of(w));
    TORCH_CHECK_VALUE(!is_x16_type((int)type) || w.size(0) % X16_TILE == 0, op, ": an interleaved weight (type ",
                      type, ") has a multiple of ", X16_TILE, " rows, got ", w.size(0));
    check_tensor(w, at::kByte, w.sizes(), op, "the quantized weight");
    return row_bytes;
}

StepNode gguf_linear_node(const Tensor &x, const Tensor &w, int64_t type, int64_t in_features, const OptTensor &bias,
                          const Tensor &out) {
    const char *op = "gguf_linear";
    check_gguf_weight(w, type, in_features, op);
    const int64_t out_features = w.size(0);
    check_activations(x, in_features, op);
    check_optional(bias, at::kFloat, {out_features}, op, "bias");
    check_tensor(out, at::kFloat, {x.size(0), out_features}, op, "the output");
    StepNode node{NODE_LINEAR_GGUF, x.size(0)};
    node.linear = {x.data_ptr<float>(), w.data_ptr(), ptr_or_null<float>(bias), out.data_ptr<float>(), nullptr,
                   in_features, out_features, (int)type, 0};
    return node;
}

/* runs a linear node over quantized blocks; one over interleaved blocks first gets the scratch its rows are
   rounded to int8 in ([bytes] uint8) */
void run_blocks_linear(StepNode &node, const char *op) {
    Tensor scratch;
    if (is_x16_type(node.linear.weight_type)) {
        scratch = at::empty({gguf_x16_scratch_bytes(node.rows, node.linear.in_features)}, at::kByte);
        node.linear.scratch = reinterpret_cast<uint16_t *>(scratch.data_ptr());
    }
    run_node(node, num_threads(), op);
}

Tensor gguf_linear(const Tensor &x, const Tensor &w, int64_t type, int64_t in_features, const OptTensor &bias) {
    TORCH_CHECK_VALUE(w.dim() == 2, "gguf_linear: expected a 2-D quantized weight, got shape ", shape_of(w));
    Tensor out = at::empty({x.dim() == 2 ? x.size(0) : 0, w.size(0)}, x.options().dtype(at::kFloat));  // [num_rows, out_features]
    StepNode node = gguf_linear_node(x, w, type, in_features, bias, out);
    run_blocks_linear(node, "gguf_linear");
    return out;
}

/* The routing of a grouped-expert linear (gguf_moe_linear): token_ids int32 [num_pairs], each in
   [0, num_tokens); expert_offsets int32 [num_experts + 1] from 0, non-decreasing, to num_pairs */
void check_expert_routing(const Tensor &token_ids, const Tensor &expert_offsets, int64_t num_tokens,
                          int64_t num_experts, const char *op) {
    TORCH_CHECK_VALUE(token_ids.dim() == 1, op, ": token_ids must be 1-D [num_pairs], got ", shape_of(token_ids));
    check_tensor(token_ids, at::kInt, token_ids.sizes(), op, "token_ids");
    check_tensor(expert_offsets, at::kInt, {num_experts + 1}, op, "expert_offsets");
    const int32_t *ids = token_ids.data_ptr<int32_t>(), *offsets = expert_offsets.data_ptr<int32_t>();
    const int64_t num_pairs = token_ids.size(0);
    TORCH_CHECK_VALUE(offsets[0] == 0 && offsets[num_experts] == num_pairs, op, ": expert_offsets must run from 0 ",
                      "to num_pairs ", num_pairs, ", got ", offsets[0], " .. ", offsets[num_experts]);
    for (int64_t e = 0; e < num_experts; e++)
        TORCH_CHECK_VALUE(offsets[e] <= offsets[e + 1], op, ": expert_offsets must not decrease, got ", offsets[e],
                          " then ", offsets[e + 1], " at expert ", e);
    for (int64_t p = 0; p < num_pairs; p++)
        TORCH_CHECK_VALUE(ids[p] >= 0 && ids[p] < num_tokens, op, ": token id ", ids[p], " at pair ", p,
                          " is outside the ", num_tokens, " tokens of x");
}

/* y [num_pairs, out_features]: row p = x[token_ids[p]] W_e^T for the expert e whose pairs hold p (gguf_moe.h);
   each expert's rows the bits gguf_linear gives them against its rows of the stacked weight */
Tensor gguf_moe_linear_op(const Tensor &x, const Tensor &w, int64_t type, int64_t num_experts,
                          const Tensor &token_ids, const Tensor &expert_offsets) {
    const char *op = "gguf_moe_linear";
    TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be [num_tokens, in_features], got ", shape_of(x));
    TORCH_CHECK_VALUE(w.dim() == 2, op, ": expected a 2-D quantized weight, got shape ", shape_of(w));
    const int64_t in_features = x.size(1);
    const int64_t row_bytes = check_gguf_weight(w, type, in_features, op);
    check_activations(x, in_features, op);
    TORCH_CHECK_VALUE(num_experts >= 1 && w.size(0) % num_experts == 0, op, ": the weight's ", w.size(0),
                      " rows are not num_experts (", num_experts, ") experts of equal rows");
    const int64_t out_features = w.size(0) / num_experts;
    TORCH_CHECK_VALUE(!is_x16_type((int)type) || out_features % X16_TILE == 0, op, ": an interleaved weight's ",
                      "experts have a multiple of ", X16_TILE, " rows each, got ", out_features);
    check_expert_routing(token_ids, expert_offsets, x.size(0), num_experts, op);
    const int64_t num_pairs = token_ids.size(0);
    Tensor out = at::empty({num_pairs, out_features}, x.options());  // [num_pairs, out_features]
    if (num_pairs == 0 || out_features == 0) return out;
    // [bytes]: x16, the tokens rounded to int8 and the pairs' copies; file order, the pairs' rows of x
    Tensor scratch = at::empty({gguf_moe_scratch_bytes((int)type, x.size(0), num_pairs, in_features)}, at::kByte);
    const MoeLinearArgs args = {x.data_ptr<float>(), w.data_ptr<uint8_t>(), token_ids.data_ptr<int32_t>(),
                                expert_offsets.data_ptr<int32_t>(), out.data_ptr<float>(), scratch.data_ptr(),
                                x.size(0), num_pairs, num_experts, in_features, out_features, row_bytes, (int)type};
    if (gguf_moe_linear(&args, num_threads()) != 0) out_of_memory(op);
    return out;
}

StepNode gguf_embedding_node(const Tensor &table, int64_t type, int64_t row_len, const Tensor &index,
                             const Tensor &out) {
    const char *op = "gguf_embedding";
    check_gguf_weight(table, type, row_len, op);
    TORCH_CHECK_VALUE(index.dim() == 1, op, ": the index must be 1-D, got ", shape_of(index));
    check_index_vector(index, index.size(0), op, "the index");
    check_tensor(out, at::kFloat, {index.size(0), row_len}, op, "the output");
    StepNode node{NODE_GATHER_GGUF, index.size(0)};
    node.gguf_gather = {table.data_ptr<uint8_t>(), index.data_ptr<int64_t>(), out.data_ptr<float>(), row_len,
                        table.size(0), (int)type, 0};
    return node;
}

Tensor gguf_embedding(const Tensor &table, int64_t type, int64_t row_len, const Tensor &index) {
    TORCH_CHECK_VALUE(index.dim() == 1, "gguf_embedding: the index must be 1-D, got ", shape_of(index));
    Tensor out = at::empty({index.size(0), row_len}, index.options().dtype(at::kFloat));  // [num_rows, row_len]
    const StepNode node = gguf_embedding_node(table, type, row_len, index, out);
    check_node_indices(node);
    run_node(node, threads_for(out.numel()), "gguf_embedding");
    return out;
}

/* the weights of one GGUF tensor as float32 [rows, in_features] (for the paths with no GGUF kernel) */
Tensor gguf_dequantize(const Tensor &w, int64_t type, int64_t in_features) {
    check_gguf_weight(w, type, in_features, "gguf_dequantize");
    Tensor out = at::empty({w.size(0), in_features}, w.options().dtype(at::kFloat));  // [rows, in_features]
    Tensor index = at::arange(w.size(0), w.options().dtype(at::kLong));             // [rows]
    const StepNode node = gguf_embedding_node(w, type, in_features, index, out);
    run_node(node, threads_for(out.numel()), "gguf_dequantize");
    return out;
}

/* rewrites a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K-Q6_K / IQ4_NL / IQ4_XS / MXFP4 weight, rows a multiple of 16,
   in place into the x16 order
   (gguf_x16.h); the op then takes it as type 512 + type */
void gguf_interleave_(const Tensor &w, int64_t type, int64_t in_features) {
    const char *op = "gguf_interleave_";
    TORCH_CHECK_VALUE(x16_takes((int)type) && !is_group_type((int)type), op, ": interleaves Q4_0 (2), Q4_1 (3), Q5_0 (6), ",
                      "Q5_1 (7), Q8_0 (8), Q2_K (10) to Q6_K (14), IQ4_NL (20), IQ4_XS (23) and MXFP4 (39) ",
                      "weights, got type ", type);
    check_gguf_weight(w, type, in_features, op);
    TORCH_CHECK_VALUE(w.size(0) % X16_TILE == 0, op, ": interleaves ", X16_TILE, " rows at a time, got ", w.size(0),
                      " rows");
    uint8_t *bytes = w.data_ptr<uint8_t>();
    at::parallel_for(0, w.size(0) / X16_TILE, 1, [&](int64_t begin, int64_t end) {
        gguf_x16_interleave(bytes, (int)type, in_features, 0, begin, end);
    });
}

/* a grouped int8 / int4 weight (gguf_blocks.h's GROUP_I8 / GROUP_I4, quantized at load): uint8
   [rows, in_features / group_size groups * group bytes], contiguous; its block type */
int check_group_weight(const Tensor &w, int64_t bits, int64_t group_size, int64_t in_features, const char *op) {
    TORCH_CHECK_VALUE(bits == 4 || bits == 8, op, ": bits must be 4 or 8, got ", bits);
    TORCH_CHECK_VALUE(group_size > 0 && group_size % GGUF_BLOCK == 0, op, ": group_size must be a positive multiple of ",
                      GGUF_BLOCK, ", got ", group_size);
    TORCH_CHECK_VALUE(in_features > 0 && in_features % group_size == 0, op, ": in_features must be a positive ",
                      "multiple of group_size ", group_size, ", got ", in_features);
    const int type = bits == 8 ? GROUP_I8 : GROUP_I4;
    const int64_t row_bytes = in_features / group_size * group_block_bytes(type, group_size);
    TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == row_bytes, op, ": a weight of ", in_features, " inputs in int",
                      bits, " groups of ", group_size, " has rows of ", row_bytes, " bytes, got shape ", shape_of(w));
    check_tensor(w, at::kByte, w.sizes(), op, "the quantized weight");
    return type;
}

StepNode quantized_linear_node(const Tensor &x, const Tensor &w, int64_t bits, int64_t group_size, int64_t in_features,
                               const OptTensor &bias, bool interleaved, const Tensor &out) {
    const char *op = "quantized_linear";
    const int type = check_group_weight(w, bits, group_size, in_features, op) + (interleaved ? GGUF_X16_BASE : 0);
    TORCH_CHECK_VALUE(!interleaved || w.size(0) % X16_TILE == 0, op, ": an interleaved weight has a multiple of ",
                      X16_TILE, " rows, got ", w.size(0));
    const int64_t out_features = w.size(0);
    check_activations(x, in_features, op);
    check_optional(bias, at::kFloat, {out_features}, op, "bias");
    check_tensor(out, at::kFloat, {x.size(0), out_features}, op, "the output");
    StepNode node{NODE_LINEAR_GGUF, x.size(0)};
    node.linear = {x.data_ptr<float>(), w.data_ptr(), ptr_or_null<float>(bias), out.data_ptr<float>(), nullptr,
                   in_features, out_features, type, group_size};
    return node;
}

Tensor quantized_linear(const Tensor &x, const Tensor &w, int64_t bits, int64_t group_size, int64_t in_features,
                        const OptTensor &bias, bool interleaved) {
    TORCH_CHECK_VALUE(w.dim() == 2, "quantized_linear: expected a 2-D quantized weight, got shape ", shape_of(w));
    Tensor out = at::empty({x.dim() == 2 ? x.size(0) : 0, w.size(0)}, x.options().dtype(at::kFloat));  // [num_rows, out_features]
    StepNode node = quantized_linear_node(x, w, bits, group_size, in_features, bias, interleaved, out);
    run_blocks_linear(node, "quantized_linear");
    return out;
}

/* rewrites a grouped int8 / int4 weight, rows a multiple of 16, in place into the x16 order (gguf_x16.h);
   quantized_linear and quantized_embedding then take it with interleaved=True */
void quantized_interleave_(const Tensor &w, int64_t bits, int64_t group_size, int64_t in_features) {
    const char *op = "quantized_interleave_";
    const int type = check_group_weight(w, bits, group_size, in_features, op);
    TORCH_CHECK_VALUE(w.size(0) % X16_TILE == 0, op, ": interleaves ", X16_TILE, " rows at a time, got ", w.size(0),
                      " rows");
    uint8_t *bytes = w.data_ptr<uint8_t>();
    at::parallel_for(0, w.size(0) / X16_TILE, 1, [&](int64_t begin, int64_t end) {
        gguf_x16_interleave(bytes, type, in_features, group_size, begin, end);
    });
}

StepNode quantized_embedding_node(const Tensor &table, int64_t bits, int64_t group_size, int64_t row_len,
                                  const Tensor &index, bool interleaved, const Tensor &out) {
    const char *op = "quantized_embedding";
    const int type = check_group_weight(table, bits, group_size, row_len, op) + (interleaved ? GGUF_X16_BASE : 0);
    TORCH_CHECK_VALUE(!interleaved || table.size(0) % X16_TILE == 0, op, ": an interleaved table has a multiple of ",
                      X16_TILE, " rows, got ", table.size(0));
    TORCH_CHECK_VALUE(index.dim() == 1, op, ": the index must be 1-D, got ", shape_of(index));
    check_index_vector(index, index.size(0), op, "the index");
    check_tensor(out, at::kFloat, {index.size(0), row_len}, op, "the output");
    StepNode node{NODE_GATHER_GGUF, index.size(0)};
    node.gguf_gather = {table.data_ptr<uint8_t>(), index.data_ptr<int64_t>(), out.data_ptr<float>(), row_len,
                        table.size(0), type, group_size};
    return node;
}

Tensor quantized_embedding(const Tensor &table, int64_t bits, int64_t group_size, int64_t row_len,
                           const Tensor &index, bool interleaved) {
    TORCH_CHECK_VALUE(index.dim() == 1, "quantized_embedding: the index must be 1-D, got ", shape_of(index));
    Tensor out = at::empty({index.size(0), row_len}, index.options().dtype(at::kFloat));  // [num_rows, row_len]
    const StepNode node = quantized_embedding_node(table, bits, group_size, row_len, index, interleaved, out);
    check_node_indices(node);
    run_node(node, threads_for(out.numel()), "quantized_embedding");
    return out;
}

// --- attention and the KV cache -------------------------------------------------

StepNode write_kv_node(const Tensor &k, const Tensor &v, const Tensor &k_cache, const Tensor &v_cache,
                       const Tensor &slots) {
    const char *op = "write_kv";
    const int kv_type = check_caches(k_cache, v_cache, op);
    const int64_t num_kv_heads = k_cache.size(2), head_dim = cache_head_dim(k_cache, kv_type);
    check_head_rows(k, num_kv_heads, head_dim, op, "k");
    check_head_rows(v, num_kv_heads, head_dim, op, "v");
    TORCH_CHECK_VALUE(v.size(0) == k.size(0), op, ": k and v must have as many rows");
    check_index_vector(slots, k.size(0), op, "the slot mapping");
    StepNode node{NODE_WRITE_KV, k.size(0)};
    node.kv = {k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0), v.stride(0), k_cache.data_ptr(),
               v_cache.data_ptr(), kv_type, slots.data_ptr<int64_t>(), num_kv_heads * head_dim,
               k_cache.size(0) * k_cache.size(1), (int)head_dim};
    return node;
}

void write_kv_op(const Tensor &k, const Tensor &v, const Tensor &k_cache, const Tensor &v_cache, const Tensor &slots) {
    const StepNode node = write_kv_node(k, v, k_cache, v_cache, slots);
    check_node_indices(node);
    run_node(node, node.rows > 256 ? num_threads() : 1, "write_kv");
}

StepNode paged_decode_node(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &block_tables,
                           const Tensor &seq_lens, double scale, const Tensor &out, int64_t window,
                           const OptTensor &sinks) {
    const char *op = "paged_decode";
    TORCH_CHECK_VALUE(window >= 0, op, ": window must be 0 (none) or a number of keys, got ", window);
    TORCH_CHECK_VALUE(q.device().is_cpu() && q.scalar_type() == at::kFloat, op,
                      " runs float32 queries on the CPU, got ", dtype_name(q.scalar_type()), " on ", q.device());
    const int kv_type = check_caches(k_cache, v_cache, op);
    const int64_t num_kv_heads = k_cache.size(2);
    TORCH_CHECK_VALUE(q.dim() == 3 && q.size(2) == cache_head_dim(k_cache, kv_type) && num_kv_heads > 0 &&
                          q.size(1) % num_kv_heads == 0,
                      op, ": queries ", shape_of(q), " do not fit a cache of ", shape_of(k_cache));
    const int64_t num_seqs = q.size(0);
    check_tensor(q, at::kFloat, q.sizes(), op, "q");
    check_tensor(out, at::kFloat, q.sizes(), op, "out");
    check_optional(sinks, at::kFloat, {q.size(1)}, op, "sinks");
    check_index_vector(seq_lens, num_seqs, op, "seq_lens");
    TORCH_CHECK_VALUE(block_tables.device().is_cpu() && block_tables.scalar_type() == at::kLong &&
                          block_tables.dim() == 2 && block_tables.size(0) == num_seqs && block_tables.stride(1) == 1,
                      op, ": block_tables must be int64 [num_seqs, max_blocks] with contiguous rows, got ",
                      shape_of(block_tables));
    StepNode node{NODE_PAGED_DECODE, num_seqs};
    node.attn = {q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), kv_type,
                 block_tables.data_ptr<int64_t>(), block_tables.stride(0), seq_lens.data_ptr<int64_t>(),
                 out.data_ptr<float>(), (int)q.size(1), (int)num_kv_heads, (int)q.size(2),
                 (int)k_cache.size(1), k_cache.size(0), block_tables.size(1), (float)scale, window,
                 ptr_or_null<float>(sinks)};
    return node;
}

void paged_decode_op(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &block_tables,
                     const Tensor &seq_lens, double scale, const Tensor &out, int64_t window,
                     const OptTensor &sinks) {
    const StepNode node = paged_decode_node(q, k_cache, v_cache, block_tables, seq_lens, scale, out, window, sinks);
    check_node_indices(node);
    run_node(node, num_threads(), "paged_decode");
}

void prefill_attention_op(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &out, const Tensor &bounds,
                          double scale, const OptTensor &sinks) {
    const char *op = "prefill_attention";
    TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && k.size(1) > 0 && q.size(1) % k.size(1) == 0, op,
                      ": needs whole query-head groups, got q ", shape_of(q), " and k ", shape_of(k));
    const int64_t num_heads = q.size(1), num_kv_heads = k.size(1), head_dim = q.size(2), rows = q.size(0);
    check_head_rows(q, num_heads, head_dim, op, "q");
    check_head_rows(out, num_heads, head_dim, op, "out");
    check_head_rows(k, num_kv_heads, head_dim, op, "k");
    check_head_rows(v, num_kv_heads, head_dim, op, "v");
    TORCH_CHECK_VALUE(k.size(0) == rows && v.size(0) == rows && out.size(0) == rows, op,
                      ": q, k, v and out must have as many rows");
    check_optional(sinks, at::kFloat, {num_heads}, op, "sinks");
    TORCH_CHECK_VALUE(bounds.dim() == 1 && bounds.size(0) % 2 == 0, op, ": bounds must be [2 * num_seqs]");
    check_index_vector(bounds, bounds.size(0), op, "bounds");
    const int64_t *b = bounds.data_ptr<int64_t>();
    for (int64_t i = 0; i < bounds.size(0); i += 2)
        TORCH_CHECK_VALUE(0 <= b[i] && b[i] <= b[i + 1] && b[i + 1] <= rows, op, ": rows [", b[i], ", ", b[i + 1],
                          ") of a prompt are outside the ", rows, " rows given");
    const int status = prefill_attention_f32(q.data_ptr<float>(), q.stride(0), k.data_ptr<float>(), k.stride(0),
                                             v.data_ptr<float>(), v.stride(0), out.data_ptr<float>(), out.stride(0),
                                             b, (int)(bounds.size(0) / 2), (int)num_heads, (int)num_kv_heads,
                                             (int)head_dim, (float)scale, ptr_or_null<float>(sinks), num_threads());
    if (status != 0) out_of_memory(op);
}

/* Prompt tokens attending through their sequences' block tables, in paged_decode's order (paged_prefill.cpp).
   Checks every index the kernel trusts: the chunks' rows, each length against its table, each block read. */
void paged_prefill_op(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &block_tables,
                      const Tensor &bounds, const Tensor &seq_lens, double scale, const Tensor &out,
                      const OptTensor &sinks) {
    const char *op = "paged_prefill";
    const int kv_type = check_caches(k_cache, v_cache, op);
    const int64_t num_kv_heads = k_cache.size(2), block_size = k_cache.size(1), num_blocks = k_cache.size(0);
    TORCH_CHECK_VALUE(q.dim() == 3 && q.size(2) == cache_head_dim(k_cache, kv_type) && num_kv_heads > 0 &&
                          q.size(1) % num_kv_heads == 0,
                      op, ": queries ", shape_of(q), " do not fit a cache of ", shape_of(k_cache));
    const int64_t num_heads = q.size(1), head_dim = q.size(2), rows = q.size(0);
    check_head_rows(q, num_heads, head_dim, op, "q");
    check_head_rows(out, num_heads, head_dim, op, "out");
    TORCH_CHECK_VALUE(out.size(0) == rows, op, ": q and out must have as many rows");
    check_optional(sinks, at::kFloat, {num_heads}, op, "sinks");
    const int64_t num_seqs = seq_lens.numel();
    check_index_vector(seq_lens, num_seqs, op, "seq_lens");
    check_index_vector(bounds, 2 * num_seqs, op, "bounds");
    TORCH_CHECK_VALUE(block_tables.device().is_cpu() && block_tables.scalar_type() == at::kLong &&
                          block_tables.dim() == 2 && block_tables.size(0) == num_seqs && block_tables.stride(1) == 1,
                      op, ": block_tables must be int64 [num_seqs, max_blocks] with contiguous rows, got ",
                      shape_of(block_tables));
    const int64_t *b = bounds.data_ptr<int64_t>(), *lens = seq_lens.data_ptr<int64_t>();
    const int64_t *tables = block_tables.data_ptr<int64_t>(), width = block_tables.size(1);
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = b[2 * s + 1] - b[2 * s];
        TORCH_CHECK_VALUE(0 <= b[2 * s] && q_len >= 0 && b[2 * s + 1] <= rows, op, ": rows [", b[2 * s], ", ",
                          b[2 * s + 1], ") of a prompt are outside the ", rows, " rows given");
        TORCH_CHECK_VALUE(q_len <= lens[s] && lens[s] <= width * block_size, op, ": sequence ", s, " of length ",
                          lens[s], " with ", q_len, " new tokens does not fit its block table of ", width, " blocks");
        for (int64_t i = 0; i < (lens[s] + block_size - 1) / block_size; i++) {
            const int64_t block = tables[s * block_tables.stride(0) + i];
            TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, op, ": block ", block, " of sequence ", s,
                              " is outside the cache of ", num_blocks, " blocks");
        }
    }
    const int status = paged_prefill_f32(q.data_ptr<float>(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                         kv_type, tables, block_tables.stride(0), b, lens, out.data_ptr<float>(),
                                         out.stride(0), (int)num_seqs, (int)num_heads, (int)num_kv_heads,
                                         (int)head_dim, (int)block_size, (float)scale, ptr_or_null<float>(sinks),
                                         num_threads());
    if (status != 0) out_of_memory(op);
}

// --- gated delta rule (linear attention) ---------------------------------------------

/* q, k [rows, num_k_heads, head_k_dim], v and out [rows, num_v_heads, head_v_dim] (rows of whole heads, any
   stride), g and beta [rows, num_v_heads] and a float32 state [num_slots, num_v_heads, head_k_dim,
   head_v_dim]: the shapes both gated delta kernels trust */
void check_gated_delta(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &g, const Tensor &beta,
                       const Tensor &state, const Tensor &out, const char *op) {
    TORCH_CHECK_VALUE(state.device().is_cpu() && state.scalar_type() == at::kFloat && state.dim() == 4 &&
                          state.is_contiguous(),
                      op, ": the state must be a contiguous float32 CPU tensor [num_slots, num_v_heads, head_k_dim, ",
                      "head_v_dim], got ", dtype_name(state.scalar_type()), " ", shape_of(state));
    const int64_t num_v_heads = state.size(1), head_k_dim = state.size(2), head_v_dim = state.size(3);
    TORCH_CHECK_VALUE(head_k_dim >= 1 && head_k_dim <= GD_MAX_HEAD_DIM && head_v_dim >= 1 &&
                          head_v_dim <= GD_MAX_HEAD_DIM && num_v_heads >= 1,
                      op, ": head sizes must be 1 to ", GD_MAX_HEAD_DIM, ", got a state of ", shape_of(state));
    TORCH_CHECK_VALUE(q.dim() == 3 && q.size(1) >= 1 && num_v_heads % q.size(1) == 0, op, ": q ", shape_of(q),
                      " must be [rows, num_k_heads, head_k_dim] with num_k_heads dividing the state's ", num_v_heads,
                      " value heads");
    const int64_t num_k_heads = q.size(1), rows = q.size(0);
    check_head_rows(q, num_k_heads, head_k_dim, op, "q");
    check_head_rows(k, num_k_heads, head_k_dim, op, "k");
    check_head_rows(v, num_v_heads, head_v_dim, op, "v");
    check_head_rows(out, num_v_heads, head_v_dim, op, "out");
    TORCH_CHECK_VALUE(k.size(0) == rows && v.size(0) == rows && out.size(0) == rows, op,
                      ": q, k, v and out must have as many rows");
    check_tensor(g, at::kFloat, {rows, num_v_heads}, op, "g");
    check_tensor(beta, at::kFloat, {rows, num_v_heads}, op, "beta");
}

StepNode gated_delta_decode_node(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &g,
                                 const Tensor &beta, const Tensor &state, const Tensor &slots, const Tensor &out,
                                 double scale, bool qk_l2norm) {
    const char *op = "gated_delta_decode";
    check_gated_delta(q, k, v, g, beta, state, out, op);
    check_index_vector(slots, q.size(0), op, "slots");
    StepNode node{NODE_GATED_DELTA_DECODE, q.size(0)};
    node.delta = {q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), q.stride(0), k.stride(0),
                  v.stride(0), g.data_ptr<float>(), beta.data_ptr<float>(), state.data_ptr<float>(),
                  slots.data_ptr<int64_t>(), state.size(0), out.data_ptr<float>(), out.stride(0), (int)q.size(1),
                  (int)state.size(1), (int)state.size(2), (int)state.size(3), (float)scale, qk_l2norm ? 1 : 0};
    return node;
}

/* one token per sequence through the recurrent form, each sequence's state slot updated in place */
void gated_delta_decode_op(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &g, const Tensor &beta,
                           const Tensor &state, const Tensor &slots, const Tensor &out, double scale,
                           bool qk_l2norm) {
    const StepNode node = gated_delta_decode_node(q, k, v, g, beta, state, slots, out, scale, qk_l2norm);
    check_node_indices(node);
    run_node(node, threads_for(node.rows * state.numel() / state.size(0)), "gated_delta_decode");
}

/* prompts (sequence s: rows bounds[2s] .. bounds[2s+1]-1) through the chunked form, from their slots' states
   (or zero where has_initial_state is false), leaving each slot at the state after its last row */
void gated_delta_prefill_op(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &g, const Tensor &beta,
                            const Tensor &state, const Tensor &bounds, const Tensor &slots,
                            const Tensor &has_initial_state, const Tensor &out, double scale, bool qk_l2norm,
                            int64_t chunk_size) {
    const char *op = "gated_delta_prefill";
    check_gated_delta(q, k, v, g, beta, state, out, op);
    TORCH_CHECK_VALUE(chunk_size >= 1 && chunk_size <= GD_MAX_CHUNK, op, ": chunk_size must be 1 to ", GD_MAX_CHUNK,
                      ", got ", chunk_size);
    const int64_t num_seqs = slots.numel(), rows = q.size(0);
    check_index_vector(slots, num_seqs, op, "slots");
    check_index_vector(bounds, 2 * num_seqs, op, "bounds");
    check_tensor(has_initial_state, at::kBool, {num_seqs}, op, "has_initial_state");
    check_state_slots(slots.data_ptr<int64_t>(), num_seqs, state.size(0), op);
    const int64_t *b = bounds.data_ptr<int64_t>();
    for (int64_t s = 0; s < num_seqs; s++)
        TORCH_CHECK_VALUE(0 <= b[2 * s] && b[2 * s] <= b[2 * s + 1] && b[2 * s + 1] <= rows, op, ": rows [", b[2 * s],
                          ", ", b[2 * s + 1], ") of a prompt are outside the ", rows, " rows given");
    const int status = gated_delta_chunked_f32(
        q.data_ptr<float>(), q.stride(0), k.data_ptr<float>(), k.stride(0), v.data_ptr<float>(), v.stride(0),
        g.data_ptr<float>(), beta.data_ptr<float>(), state.data_ptr<float>(), b, slots.data_ptr<int64_t>(),
        (const uint8_t *)has_initial_state.data_ptr<bool>(), (int)num_seqs, out.data_ptr<float>(), out.stride(0),
        (int)q.size(1), (int)state.size(1), (int)state.size(2), (int)state.size(3), (float)scale, qk_l2norm ? 1 : 0,
        (int)chunk_size, num_threads());
    if (status != 0) out_of_memory(op);
}

// --- sampling -------------------------------------------------------------------

std::tuple<Tensor, Tensor> logit_stats(const Tensor &logits) {
    TORCH_CHECK_VALUE(logits.dim() == 2, "logit_stats: logits must be [rows, vocab], got ", shape_of(logits));
    check_f32_rows(logits, logits.size(1), "logit_stats", "logits");
    const int64_t rows = logits.size(0);
    Tensor argmax = at::empty({rows}, logits.options().dtype(at::kLong));  // [rows]
    Tensor lse = at::empty({rows}, logits.options());                      // [rows]
    logit_stats_f32(logits.data_ptr<float>(), rows, logits.size(1), argmax.data_ptr<int64_t>(), lse.data_ptr<float>(),
                    num_threads());
    return {argmax, lse};
}

// --- state layers ------------------------------------------------------------------------

/* the width of a depthwise conv's weight [dim, width] (min_width..CONV_MAX_WIDTH), checked with its bias [dim] and
   its state [num_slots, width - 1, dim] (causal_conv1d, causal_conv1d_decode) */
static int64_t check_conv_weights(const Tensor &weight, const OptTensor &bias, const Tensor &conv_state, int64_t dim,
                                  int64_t min_width, const char *op) {
    TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) == dim && weight.size(1) >= min_width &&
                          weight.size(1) <= CONV_MAX_WIDTH,
                      op, ": weight must be [dim=", dim, ", width] with width ", min_width, "..", CONV_MAX_WIDTH,
                      ", got ", shape_of(weight));
    check_tensor(weight, at::kFloat, weight.sizes(), op, "weight");
    const int64_t width = weight.size(1);
    check_optional(bias, at::kFloat, {dim}, op, "bias");
    TORCH_CHECK_VALUE(conv_state.dim() == 3 && conv_state.size(1) == width - 1 && conv_state.size(2) == dim, op,
                      ": conv_state must be [num_slots, width - 1 = ", width - 1, ", dim = ", dim, "], got ",
                      shape_of(conv_state));
    check_tensor(conv_state, at::kFloat, conv_state.sizes(), op, "conv_state");
    return width;
}

/* causal_conv1d (conv/causal_conv1d.cpp): the kernel trusts the slots, the token ranges and the width */
Tensor causal_conv1d(const Tensor &x, const Tensor &weight, const OptTensor &bias, const Tensor &conv_state,
                     const Tensor &query_start_loc, const Tensor &state_slots, const Tensor &has_initial_state,
                     const std::string &activation) {
    const char *op = "causal_conv1d";
    TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be [num_tokens, dim], got ", shape_of(x));
    check_tensor(x, at::kFloat, x.sizes(), op, "x");
    const int64_t num_tokens = x.size(0), dim = x.size(1);
    const int64_t width = check_conv_weights(weight, bias, conv_state, dim, 1, op);
    TORCH_CHECK_VALUE(state_slots.dim() == 1, op, ": state_slots must be [num_seqs], got ", shape_of(state_slots));
    const int64_t num_seqs = state_slots.size(0), num_slots = conv_state.size(0);
    check_tensor(state_slots, at::kLong, {num_seqs}, op, "state_slots");
    check_tensor(query_start_loc, at::kLong, {num_seqs + 1}, op, "query_start_loc");
    check_tensor(has_initial_state, at::kBool, {num_seqs}, op, "has_initial_state");
    TORCH_CHECK_VALUE(activation == "none" || activation == "silu", op,
                      ": activation must be \"none\" or \"silu\", got \"", activation, "\"");
    const int64_t *loc = query_start_loc.data_ptr<int64_t>();
    const int64_t *slots = state_slots.data_ptr<int64_t>();
    TORCH_CHECK_VALUE(loc[0] == 0 && loc[num_seqs] == num_tokens, op, ": query_start_loc must run from 0 to ",
                      num_tokens, " (the tokens of x), got ", loc[0], " .. ", loc[num_seqs]);
    std::vector<bool> taken(num_slots, false);
    for (int64_t s = 0; s < num_seqs; s++) {
        TORCH_CHECK_VALUE(loc[s + 1] >= loc[s], op, ": query_start_loc must not decrease (sequence ", s, ")");
        TORCH_CHECK_VALUE(slots[s] >= 0 && slots[s] < num_slots, op, ": state slot ", slots[s], " of sequence ", s,
                          " is outside the ", num_slots, " slots");
        TORCH_CHECK_VALUE(!taken[slots[s]], op, ": state slot ", slots[s], " is given to two sequences");
        taken[slots[s]] = true;
    }
    Tensor out = at::empty({num_tokens, dim}, x.options());  // [num_tokens, dim]
    const float *b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    causal_conv1d_f32(x.data_ptr<float>(), weight.data_ptr<float>(), b, conv_state.data_ptr<float>(),
                      out.data_ptr<float>(), loc, slots, has_initial_state.data_ptr<bool>(), num_seqs, dim,
                      static_cast<int>(width), activation == "silu" ? 1 : 0,
                      threads_for(num_tokens * dim * width));
    return out;
}

/* one token per sequence (row r: the sequence whose conv state is slot slots[r]) continuing its slot: the rows of
   causal_conv1d for a decode step, as a step program's node. x rows may be strided (a column slice). */
StepNode causal_conv1d_decode_node(const Tensor &x, const Tensor &weight, const OptTensor &bias,
                                   const Tensor &conv_state, const Tensor &state_slots, bool silu, const Tensor &out) {
    const char *op = "causal_conv1d_decode";
    TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                          (x.size(0) <= 1 || x.stride(0) >= x.size(1)),
                      op, ": x must be float32 rows [num_seqs, dim], each contiguous, got ", shape_of(x));
    const int64_t rows = x.size(0), dim = x.size(1);
    const int64_t width = check_conv_weights(weight, bias, conv_state, dim, 2, op);
    check_index_vector(state_slots, rows, op, "state_slots");
    check_tensor(out, at::kFloat, {rows, dim}, op, "out");
    StepNode node{NODE_CONV_DECODE, rows};
    node.conv = {x.data_ptr<float>(), rows > 1 ? x.stride(0) : dim, weight.data_ptr<float>(),
                 ptr_or_null<float>(bias), conv_state.data_ptr<float>(), state_slots.data_ptr<int64_t>(),
                 conv_state.size(0), out.data_ptr<float>(), dim, (int)width, silu ? 1 : 0};
    return node;
}

Tensor causal_conv1d_decode(const Tensor &x, const Tensor &weight, const OptTensor &bias, const Tensor &conv_state,
                            const Tensor &state_slots, bool silu) {
    TORCH_CHECK_VALUE(x.dim() == 2, "causal_conv1d_decode: x must be [num_seqs, dim], got ", shape_of(x));
    Tensor out = at::empty({x.size(0), x.size(1)}, x.options().memory_format(at::MemoryFormat::Contiguous));
    const StepNode node = causal_conv1d_decode_node(x, weight, bias, conv_state, state_slots, silu, out);
    check_node_indices(node);
    run_node(node, threads_for(out.numel() * weight.size(1)), "causal_conv1d_decode");
    return out;
}

// --- mixture-of-experts routing ---------------------------------------------------------

/* Router kinds (layers/router.py's RouterSpec): softmax over every expert then the top k; the top k logits then
   a softmax over them; sigmoid scores, chosen by score plus an optional correction bias */
constexpr int64_t ROUTE_SOFTMAX_TOPK = 0, ROUTE_TOPK_SOFTMAX = 1, ROUTE_SIGMOID = 2;

/* (weights float32 [rows, top_k], ids int64 [rows, top_k]) of router logits [rows, num_experts], as
   route_logits (layers/router.py) computes them. The scores, the top-k and the renormalising sum are torch's
   own CPU kernels called from here, on purpose: their bits (torch's vectorised exp, its reduction order, its
   top-k's order among equal scores) are then the torch routing's on every variant of these kernels, which a
   SIMD softmax of ours could not promise. What this op saves is the Python dispatch of each small op. */
std::tuple<Tensor, Tensor> moe_route(const Tensor &logits, int64_t top_k, int64_t kind, bool renormalize,
                                     const std::optional<Tensor> &correction_bias, double scaling_factor) {
    const char *op = "moe_route";
    TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(1) >= 1, op, ": logits must be [rows, num_experts], got ",
                      shape_of(logits));
    TORCH_CHECK_VALUE(logits.is_floating_point() && logits.device().is_cpu(), op,
                      ": logits must be a floating-point CPU tensor");
    const int64_t num_experts = logits.size(1);
    TORCH_CHECK_VALUE(top_k >= 1 && top_k <= num_experts, op, ": top_k must be between 1 and ", num_experts,
                      ", got ", top_k);
    TORCH_CHECK_VALUE(kind >= ROUTE_SOFTMAX_TOPK && kind <= ROUTE_SIGMOID, op, ": unknown router kind ", kind);
    TORCH_CHECK_VALUE(scaling_factor > 0, op, ": the routed scaling factor must be positive, got ", scaling_factor);
    TORCH_CHECK_VALUE(!correction_bias.has_value() || kind == ROUTE_SIGMOID, op,
                      ": a correction bias is added to sigmoid scores only");
    if (correction_bias.has_value())
        TORCH_CHECK_VALUE(correction_bias->dim() == 1 && correction_bias->size(0) == num_experts &&
                              correction_bias->is_floating_point(), op, ": correction_bias must be [", num_experts,
                          "] floating point, got ", shape_of(*correction_bias));
    const Tensor l = logits.to(at::kFloat);
    Tensor weights, ids;
    if (kind == ROUTE_SIGMOID) {
        const Tensor scores = l.sigmoid();
        const Tensor choice = correction_bias.has_value() ? scores.add(correction_bias->to(at::kFloat)) : scores;
        ids = std::get<1>(choice.topk(top_k, -1));
        weights = scores.gather(1, ids);
        if (renormalize) weights = weights.div(weights.sum(-1, true).add(1e-20));
    } else if (kind == ROUTE_TOPK_SOFTMAX) {
        Tensor top;
        std::tie(top, ids) = l.topk(top_k, -1);
        weights = top.softmax(-1);
    } else {
        std::tie(weights, ids) = l.softmax(-1).topk(top_k, -1);
        if (renormalize) weights = weights.div(weights.sum(-1, true));
    }
    if (scaling_factor != 1.0) weights = weights.mul(scaling_factor);
    return {weights, ids};
}

/* The pairs of expert ids [rows, top_k] (int64, each in [0, num_experts)) grouped by expert, stably
   (moe_group.cpp): (order int64 [pairs], token_ids int32 [pairs], pair_experts int64 [pairs],
   counts int64 [num_experts], offsets int32 [num_experts + 1]); what a stable argsort of the ids gives */
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> moe_group(const Tensor &ids, int64_t num_experts) {
    const char *op = "moe_group";
    TORCH_CHECK_VALUE(ids.dim() == 2 && ids.size(1) >= 1, op, ": ids must be [rows, top_k], got ", shape_of(ids));
    TORCH_CHECK_VALUE(num_experts >= 1, op, ": num_experts must be positive, got ", num_experts);
    check_tensor(ids, at::kLong, ids.sizes(), op, "ids");
    const int64_t num_pairs = ids.numel();
    TORCH_CHECK_VALUE(num_pairs < INT32_MAX, op, ": too many pairs for int32 offsets: ", num_pairs);
    const auto longs = ids.options(), ints = ids.options().dtype(at::kInt);
    Tensor order = at::empty({num_pairs}, longs), token_ids = at::empty({num_pairs}, ints);
    Tensor pair_experts = at::empty({num_pairs}, longs), counts = at::empty({num_experts}, longs);
    Tensor offsets = at::empty({num_experts + 1}, ints);
    const int status = moe_group_pairs(ids.data_ptr<int64_t>(), num_pairs, ids.size(1), num_experts,
                                       counts.data_ptr<int64_t>(), offsets.data_ptr<int32_t>(),
                                       order.data_ptr<int64_t>(), token_ids.data_ptr<int32_t>(),
                                       pair_experts.data_ptr<int64_t>());
    TORCH_CHECK_VALUE(status == 0, op, ": an expert id is outside [0, ", num_experts, ")");
    return {order, token_ids, pair_experts, counts, offsets};
}

// --- tensor parallelism ------------------------------------------------------------------

void shm_all_reduce(const Tensor &x, const Tensor &slots, const Tensor &flags, const Tensor &pids, int64_t rank,
                    double timeout_s) {
    const char *op = "shm_all_reduce";
    TORCH_CHECK_VALUE(slots.device().is_cpu() && slots.scalar_type() == at::kFloat && slots.dim() == 3 &&
                          slots.size(0) == 2 && slots.is_contiguous(),
                      op, ": slots must be contiguous float32 [2, ranks, capacity], got ", shape_of(slots));
    const int64_t size = slots.size(1), capacity = slots.size(2);
    check_tensor(flags, at::kLong, {size}, op, "flags");
    check_tensor(pids, at::kLong, {size}, op, "pids");
    TORCH_CHECK_VALUE(rank >= 0 && rank < size, op, ": rank ", rank, " is outside ", size, " ranks");
    TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
                      ": x must be a contiguous float32 CPU tensor");
    TORCH_CHECK_VALUE(x.numel() <= capacity, op, ": ", x.numel(), " values exceed the slots' capacity ", capacity);
    TORCH_CHECK_VALUE(timeout_s > 0, op, ": timeout_s must be positive");
    const int status = shm_all_reduce_f32(x.data_ptr<float>(), x.numel(), slots.data_ptr<float>(), capacity,
                                          flags.data_ptr<int64_t>(), pids.data_ptr<int64_t>(), (int)rank, (int)size,
                                          timeout_s, num_threads());
    TORCH_CHECK(status != 4, op, ": rank ", rank, " waited more than ", timeout_s, " s for another rank");
    TORCH_CHECK(status != 5, op, ": rank ", rank, " found another rank's process gone");
}

int64_t panel_f32() { return PANEL; }
int64_t panel_bf16() { return BF_PANEL; }
int64_t bf16_native() { return packed_linear_bf16_native(); }

}  // namespace

#include "step/step_program.h"

/* ssm/ssd_ops.cpp: the Mamba-2 decode's node (its schema is that file's fragment) */
StepNode ssd_decode_node(const at::Tensor &x, const at::Tensor &dt, const at::Tensor &B, const at::Tensor &C,
                         const at::Tensor &A, const at::Tensor &D, const at::Tensor &dt_bias, const at::Tensor &state,
                         const at::Tensor &slots, double dt_min, double dt_max, const at::Tensor &out);

/* An op a step program runs has its node builder registered by step_node (step_program.h) after its schema,
   which the builder's parameters must follow (checked there). */
TORCH_LIBRARY(pagedllm, m) {
    m.class_<StepProgram>("StepProgram")
        .def(torch::init<int64_t>())
        .def("add", &StepProgram::add)
        .def("run", &StepProgram::run)
        .def("num_nodes", &StepProgram::num_nodes);
    // the row moves runner/step_program.py lowers aten ops to
    step_node("gather_rows", gather_rows_node);
    step_node("copy_rows", copy_rows_node);
    step_node("add_", add_node);
    m.def("add_rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
    step_node("add_rms_norm", add_rms_norm_node);
    m.def("qk_norm_rope(Tensor(a!) x, int num_q_heads, int num_kv_heads, int head_dim, Tensor cos, Tensor sin, "
          "Tensor? q_norm, Tensor? k_norm, float eps) -> ()");
    step_node("qk_norm_rope", qk_norm_rope_node);
    m.def("silu_mul(Tensor gate_up) -> Tensor");
    step_node("silu_mul", silu_mul_node);
    m.def("moe_slot_sum(Tensor y, Tensor weights, Tensor? shared, Tensor? gate) -> Tensor");
    step_node("moe_slot_sum", moe_slot_sum_node);
    m.def("gated_rms_norm(Tensor x, Tensor z, Tensor weight, float eps, int tiled_k_heads) -> Tensor");
    step_node("gated_rms_norm", gated_rms_norm_node);
    m.def("row_affine_(Tensor(a!) x, Tensor? mul, Tensor? add) -> ()");
    step_node("row_affine_", row_affine_node);
    m.def("gguf_linear(Tensor x, Tensor weight, int type, int in_features, Tensor? bias) -> Tensor");
    step_node("gguf_linear", gguf_linear_node);
    m.def("gguf_embedding(Tensor table, int type, int row_len, Tensor index) -> Tensor");
    step_node("gguf_embedding", gguf_embedding_node);
    m.def("gguf_moe_linear(Tensor x, Tensor weight, int type, int num_experts, Tensor token_ids, "
          "Tensor expert_offsets) -> Tensor");
    m.def("gguf_dequantize(Tensor weight, int type, int in_features) -> Tensor");
    m.def("gguf_interleave_(Tensor(a!) weight, int type, int in_features) -> ()");
    m.def("quantized_linear(Tensor x, Tensor weight, int bits, int group_size, int in_features, Tensor? bias, "
          "bool interleaved=False) -> Tensor");
    step_node("quantized_linear", quantized_linear_node);
    m.def("quantized_interleave_(Tensor(a!) weight, int bits, int group_size, int in_features) -> ()");
    m.def("quantized_embedding(Tensor table, int bits, int group_size, int row_len, Tensor index, "
          "bool interleaved=False) -> Tensor");
    step_node("quantized_embedding", quantized_embedding_node);
    m.def("pack_panels(Tensor weight) -> Tensor");
    m.def("pack_panels_bf16(Tensor weight) -> Tensor");
    m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
    step_node("packed_linear", packed_linear_node);
    m.def("packed_linear_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
    step_node("packed_linear_bf16", packed_linear_bf16_node);
    m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
    step_node("write_kv", write_kv_node);
    m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
          "float scale, Tensor(a!) out, int window=0, Tensor? sinks=None) -> ()");
    step_node("paged_decode", paged_decode_node);
    m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor bounds, float scale, "
          "Tensor? sinks=None) -> ()");
    m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor bounds, "
          "Tensor seq_lens, float scale, Tensor(a!) out, Tensor? sinks=None) -> ()");
    m.def("gated_delta_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, "
          "Tensor slots, Tensor(b!) out, float scale, bool qk_l2norm) -> ()");
    step_node("gated_delta_decode", gated_delta_decode_node);
    m.def("gated_delta_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, "
          "Tensor bounds, Tensor slots, Tensor has_initial_state, Tensor(b!) out, float scale, bool qk_l2norm, "
          "int chunk_size=64) -> ()");
    m.def("logit_stats(Tensor logits) -> (Tensor argmax, Tensor lse)");
    m.def("causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, Tensor query_start_loc, "
          "Tensor state_slots, Tensor has_initial_state, str activation) -> Tensor");
    m.def("causal_conv1d_decode(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, Tensor state_slots, "
          "bool silu) -> Tensor");
    step_node("causal_conv1d_decode", causal_conv1d_decode_node);
    // the Mamba-2 scan (implemented in ssm/ssd_ops.cpp)
    m.def("ssd_decode(Tensor x, Tensor dt, Tensor B, Tensor C, Tensor A, Tensor D, Tensor dt_bias, "
          "Tensor(a!) state, Tensor slots, float dt_min=0.0, float? dt_max=None) -> Tensor");
    step_node("ssd_decode", ssd_decode_node);  // "float? dt_max": a float, None as infinity
    m.def("ssd_prefill(Tensor x, Tensor dt, Tensor B, Tensor C, Tensor A, Tensor D, Tensor dt_bias, "
          "Tensor(a!) state, Tensor slots, Tensor bounds, Tensor has_initial_state, int chunk_size, "
          "float dt_min=0.0, float? dt_max=None) -> Tensor");
    m.def("moe_route(Tensor logits, int top_k, int kind, bool renormalize, Tensor? correction_bias, "
          "float scaling_factor) -> (Tensor weights, Tensor ids)");
    m.def("moe_group(Tensor ids, int num_experts) -> (Tensor order, Tensor token_ids, Tensor pair_experts, "
          "Tensor counts, Tensor offsets)");
    m.def("shm_all_reduce(Tensor(a!) x, Tensor(b!) slots, Tensor(c!) flags, Tensor pids, int rank, float timeout_s) -> ()");
    // what this build was compiled for: no tensor arguments, so one kernel for every dispatch key
    m.def("packed_linear_panel() -> int", &panel_f32);
    m.def("packed_linear_bf16_panel() -> int", &panel_bf16);
    m.def("packed_linear_bf16_native() -> int", &bf16_native);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("qk_norm_rope", &qk_norm_rope);
    m.impl("silu_mul", &silu_mul);
    m.impl("moe_slot_sum", &moe_slot_sum);
    m.impl("gated_rms_norm", &gated_rms_norm);
    m.impl("row_affine_", &row_affine_);
    m.impl("gguf_linear", &gguf_linear);
    m.impl("gguf_embedding", &gguf_embedding);
    m.impl("gguf_moe_linear", &gguf_moe_linear_op);
    m.impl("gguf_dequantize", &gguf_dequantize);
    m.impl("gguf_interleave_", &gguf_interleave_);
    m.impl("quantized_linear", &quantized_linear);
    m.impl("quantized_interleave_", &quantized_interleave_);
    m.impl("quantized_embedding", &quantized_embedding);
    m.impl("pack_panels", &pack_panels);
    m.impl("pack_panels_bf16", &pack_panels_bf16);
    m.impl("packed_linear", &packed_linear);
    m.impl("packed_linear_bf16", &packed_linear_bf16_op);
    m.impl("write_kv", &write_kv_op);
    m.impl("paged_decode", &paged_decode_op);
    m.impl("prefill_attention", &prefill_attention_op);
    m.impl("paged_prefill", &paged_prefill_op);
    m.impl("gated_delta_decode", &gated_delta_decode_op);
    m.impl("gated_delta_prefill", &gated_delta_prefill_op);
    m.impl("logit_stats", &logit_stats);
    m.impl("causal_conv1d", &causal_conv1d);
    m.impl("causal_conv1d_decode", &causal_conv1d_decode);
    m.impl("moe_route", &moe_route);
    m.impl("moe_group", &moe_group);
    m.impl("shm_all_reduce", &shm_all_reduce);
}
