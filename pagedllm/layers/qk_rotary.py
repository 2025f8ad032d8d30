"""q and k of the fused qkv projection, per-head RMS-normed where the model has q/k norms, then rotated (RoPE)."""

from __future__ import annotations

import torch

from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.parallel import ParallelRMSNorm, parallel_norm_pair
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

    ``whole_projection=True`` (OLMo 2): each norm spans the whole q
    (``num_heads * head_dim`` features) or k projection of a token, not one
    head; the native path norms copies through the norms' native rows and
    writes them back into ``qkv``, then rotates in place with the same
    native pass, given no per-head weights. A tensor-parallel rank's such
    norms (``ParallelRMSNorm``) sum their squares over the ranks in one
    all-reduce for q and k together (``parallel_norm_pair``).
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
        whole_projection: bool = False,
        rotary_dim: int | None = None,
    ) -> None:
        if (q_norm is None) != (k_norm is None):
            raise ValueError("QKNormRotary takes both q_norm and k_norm, or neither")
        if whole_projection and q_norm is None:
            raise ValueError("QKNormRotary: whole_projection applies to q/k norms, and none were given")
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.rotate = rotate
        self.whole_projection = whole_projection
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
            # whole heads (or whole projections) as rows: the norms' own implementation (native rows or torch)
            # over copies
            q, k = self._normed_rows(q, k)
        return q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim)

    def _normed_rows(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed copies of ``q`` ``[num_tokens, q_size]`` and ``k`` ``[num_tokens, kv_size]``, per head or over
        the whole projection; as rows (``[-1, span]``), contiguous as the native rows need them."""
        q_norm, k_norm = self._norms
        if isinstance(q_norm, ParallelRMSNorm) and isinstance(k_norm, ParallelRMSNorm):
            # a tensor-parallel rank's slices of whole-projection norms: one all-reduce for q's and k's squares
            return parallel_norm_pair(q_norm, k_norm, q, k)
        q_span, k_span = (self.q_size, self.kv_size) if self.whole_projection else (self.head_dim, self.head_dim)
        return q_norm(q.reshape(-1, q_span).contiguous()), k_norm(k.reshape(-1, k_span).contiguous())

    def forward_native(self, qkv: torch.Tensor, cos_sin: CosSin) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms and RoPE in place on ``qkv``'s q and k heads, one native pass; q and k are views of ``qkv``."""
        cos, sin = (t.view(-1, self.head_dim) for t in cos_sin)
        if self.whole_projection:
            # norms over whole projections, written back; the native pass then rotates only
            q_rows, k_rows = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q_normed, k_normed = self._normed_rows(q_rows, k_rows)
            q_rows.copy_(q_normed)
            k_rows.copy_(k_normed)
            q_weight, k_weight, eps = None, None, 0.0
        elif self._norms is None:
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
        if self.whole_projection:
            q, k = self._normed_rows(qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size])
            q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
            return self._rotate(q, cos_sin), self._rotate(k, cos_sin)
        # heads as rows: a partial rotation runs here with its norms native, which take rows
        q, k = self._normed_rows(qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size])
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        return self._rotate(q, cos_sin), self._rotate(k, cos_sin)
