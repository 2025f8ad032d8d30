"""Fused elementwise ops for float32 on the CPU (``kernels/elementwise/elementwise.cpp``).

Between its matmuls a Llama layer runs about twenty small torch ops: the
residual add and RMSNorm (five ops inside), RoPE on q and k (multiply, roll,
multiply, add), SiLU and the multiply by ``up``. Each is a separate pass and
a separate dispatch; at decode sizes the dispatch is most of their cost.
``NativeOps`` does each group in one call and one pass over the rows. The
model uses it when the runner hands it one (CPU, float32, kernels built) and
runs the plain torch ops otherwise; tests compare the two.
"""

from __future__ import annotations

from typing import Any

import torch


class NativeOps:
    """RMSNorm (with the residual add), RoPE (after Qwen3's per-head norms) and SiLU-and-multiply as single native ops.

    Each method calls one ``torch.ops.pagedllm`` op, which checks its
    tensors (dtype, shapes, contiguity) and raises ValueError for what it
    cannot run.
    """

    def __init__(self, ops: Any = None) -> None:  # noqa: ANN401 (torch's op namespace)
        # the namespace load_kernels() returned; the ops are reached through torch.ops either way
        self._ops = ops if ops is not None else torch.ops.pagedllm

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``x += delta`` in place (when given), then ``rms_norm(x) * weight`` as a new tensor.

        x, delta: ``[num_tokens, hidden]`` contiguous; weight ``[hidden]``.
        """
        return self._ops.add_rms_norm(x, delta, weight, eps)

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
        self._ops.qk_norm_rope(x, num_q_heads, num_kv_heads, head_dim, cos, sin, q_norm, k_norm, eps)

    def row_affine_(self, x: torch.Tensor, mul: torch.Tensor | None, add: torch.Tensor | None) -> None:
        """In place on rows ``x`` ``[num_tokens, n]`` (each row contiguous): ``x = x * mul + add`` per column,
        ``mul``/``add`` ``[n]`` or None."""
        self._ops.row_affine_(x, mul, add)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` ``[num_tokens, inter]`` for rows ``[gate | up]`` of ``gate_up`` ``[num_tokens, 2 * inter]``."""
        return self._ops.silu_mul(gate_up)

    def gated_delta_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        state: torch.Tensor, bounds: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor,
        out: torch.Tensor, scale: float, chunk_size: int, qk_l2norm: bool = True,
    ) -> None:
        """Prompts through the gated delta rule in chunks (``kernels/gated_delta/gated_delta_chunk.cpp``).

        Sequence ``s``: rows ``bounds[2s] .. bounds[2s+1]-1`` of q, k ``[rows, num_k_heads, head_k_dim]``, v and
        ``out`` ``[rows, num_v_heads, head_v_dim]``, g and beta ``[rows, num_v_heads]``; its state
        ``state[slots[s]]``, zero first where ``has_initial_state[s]`` is False, left at its last row's.
        """
        self._ops.gated_delta_prefill(q, k, v, g, beta, state, bounds, slots, has_initial_state, out, scale,
                                      qk_l2norm, chunk_size)

    def gated_delta_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        state: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, scale: float, qk_l2norm: bool = True,
    ) -> None:
        """One token per sequence (row ``r``: slot ``slots[r]``) through the recurrent form, states in place."""
        self._ops.gated_delta_decode(q, k, v, g, beta, state, slots, out, scale, qk_l2norm)

    def moe_route(
        self, logits: torch.Tensor, top_k: int, kind: int, renormalize: bool, correction_bias: torch.Tensor | None,
        scaling_factor: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A router's (weights float32, expert ids int64), each ``[rows, top_k]``, from its logits ``[rows,
        num_experts]``: ``route_logits``' bits (``layers/router.py``; ``kind`` as its ``ROUTER_KINDS``)."""
        return self._ops.moe_route(logits, top_k, kind, renormalize, correction_bias, scaling_factor)

    def moe_slot_sum(self, y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                     gate: torch.Tensor | None) -> torch.Tensor:
        """``[num_tokens, hidden]``: each token's ``top_k`` expert outputs ``y`` ``[num_tokens, top_k, hidden]``
        weighted by ``weights`` ``[num_tokens, top_k]`` and summed in slot order, plus ``shared`` (times
        ``sigmoid(gate)`` ``[num_tokens, 1]`` where given)."""
        return self._ops.moe_slot_sum(y, weights, shared, gate)

    def gated_rms_norm(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                       tiled_k_heads: int) -> torch.Tensor:
        """``[num_tokens, num_heads * head_dim]``: ``rms_norm(x) * weight * silu(z)`` per head of ``x``, ``z``
        ``[num_tokens, num_heads, head_dim]``, heads written tiled over ``tiled_k_heads`` key heads (0: as given)."""
        return self._ops.gated_rms_norm(x, z, weight, eps, tiled_k_heads)

    def moe_group(self, ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
        """Expert ids ``[rows, top_k]`` as pairs grouped by expert, stably: (order, token_ids, pair_experts,
        counts, offsets) (``layers/moe_pairs.py``'s ``PairGroups``)."""
        return self._ops.moe_group(ids, num_experts)
