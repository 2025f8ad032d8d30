/*
 * pagedllm.StepProgram, a torch custom class: the kernel calls of a traced
 * decode step (runner/decode_graph.py lowers the FX trace's nodes to them),
 * run by one OpenMP team in one parallel region (step_nodes.h). Part of
 * ops.cpp (included once, there, after its node builders): only that file
 * sees torch's headers.
 *
 * add(op, tensors, ints, floats) appends one call of the op named, checked
 * by the same builder the eager op uses (a ValueError for what it cannot
 * run), on static tensors the program holds for as long as it lives:
 *
 *   op                   tensors                                  ints               floats
 *   add_rms_norm         x, delta?, weight, out                                      eps
 *   qk_norm_rope         x, cos, sin, q_norm?, k_norm?            nq, nkv, head_dim  eps
 *   silu_mul             gate_up, out
 *   packed_linear(_bf16) x, packed, bias?, out                    out_features
 *   gguf_linear          x, weight, bias?, out                    type, in_features
 *   gguf_embedding       table, index, out                        type, row_len
 *   quantized_linear     x, weight, bias?, out                    bits, group_size, in_features, interleaved
 *   quantized_embedding  table, index, out                        bits, group_size, row_len, interleaved
 *   write_kv             k, v, k_cache, v_cache, slots
 *   paged_decode         q, k_cache, v_cache, tables, lens, out   window             scale
 *   gather_rows          table, index, out
 *   copy_rows            src, dst     (rows, dim 0, any stride apart; each row contiguous)
 *   add_                 x, y
 *
 * Every node works on the step's tokens row by row, `rows` of them (the
 * constructor's), so run(n) may run the first n rows only: a decode step of
 * n <= rows sequences replays a program captured for `rows` without padding
 * (add refuses a node that is not per-row; it stays a Python call). run(n)
 * checks the indices every node reads through (the step's slots, block
 * tables, lengths and gathered ids), then runs the nodes.
 */
#include <string>

