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


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``,
    ``g = min(gate, limit)`` (transformers' ``GptOssExperts._apply_gate``)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwigluAndMul(nn.Module):
    """gpt-oss's clamped SwiGLU for ``x`` ``[num_tokens, 2 * inter]`` -> ``[num_tokens, inter]``, rows ``[gate | up]``.

    ``clamped_swiglu`` on the halves: the gate clamped above at ``limit``,
    the up projection to ``[-limit, limit]``, ``glu = gate * sigmoid(alpha *
    gate)``, out ``(up + 1) * glu``. gpt-oss's defaults are ``alpha`` 1.702 and
    ``limit`` 7.0 (``swiglu_alpha`` / ``swiglu_limit``). transformers stores
    gpt-oss's gate and up interleaved (gate in the even columns of
    ``gate_up_proj``); whoever loads them puts them in halves first. Plain torch.
    """

    def __init__(self, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        if not limit > 0:
            raise ValueError(f"ClampedSwigluAndMul: limit must be positive, got {limit!r}")
        self.alpha, self.limit = float(alpha), float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The activation of ``[gate | up]`` rows, in torch ops."""
        gate, up = x.chunk(2, dim=-1)
        return clamped_swiglu(gate, up, self.alpha, self.limit)


# transformers' activation names (ACT2FN keys) -> the gated layer computing the same function; "swiglu_oai" is
# gpt-oss's clamped SwiGLU (not an ACT2FN name: its config says hidden_act "silu" and the experts clamp)
GATED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu", "swiglu_oai")


def gated_activation(name: str, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> nn.Module:
    """The ``act(gate) * up`` layer for the checkpoint's ``hidden_act`` / ``hidden_activation`` ``name``.

    ``swiglu_alpha`` / ``swiglu_limit``: the clamped SwiGLU's (``"swiglu_oai"``) only.
    Raises ValueError naming an activation no layer computes (and the
    supported ones), rather than running another function in its place.
    """
    if name == "swiglu_oai":
        return ClampedSwigluAndMul(swiglu_alpha, swiglu_limit)
    if name in ("silu", "swish"):  # transformers' "swish" is SiLU
        return SiluAndMul()
    if name == "gelu":
        return GeluAndMul("none")
    if name == "gelu_pytorch_tanh":
        return GeluAndMul("tanh")
    if name == "relu":
        return ReluAndMul()
    raise ValueError(f"unsupported hidden activation {name!r}; supported: {GATED_ACTIVATIONS}")
