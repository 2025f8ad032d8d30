"""Gemma 3, text only (transformers' ``Gemma3ForCausalLM``, model_type ``gemma3_text``).

Where it differs from the Llama family, each as transformers computes it:

- embeddings are multiplied by ``sqrt(hidden_size)``, that factor rounded
  to the model's dtype first (``embed_scale``, a buffer: ``model.to(dtype)``
  rounds it with the weights);
- every RMSNorm is Gemma's: ``rms_norm(x) * (1 + weight)`` in float32;
- four norms per layer: before and after attention, before and after the MLP,
  the "after" ones applied to the branch before it joins the residual;
- q and k are RMS-normed per head before RoPE;
- the MLP gate is GELU (tanh approximation), not SiLU;
- attention scales scores by ``query_pre_attn_scalar ** -0.5``; the logits
  are capped by ``final_logit_softcapping``. Scores would be capped by
  ``cfg.attn_logit_softcapping``, but the loader reads Gemma 3's as None:
  transformers' Gemma 3 keeps that value and never applies it;
- sliding-window layers ("sliding_attention") use their own RoPE base
  (``local_rope_theta``), global layers ``rope_theta`` with its scaling;
- the LM head is usually tied to the embedding.

Tokens of all sequences in a step are one flat batch, as in ``llama.py``;
q/k/v and gate/up are stored fused and loaded by HF name. The layers choose
their kernels (``layers/custom_op.py``): with native ops (float32 on the
CPU) the norms run the native RMSNorm with ``1 + w`` made once, and q/k
norms and RoPE are one in-place pass over qkv (``QKNormRotary``), as in
``llama.py``; GELU stays torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.activation import GeluAndMul
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.custom_op import NativeOpsMixin
from pagedllm.layers.kv_transform import KvTransform
from pagedllm.layers.linear import Linear
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    TensorParallelGroup,
    VocabParallelEmbedding,
)
from pagedllm.layers.qk_rotary import QKNormRotary
from pagedllm.layers.quant_config import QuantConfig
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.weights import fused_projections, load_hf_weights
from pagedllm.loader.model_config import GELU_APPROXIMATIONS, ModelArchConfig

CosSin = tuple[torch.Tensor, torch.Tensor]


class Gemma3Attention(nn.Module):
    """Self-attention of one layer: per-head q/k norms, RoPE, the layer's window and softcap."""

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, layer: int, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, quant_config,
                               f"{prefix}.qkv_proj")
        q_start = tp.plan.q_rows[0] if tp is not None else 0
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.attention_bias, tp, q_start, quant_config,
                                        f"{prefix}.o_proj")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.backend = backend
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else self.head_dim**-0.5
        self.sliding_window = cfg.sliding_window(layer)  # None: full attention
        self.softcap = cfg.attn_logit_softcapping
        self.qk_norm_rope = QKNormRotary(self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm, self.k_norm)
        # an int4 cache's change of variables for K (layers/kv_transform.py), fitted by the runner
        self.kv_transform = KvTransform(self.num_kv_heads, self.head_dim, shift_keys=self.softcap is None)

    @property
    def native(self) -> NativeOps | None:
        """The native ops q/k norms and RoPE run through (None: torch), as ``qk_norm_rope`` chose them.

        Read only, for callers that inspect which path a layer takes
        (``tests/models/test_gemma3_sliding_window.py``).
        """
        return self.qk_norm_rope.native

    def forward(
        self, cos_sin: CosSin, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> attention output ``[num_tokens, hidden]``."""
        qkv = self.qkv_proj(x)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.qk_norm_rope(qkv, cos_sin)  # per-head norms (1 + w), then RoPE
        q, k = self.kv_transform.encode(q, k)  # the identity unless an int4 cache fitted it
        out = self.backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
            sliding_window=self.sliding_window, softcap=self.softcap,
        )  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.flatten(1))


class Gemma3MLP(nn.Module):
    """``down(gelu(gate(x)) * up(x))``, gate and up as one matmul."""

    def __init__(
        self, cfg: ModelArchConfig, tp: TensorParallelGroup | None = None, quant_config: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, quant_config,
                                   f"{prefix}.gate_up_proj")
        start = tp.plan.intermediate[0] if tp is not None else 0
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp, start, quant_config,
                                           f"{prefix}.down_proj")
        self.act_fn = GeluAndMul(GELU_APPROXIMATIONS[cfg.hidden_act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    """Attention and MLP, each between a pre-norm and a post-norm, each added to the residual."""

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, layer: int, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.is_sliding = bool(cfg.layer_types) and cfg.layer_types[layer] == "sliding_attention"
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)
        self.self_attn = Gemma3Attention(cfg, backend, layer, tp, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)
        self.mlp = Gemma3MLP(cfg, tp, quant_config, f"{prefix}.mlp")
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)

    def forward(
        self, cos_sin: CosSin, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """One layer over the residual stream ``x`` ``[num_tokens, hidden]``, updated in place."""
        attn_out = self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta)
        x.add_(self.post_attention_layernorm(attn_out))
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x))
        return x.add_(self.post_feedforward_layernorm(mlp_out))


class Gemma3Rotary(nn.Module):
    """The two RoPE tables of Gemma 3: ``full`` for global layers, ``local`` for sliding ones.

    Offers ``build_tables`` as ``RotaryEmbedding`` does, so the runner
    rebuilds both after moving the model.
    """

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        max_pos = cfg.max_position_embeddings
        self.full = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        local_theta = cfg.local_rope_theta if cfg.local_rope_theta is not None else cfg.rope_theta
        self.local = RotaryEmbedding(cfg.head_dim, max_pos, local_theta, cfg.local_rope_scaling)

    def build_tables(self) -> None:
        """Fill both cos/sin tables (again after a model built on the meta device)."""
        self.full.build_tables()
        self.local.build_tables()


class Gemma3Model(nn.Module):
    """Embedding (scaled), decoder layers, final norm and the RoPE tables."""

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None, prefix: str = "model",
    ) -> None:
        super().__init__()
        vocab_start, vocab_rows = tp.plan.vocab if tp is not None else (0, cfg.vocab_size)
        self.embed_tokens = VocabParallelEmbedding(vocab_rows, cfg.hidden_size, tp, vocab_start, quant_config,
                                                   f"{prefix}.embed_tokens")
        # filled by load_weights (a model built on the meta device has no values yet)
        self.register_buffer("embed_scale", torch.empty(()), persistent=False)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, backend, i, tp, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.rotary = Gemma3Rotary(cfg)


class Gemma3ForCausalLM(NativeOpsMixin, nn.Module):
    """Decoder plus LM head; ``forward`` returns hidden states, ``compute_logits`` the (softcapped) logits.

    ``use_native_ops`` (``NativeOpsMixin``) switches its layers between native and torch implementations.
    """

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        if cfg.architecture != "gemma3":
            raise ValueError(f"Gemma3ForCausalLM cannot run a {cfg.architecture!r} model")
        self.config = cfg
        self.tp = tp
        self.model = Gemma3Model(cfg, backend, tp, quant_config)
        vocab_start, vocab_rows = tp.plan.vocab if tp is not None else (0, cfg.vocab_size)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.hidden_size, vocab_rows, tp, vocab_start, quant_config, "lm_head", tied)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Hidden states after the final norm for the step's tokens."""
        x = self.model.embed_tokens(input_ids)
        x = x * self.model.embed_scale.to(x.dtype)
        rotary = self.model.rotary
        # looked up once per step for all layers of each kind
        full, local = rotary.full.cos_sin(positions, x.dtype), rotary.local.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(local if layer.is_sliding else full, x, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[n, vocab]`` in float32, for the rows that sample only; ``cap * tanh(x / cap)`` if capped.

        None on tensor-parallel ranks but 0 (their slices are gathered there).
        """
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return self.lm_head.gather(logits.float())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters; set the embedding scale."""
        cfg = self.config
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        fused = fused_projections(q_size, kv_size, cfg.intermediate_size, self.tp.plan if self.tp else None)
        load_hf_weights(self, weights, fused, cfg.tie_word_embeddings)
        with torch.no_grad():
            self.model.embed_scale.fill_(cfg.hidden_size**0.5)  # as transformers computes it
