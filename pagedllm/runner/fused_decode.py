"""Decode steps in one native call (``kernels/decode_step.c``).

A decode step of SmolLM2-135M runs 30 layers; layer by layer from Python
each is about 20 small ops and 5 kernel calls, and their dispatch costs
more than the elementwise work itself: ~10% of the throughput workload's
time with bf16 panels, more with few sequences and int8 weights.
``FusedDecode`` hands the whole decoder to one C function instead: the
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

Other steps (prefills, mixed steps) take the layer-by-layer path. Tests
compare the two.

The C side reads raw pointers to the model's weights, the RoPE tables and
the KV cache, collected once here into ``ctypes`` structures that mirror
the C ones; this object keeps the tensors they point into alive.
"""

from __future__ import annotations

import ctypes

import torch

from pagedllm.kernels import KV_TYPE_CODES, load_kernels
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.int8_linear import SMALL_BATCH_ROWS, Int8LinearMethod
from pagedllm.layers.linear import Linear
from pagedllm.layers.packed_linear import PackedBF16LinearMethod, PackedLinearMethod, panel_width
from pagedllm.models.llama import LlamaForCausalLM

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

# the kernel's numbering of linear-layer kinds (decode_step.c, LINEAR_*), and the
# largest decode step each kind takes (None: any)
_LINEAR_KINDS: dict[type, tuple[int, int | None]] = {
    Int8LinearMethod: (0, SMALL_BATCH_ROWS),
    PackedLinearMethod: (1, None),
    PackedBF16LinearMethod: (2, None),
}
_CACHE_CODES = {getattr(torch, name): code for name, code in KV_TYPE_CODES.items()}


class _Linear(ctypes.Structure):
    _fields_ = [("weight", _ptr), ("scales", _ptr), ("bias", _ptr)]


class _DecodeLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("k_cache", _ptr), ("v_cache", _ptr),
    ]


class _DecodeModel(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64), ("hidden_size", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
        ("head_dim", _i64), ("intermediate_size", _i64), ("num_slots", _i64), ("max_position", _i64),
        ("block_size", _i64), ("linear_kind", _i64), ("kv_type", _i64), ("norm_eps", _f32), ("scale", _f32),
        ("final_norm", _ptr), ("cos", _ptr), ("sin", _ptr), ("layers", ctypes.POINTER(_DecodeLayer)),
    ]


