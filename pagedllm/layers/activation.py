"""Gated activations: ``act(gate) * up`` over rows ``[gate | up]``."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """``silu(gate) * up`` for ``x`` ``[num_tokens, 2 * inter]`` -> ``[num_tokens, inter]`` (Llama's MLP).

    One native pass once ``select_impl`` hands it native ops (``layers/custom_op.py``).
    """

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` in one native pass (``x`` contiguous rows)."""
        return self.native.silu_mul(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` in torch ops."""
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


class GeluAndMul(nn.Module):
    """``gelu(gate) * up`` for ``x`` ``[num_tokens, 2 * inter]`` -> ``[num_tokens, inter]`` (Gemma's MLP).

    ``approximate``: "tanh" (transformers' ``gelu_pytorch_tanh``, Gemma's
    default) or "none" (exact erf GELU). Plain torch: there is no native kernel.
    """

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GeluAndMul: approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(gate) * up`` in torch ops."""
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.gelu(gate, approximate=self.approximate) * up
