"""The Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3.

They differ in four switches read from ``ModelArchConfig``: q/k/v biases
(Qwen2), a per-head RMSNorm on q and k (Qwen3), tied embeddings and a
per-layer sliding window (Mistral, Qwen2/Qwen3 with ``use_sliding_window``). Tokens of
all sequences in a step are flattened into one batch ``[num_tokens, hidden]``;
only attention needs to know where one sequence ends, and it learns that from
``AttentionMetadata``.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are
stored fused (``qkv_proj``, ``gate_up_proj``) so each is one matmul;
``load_weights`` writes the separate checkpoint tensors into their slices.

The file says what each layer computes (RMSNorm, q/k norm and RoPE, SiLU
and multiply, paged attention); which kernels run them is the layers'
choice (``layers/custom_op.py``), made once when the runner hands the
loaded model its native ops.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.custom_op import NativeOpsMixin
from pagedllm.layers.kv_transform import KvTransform
from pagedllm.layers.linear import Linear
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
from pagedllm.layers.weights import FusedMap, fused_projections, load_hf_weights
from pagedllm.loader.model_config import ModelArchConfig


class Attention(nn.Module):
    """Self-attention of one layer: fused qkv, q/k norms (Qwen3) and RoPE, paged attention, output projection."""

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, layer: int = 0, tp: TensorParallelGroup | None = None,
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
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, False, tp, q_start, quant_config, f"{prefix}.o_proj")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend
        self.scale = self.head_dim**-0.5
        self.sliding_window = cfg.sliding_window(layer)  # None: full attention
        self.qk_norm_rope = QKNormRotary(self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm, self.k_norm)
        # an int4 cache's change of variables for K (layers/kv_transform.py), fitted by the runner
        self.kv_transform = KvTransform(self.num_kv_heads, self.head_dim, shift_keys=True)

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> attention output ``[num_tokens, hidden]``."""
        qkv = self.qkv_proj(x)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.qk_norm_rope(qkv, cos_sin)
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        q, k = self.kv_transform.encode(q, k)  # the identity unless an int4 cache fitted it
        out = self.backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, sliding_window=self.sliding_window
        )
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate and up as one matmul."""

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
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, layer: int = 0, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, layer, tp, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp, quant_config, f"{prefix}.mlp")

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One layer over the residual stream ``x`` ``[num_tokens, hidden]``, updated in place and returned."""
        # x += attn(...), x += mlp(...) in place: no new residual tensor per layer
        attn_out = self.self_attn(cos_sin, self.input_layernorm(x), kv_cache, meta)
        h = self.post_attention_layernorm.add_forward(x, attn_out)
        return x.add_(self.mlp(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and the RoPE table (Hugging Face's ``model.*`` names)."""

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None, prefix: str = "model",
    ) -> None:
        super().__init__()
        vocab_start, vocab_rows = tp.plan.vocab if tp is not None else (0, cfg.vocab_size)
        self.embed_tokens = VocabParallelEmbedding(vocab_rows, cfg.hidden_size, tp, vocab_start, quant_config,
                                                   f"{prefix}.embed_tokens")
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i, tp, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary


class LlamaForCausalLM(NativeOpsMixin, nn.Module):
    """Decoder plus LM head; ``forward`` returns hidden states, ``compute_logits`` the logits.

    ``cfg`` is the shape this process holds: with ``tp`` (tensor
    parallelism) a rank's head counts and intermediate size
    (``ShardPlan.local_config``), and ``tp.plan`` says which slices they are.
    ``use_native_ops`` (``NativeOpsMixin``) switches its layers between
    native and torch implementations.
    """

    def __init__(
        self, cfg: ModelArchConfig, backend: AttentionBackend, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, backend, tp, quant_config)
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
        cos_sin = self.model.rotary.cos_sin(positions, x.dtype)  # looked up once for all layers
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(cos_sin, x, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits ``[n, vocab]`` in float32, for the rows that sample only (None on tensor-parallel ranks but 0)."""
        return self.lm_head.gather(self.lm_head(hidden).float())

    # --- weights -------------------------------------------------------------
    @staticmethod
    def checkpoint_fused_map(cfg: ModelArchConfig, tp: TensorParallelGroup | None) -> FusedMap:
        """Where a checkpoint's separate q/k/v and gate/up tensors go in the fused parameters of the model of
        shape ``cfg`` (a rank's, with ``tp``): known before the model is built."""
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        return fused_projections(q_size, kv_size, cfg.intermediate_size, tp.plan if tp else None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters."""
        load_hf_weights(self, weights, self.checkpoint_fused_map(self.config, self.tp), self.config.tie_word_embeddings)
