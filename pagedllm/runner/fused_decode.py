"""Decode steps in one native op (``kernels/decode_step.cpp``).

A decode step of SmolLM2-135M runs 30 layers; layer by layer from Python
each is about 20 small ops and 5 kernel calls, and their dispatch costs
more than the elementwise work itself: ~10% of the throughput workload's
time with bf16 panels, more with few sequences and int8 weights.
``FusedDecode`` hands the whole decoder to one op instead: the
embedding lookup, the LM head and sampling stay in torch; everything
between runs in one OpenMP region, with the arithmetic of the layer-by-layer
path (the same tile functions, K/V rounding and attention).

The runner uses it for decode-only steps when the attention backend is
``cpu_paged`` and every linear layer of the decoder is one of:

- ``Int8LinearMethod`` (``quantization="int8"``), for steps of at most
  ``SMALL_BATCH_ROWS`` tokens: above that the layer-by-layer path switches
  to a dequantized GEMM, so the two would not compute alike;
- ``PackedLinearMethod`` (float32 panels, the default on the CPU), any number of tokens;
- ``PackedBF16LinearMethod`` (``dtype="bfloat16"`` on the CPU), any number of tokens.

It implements the Llama layer with full attention only (``supports``).

Other steps (prefills, mixed steps) take the layer-by-layer path. Tests
compare the two.

The model's weights, the RoPE tables and the KV cache are handed once to a
``torch.classes.pagedllm.FusedDecoder`` (``kernels/fused_decoder.h``),
which checks them against the model's dimensions and this build's panel
widths and holds them; each step is one ``torch.ops.pagedllm.decode_step``
call on it.
"""

from __future__ import annotations

import torch

from pagedllm.kernels import load_kernels
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.int8_linear import SMALL_BATCH_ROWS, Int8LinearMethod
from pagedllm.layers.linear import Linear
from pagedllm.layers.packed_linear import PackedBF16LinearMethod, PackedLinearMethod
from pagedllm.models.llama import LlamaForCausalLM

# the kernel's numbering of linear-layer kinds (decode_step.h, LINEAR_*), and the
# largest decode step each kind takes (None: any)
_LINEAR_KINDS: dict[type, tuple[int, int | None]] = {
    Int8LinearMethod: (0, SMALL_BATCH_ROWS),
    PackedLinearMethod: (1, None),
    PackedBF16LinearMethod: (2, None),
}


def _linear_tensors(layer: torch.nn.Module, kind: type) -> list[torch.Tensor | None]:
    """(weight, scales, bias) of one linear layer as the FusedDecoder takes them; the class checks their shapes."""
    if not isinstance(layer, Linear) or type(layer.quant_method) is not kind:
        got = type(layer.quant_method).__name__ if isinstance(layer, Linear) else type(layer).__name__
        raise ValueError(f"the fused decode step needs linear layers of one kind, got {kind.__name__} and {got}")
    if kind is Int8LinearMethod:
        return [layer.qweight, layer.scales, layer.bias]
    return [layer.packed_weight, None, layer.bias]


def _layer_tensors(layer: torch.nn.Module, kind: type, caches: tuple[torch.Tensor, torch.Tensor]) -> list:
    """One decoder layer's 18 tensors in the FusedDecoder's order (kernels/fused_decoder.h)."""
    attn, mlp = layer.self_attn, layer.mlp
    q_norm = None if attn.q_norm is None else attn.q_norm.weight.data
    k_norm = None if attn.k_norm is None else attn.k_norm.weight.data
    return [
        layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data, q_norm, k_norm,
        *_linear_tensors(attn.qkv_proj, kind), *_linear_tensors(attn.o_proj, kind),
        *_linear_tensors(mlp.gate_up_proj, kind), *_linear_tensors(mlp.down_proj, kind),
        *caches,
    ]


class FusedDecode:
    """The decoder of a ``LlamaForCausalLM`` for decode steps, in one native op.

    Args:
        model: the model; every linear layer of its decoder with an ``Int8LinearMethod``,
            a ``PackedLinearMethod`` or a ``PackedBF16LinearMethod``, all of one kind.
        kv_caches: per layer (K, V) caches ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            float32, float16 or bfloat16.
        block_size: tokens per KV block.
    """

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Whether the native decoder implements ``model``: a ``LlamaForCausalLM`` with full attention in every layer.

        The kernel has no sliding window (it reads each sequence's whole
        context) and knows the Llama layer only; any other model or a
        windowed layer must take the layer-by-layer path.
        """
        return type(model) is LlamaForCausalLM and not model.config.has_sliding_window

    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int
    ) -> None:
        if not self.supports(model):
            raise ValueError("the fused decode step runs Llama-family models without sliding windows only")
        ops = load_kernels()
        if ops is None:
            raise ValueError("the fused decode step needs the native CPU kernels")
        self._step = ops.decode_step
        cfg = model.config
        self.model = model
        layers = model.model.layers
        kind = type(getattr(layers[0].self_attn.qkv_proj, "quant_method", None))
        if kind not in _LINEAR_KINDS:
            raise ValueError(f"the fused decode step runs int8 or packed linear layers, got {kind.__name__}")
        self.linear_kind, self.max_rows = _LINEAR_KINDS[kind]
        if any(k.shape[1] != block_size for k, _ in kv_caches):
            raise ValueError(f"the fused decode step was given block_size {block_size} and caches of another")
        rotary = model.model.rotary
        # the holder keeps these tables and reads them through raw pointers:
        # rebuilding them (RotaryEmbedding.build_tables) afterwards needs a new FusedDecode
        self._rope_tables = (rotary.cos, rotary.sin)
        tensors = [model.model.norm.weight.data, rotary.cos, rotary.sin]
        for layer, caches in zip(layers, kv_caches, strict=True):
            tensors += _layer_tensors(layer, kind, caches)
        dims = [cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                cfg.intermediate_size, self.linear_kind]
        # checks every tensor (dtype, contiguity, shapes, panel widths) and holds it
        self._decoder = torch.classes.pagedllm.FusedDecoder(
            tensors, dims, [float(cfg.rms_norm_eps), float(layers[0].self_attn.scale)]
        )

    def accepts(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether a step fits: decode tokens only (one per sequence), at most ``max_rows`` of them."""
        return (
            meta.num_prefills == 0 and num_tokens == meta.num_seqs
            and (self.max_rows is None or num_tokens <= self.max_rows)
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]`` (after the last norm), as the model's forward."""
        if not self.accepts(meta, input_ids.shape[0]):
            limit = "" if self.max_rows is None else f" of at most {self.max_rows} sequences"
            raise ValueError(f"the fused decode step takes decode-only steps{limit}")
        if input_ids.dim() != 1:
            raise ValueError(f"fused decode step: input_ids must be [num_tokens], got {tuple(input_ids.shape)}")
        rotary = self.model.model.rotary
        if rotary.cos is not self._rope_tables[0] or rotary.sin is not self._rope_tables[1]:
            raise ValueError("the model's RoPE tables were rebuilt after the fused decode step was set up")
        x = self.model.model.embed_tokens(input_ids).contiguous()  # [num_tokens, hidden], the residual stream
        # the op checks one int64 position, slot, length and block-table row per token, and that
        # they address the cache consistently (ValueError); x is updated in place
        tables, seq_lens = meta.block_tables.contiguous(), meta.seq_lens_tensor.contiguous()
        return self._step(
            self._decoder, x, positions.contiguous(), meta.slot_mapping.contiguous(), tables, seq_lens
        )  # [num_tokens, hidden]
