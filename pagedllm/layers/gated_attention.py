"""Self-attention with an output gate (Qwen3-Next, Qwen3.5: their full-attention layers).

The checkpoint's ``q_proj`` is twice as wide as the heads: per head, its
query rows then as many gate rows. The attention output of each head is
multiplied by ``sigmoid(gate)`` before ``o_proj``. Here the gate rows sit at
the end of the fused projection, ``qkv_proj`` = ``[q | k | v | gate]``, so q,
k and v are where ``SelfAttention`` reads them (its q/k norms and RoPE run
unchanged); ``split_gated_queries`` de-interleaves the checkpoint's rows
into ``q_proj`` and ``attn_gate`` as the weights stream in, and
``gated_fused_map`` says where each goes. Under tensor parallelism a rank
holds its query heads' query and gate rows and its KV heads' k and v rows
(the gate multiplies its own heads' outputs, before the row-parallel
``o_proj``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedllm.distributed.shard_plan import ShardPlan
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.linear import Linear
from pagedllm.layers.parallel import TensorParallelGroup
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.self_attention import AttentionSpec, CosSin, SelfAttention
from pagedllm.layers.weights import FusedMap


class GatedSelfAttention(SelfAttention):
    """``SelfAttention`` whose output is gated per head by ``sigmoid`` of a second query-sized projection."""

    def __init__(
        self, spec: AttentionSpec, backend: AttentionBackend, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__(spec, backend, tp, quant_config, prefix)
        self.qkv_proj = Linear(spec.hidden_size, 2 * self.q_size + 2 * self.kv_size, spec.qkv_bias, quant_config,
                               f"{prefix}.qkv_proj")

    def forward(
        self, cos_sin: CosSin | None, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> the gated attention output ``[num_tokens, hidden]``."""
        qkv = self.qkv_proj(x)  # [num_tokens, q | k | v | gate]
        gate = qkv[:, self.q_size + 2 * self.kv_size :]
        v = qkv[:, self.q_size + self.kv_size : self.q_size + 2 * self.kv_size].view(-1, self.num_kv_heads,
                                                                                      self.head_dim)
        q, k = self.qk_norm_rope(qkv, cos_sin)
        q, k = self.kv_transform.encode(q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                   sliding_window=self.sliding_window, softcap=self.softcap, sinks=self.sinks)
        return self.o_proj(out.flatten(1) * torch.sigmoid(gate))


def gated_fused_map(q_size: int, kv_size: int, plan: ShardPlan | None = None) -> FusedMap:
    """Where q, k, v and the gate rows go in ``qkv_proj`` (sizes: this process's); ``plan``: a tensor-parallel
    rank's first rows of each (its query heads' of q and the gate, its KV heads' of k and v); None: whole tensors."""
    q_start = kv_start = None
    if plan is not None and plan.size > 1:
        q_start, kv_start = plan.q_rows[0], plan.kv_rows[0]
    return {
        "q_proj": ("qkv_proj", 0, q_size, q_start),
        "k_proj": ("qkv_proj", q_size, kv_size, kv_start),
        "v_proj": ("qkv_proj", q_size + kv_size, kv_size, kv_start),
        "attn_gate": ("qkv_proj", q_size + 2 * kv_size, q_size, q_start),
    }


def split_gated_queries(
    weights: Iterable[tuple[str, torch.Tensor]], head_dim: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each ``self_attn.q_proj`` tensor (rows: per head, ``head_dim`` query rows then ``head_dim`` gate rows) as
    ``self_attn.q_proj`` (the query rows) and ``self_attn.attn_gate`` (the gate rows); others pass through."""
    for name, tensor in weights:
        owner, _, param = name.rpartition(".")
        if not owner.endswith("self_attn.q_proj"):
            yield name, tensor
            continue
        if tensor.shape[0] % (2 * head_dim):
            raise ValueError(f"{name}: {tensor.shape[0]} rows are not whole (query, gate) heads of {head_dim}")
        heads = tensor.reshape(-1, 2, head_dim, *tensor.shape[1:])
        module = owner.removesuffix(".q_proj")
        yield f"{module}.q_proj.{param}", heads[:, 0].reshape(-1, *tensor.shape[1:])
        yield f"{module}.attn_gate.{param}", heads[:, 1].reshape(-1, *tensor.shape[1:])
