"""Gated activations: ``act(gate) * up`` over rows ``[gate | up]``, chosen by the checkpoint's activation name."""

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
    default) or "none" (exact erf GELU, transformers' ``gelu``). Plain torch:
    there is no native kernel.
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


class ReluAndMul(nn.Module):
    """``relu(gate) * up`` for ``x`` ``[num_tokens, 2 * inter]`` -> ``[num_tokens, inter]``. Plain torch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(gate) * up`` in torch ops."""
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.relu(gate) * up


# transformers' activation names (ACT2FN keys) -> the gated layer computing the same function
GATED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")


def gated_activation(name: str) -> nn.Module:
    """The ``act(gate) * up`` layer for the checkpoint's ``hidden_act`` / ``hidden_activation`` ``name``.

    Raises ValueError naming an activation no layer computes (and the
    supported ones), rather than running another function in its place.
    """
    if name in ("silu", "swish"):  # transformers' "swish" is SiLU
        return SiluAndMul()
    if name == "gelu":
        return GeluAndMul("none")
    if name == "gelu_pytorch_tanh":
        return GeluAndMul("tanh")
    if name == "relu":
        return ReluAndMul()
    raise ValueError(f"unsupported hidden activation {name!r}; supported: {GATED_ACTIVATIONS}")
