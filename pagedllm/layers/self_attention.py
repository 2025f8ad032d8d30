"""The self-attention block of a decoder layer, with the options the model families differ in.

``AttentionSpec`` says what one layer computes: its head counts and size
(per layer: a family may give layers different head sizes), biases on the
q/k/v and output projections, per-head q/k norms and their kind, the score
scale and softcap, a sliding window, attention sinks, and whether the layer
rotates q and k at all. ``SelfAttention`` builds the layer from it; which kernels run it is
chosen once, by ``select_impl`` (``layers/custom_op.py``) and the
attention backend the runner made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.attention import AttentionBackend, AttentionMetadata
from pagedllm.layers.kv_transform import KvTransform
from pagedllm.layers.linear import Linear
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.norm import NormSpec
from pagedllm.layers.parallel import ParallelRMSNorm, RowParallelLinear, TensorParallelGroup
from pagedllm.layers.qk_rotary import QKNormRotary
from pagedllm.layers.quantization.quant_config import QuantConfig

CosSin = tuple[torch.Tensor, torch.Tensor]
QK_NORM_SPANS = ("head", "projection")


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, as this process holds it (with tensor parallelism: a rank's head counts).

    ``qk_norm``: the RMSNorm applied to each q and k head before RoPE (None:
    none). ``scale``: multiplies the scores (None: ``head_dim ** -0.5``).
    ``softcap``: scores become ``cap * tanh(s / cap)`` (None: uncapped).
    ``sliding_window``: a query at ``i`` sees keys ``i - w < j <= i`` (None:
    every earlier key). ``rope``: whether q and k are rotated.
    ``qk_norm_span``: what one q/k norm spans, "head" (Qwen3, Gemma 3: each
    head alone, weight ``[head_dim]``) or "projection" (OLMo 2: a token's
    whole q or k projection, weights ``[num_heads * head_dim]`` and
    ``[num_kv_heads * head_dim]``; under tensor parallelism each rank holds
    its heads' slice and the mean square is all-reduced, ``ParallelRMSNorm``).
    ``rotary_dim``: how many leading dimensions of each head are rotated
    (None: all of them; fewer for a partial rotation, Phi-4-mini's).
    ``sinks``: one learned logit per query head in the softmax's denominator
    (gpt-oss's ``self_attn.sinks``, ``layers/attention.py``).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: NormSpec | None = None
    scale: float | None = None
    softcap: float | None = None
    sliding_window: int | None = None
    rope: bool = True
    qk_norm_span: str = "head"
    rotary_dim: int | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.qk_norm_span not in QK_NORM_SPANS:
            raise ValueError(f"qk_norm_span must be one of {QK_NORM_SPANS}, got {self.qk_norm_span!r}")


class SelfAttention(nn.Module):
    """Fused qkv projection, q/k norms and RoPE, paged attention, output projection.

    Parameter names are Hugging Face's (``q_norm``, ``k_norm``, ``o_proj``)
    but for ``qkv_proj``, which holds q, k and v fused (loaded by parts,
    ``layers/weights.py``).
    """

    def __init__(
        self, spec: AttentionSpec, backend: AttentionBackend, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None, prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, quant_config,
                               f"{prefix}.qkv_proj")
        q_start = tp.plan.q_rows[0] if tp is not None else 0
        self.o_proj = RowParallelLinear(self.q_size, spec.hidden_size, spec.o_bias, tp, q_start, quant_config,
                                        f"{prefix}.o_proj")
        whole = spec.qk_norm is not None and spec.qk_norm_span == "projection"
        if whole and tp is not None and tp.size > 1:
            # a rank holds its heads' slice of each norm; the mean square is every rank's (an all-reduce)
            plan = tp.plan
            self.q_norm = ParallelRMSNorm(spec.qk_norm, self.q_size, tp, plan.q_rows[0], plan.total_q_size)
            self.k_norm = ParallelRMSNorm(spec.qk_norm, self.kv_size, tp, plan.kv_rows[0], plan.total_kv_size)
        else:
            q_span, k_span = (self.q_size, self.kv_size) if whole else (self.head_dim, self.head_dim)
            self.q_norm = spec.qk_norm.build(q_span) if spec.qk_norm is not None else None
            self.k_norm = spec.qk_norm.build(k_span) if spec.qk_norm is not None else None
        self.backend = backend
        self.scale = spec.scale if spec.scale is not None else self.head_dim**-0.5
        self.sliding_window = spec.sliding_window  # None: full attention
        self.softcap = spec.softcap
        self.qk_norm_rope = QKNormRotary(self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm, self.k_norm,
                                         rotate=spec.rope, whole_projection=whole, rotary_dim=spec.rotary_dim)
        # an int4 cache's change of variables for K (layers/kv_transform.py), fitted by the runner; shifting
        # keys changes capped scores, so a capped layer keeps its keys as they are
        # (a sink is a logit of its own, not shifted with the keys' scores: a layer with sinks keeps them too)
        self.kv_transform = KvTransform(self.num_kv_heads, self.head_dim,
                                        shift_keys=self.softcap is None and not spec.sinks)
        # this rank's query heads' sink logits, float32 whatever the model's dtype (the native kernels read
        # float32; the torch softmax runs in float32); the first head's index in the checkpoint's tensor
        self.first_head = q_start // self.head_dim if tp is not None and tp.size > 1 else None
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False) \
            if spec.sinks else None

    def checkpoint_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` of this module: its query heads' sinks."""
        if name == "sinks" and self.first_head is not None:
            if tensor.shape[0] < self.first_head + self.num_heads:
                raise ValueError(f"sinks: checkpoint has {tensor.shape[0]} heads, the shard needs heads "
                                 f"{self.first_head}..{self.first_head + self.num_heads}")
            return tensor.narrow(0, self.first_head, self.num_heads)
        return tensor

    @property
    def native(self) -> NativeOps | None:
        """The native ops q/k norms and RoPE run through (None: torch), as ``qk_norm_rope`` chose them.

        Read only, for callers that inspect which path a layer takes.
        """
        return self.qk_norm_rope.native

    def forward(
        self, cos_sin: CosSin | None, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> attention output ``[num_tokens, hidden]``; ``cos_sin`` None without RoPE."""
        qkv = self.qkv_proj(x)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.qk_norm_rope(qkv, cos_sin)
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        q, k = self.kv_transform.encode(q, k)  # the identity unless an int4 cache fitted it
        out = self.backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
            sliding_window=self.sliding_window, softcap=self.softcap, sinks=self.sinks,
        )  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.flatten(1))
