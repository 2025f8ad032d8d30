/*
 * pagedllm.StepProgram, a torch custom class: the kernel calls of a traced
 * decode step (runner/decode_graph.py lowers the FX trace's nodes to them),
 * run by one OpenMP team in one parallel region (step_nodes.h). Part of
 * ops.cpp (included once, there, after its node builders): only that file
 * sees torch's headers.
 *
 * add(op, tensors, ints, floats) appends one call of the op named, built
 * by the same node builder the eager op runs (its checks raise ValueError
 * for what it cannot run), on static tensors the program holds for as long
 * as it lives. The arguments come as runner/step_program.py reads them from
 * the op's schema: tensors (None for an absent optional one), ints (and
 * bools) and floats, each list in schema order, the op's result appended to
 * the tensors. A node builder takes exactly that: the schema's arguments as
 * C++ parameters in order, then the result, so its parameter types say
 * which list each comes from:
 *
 *   schema   quantized_linear(Tensor x, Tensor weight, int bits, int group_size, int in_features,
 *                             Tensor? bias, bool interleaved=False) -> Tensor
 *   builder  quantized_linear_node(const Tensor &x, const Tensor &w, int64_t bits, int64_t group_size,
 *                                  int64_t in_features, const OptTensor &bias, bool interleaved, const Tensor &out)
 *   add      ("quantized_linear", [x, w, bias, out], [bits, group_size, in_features, interleaved], [])
 *
 * step_node(op, builder), one line after the op's schema in ops.cpp,
 * registers the builder: a template reads its parameter list, checks it
 * against the schema when the library loads (a builder out of step with
 * its schema would take its arguments from the wrong places, so a mismatch
 * stops the load), and unpacks add's lists into it (checking their
 * lengths: a ValueError). So an op's argument order is
 * written once, in its schema, and nothing here names an op. An op with no
 * builder is refused (ValueError "no node for op"); the runner keeps it a
 * Python call. The aten row moves a step makes between kernels have
 * builders of their own, registered the same way (no schema to check):
 *
 *   gather_rows   table, index, out   (the embedding, the RoPE table lookup)
 *   copy_rows     src, dst            (rows, dim 0, any stride apart; each row contiguous)
 *   add_          x, y                (the residual add)
 *
 * Every node works on the step's tokens row by row, StepNode.rows of them,
 * which add requires to be the constructor's `rows`. So run(n) may run the
 * first n rows only, by setting every node's rows to n: a decode step of
 * n <= rows sequences replays a program captured for `rows` without
 * padding (add refuses a node that is not over those rows; it stays a
 * Python call). run(n) checks the indices every node reads through (the
 * step's slots, block tables, lengths and gathered ids), then runs the
 * nodes.
 */
#include <functional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace {

StepNode gather_rows_node(const Tensor &table, const Tensor &index, const Tensor &out) {
    const char *op = "gather_rows";
    TORCH_CHECK_VALUE(table.dim() == 2, op, ": the table must be 2-D, got ", shape_of(table));
    check_tensor(table, at::kFloat, table.sizes(), op, "the table");
    TORCH_CHECK_VALUE(index.dim() == 1, op, ": the index must be 1-D, got ", shape_of(index));
    check_index_vector(index, index.size(0), op, "the index");
    check_tensor(out, at::kFloat, {index.size(0), table.size(1)}, op, "the output");
    StepNode node{NODE_GATHER_ROWS, index.size(0)};
    node.gather = {table.data_ptr<float>(), index.data_ptr<int64_t>(), out.data_ptr<float>(), table.size(1),
                   table.size(0)};
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
    StepNode node{NODE_COPY_ROWS, src.size(0)};
    node.copy = {src.data_ptr<float>(), dst.data_ptr<float>(), row_len, src.stride(0), dst.stride(0)};
    return node;
}