class FusedDecode:
    """The decoder of a ``LlamaForCausalLM`` for decode steps, in one native call.

    Args:
        model: the model; every linear layer of its decoder with an
            ``Int8LinearMethod``, a ``PackedLinearMethod`` or a ``PackedBF16LinearMethod``, all of one kind.
        kv_caches: per layer (K, V) caches ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            float32, float16 or bfloat16.
        block_size: tokens per KV block.
    """

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """Whether the C decoder implements ``model``: a ``LlamaForCausalLM`` with full attention in every layer.

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
        lib = load_kernels()
        if lib is None:
            raise ValueError("the fused decode step needs the native CPU kernels")
        self._kernel = lib.decode_step
        cfg = model.config
        self.model = model
        # the tensors the C structures point into; held so they outlive the pointers
        self._tensors: list[torch.Tensor] = []

        def keep(t: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> int | None:
            if t is None:
                return None
            if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"the fused decode step needs contiguous {dtype} CPU tensors, got {t.dtype}")
            self._tensors.append(t)
            return t.data_ptr()

        layers = model.model.layers
        kind = type(getattr(layers[0].self_attn.qkv_proj, "quant_method", None))
        if kind not in _LINEAR_KINDS:
            raise ValueError(f"the fused decode step runs int8 or packed linear layers, got {kind.__name__}")
        self.linear_kind, self.max_rows = _LINEAR_KINDS[kind]

        def linear(layer: torch.nn.Module, in_features: int, out_features: int) -> _Linear:
            # the kernel trusts these buffers' sizes: a layer of another shape or panel width
            # (packed on another CPU) is refused here, as the layer-by-layer kernels refuse it
            if not isinstance(layer, Linear) or type(layer.quant_method) is not kind:
                got = type(layer.quant_method).__name__ if isinstance(layer, Linear) else type(layer).__name__
                raise ValueError(f"the fused decode step needs linear layers of one kind, got {kind.__name__} "
                                 f"and {got}")
            if (layer.in_features, layer.out_features) != (in_features, out_features):
                raise ValueError(f"a {in_features} -> {out_features} layer of the model is "
                                 f"{layer.in_features} -> {layer.out_features}")
            if layer.bias is not None and layer.bias.shape != (out_features,):
                raise ValueError(f"bias of shape {tuple(layer.bias.shape)} for {out_features} outputs")
            if kind is Int8LinearMethod:
                if layer.qweight.shape != (out_features, in_features) or layer.scales.shape != (out_features,):
                    raise ValueError(f"int8 weight {tuple(layer.qweight.shape)} does not fit {out_features}x{in_features}")
                return _Linear(keep(layer.qweight, torch.int8), keep(layer.scales), keep(layer.bias))
            if kind is PackedLinearMethod:
                dtype = torch.float32
                panel = panel_width(dtype)
                fits = layer.packed_weight.shape[1:] == (in_features, panel)
            else:
                dtype = torch.bfloat16
                panel = panel_width(dtype)
                fits = layer.packed_weight.shape[1:] == ((in_features + 1) // 2, panel, 2)
            if not fits or layer.packed_weight.shape[0] * panel < out_features:
                raise ValueError(f"packed weight {tuple(layer.packed_weight.shape)} does not fit "
                                 f"{out_features}x{in_features} in this build's {panel}-column panels")
            return _Linear(keep(layer.packed_weight, dtype), None, keep(layer.bias))

        if cfg.num_attention_heads % cfg.num_key_value_heads or cfg.head_dim % 2:
            raise ValueError("the fused decode step needs whole query-head groups and an even head_dim")
        cache_dtype = kv_caches[0][0].dtype
        if cache_dtype not in _CACHE_CODES:
            raise ValueError(f"the fused decode step reads float32, float16 or bfloat16 caches, got {cache_dtype}")

        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self._layers = (_DecodeLayer * len(layers))()
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=True)):
            attn = layer.self_attn
            if k_cache.shape != v_cache.shape or k_cache.shape[1:] != (block_size, cfg.num_key_value_heads, cfg.head_dim):
                raise ValueError(f"layer {i}: KV cache of shape {tuple(k_cache.shape)} does not fit the model")
            self._layers[i] = _DecodeLayer(
                keep(layer.input_layernorm.weight.data), keep(layer.post_attention_layernorm.weight.data),
                keep(attn.q_norm.weight.data if attn.q_norm is not None else None),
                keep(attn.k_norm.weight.data if attn.k_norm is not None else None),
                linear(attn.qkv_proj, hidden, q_size + 2 * kv_size), linear(attn.o_proj, q_size, hidden),
                linear(layer.mlp.gate_up_proj, hidden, 2 * inter), linear(layer.mlp.down_proj, inter, hidden),
                keep(k_cache, cache_dtype), keep(v_cache, cache_dtype),
            )
        rotary = model.model.rotary
        # the C side holds raw pointers into these tables: rebuilding them
        # (RotaryEmbedding.build_tables) afterwards needs a new FusedDecode
        self._rope_tables = (rotary.cos, rotary.sin)
        num_blocks = kv_caches[0][0].shape[0]
        self._model = _DecodeModel(
            len(layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, num_blocks * block_size, rotary.cos.shape[0], block_size,
            self.linear_kind, _CACHE_CODES[cache_dtype],
            cfg.rms_norm_eps, layers[0].self_attn.scale,
            keep(model.model.norm.weight.data), keep(rotary.cos), keep(rotary.sin), self._layers,
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
        num_tokens = input_ids.shape[0]
        if positions.dtype != torch.int64 or meta.slot_mapping.dtype != torch.int64:
            raise ValueError("positions and the slot mapping must be int64")
        # the kernel reads one position, slot, length and block-table row per token
        if (
            input_ids.dim() != 1 or positions.shape != (num_tokens,) or meta.slot_mapping.shape != (num_tokens,)
            or meta.seq_lens_tensor.shape != (num_tokens,) or meta.seq_lens_tensor.dtype != torch.int64
            or meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != num_tokens
            or meta.block_tables.dtype != torch.int64
        ):
            raise ValueError(
                f"fused decode step: {num_tokens} tokens need as many positions, slots and sequence lengths "
                "(int64) and block-table rows"
            )
        rotary = self.model.model.rotary
        if rotary.cos is not self._rope_tables[0] or rotary.sin is not self._rope_tables[1]:
            raise ValueError("the model's RoPE tables were rebuilt after the fused decode step was set up")
        x = self.model.model.embed_tokens(input_ids).contiguous()  # [num_tokens, hidden], the residual stream
        out = torch.empty_like(x)  # [num_tokens, hidden]
        tables, seq_lens = meta.block_tables.contiguous(), meta.seq_lens_tensor.contiguous()
        positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        status = self._kernel(
            ctypes.byref(self._model), x.data_ptr(), x.shape[0], positions.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), torch.get_num_threads(),
        )
        if status == 1:
            raise MemoryError("fused decode step: out of memory for its scratch buffers")
        if status == 2:
            raise ValueError(
                "fused decode step: inconsistent addressing (a position outside the RoPE table or the cache, "
                "a sequence length other than position + 1, or a slot that is not the position's place in "
                "the block table)"
            )
        if status:
            raise ValueError("fused decode step: the kernel does not know this linear kind or cache dtype")
        return out
