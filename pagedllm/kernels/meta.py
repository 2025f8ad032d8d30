"""Fake (meta) implementations of the ``torch.ops.pagedllm`` ops, for tracing.

torch.compile, FakeTensor and meta tensors run these instead of the CPU
kernels: each gives its outputs' shapes and dtypes (new tensors for the ops
that return them, nothing for those that only write into their arguments)
without touching data. Registered once per process, after the library is
loaded (``pagedllm.kernels._load``).
"""

from __future__ import annotations

import functools

import torch

_NS = "pagedllm::"


def _rows_out(x: torch.Tensor, out_features: int) -> torch.Tensor:
    """A new ``[num_rows, out_features]`` tensor like ``x``'s rows."""
    return x.new_empty(x.shape[0], out_features)


def _register_returning() -> None:
    reg = torch.library.register_fake

    @reg(_NS + "add_rms_norm")
    def _(x, delta, weight, eps):  # noqa: ANN001, ANN202
        return torch.empty_like(x)  # [num_tokens, hidden]

    @reg(_NS + "silu_mul")
    def _(gate_up):  # noqa: ANN001, ANN202
        return _rows_out(gate_up, gate_up.shape[1] // 2)  # [num_tokens, inter]

    @reg(_NS + "moe_slot_sum")
    def _(y, weights, shared, gate):  # noqa: ANN001, ANN202
        return y.new_empty(y.shape[0], y.shape[2])  # [num_tokens, hidden]

    @reg(_NS + "gated_rms_norm")
    def _(x, z, weight, eps, tiled_k_heads):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape[0], x.shape[1] * x.shape[2])  # [num_tokens, num_heads * head_dim]

    @reg(_NS + "gguf_linear")
    def _(x, weight, type, in_features, bias):  # noqa: ANN001, ANN202, A002
        return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)  # [num_rows, out_features]

    @reg(_NS + "gguf_moe_linear")
    def _(x, weight, type, num_experts, token_ids, expert_offsets):  # noqa: ANN001, ANN202, A002
        if num_experts < 1 or weight.shape[0] % num_experts:
            raise ValueError(f"gguf_moe_linear: the weight's {weight.shape[0]} rows are not {num_experts} experts")
        # [num_pairs, out_features of one expert]
        return x.new_empty(token_ids.shape[0], weight.shape[0] // num_experts, dtype=torch.float32)

    @reg(_NS + "gguf_embedding")
    def _(table, type, row_len, index):  # noqa: ANN001, ANN202, A002
        return index.new_empty(index.shape[0], row_len, dtype=torch.float32)  # [num_rows, row_len]

    @reg(_NS + "gguf_dequantize")
    def _(weight, type, in_features):  # noqa: ANN001, ANN202, A002
        return weight.new_empty(weight.shape[0], in_features, dtype=torch.float32)  # [rows, in_features]

    @reg(_NS + "gguf_interleave_")
    def _(weight, type, in_features):  # noqa: ANN001, ANN202, A002
        return None  # rewrites weight in place

    @reg(_NS + "quantized_linear")
    def _(x, weight, bits, group_size, in_features, bias, interleaved=False):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)  # [num_rows, out_features]

    @reg(_NS + "quantized_interleave_")
    def _(weight, bits, group_size, in_features):  # noqa: ANN001, ANN202
        return None  # rewrites weight in place

    @reg(_NS + "quantized_embedding")
    def _(table, bits, group_size, row_len, index, interleaved=False):  # noqa: ANN001, ANN202
        return index.new_empty(index.shape[0], row_len, dtype=torch.float32)  # [num_rows, row_len]

    @reg(_NS + "pack_panels")
    def _(weight):  # noqa: ANN001, ANN202
        panel = torch.ops.pagedllm.packed_linear_panel()
        n, k = weight.shape
        return weight.new_empty((n + panel - 1) // panel, k, panel)  # [num_panels, in, panel]

    @reg(_NS + "pack_panels_bf16")
    def _(weight):  # noqa: ANN001, ANN202
        panel = torch.ops.pagedllm.packed_linear_bf16_panel()
        n, k = weight.shape
        # [num_panels, ceil(in / 2), panel, 2]
        return weight.new_empty((n + panel - 1) // panel, (k + 1) // 2, panel, 2, dtype=torch.bfloat16)

    @reg(_NS + "packed_linear")
    def _(x, packed, bias, out_features):  # noqa: ANN001, ANN202
        return _rows_out(x, out_features)  # [num_rows, out_features]

    @reg(_NS + "packed_linear_bf16")
    def _(x, packed, bias, out_features):  # noqa: ANN001, ANN202
        return _rows_out(x, out_features)  # [num_rows, out_features]

    @reg(_NS + "causal_conv1d")
    def _(x, weight, bias, conv_state, query_start_loc, state_slots, has_initial_state, activation):  # noqa: ANN001, ANN202
        return torch.empty_like(x)  # [num_tokens, dim]; conv_state is updated in place

    @reg(_NS + "causal_conv1d_decode")
    def _(x, weight, bias, conv_state, state_slots, silu):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape)  # [num_seqs, dim], contiguous; conv_state is updated in place

    @reg(_NS + "logit_stats")
    def _(logits):  # noqa: ANN001, ANN202
        rows = logits.shape[0]
        return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows)  # argmax [rows], lse [rows]

    @reg(_NS + "moe_route")
    def _(logits, top_k, kind, renormalize, correction_bias, scaling_factor):  # noqa: ANN001, ANN202
        rows = logits.shape[0]  # weights float32 [rows, top_k], ids int64 [rows, top_k]
        return (logits.new_empty(rows, top_k, dtype=torch.float32),
                logits.new_empty(rows, top_k, dtype=torch.int64))

    @reg(_NS + "moe_group")
    def _(ids, num_experts):  # noqa: ANN001, ANN202
        pairs = ids.shape[0] * ids.shape[1]  # order, token_ids, pair_experts [pairs]; counts, offsets
        return (ids.new_empty(pairs), ids.new_empty(pairs, dtype=torch.int32), ids.new_empty(pairs),
                ids.new_empty(num_experts), ids.new_empty(num_experts + 1, dtype=torch.int32))