/* x += y over x's rows (dim 0; a tensor of no dimension is one row) */
StepNode add_node(const Tensor &x, const Tensor &y) {
    check_tensor(x, at::kFloat, x.sizes(), "add_", "x");
    check_tensor(y, at::kFloat, x.sizes(), "add_", "y");
    const int64_t rows = x.dim() >= 1 ? x.size(0) : 1;
    StepNode node{NODE_ADD, rows};
    node.add = {x.data_ptr<float>(), y.data_ptr<float>(), rows > 0 ? x.numel() / rows : 0};
    return node;
}

// --- the node builders by op name (see the top of this file) ---------------------------------------------------

/* a builder's parameter type as a letter of its signature: T tensor, O optional tensor, i int, b bool, f float */
template <typename P> struct StepArg;
template <> struct StepArg<const Tensor &> { static constexpr char code = 'T'; };
template <> struct StepArg<const OptTensor &> { static constexpr char code = 'O'; };
template <> struct StepArg<int64_t> { static constexpr char code = 'i'; };
template <> struct StepArg<bool> { static constexpr char code = 'b'; };
template <> struct StepArg<double> { static constexpr char code = 'f'; };

/* the list a signature letter is read from: 0 tensors, 1 ints, 2 floats */
constexpr int step_list(char code) { return code == 'T' || code == 'O' ? 0 : code == 'f' ? 2 : 1; }

struct StepArgs {
    const std::string &op;
    const std::vector<OptTensor> &tensors;
    const std::vector<int64_t> &ints;
    const std::vector<double> &floats;

    const Tensor &get(const Tensor *, size_t i) const {
        TORCH_CHECK_VALUE(tensors[i].has_value(), "StepProgram.add(", op, "): tensor ", i, " is missing");
        return *tensors[i];
    }
    const OptTensor &get(const OptTensor *, size_t i) const { return tensors[i]; }
    int64_t get(const int64_t *, size_t i) const { return ints[i]; }
    bool get(const bool *, size_t i) const { return ints[i] != 0; }
    double get(const double *, size_t i) const { return floats[i]; }
};

/* a builder's parameter types, P..., as signature letters: how many each list holds, and where parameter i
   is in its list (the parameters of its list before it) */
template <typename... P>
struct StepSignature {
    static constexpr char codes[] = {StepArg<P>::code..., '\0'};

    static constexpr size_t count(int list) {
        size_t n = 0;
        for (size_t j = 0; j < sizeof...(P); j++) n += step_list(codes[j]) == list;
        return n;
    }
    static constexpr size_t index(size_t i) {
        size_t n = 0;
        for (size_t j = 0; j < i; j++) n += step_list(codes[j]) == step_list(codes[i]);
        return n;
    }
};

template <typename... P, size_t... I>
StepNode build_step_node(StepNode (*builder)(P...), const StepArgs &a, std::index_sequence<I...>) {
    using S = StepSignature<P...>;
    TORCH_CHECK_VALUE(a.tensors.size() == S::count(0) && a.ints.size() == S::count(1) && a.floats.size() == S::count(2),
                      "StepProgram.add(", a.op, "): expected ", S::count(0), " tensors, ", S::count(1), " ints and ",
                      S::count(2), " floats");
    return builder(a.get((std::remove_cv_t<std::remove_reference_t<P>> *)nullptr, S::index(I))...);
}

using StepNodeBuilder = std::function<StepNode(const StepArgs &)>;

std::unordered_map<std::string, StepNodeBuilder> &step_node_builders() {
    static std::unordered_map<std::string, StepNodeBuilder> builders;
    return builders;
}

/* the signature letters of a pagedllm op's schema, its arguments then its Tensor result; "" for an op of no
   such schema (the row moves the runner lowers aten ops to) */
