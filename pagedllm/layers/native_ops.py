"""Fused elementwise ops for float32 on the CPU (``kernels/elementwise.c``).

Between its matmuls a Llama layer runs about twenty small torch ops: the
residual add and RMSNorm (five ops inside), RoPE on q and k (multiply, roll,
multiply, add), SiLU and the multiply by ``up``. Each is a separate pass and
a separate dispatch; at decode sizes the dispatch is most of their cost.
``NativeOps`` does each group in one call and one pass over the rows. The
model uses it when the runner hands it one (CPU, float32, kernels built) and
runs the plain torch ops otherwise; tests compare the two.
"""

from __future__ import annotations

import ctypes

import torch


def _check_rows(name: str, t: torch.Tensor, row_len: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"native {name} takes float32 CPU tensors, got {t.dtype} on {t.device}")
    if t.dim() != 2 or t.shape[1] != row_len or t.stride(1) != 1:
        raise ValueError(f"native {name}: expected rows of {row_len} contiguous floats, got {tuple(t.shape)}")


class NativeOps:
    """RMSNorm (with the residual add), RoPE (after Qwen3's per-head norms) and SiLU-and-multiply as single native calls."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += delta`` in place (when given), then ``rms_norm(x) * weight`` as a new tensor.

        x, delta: ``[num_tokens, hidden]`` contiguous; weight ``[hidden]``.
        """
        hidden = weight.shape[0]
        _check_rows("rms_norm", x, hidden)
        if not x.is_contiguous() or not weight.is_contiguous():
            raise ValueError("native rms_norm needs contiguous x and weight")
        if delta is not None:
            _check_rows("rms_norm", delta, hidden)
            if delta.shape != x.shape or not delta.is_contiguous():
                raise ValueError("native rms_norm: delta must be contiguous and shaped like x")
        y = torch.empty_like(x)  # [num_tokens, hidden]
        self._lib.add_rms_norm_f32(
            x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), y.data_ptr(),
            x.shape[0], hidden, eps, torch.get_num_threads(),
        )
        return y

    def qk_norm_rope_(
        self, x: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
        sin: torch.Tensor, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
    ) -> None:
        """RoPE in place on the q and k heads of each row of ``x``, each head first RMS-normed when given norms.

        x: ``[num_tokens, >= (num_q_heads + num_kv_heads) * head_dim]`` with
        contiguous rows (the fused qkv output: q heads, then k heads);
        cos, sin: ``[num_tokens, head_dim]`` contiguous, sin signed as in
        ``RotaryEmbedding``; q_norm, k_norm: ``[head_dim]`` per-head RMSNorm
        weights (Qwen3), both or neither.
        """
        num_heads = num_q_heads + num_kv_heads
        if head_dim > 1024 or head_dim % 2:
            raise ValueError(f"native rope: head_dim must be even and <= 1024, got {head_dim}")
        if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < num_heads * head_dim or x.dtype != torch.float32:
            raise ValueError(f"native rope: x of shape {tuple(x.shape)} does not hold {num_heads} float32 heads")
        for t in (cos, sin):
            _check_rows("rope", t, head_dim)
            if not t.is_contiguous() or t.shape[0] != x.shape[0]:
                raise ValueError("native rope: cos and sin must be contiguous [num_tokens, head_dim]")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("native rope: give both q and k norm weights, or neither")
        for w in (q_norm, k_norm):
            if w is not None and (w.shape != (head_dim,) or w.dtype != torch.float32 or not w.is_contiguous()):
                raise ValueError(f"native rope: a head norm weight must be contiguous float32 [{head_dim}]")
        self._lib.qk_norm_rope_f32(
            x.data_ptr(), x.shape[0], x.stride(0), num_q_heads, num_kv_heads, head_dim,
            None if q_norm is None else q_norm.data_ptr(), None if k_norm is None else k_norm.data_ptr(), eps,
            cos.data_ptr(), sin.data_ptr(), torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for rows ``[gate | up]`` of ``gate_up`` ``[num_tokens, 2 * inter]``."""
        inter = gate_up.shape[1] // 2
        _check_rows("silu_mul", gate_up, 2 * inter)
        if not gate_up.is_contiguous():
            raise ValueError("native silu_mul needs a contiguous gate_up")
        out = torch.empty(gate_up.shape[0], inter, dtype=torch.float32)  # [num_tokens, inter]
        self._lib.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, torch.get_num_threads())
        return out