def _register_in_place() -> None:
    # ops that only write into their (a!) arguments: nothing to make, but
    # FakeTensor needs a kernel to run
    reg = torch.library.register_fake
    reg(_NS + "qk_norm_rope")(lambda x, nq, nkv, hd, cos, sin, qn, kn, eps: None)
    reg(_NS + "row_affine_")(lambda x, mul, add: None)
    reg(_NS + "write_kv")(lambda k, v, k_cache, v_cache, slots: None)
    reg(_NS + "paged_decode")(lambda q, k_cache, v_cache, tables, seq_lens, scale, out, window=0, sinks=None: None)
    reg(_NS + "prefill_attention")(lambda q, k, v, out, bounds, scale, sinks=None: None)
    reg(_NS + "paged_prefill")(lambda q, k_cache, v_cache, tables, bounds, seq_lens, scale, out, sinks=None: None)
    reg(_NS + "gated_delta_decode")(lambda q, k, v, g, beta, state, slots, out, scale, qk_l2norm: None)
    reg(_NS + "gated_delta_prefill")(
        lambda q, k, v, g, beta, state, bounds, slots, has_initial, out, scale, qk_l2norm, chunk_size=64: None)
    reg(_NS + "shm_all_reduce")(lambda x, slots, flags, pids, rank, timeout_s: None)


def _register_ssm() -> None:
    # the Mamba-2 scan (kernels/ssm/ssd_ops.cpp): a new output; the state is updated in place
    reg = torch.library.register_fake

    @reg(_NS + "ssd_decode")
    def _(x, dt, B, C, A, D, dt_bias, state, slots, dt_min=0.0, dt_max=None):  # noqa: ANN001, ANN202, N803
        return x.new_empty(x.shape[0], state.shape[1] * state.shape[2])  # [num_seqs, num_heads * head_dim]

    @reg(_NS + "ssd_prefill")
    def _(x, dt, B, C, A, D, dt_bias, state, slots, bounds, has_initial_state, chunk_size,  # noqa: ANN001, ANN202, N803
          dt_min=0.0, dt_max=None):
        return x.new_empty(x.shape[0], state.shape[1] * state.shape[2])  # [num_tokens, num_heads * head_dim]


@functools.cache
def register_fakes() -> None:
    """Register every op's fake implementation (once per process; the ops must be loaded)."""
    _register_returning()
    _register_in_place()
    _register_ssm()
