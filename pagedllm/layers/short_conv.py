"""LFM2's gated short conv, a state layer's mixer: ``out_proj(C * causal_conv1d(B * x))``.

``in_proj`` gives ``B``, ``C`` and ``x`` (``[num_tokens, hidden]`` each); the
depthwise conv over ``width`` taps runs over each sequence's new tokens and
continues the conv state in its slot (``layers/causal_conv1d.py``,
docs/hybrid-models.md). ``ShortConvLayerSpec`` marks a decoder layer whose
mixer it is (``layers/mixer_decoder_layer.py``).

The conv is depthwise and the gates elementwise, so under tensor parallelism
a rank holds a slice of the channels (``ShardPlan.conv_channels``): its rows
of each of B, C and x in ``in_proj``, its filters and conv state, and its
columns of the row-parallel ``out_proj``, whose partial sums are all-reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.attention import AttentionMetadata, DecodeMetadata
from pagedllm.layers.causal_conv1d import causal_conv1d, causal_conv1d_decode
from pagedllm.layers.decoder import DecoderLayerSpec
from pagedllm.layers.parallel import RowParallelLinear, SegmentedColumnLinear, TensorParallelGroup
from pagedllm.layers.quantization.quant_config import QuantConfig


@dataclass(frozen=True)
class ShortConvLayerSpec(DecoderLayerSpec):
    """A decoder layer whose mixer is LFM2's gated short conv (``attention`` is not built)."""

    conv_kernel_size: int = 3
    conv_bias: bool = False


class ShortConv(nn.Module):
    """LFM2's gated short conv over the step's tokens, continuing each sequence's conv state."""

    def __init__(
        self, hidden_size: int, width: int, bias: bool, quant_config: QuantConfig | None, prefix: str,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.width = width
        sharded = tp is not None and tp.size > 1
        # this process's channels (a tensor-parallel rank's slice, else all of them)
        self.first_channel, self.channels = tp.plan.conv_channels if sharded else (0, hidden_size)
        c0, n = self.first_channel, self.channels
        self.in_proj = SegmentedColumnLinear(hidden_size, ((c0, n), (hidden_size + c0, n), (2 * hidden_size + c0, n)),
                                             bias, tp, quant_config, f"{prefix}.in_proj")
        self.out_proj = RowParallelLinear(n, hidden_size, bias, tp, c0, quant_config, f"{prefix}.out_proj")
        self.conv_weight = nn.Parameter(torch.empty(n, width), requires_grad=False)  # [channels, width]
        self.conv_bias = nn.Parameter(torch.empty(n), requires_grad=False) if bias else None
        self.sharded = sharded

    def checkpoint_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's channels of the checkpoint's ``conv_weight`` / ``conv_bias`` (one process: all)."""
        return tensor.narrow(0, self.first_channel, self.channels) if self.sharded else tensor

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The conv state: the last ``width - 1`` inputs of a sequence, this process's channels (at least one row,
        so a width-1 conv still has a tensor to point at)."""
        return ((max(1, self.width - 1), self.channels),)

    def forward(self, h: torch.Tensor, states: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        """``h`` ``[num_tokens, hidden]`` (normed) -> the mixer's output ``[num_tokens, hidden]`` (all-reduced over
        tensor-parallel ranks by ``out_proj``)."""
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
