/*
 * The Mamba-2 scan's torch ops (ssd_scan.h), registered as a fragment of the
 * pagedllm library next to ops.cpp's: the schemas, the checks of every
 * pointer, size and slot the kernels trust (a bad tensor raises ValueError),
 * and the calls. A file of its own so that the families of state-space
 * layers each add theirs without touching ops.cpp's one schema block.
 *
 *   ssd_decode(x, dt, B, C, A, D, dt_bias, state, slots, dt_min, dt_max) -> out   (dt_max None: no limit)
 *   ssd_prefill(x, dt, B, C, A, D, dt_bias, state, slots, bounds,
 *               has_initial_state, chunk_size, dt_min, dt_max) -> out
 */
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <math.h>

#include <optional>
#include <vector>

#include "ssd_scan.h"
#include "../step/step_nodes.h"

namespace {

using at::Tensor;

/* [tokens, width] float32 rows on the CPU, unit column stride (a column slice of wider rows is fine) */
void check_rows(const Tensor &t, int64_t tokens, int64_t width, const char *op, const char *name) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", name,
                      " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == tokens && t.size(1) == width, op, ": ", name, " must be [",
                      tokens, ", ", width, "], got ", t.sizes());
    TORCH_CHECK_VALUE(t.stride(1) == 1 && (tokens <= 1 || t.stride(0) >= width), op, ": ", name,
                      " must be rows of contiguous values");
}

void check_vector(const Tensor &t, at::ScalarType dtype, int64_t n, const char *op, const char *name) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == n &&
                          t.is_contiguous(),
                      op, ": ", name, " must be a contiguous ", dtype, " CPU tensor of ", n, " values, got ",
                      t.scalar_type(), " ", t.sizes());
}

/* the layer's sizes, read off the state [num_slots, num_heads, head_dim, state_size] and B's width */
SsdLayer check_layer(const Tensor &state, const Tensor &B, const Tensor &A, const Tensor &D, const Tensor &dt_bias,
                     double dt_min, std::optional<double> dt_max_or_none, const char *op) {
    const double dt_max = dt_max_or_none.value_or(INFINITY);  // None: no upper limit
    TORCH_CHECK_VALUE(state.device().is_cpu() && state.scalar_type() == at::kFloat && state.dim() == 4 &&
                          state.is_contiguous(),
                      op, ": state must be a contiguous float32 CPU tensor [num_slots, num_heads, head_dim, ",
                      "state_size], got ", state.scalar_type(), " ", state.sizes());
    const int64_t num_heads = state.size(1), head_dim = state.size(2), state_size = state.size(3);
    TORCH_CHECK_VALUE(num_heads > 0 && head_dim > 0 && state_size > 0, op, ": empty state dimensions ", state.sizes());
    TORCH_CHECK_VALUE(B.dim() == 2 && B.size(1) % state_size == 0 && B.size(1) > 0, op, ": B's width ",
                      B.dim() == 2 ? B.size(1) : -1, " is not a multiple of state_size ", state_size);
    const int64_t num_groups = B.size(1) / state_size;
    TORCH_CHECK_VALUE(num_heads % num_groups == 0, op, ": ", num_heads, " heads do not split into ", num_groups,
                      " groups");
    check_vector(A, at::kFloat, num_heads, op, "A");
    check_vector(D, at::kFloat, num_heads, op, "D");
    check_vector(dt_bias, at::kFloat, num_heads, op, "dt_bias");
    TORCH_CHECK_VALUE(dt_min >= 0 && dt_min <= dt_max, op, ": the time step limits must be 0 <= dt_min <= dt_max, got ",
                      dt_min, ", ", dt_max);
    return SsdLayer{A.data_ptr<float>(), D.data_ptr<float>(), dt_bias.data_ptr<float>(), (float)dt_min,
                    (float)dt_max, (int)num_heads, (int)head_dim, (int)state_size, (int)num_groups};
}

/* the token rows checked against the layer; out made here */
SsdRows check_token_rows(const SsdLayer &l, const Tensor &x, const Tensor &dt, const Tensor &B, const Tensor &C,
                         Tensor &out, const char *op) {
    const int64_t tokens = x.dim() == 2 ? x.size(0) : -1, inner = (int64_t)l.num_heads * l.head_dim;
    check_rows(x, tokens, inner, op, "x");
    check_rows(dt, tokens, l.num_heads, op, "dt");
    check_rows(B, tokens, (int64_t)l.num_groups * l.state_size, op, "B");
    check_rows(C, tokens, (int64_t)l.num_groups * l.state_size, op, "C");
    out = at::empty({tokens, inner}, x.options());
    return SsdRows{x.data_ptr<float>(), dt.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>(),
                   out.data_ptr<float>(), x.stride(0), dt.stride(0), B.stride(0), C.stride(0), out.stride(0)};
}

/* one slot per sequence, each inside the state, none shared (their tasks write the slots at once) */
void check_slots(const Tensor &slots, int64_t num_seqs, int64_t num_slots, const char *op) {
    check_vector(slots, at::kLong, num_seqs, op, "slots");
    std::vector<bool> taken((size_t)num_slots, false);
    const int64_t *s = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < num_seqs; i++) {
        TORCH_CHECK_VALUE(s[i] >= 0 && s[i] < num_slots, op, ": slot ", s[i], " is outside the state's ", num_slots,
                          " slots");
        TORCH_CHECK_VALUE(!taken[(size_t)s[i]], op, ": slot ", s[i], " is given to two sequences");
        taken[(size_t)s[i]] = true;
    }
}