std::string schema_codes(const std::string &op) {
    const auto handle = c10::Dispatcher::singleton().findSchema({"pagedllm::" + op, ""});
    if (!handle.has_value()) return "";
    std::string codes;
    for (const c10::Argument &arg : handle->schema().arguments()) {
        const c10::TypePtr &type = arg.type();
        const auto optional = type->cast<c10::OptionalType>();
        if (type->kind() == c10::TypeKind::TensorType) codes += 'T';
        else if (optional && optional->getElementType()->kind() == c10::TypeKind::TensorType) codes += 'O';
        else if (type->kind() == c10::TypeKind::IntType) codes += 'i';
        else if (type->kind() == c10::TypeKind::BoolType) codes += 'b';
        else if (type->kind() == c10::TypeKind::FloatType) codes += 'f';
        else if (optional && optional->getElementType()->kind() == c10::TypeKind::FloatType) codes += 'f';
        else codes += '?';
    }
    const auto &returns = handle->schema().returns();
    if (returns.size() == 1 && returns[0].type()->kind() == c10::TypeKind::TensorType) codes += 'T';
    return codes;
}

/* makes `builder` the node of op `op`; for a pagedllm op (declared before this is called) its parameters must
   be the schema's arguments in order, then the result: checked here, when the library loads */
template <typename... P>
void step_node(const std::string &op, StepNode (*builder)(P...)) {
    const std::string schema = schema_codes(op), params = StepSignature<P...>::codes;
    TORCH_CHECK(schema.empty() || schema == params, "the node builder of ", op, " takes (", params,
                "), its schema's arguments and result are (", schema, "): T tensor, O optional tensor, i int, ",
                "b bool, f float");
    step_node_builders()[op] = [builder](const StepArgs &a) {
        return build_step_node(builder, a, std::index_sequence_for<P...>());
    };
}

struct StepProgram : torch::CustomClassHolder {
    int64_t rows;                   // the tokens every node was built for
    std::vector<StepNode> nodes;
    std::vector<StepNode> resized;  // the nodes over fewer rows, rebuilt by run(n < rows)
    std::vector<Tensor> held;       // every tensor a node points into
    Tensor scratch;                 // [values] bf16: the rounded activations of one bf16 or x16 GGUF linear node at a time

    explicit StepProgram(int64_t rows_) : rows(rows_) {
        TORCH_CHECK_VALUE(rows >= 1, "StepProgram: rows must be at least 1, got ", rows);
    }

    /* appends one kernel call (see the top of this file); ValueError for what it cannot run */
    void add(const std::string &op, std::vector<OptTensor> tensors, std::vector<int64_t> ints,
             std::vector<double> floats) {
        const auto builder = step_node_builders().find(op);
        TORCH_CHECK_VALUE(builder != step_node_builders().end(), "StepProgram.add: no node for op '", op, "'");
        StepNode node = builder->second(StepArgs{op, tensors, ints, floats});
        // every node must be over the program's rows, for run(n) to cut it to n rows
        TORCH_CHECK_VALUE(node.rows == rows, "StepProgram.add(", op, "): the node is not over the program's ", rows,
                          " rows");
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
        if (node.kind == NODE_LINEAR_BF16_PANELS) return bf16_scratch_values(node.rows, node.linear.in_features);
        if (node.kind == NODE_LINEAR_GGUF && is_x16_type(node.linear.weight_type))
            return (gguf_x16_scratch_bytes(node.rows, node.linear.in_features) + 1) / 2;
        return 0;
    }

    /* runs every node over its first n rows on the tensors' current values, after checking the indices
       those rows read through */
    void run(int64_t n) {
        TORCH_CHECK_VALUE(n >= 1 && n <= rows, "StepProgram.run: ", n, " rows, the program has ", rows);
        const std::vector<StepNode> *todo = &nodes;
        if (n < rows) {
            resized = nodes;
            for (StepNode &node : resized) node.rows = n;
            todo = &resized;
        }
        for (const StepNode &node : *todo) check_node_indices(node);
        if (run_step_nodes(todo->data(), (int64_t)todo->size(), num_threads()) != 0) out_of_memory("step program");
    }

    int64_t num_nodes() { return (int64_t)nodes.size(); }
};

}  // namespace
