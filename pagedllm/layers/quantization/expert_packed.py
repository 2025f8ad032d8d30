"""Float expert weights in packed panels cut per expert, so that one expert's rows are a run of whole panels.

The experts of a mixture-of-experts layer are one ``Linear`` whose rows are
the experts' stacked (``layers/fused_moe.py``): expert ``e`` holds rows
``[e * rows, (e + 1) * rows)``. Most methods keep rows as rows, and an
expert's slice is a row range of what they hold (GGUF blocks, int8 / int4
groups, a float or bf16 weight). The packed-panel kernels
(``packed_linear.py``) reorder a weight into panels of ``panel`` output
columns, and an expert's rows need not start on a panel: these methods pack
each expert's ``[rows, in]`` on its own and keep the experts' panels back to
back, ``[num_experts * panels per expert, in, panel]`` (bf16:
``[num_experts * panels per expert, ceil(in / 2), panel, 2]``), so that
``experts_linear`` hands the kernel expert ``e``'s panels as one slice, with
the same bits a dense layer of that expert alone gives.

``expert_method`` is how the experts' layers take their method: the
config's answer, made row-sliceable (these two for the packed kernels, the
plain float or bf16 weight in place of oneDNN's opaque packing).
"""

from __future__ import annotations

import torch

from pagedllm.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod, replace_parameter
from pagedllm.layers.quantization.bf16_linear import TorchBF16LinearMethod
from pagedllm.layers.quantization.onednn_linear import OneDnnLinearMethod
from pagedllm.layers.quantization.packed_linear import (
    PackedBF16LinearMethod,
    PackedLinearMethod,
    pack_weight_panels,
    pack_weight_panels_bf16,
    packed_linear,
    packed_linear_bf16,
)


class ExpertPackedLinearMethod(PackedLinearMethod):
    """``PackedLinearMethod`` with each of ``num_experts`` experts' rows packed on its own."""

    name = "packed-experts"

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def process_weights_after_loading(self, layer: Linear) -> None:
        rows = layer.out_features // self.num_experts
        weight = layer.weight.detach().view(self.num_experts, rows, layer.in_features)
        panels = [pack_weight_panels(weight[e]) for e in range(self.num_experts)]
        replace_parameter(layer, "packed_weight", torch.cat(panels))  # [experts * panels, in, panel]
        replace_parameter(layer, "weight", None)
        replace_parameter(layer, "bias", None if layer.bias is None else layer.bias.detach().float().contiguous())

    def expert_rows(self, layer: Linear, x: torch.Tensor, expert: int) -> torch.Tensor:
        """``x`` ``[n, in]`` times expert ``expert``'s rows: ``[n, rows per expert]``."""
        rows = layer.out_features // self.num_experts
        per = layer.packed_weight.shape[0] // self.num_experts
        bias = None if layer.bias is None else layer.bias.narrow(0, expert * rows, rows)
        return packed_linear(x, layer.packed_weight.narrow(0, expert * per, per), bias, rows)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features)
        out = torch.cat([self.expert_rows(layer, rows, e) for e in range(self.num_experts)], dim=-1)
        return out.view(*x.shape[:-1], layer.out_features)


class ExpertPackedBF16LinearMethod(PackedBF16LinearMethod):
    """``PackedBF16LinearMethod`` with each of ``num_experts`` experts' rows packed on its own."""

    name = "packed_bf16-experts"

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def process_weights_after_loading(self, layer: Linear) -> None:
        rows = layer.out_features // self.num_experts
        weight = layer.weight.detach().view(self.num_experts, rows, layer.in_features)
        panels = [pack_weight_panels_bf16(weight[e]) for e in range(self.num_experts)]
        replace_parameter(layer, "packed_weight", torch.cat(panels))
        replace_parameter(layer, "weight", None)
        bias = None if layer.bias is None else layer.bias.detach().to(torch.bfloat16).float().contiguous()
        replace_parameter(layer, "bias", bias)

    def expert_rows(self, layer: Linear, x: torch.Tensor, expert: int) -> torch.Tensor:
        """``x`` ``[n, in]`` times expert ``expert``'s rows: ``[n, rows per expert]``."""
        rows = layer.out_features // self.num_experts
        per = layer.packed_weight.shape[0] // self.num_experts
        bias = None if layer.bias is None else layer.bias.narrow(0, expert * rows, rows)
        return packed_linear_bf16(x, layer.packed_weight.narrow(0, expert * per, per), bias, rows, layer.in_features)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, layer.in_features)
        out = torch.cat([self.expert_rows(layer, rows, e) for e in range(self.num_experts)], dim=-1)
        return out.view(*x.shape[:-1], layer.out_features)


def expert_method(method: LinearMethod, num_experts: int) -> LinearMethod:
    """The method an experts' layer takes for ``method`` (the config's answer): one whose experts are row
    slices (``experts_linear`` multiplies them one at a time)."""
    if type(method) is PackedLinearMethod:
        return ExpertPackedLinearMethod(num_experts)
    if type(method) is PackedBF16LinearMethod:
        return ExpertPackedBF16LinearMethod(num_experts)
    if isinstance(method, OneDnnLinearMethod):  # an opaque packing: the plain weight of its dtype instead
        return UnquantizedLinearMethod() if method.weight_dtype == torch.float32 else TorchBF16LinearMethod()
    return method
