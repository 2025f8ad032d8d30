/*
 * The fused decode step's model (decode_step.cpp) as a torch custom class,
 * pagedllm.FusedDecoder, and the decode_step op that runs it. Part of
 * ops.cpp (included once, there, after its helpers): only that file sees
 * torch's headers.
 *
 * The holder is built once per model and KV cache (runner/fused_decode.py):
 * every weight, norm, RoPE table and cache tensor is checked here, once,
 * against the model's dimensions and this build's panel widths, and kept
 * alive by the holder for as long as the DecodeModel's raw pointers into
 * them are used. A step then checks only its own inputs.
 *
 * Arguments: tensors = [final_norm, cos, sin] then per layer, in order,
 *   input_norm, post_norm, q_norm, k_norm,
 *   (weight, scales, bias) of qkv, o, gate_up and down,
 *   k_cache, v_cache
 * (None where a layer has no such tensor: q/k norms but in Qwen3, scales
 * but for int8, biases); dims = [hidden, num_heads, num_kv_heads, head_dim,
 * intermediate_size, linear_kind (LINEAR_*)]; floats = [norm_eps, scale].
 */
#include <memory>

namespace {

constexpr int64_t kGlobalTensors = 3, kLayerTensors = 18;

struct FusedDecoder : torch::CustomClassHolder {
    std::vector<OptTensor> tensors; /* what the pointers below point into, held */
    std::vector<DecodeLayer> layers;
    DecodeModel model{};

    FusedDecoder(std::vector<OptTensor> ts, std::vector<int64_t> dims, std::vector<double> floats)
        : tensors(std::move(ts)) {
        TORCH_CHECK_VALUE(dims.size() == 6 && floats.size() == 2, "FusedDecoder: expected 6 dims and 2 floats");
        const int64_t num_layers = ((int64_t)tensors.size() - kGlobalTensors) / kLayerTensors;
        TORCH_CHECK_VALUE(num_layers >= 1 && (int64_t)tensors.size() == kGlobalTensors + num_layers * kLayerTensors,
                          "FusedDecoder: expected 3 + 18 per layer tensors, got ", tensors.size());
        DecodeModel &m = model;
        m.num_layers = num_layers;
        m.hidden_size = dims[0], m.num_heads = dims[1], m.num_kv_heads = dims[2], m.head_dim = dims[3];
        m.intermediate_size = dims[4], m.linear_kind = dims[5];
        m.norm_eps = (float)floats[0], m.scale = (float)floats[1];
        TORCH_CHECK_VALUE(m.hidden_size > 0 && m.intermediate_size > 0 && m.num_kv_heads > 0 &&
                              m.num_heads % m.num_kv_heads == 0 && m.head_dim > 0 && m.head_dim % 2 == 0,
                          "the fused decode step needs whole query-head groups and an even head_dim");
        TORCH_CHECK_VALUE(m.linear_kind == LINEAR_INT8 || m.linear_kind == LINEAR_F32_PANELS ||
                              m.linear_kind == LINEAR_BF16_PANELS,
                          "FusedDecoder: unknown linear kind ", m.linear_kind);
        m.final_norm = vector_of(0, m.hidden_size, "the final norm");
        const Tensor &cos = required(1, "the RoPE cos table");
        check_tensor(cos, at::kFloat, {cos.size(0), m.head_dim}, "fused decode step", "the RoPE cos table");
        check_tensor(required(2, "the RoPE sin table"), at::kFloat, cos.sizes(), "fused decode step",
                     "the RoPE sin table");
        m.cos = cos.data_ptr<float>(), m.sin = tensors[2]->data_ptr<float>(), m.max_position = cos.size(0);
        layers.resize((size_t)num_layers);
        for (int64_t i = 0; i < num_layers; i++) layers[(size_t)i] = layer(i);
        m.layers = layers.data();
    }

    const Tensor &required(int64_t i, const char *what) const {
        TORCH_CHECK_VALUE(tensors[(size_t)i].has_value(), "FusedDecoder: ", what, " is missing");
        return *tensors[(size_t)i];
    }

    const float *vector_of(int64_t i, int64_t n, const char *what) const {
        check_tensor(required(i, what), at::kFloat, {n}, "fused decode step", what);
        return tensors[(size_t)i]->data_ptr<float>();
    }

