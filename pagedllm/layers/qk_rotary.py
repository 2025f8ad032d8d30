"""q and k of the fused qkv projection, per-head RMS-normed where the model has q/k norms, then rotated (RoPE)."""

from __future__ import annotations

import torch

from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

CosSin = tuple[torch.Tensor, torch.Tensor]


class QKNormRotary(CustomOp):
    """``qkv`` rows -> rotated ``q`` ``[num_tokens, num_heads, head_dim]`` and ``k`` ``[num_tokens, num_kv_heads, head_dim]``.

    ``qkv`` is ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]``:
    q heads, k heads, v heads side by side (v is left alone). ``cos_sin``
    is ``RotaryEmbedding.cos_sin`` of the step's positions. With
    ``q_norm``/``k_norm`` (Qwen3, Gemma 3) each q and k head is RMS-normed
    before the rotation.

    - torch: with norms, each of q and k normed and rotated (new tensors);
      without, q and k rotated together, as one block of heads.
    - native: norms and rotation in place on the q and k of ``qkv``, one
      pass (``NativeOps.qk_norm_rope_``); q and k are views of ``qkv``.

    ``rotate=False`` (a layer without RoPE, SmolLM3's every fourth): the
    norms only, on copies of q and k, in either implementation; ``cos_sin``
    is then ignored (None).

    ``rotary_dim`` below ``head_dim`` (Phi-4-mini's partial rotation): the
    first ``rotary_dim`` dimensions of each head are rotated, the rest pass
    (``RotaryEmbedding.apply_partial``). The native pass rotates whole heads,
    so such a layer runs its torch implementation, whatever ops it is given.

    The norms are the attention's modules (their weights load under the
    checkpoint's names, ``self_attn.q_norm.weight``); this layer uses them
    without owning them, and selects their implementation with its own.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int,
        q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, rotate: bool = True,
        rotary_dim: int | None = None,
    ) -> None:
        if (q_norm is None) != (k_norm is None):
            raise ValueError("QKNormRotary takes both q_norm and k_norm, or neither")
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.rotate = rotate
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {self.rotary_dim}")
        # chosen once: a whole head's rotation or a partial one (torch only)
        self._rotate = RotaryEmbedding.apply if self.rotary_dim == head_dim else RotaryEmbedding.apply_partial
        # a tuple, not attributes: nn.Module would register the norms here as well as on the
        # attention, and their parameters would get a second name
        self._norms: tuple[RMSNorm, RMSNorm] | None = None if q_norm is None else (q_norm, k_norm)
        if not rotate:  # chosen here and again by select_impl: the same path in either implementation
            self._forward_impl = self._forward_unrotated

    def select_impl(self, ops: NativeOps | None) -> None:
        """Run through ``ops`` from now on (None: plain torch), the q/k norms too; after the weights are loaded."""
        if self._norms is not None:
            # the native pass reads the norms' native weights (Gemma's 1 + w), made by their select_impl
            for norm in self._norms:
                norm.select_impl(ops)
        # the native pass rotates whole heads only: a partial rotation stays torch (the norms may still be native)
        super().select_impl(ops if self.rotary_dim == self.head_dim else None)
        if not self.rotate:
            self._forward_impl = self._forward_unrotated

    def _forward_unrotated(self, qkv: torch.Tensor, cos_sin: CosSin | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k of ``qkv``, per-head normed (copies) where the model has q/k norms; no rotation."""
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        if self._norms is not None:
            # whole heads as rows: the norms' own implementation (native rows or torch) over copies
            q_norm, k_norm = self._norms
            q, k = q_norm(q.reshape(-1, self.head_dim)), k_norm(k.reshape(-1, self.head_dim))
        return q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim)

    def forward_native(self, qkv: torch.Tensor, cos_sin: CosSin) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms and RoPE in place on ``qkv``'s q and k heads, one native pass; q and k are views of ``qkv``."""
        cos, sin = (t.view(-1, self.head_dim) for t in cos_sin)
        if self._norms is None:
            q_weight, k_weight, eps = None, None, 0.0
        else:
            q_norm, k_norm = self._norms
            q_weight, k_weight, eps = q_norm.native_weight, k_norm.native_weight, q_norm.eps
        self.native.qk_norm_rope_(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin, q_weight, k_weight, eps
        )
        q = qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
        return q, k

    def forward_torch(self, qkv: torch.Tensor, cos_sin: CosSin) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms (when given) and RoPE in torch ops; ``qkv`` is left as it is."""
        if self._norms is None:
            # q and k sit side by side in qkv: rotate both blocks of heads at once
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = self._rotate(qk, cos_sin).split([self.num_heads, self.num_kv_heads], dim=1)
            return q, k
        q_norm, k_norm = self._norms
        q = q_norm(qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim))
        k = k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(-1, self.num_kv_heads, self.head_dim))
        return self._rotate(q, cos_sin), self._rotate(k, cos_sin)
