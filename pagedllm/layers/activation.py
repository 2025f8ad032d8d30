"""Gated activations: ``act(gate) * up`` over rows ``[gate | up]``."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.native_ops import NativeOps


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x`` ``[num_tokens, 2 * inter]`` -> ``[num_tokens, inter]`` (Llama's MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.native: NativeOps | None = None  # one native pass when set (LlamaForCausalLM.use_native_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.silu_mul(x)
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
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.gelu(gate, approximate=self.approximate) * up