    /* weight, scales, bias at tensors[i..i+2] of an in_features -> out_features layer of this model's kind */
    StepLinear linear(int64_t i, int64_t in_features, int64_t out_features) const {
        const char *op = "fused decode step";
        const Tensor &w = required(i, "a linear weight");
        const OptTensor &scales = tensors[(size_t)i + 1], &bias = tensors[(size_t)i + 2];
        check_optional(bias, at::kFloat, {out_features}, op, "a bias");
        StepLinear l{w.data_ptr(), nullptr, ptr_or_null<float>(bias)};
        if (model.linear_kind == LINEAR_INT8) {
            TORCH_CHECK_VALUE(w.sizes() == at::IntArrayRef({out_features, in_features}) && scales.has_value() &&
                                  scales->sizes() == at::IntArrayRef{out_features},
                              "int8 weight ", shape_of(w), " does not fit ", out_features, "x", in_features);
            check_tensor(w, at::kChar, w.sizes(), op, "an int8 weight");
            check_tensor(*scales, at::kFloat, {out_features}, op, "int8 scales");
            l.scales = scales->data_ptr<float>();
            return l;
        }
        const bool f32 = model.linear_kind == LINEAR_F32_PANELS;
        const int64_t panel = f32 ? PANEL : BF_PANEL;
        const bool fits = f32 ? w.dim() == 3 && w.size(1) == in_features && w.size(2) == PANEL
                              : w.dim() == 4 && w.size(1) == (in_features + 1) / 2 && w.size(2) == BF_PANEL &&
                                    w.size(3) == 2;
        TORCH_CHECK_VALUE(fits && w.size(0) * panel >= out_features, "packed weight ", shape_of(w), " does not fit ",
                          out_features, "x", in_features, " in this build's ", panel, "-column panels");
        check_tensor(w, f32 ? at::kFloat : at::kBFloat16, w.sizes(), op, "a packed weight");
        return l;
    }

    /* layer i's norms, linears and caches, checked */
    DecodeLayer layer(int64_t i) {
        const int64_t base = kGlobalTensors + i * kLayerTensors, hidden = model.hidden_size, hd = model.head_dim;
        const int64_t q_size = model.num_heads * hd, kv_size = model.num_kv_heads * hd;
        DecodeLayer L{};
        L.input_norm = vector_of(base, hidden, "an input norm");
        L.post_norm = vector_of(base + 1, hidden, "a post-attention norm");
        TORCH_CHECK_VALUE(tensors[(size_t)base + 2].has_value() == tensors[(size_t)base + 3].has_value(),
                          "the fused decode step needs both q and k norms, or neither");
        if (tensors[(size_t)base + 2].has_value()) {
            L.q_norm = vector_of(base + 2, hd, "a q norm");
            L.k_norm = vector_of(base + 3, hd, "a k norm");
        }
        L.qkv = linear(base + 4, hidden, q_size + 2 * kv_size);
        L.o = linear(base + 7, q_size, hidden);
        L.gate_up = linear(base + 10, hidden, 2 * model.intermediate_size);
        L.down = linear(base + 13, model.intermediate_size, hidden);
        const Tensor &k_cache = required(base + 16, "a K cache"), &v_cache = required(base + 17, "a V cache");
        const int kv_type = check_caches(k_cache, v_cache, "the fused decode step");
        TORCH_CHECK_VALUE(k_cache.size(2) == model.num_kv_heads && k_cache.size(3) == hd, "layer ", i,
                          ": KV cache of shape ", shape_of(k_cache), " does not fit the model");
        if (i == 0) {
            model.kv_type = kv_type, model.block_size = k_cache.size(1);
            model.num_slots = k_cache.size(0) * k_cache.size(1);
        }
        TORCH_CHECK_VALUE(kv_type == model.kv_type && k_cache.size(1) == model.block_size &&
                              k_cache.size(0) * k_cache.size(1) == model.num_slots,
                          "layer ", i, ": every layer's KV cache must be of one dtype and shape");
        L.k_cache = k_cache.data_ptr(), L.v_cache = v_cache.data_ptr();
        return L;
    }
};

/* one decode step: x [num_tokens, hidden] (the embedded tokens, the residual stream, updated in place) ->
   the final hidden states [num_tokens, hidden] */
Tensor decode_step_op(const c10::intrusive_ptr<FusedDecoder> &decoder, const Tensor &x, const Tensor &positions,
                      const Tensor &slots, const Tensor &block_tables, const Tensor &seq_lens) {
    const DecodeModel &m = decoder->model;
    check_f32_rows(x, m.hidden_size, "fused decode step", "x");
    const int64_t n = x.size(0);
    const bool fits = block_tables.dim() == 2 && block_tables.size(0) == n && block_tables.stride(1) == 1 &&
                      block_tables.scalar_type() == at::kLong && block_tables.device().is_cpu();
    for (const Tensor *t : {&positions, &slots, &seq_lens}) {
        TORCH_CHECK_VALUE(fits && t->sizes() == at::IntArrayRef{n} && t->scalar_type() == at::kLong &&
                              t->is_contiguous() && t->device().is_cpu(),
                          "fused decode step: ", n, " tokens need as many positions, slots and sequence lengths, ",
                          "all int64, and as many int64 block-table rows");
    }
    Tensor out = at::empty_like(x);  // [num_tokens, hidden]
    const int status = decode_step(&m, x.data_ptr<float>(), n, positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                                   block_tables.data_ptr<int64_t>(), block_tables.stride(0),
                                   seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(), num_threads());
    if (status == 1) out_of_memory("fused decode step");
    TORCH_CHECK_VALUE(status != 2,
                      "fused decode step: inconsistent addressing (a position outside the RoPE table or the cache, "
                      "a sequence length other than position + 1, or a slot that is not the position's place in "
                      "the block table)");
    TORCH_CHECK_VALUE(status == 0, "fused decode step: the kernel does not know this linear kind or cache dtype");
    return out;
}

}  // namespace