Tensor ssd_decode(const Tensor &x, const Tensor &dt, const Tensor &B, const Tensor &C, const Tensor &A,
                  const Tensor &D, const Tensor &dt_bias, const Tensor &state, const Tensor &slots, double dt_min,
                  std::optional<double> dt_max) {
    const char *op = "ssd_decode";
    const SsdLayer layer = check_layer(state, B, A, D, dt_bias, dt_min, dt_max, op);
    Tensor out;
    const SsdRows rows = check_token_rows(layer, x, dt, B, C, out, op);
    check_slots(slots, x.size(0), state.size(0), op);
    ssd_decode_f32(&layer, &rows, state.data_ptr<float>(), slots.data_ptr<int64_t>(), (int)x.size(0),
                   at::get_num_threads());
    return out;
}

Tensor ssd_prefill(const Tensor &x, const Tensor &dt, const Tensor &B, const Tensor &C, const Tensor &A,
                   const Tensor &D, const Tensor &dt_bias, const Tensor &state, const Tensor &slots,
                   const Tensor &bounds, const Tensor &has_initial_state, int64_t chunk_size, double dt_min,
                   std::optional<double> dt_max) {
    const char *op = "ssd_prefill";
    const SsdLayer layer = check_layer(state, B, A, D, dt_bias, dt_min, dt_max, op);
    Tensor out;
    const SsdRows rows = check_token_rows(layer, x, dt, B, C, out, op);
    TORCH_CHECK_VALUE(bounds.dim() == 1 && bounds.size(0) >= 1, op, ": bounds must be [num_seqs + 1], got ",
                      bounds.sizes());
    const int64_t num_seqs = bounds.size(0) - 1;
    check_vector(bounds, at::kLong, num_seqs + 1, op, "bounds");
    check_vector(has_initial_state, at::kBool, num_seqs, op, "has_initial_state");
    check_slots(slots, num_seqs, state.size(0), op);
    const int64_t *b = bounds.data_ptr<int64_t>();
    TORCH_CHECK_VALUE(b[0] == 0 && b[num_seqs] == x.size(0), op, ": bounds must run from 0 to the ", x.size(0),
                      " tokens, got ", b[0], " .. ", b[num_seqs]);
    for (int64_t i = 0; i < num_seqs; i++)
        TORCH_CHECK_VALUE(b[i] <= b[i + 1], op, ": bounds must not decrease, got ", b[i], " then ", b[i + 1]);
    TORCH_CHECK_VALUE(chunk_size >= 1 && chunk_size <= SSD_MAX_CHUNK, op, ": chunk_size must be in [1, ",
                      SSD_MAX_CHUNK, "], got ", chunk_size);
    ssd_prefill_f32(&layer, &rows, state.data_ptr<float>(), slots.data_ptr<int64_t>(), b,
                    (const uint8_t *)has_initial_state.data_ptr<bool>(), (int)num_seqs, (int)chunk_size,
                    at::get_num_threads());
    return out;
}

}  // namespace

/* ssd_decode as a step program's node (registered by ops.cpp): out [tokens, num_heads * head_dim] given; the
   slots' values are checked before every run (ops.cpp's check_node_indices) */
StepNode ssd_decode_node(const Tensor &x, const Tensor &dt, const Tensor &B, const Tensor &C, const Tensor &A,
                         const Tensor &D, const Tensor &dt_bias, const Tensor &state, const Tensor &slots,
                         double dt_min, double dt_max, const Tensor &out) {
    const char *op = "ssd_decode";
    const SsdLayer layer = check_layer(state, B, A, D, dt_bias, dt_min, dt_max, op);
    const int64_t tokens = x.dim() == 2 ? x.size(0) : -1, inner = (int64_t)layer.num_heads * layer.head_dim;
    check_rows(x, tokens, inner, op, "x");
    check_rows(dt, tokens, layer.num_heads, op, "dt");
    check_rows(B, tokens, (int64_t)layer.num_groups * layer.state_size, op, "B");
    check_rows(C, tokens, (int64_t)layer.num_groups * layer.state_size, op, "C");
    check_rows(out, tokens, inner, op, "out");
    check_vector(slots, at::kLong, tokens, op, "slots");
    StepNode node{NODE_SSD_DECODE, tokens};
    node.ssd = {layer,
                SsdRows{x.data_ptr<float>(), dt.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>(),
                        out.data_ptr<float>(), x.stride(0), dt.stride(0), B.stride(0), C.stride(0), out.stride(0)},
                state.data_ptr<float>(), slots.data_ptr<int64_t>(), state.size(0)};
    return node;
}

// the schemas of ssd_decode / ssd_prefill are in ops.cpp's TORCH_LIBRARY, beside every other op's: the
// step node of ssd_decode is checked against its schema there, which must be declared first

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
    m.impl("ssd_decode", &ssd_decode);
    m.impl("ssd_prefill", &ssd_prefill);
}
