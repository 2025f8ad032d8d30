"""Gemma 4's self-attention: per-layer head shapes, q/k/v norms, values shared with keys, a cache of one shape.

As transformers' ``Gemma4TextAttention`` computes it, for a layer of ``num_kv_heads`` heads of ``head_dim``::

    q = rope(q_norm(q_proj(x)))            per head, RMSNorm with its weight (float32, then cast)
    k = rope(k_norm(k_proj(x)))
    v = v_norm(v_proj(x))                   per head, RMSNorm without a weight
    (attention_k_eq_v, global layers: no v_proj; v = v_norm(k_proj(x)), k before its norm)
    out = o_proj(softmax(q k^T + mask) v)  scores not scaled (scale 1.0), no softcap

Sliding and global layers differ in ``head_dim`` and kv heads (global
layers have larger heads, e.g. 512 against 256, and may have fewer), but the KV cache has one shape for all layers
(``runner/kv_cache.py``): ``cache_kv_heads`` heads of ``cache_head_dim``.
A layer with fewer, smaller heads fits them exactly: each kv head is
repeated ``cache_kv_heads / num_kv_heads`` times (query head ``h`` still
reads kv head ``h // (num_heads / num_kv_heads)``), and q, k and v are padded
with zeros to ``cache_head_dim`` (zeros add nothing to a score, and the
padded columns of the output are dropped). The cost is cache memory: such a
layer's blocks are as large as the widest layer's.

Under tensor parallelism (``distributed/shard_plan.py``) a rank holds the same
slice of query heads in every layer and the kv heads they read: a sliding
layer's of ``num_key_value_heads``, a global layer's of its own
(``ShardPlan.global_kv_heads``); q, k and v are column-parallel (their rows
come through the model's fused map, ``models/gemma4.py``), o_proj
row-parallel, the per-head norms whole. The KV cache then has this rank's
share of ``cache_kv_heads``, fitted as above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.group import TensorParallelGroup
from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.kv_transform import KvTransform
from pagedllm.layers.linear import Linear
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.parallel import RowParallelLinear
from pagedllm.layers.quantization.quant_config import QuantConfig
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.self_attention import AttentionSpec, CosSin


@dataclass(frozen=True)
class Gemma4AttentionShape:
    """What a Gemma 4 layer's attention adds to ``AttentionSpec``: values shared with keys (no v projection),
    the KV cache's shape per token (kv heads, head size) that the layer's own heads are fitted into, and whether
    it is a global layer (its kv heads its own: which slice a tensor-parallel rank takes)."""

    k_eq_v: bool
    cache_kv_heads: int
    cache_head_dim: int
    global_layer: bool = False


def head_rows(shape: Gemma4AttentionShape, head_dim: int, tp: TensorParallelGroup | None) -> tuple[int, int] | None:
    """The first row of the whole model's q_proj and of its k_proj / v_proj that a tensor-parallel rank's slice
    of a layer of ``shape`` and ``head_dim`` starts at; None in one process."""
    if tp is None or tp.size == 1:
        return None
    plan = tp.plan
    kv_first = plan.global_kv_heads[0] if shape.global_layer and plan.global_kv_heads[1] else plan.kv_heads[0]
    return plan.q_heads[0] * head_dim, kv_first * head_dim


class Gemma4Attention(nn.Module):
    """One Gemma 4 layer's attention (see the module docstring); parameter names are Hugging Face's."""

    def __init__(
        self, spec: AttentionSpec, shape: Gemma4AttentionShape, norm: NormSpec, backend: AttentionBackend,
        quant_config: QuantConfig | None = None, prefix: str = "", tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        if shape.cache_kv_heads % self.num_kv_heads or self.num_heads % shape.cache_kv_heads \
                or shape.cache_head_dim < self.head_dim:
            raise ValueError(f"a layer of {self.num_kv_heads} kv heads of {self.head_dim} does not fit a KV cache of "
                             f"{shape.cache_kv_heads} heads of {shape.cache_head_dim} for {self.num_heads} query heads")
        self.kv_repeat = shape.cache_kv_heads // self.num_kv_heads
        self.pad = shape.cache_head_dim - self.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = spec.qkv_bias
        self.q_proj = Linear(spec.hidden_size, q_size, bias, quant_config, f"{prefix}.q_proj")
        self.k_proj = Linear(spec.hidden_size, kv_size, bias, quant_config, f"{prefix}.k_proj")
        self.v_proj = None if shape.k_eq_v else Linear(spec.hidden_size, kv_size, bias, quant_config,
                                                       f"{prefix}.v_proj")
        rows = head_rows(shape, self.head_dim, tp)
        self.o_proj = RowParallelLinear(q_size, spec.hidden_size, spec.o_bias, tp, rows[0] if rows else 0,
                                        quant_config, f"{prefix}.o_proj")
        self.q_norm = norm.build(self.head_dim)
        self.k_norm = norm.build(self.head_dim)
        self.eps = norm.eps
        self.backend = backend
        self.scale = spec.scale if spec.scale is not None else 1.0
        self.sliding_window = spec.sliding_window
        self.rope = spec.rope
        # an int4 cache's change of variables for K (layers/kv_transform.py), over the cache's heads
        self.kv_transform = KvTransform(shape.cache_kv_heads, shape.cache_head_dim)

    def _head_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm`` over each head of ``x`` ``[num_tokens, heads, head_dim]``."""
        return norm(x.reshape(-1, self.head_dim)).view(x.shape)

    def _fit_cache(self, x: torch.Tensor, repeat: int) -> torch.Tensor:
        """Heads ``[num_tokens, heads, head_dim]`` each repeated ``repeat`` times and zero-padded to the cache's size."""
        if repeat > 1:
            x = x.repeat_interleave(repeat, dim=1)
        return F.pad(x, (0, self.pad)) if self.pad else x

    def forward(
        self, cos_sin: CosSin | None, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> attention output ``[num_tokens, hidden]``."""
        k_raw = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v_raw = k_raw if self.v_proj is None else self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        q = self._head_norm(self.q_norm, self.q_proj(x).view(-1, self.num_heads, self.head_dim))
        k = self._head_norm(self.k_norm, k_raw)
        v = F.rms_norm(v_raw.float(), (self.head_dim,), None, self.eps).to(x.dtype)
        if self.rope:
            q, k = RotaryEmbedding.apply(q, cos_sin), RotaryEmbedding.apply(k, cos_sin)
        q, k, v = self._fit_cache(q, 1), self._fit_cache(k, self.kv_repeat), self._fit_cache(v, self.kv_repeat)
        q, k = self.kv_transform.encode(q.contiguous(), k.contiguous())  # the identity unless an int4 cache fitted it
        out = self.backend.forward(q, k, v.contiguous(), kv_cache[0], kv_cache[1], meta, self.scale,
                                   sliding_window=self.sliding_window)  # [num_tokens, num_heads, cache_head_dim]
        if self.pad:
            out = out[..., : self.head_dim]
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))