namespace {

StepNode gather_rows_node(const Tensor &table, const Tensor &index, const Tensor &out) {
    const char *op = "gather_rows";
    TORCH_CHECK_VALUE(table.dim() == 2, op, ": the table must be 2-D, got ", shape_of(table));
    check_tensor(table, at::kFloat, table.sizes(), op, "the table");
    TORCH_CHECK_VALUE(index.dim() == 1, op, ": the index must be 1-D, got ", shape_of(index));
    check_index_vector(index, index.size(0), op, "the index");
    check_tensor(out, at::kFloat, {index.size(0), table.size(1)}, op, "the output");
    StepNode node{NODE_GATHER_ROWS};
    node.gather = {table.data_ptr<float>(), index.data_ptr<int64_t>(), out.data_ptr<float>(), index.size(0),
                   table.size(1), table.size(0)};
    return node;
}

/* the floats of one row (dim 0) of t, which must be contiguous within each row */
int64_t contiguous_row_len(const Tensor &t, const char *op, const char *name) {
    TORCH_CHECK_VALUE(t.dim() >= 1 && t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", name,
                      " must be a float32 CPU tensor of at least one dimension");
    int64_t row_len = 1;
    for (int64_t d = t.dim() - 1; d >= 1; d--) {
        TORCH_CHECK_VALUE(t.size(d) == 1 || t.stride(d) == row_len, op, ": the rows of ", name, " ", shape_of(t),
                          " are not contiguous");
        row_len *= t.size(d);
    }
    return row_len;
}

/* dst = src, the rows (dim 0) of each any stride apart but each row contiguous */
StepNode copy_rows_node(const Tensor &src, const Tensor &dst) {
    const char *op = "copy_rows";
    const int64_t row_len = contiguous_row_len(src, op, "the source");
    contiguous_row_len(dst, op, "the destination");
    TORCH_CHECK_VALUE(dst.sizes() == src.sizes(), op, ": the destination must be of shape ", src.sizes(), ", got ",
                      shape_of(dst));
    StepNode node{NODE_COPY_ROWS};
    node.copy = {src.data_ptr<float>(), dst.data_ptr<float>(), src.size(0), row_len, src.stride(0), dst.stride(0)};
    return node;
}

StepNode add_node(const Tensor &x, const Tensor &y) {
    check_tensor(x, at::kFloat, x.sizes(), "add_", "x");
    check_tensor(y, at::kFloat, x.sizes(), "add_", "y");
    StepNode node{NODE_ADD};
    node.add = {x.data_ptr<float>(), y.data_ptr<float>(), x.numel()};
    return node;
}

/* a node's rows (tokens); add_ nodes, which know only their element count, have numel / row_len of them */
int64_t node_rows(const StepNode &node, int64_t row_len) {
    switch (node.kind) {
        case NODE_GATHER_ROWS: return node.gather.rows;
        case NODE_COPY_ROWS: return node.copy.rows;
        case NODE_ADD: return node.add.numel / row_len;
        case NODE_ADD_RMS_NORM: return node.norm.rows;
        case NODE_QK_NORM_ROPE: return node.rope.rows;
        case NODE_SILU_MUL: return node.silu.rows;
        case NODE_LINEAR_F32_PANELS:
        case NODE_LINEAR_BF16_PANELS:
        case NODE_LINEAR_GGUF: return node.linear.rows;
        case NODE_GATHER_GGUF: return node.gguf_gather.rows;
        case NODE_WRITE_KV: return node.kv.rows;
        case NODE_PAGED_DECODE: return node.attn.num_seqs;
        default: return -1;
    }
}

/* the same node over its first `rows` rows */
void set_node_rows(StepNode &node, int64_t rows, int64_t add_row_len) {
    switch (node.kind) {
        case NODE_GATHER_ROWS: node.gather.rows = rows; break;
        case NODE_COPY_ROWS: node.copy.rows = rows; break;
        case NODE_ADD: node.add.numel = rows * add_row_len; break;
        case NODE_ADD_RMS_NORM: node.norm.rows = rows; break;
        case NODE_QK_NORM_ROPE: node.rope.rows = rows; break;
        case NODE_SILU_MUL: node.silu.rows = rows; break;
        case NODE_LINEAR_F32_PANELS:
        case NODE_LINEAR_BF16_PANELS:
        case NODE_LINEAR_GGUF: node.linear.rows = rows; break;
        case NODE_GATHER_GGUF: node.gguf_gather.rows = rows; break;
        case NODE_WRITE_KV: node.kv.rows = rows; break;
        case NODE_PAGED_DECODE: node.attn.num_seqs = (int)rows; break;
        default: break;
    }
}

struct StepProgram : torch::CustomClassHolder {
    int64_t rows;                  // the tokens every node was built for
    std::vector<StepNode> nodes;
    std::vector<int64_t> row_lens;  // per node: an add_ node's elements per row (else unused)
    std::vector<StepNode> resized;  // the nodes over fewer rows, rebuilt by run(n < rows)
    std::vector<Tensor> held;       // every tensor a node points into
    Tensor scratch;                 // [values] bf16: the rounded activations of one bf16 or x16 GGUF linear node at a time

    explicit StepProgram(int64_t rows_) : rows(rows_) {
        TORCH_CHECK_VALUE(rows >= 1, "StepProgram: rows must be at least 1, got ", rows);
    }

    static const Tensor &need(const std::vector<OptTensor> &t, size_t i, const std::string &op) {
        TORCH_CHECK_VALUE(i < t.size() && t[i].has_value(), "StepProgram.add(", op, "): tensor ", i, " is missing");
        return *t[i];
    }

    static OptTensor maybe(const std::vector<OptTensor> &t, size_t i) { return i < t.size() ? t[i] : OptTensor(); }

