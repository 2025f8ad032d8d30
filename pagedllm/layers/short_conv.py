"""LFM2's gated short conv, a state layer's mixer: ``out_proj(C * causal_conv1d(B * x))``.

``in_proj`` gives ``B``, ``C`` and ``x`` (``[num_tokens, hidden]`` each); the
depthwise conv over ``width`` taps runs over each sequence's new tokens and
continues the conv state in its slot (``layers/causal_conv1d.py``,
docs/hybrid-models.md). ``ShortConvLayerSpec`` marks a decoder layer whose
mixer it is (``layers/mixer_decoder_layer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.attention import AttentionMetadata, DecodeMetadata
from pagedllm.layers.causal_conv1d import causal_conv1d, causal_conv1d_decode
from pagedllm.layers.decoder import DecoderLayerSpec
from pagedllm.layers.linear import Linear
from pagedllm.layers.quantization.quant_config import QuantConfig


@dataclass(frozen=True)
class ShortConvLayerSpec(DecoderLayerSpec):
    """A decoder layer whose mixer is LFM2's gated short conv (``attention`` is not built)."""

    conv_kernel_size: int = 3
    conv_bias: bool = False


class ShortConv(nn.Module):
    """LFM2's gated short conv over the step's tokens, continuing each sequence's conv state."""

    def __init__(self, hidden_size: int, width: int, bias: bool, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.width = width
        self.in_proj = Linear(hidden_size, 3 * hidden_size, bias, quant_config, f"{prefix}.in_proj")
        self.out_proj = Linear(hidden_size, hidden_size, bias, quant_config, f"{prefix}.out_proj")
        self.conv_weight = nn.Parameter(torch.empty(hidden_size, width), requires_grad=False)  # [hidden, width]
        self.conv_bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if bias else None

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The conv state: the last ``width - 1`` inputs of a sequence (at least one row, so a width-1 conv
        still has a tensor to point at)."""
        return ((max(1, self.width - 1), self.hidden_size),)

    def forward(self, h: torch.Tensor, states: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        """``h`` ``[num_tokens, hidden]`` (normed) -> the mixer's output ``[num_tokens, hidden]``."""
        decode = isinstance(meta, DecodeMetadata)  # a captured decode step: the step's sizes stay tensors
        if meta.state_slots is None or (not decode and meta.has_initial_state is None):
            raise ValueError("an LFM2 conv layer needs the step's state slots (AttentionMetadata.state_slots)")
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        conv_state = states[0][:, : self.width - 1]  # [num_slots, width - 1, hidden]
        if decode:
            y = causal_conv1d_decode((b * x).contiguous(), self.conv_weight, self.conv_bias, conv_state,
                                     meta.state_slots, "none", native=conv_state.is_contiguous())
            return self.out_proj(c * y)
        y = causal_conv1d((b * x).contiguous(), self.conv_weight, self.conv_bias, conv_state, meta.query_start_loc,
                          meta.state_slots, meta.has_initial_state, "none", native=conv_state.is_contiguous())
        return self.out_proj(c * y)