    StepNode build(const std::string &op, const std::vector<OptTensor> &t, const std::vector<int64_t> &ints,
                   const std::vector<double> &floats) const {
        auto T = [&](size_t i) -> const Tensor & { return need(t, i, op); };
        auto counts = [&](size_t num_tensors, size_t num_ints, size_t num_floats) {
            TORCH_CHECK_VALUE(t.size() == num_tensors && ints.size() == num_ints && floats.size() == num_floats,
                              "StepProgram.add(", op, "): expected ", num_tensors, " tensors, ", num_ints,
                              " ints and ", num_floats, " floats");
        };
        if (op == "add_rms_norm") return counts(4, 0, 1), add_rms_norm_node(T(0), maybe(t, 1), T(2), T(3), floats[0]);
        if (op == "qk_norm_rope")
            return counts(5, 3, 1), qk_norm_rope_node(T(0), ints[0], ints[1], ints[2], T(1), T(2), maybe(t, 3),
                                                      maybe(t, 4), floats[0]);
        if (op == "silu_mul") return counts(2, 0, 0), silu_mul_node(T(0), T(1));
        if (op == "packed_linear") return counts(4, 1, 0), packed_linear_node(T(0), T(1), maybe(t, 2), ints[0], T(3));
        if (op == "packed_linear_bf16")
            return counts(4, 1, 0), packed_linear_bf16_node(T(0), T(1), maybe(t, 2), ints[0], T(3));
        if (op == "gguf_linear")
            return counts(4, 2, 0), gguf_linear_node(T(0), T(1), ints[0], ints[1], maybe(t, 2), T(3));
        if (op == "gguf_embedding") return counts(3, 2, 0), gguf_embedding_node(T(0), ints[0], ints[1], T(1), T(2));
        if (op == "quantized_linear")
            return counts(4, 4, 0), quantized_linear_node(T(0), T(1), ints[0], ints[1], ints[2], maybe(t, 2), T(3),
                                                          ints[3] != 0);
        if (op == "quantized_embedding")
            return counts(3, 4, 0), quantized_embedding_node(T(0), ints[0], ints[1], ints[2], T(1), T(2), ints[3] != 0);
        if (op == "write_kv") return counts(5, 0, 0), write_kv_node(T(0), T(1), T(2), T(3), T(4));
        if (op == "paged_decode")
            return counts(6, 1, 1), paged_decode_node(T(0), T(1), T(2), T(3), T(4), floats[0], T(5), ints[0]);
        if (op == "gather_rows") return counts(3, 0, 0), gather_rows_node(T(0), T(1), T(2));
        if (op == "copy_rows") return counts(2, 0, 0), copy_rows_node(T(0), T(1));
        if (op == "add_") return counts(2, 0, 0), add_node(T(0), T(1));
        TORCH_CHECK_VALUE(false, "StepProgram.add: no node for op '", op, "'");
    }

    /* appends one kernel call (see the top of this file); ValueError for what it cannot run */
    void add(const std::string &op, std::vector<OptTensor> tensors, std::vector<int64_t> ints,
             std::vector<double> floats) {
        StepNode node = build(op, tensors, ints, floats);
        // every node must be per-row, for run(n) to cut it to n rows
        const int64_t row_len = node.kind == NODE_ADD && tensors[0]->dim() >= 1 && tensors[0]->size(0) == rows
                                    ? tensors[0]->numel() / rows : 1;
        TORCH_CHECK_VALUE(node_rows(node, row_len) == rows && (node.kind != NODE_ADD || row_len * rows == node.add.numel),
                          "StepProgram.add(", op, "): the node is not over the program's ", rows, " rows");
        row_lens.push_back(row_len);
        for (const OptTensor &t : tensors)
            if (t.has_value()) held.push_back(*t);
        nodes.push_back(node);
        const int64_t values = scratch_values(node);
        if (values > 0) {
            if (!scratch.defined() || scratch.numel() < values) scratch = at::empty({values}, at::kBFloat16);
            for (StepNode &n : nodes)  // the scratch may have moved: every node using it gets the current one
                if (scratch_values(n) > 0) n.linear.scratch = (uint16_t *)scratch.data_ptr();
        }
    }

    /* bf16 values of scratch a node needs: bf16 linears round their activations to bf16 there, linears
       over interleaved GGUF weights to int8 blocks; 0 for the others */
    static int64_t scratch_values(const StepNode &node) {
        if (node.kind == NODE_LINEAR_BF16_PANELS) return bf16_scratch_values(node.linear.rows, node.linear.in_features);
        if (node.kind == NODE_LINEAR_GGUF && is_x16_type(node.linear.weight_type))
            return (gguf_x16_scratch_bytes(node.linear.rows, node.linear.in_features) + 1) / 2;
        return 0;
    }

    /* runs every node over its first n rows on the tensors' current values, after checking the indices
       those rows read through */
    void run(int64_t n) {
        TORCH_CHECK_VALUE(n >= 1 && n <= rows, "StepProgram.run: ", n, " rows, the program has ", rows);
        const std::vector<StepNode> *todo = &nodes;
        if (n < rows) {
            resized = nodes;
            for (size_t i = 0; i < resized.size(); i++) set_node_rows(resized[i], n, row_lens[i]);
            todo = &resized;
        }
        for (const StepNode &node : *todo) check_node_indices(node);
        if (run_step_nodes(todo->data(), (int64_t)todo->size(), num_threads()) != 0) out_of_memory("step program");
    }

    int64_t num_nodes() { return (int64_t)nodes.size(); }
};

}  // namespace
