"""The gated MLP of a decoder layer: ``down(act(gate(x)) * up(x))``, gate and up as one matmul."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.activation import gated_activation
from pagedllm.layers.linear import Linear
from pagedllm.layers.parallel import RowParallelLinear, TensorParallelGroup
from pagedllm.layers.quantization.quant_config import QuantConfig


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with ``act`` named by the checkpoint (``hidden_act``).

    ``gate_up_proj`` holds gate and up fused (column-parallel: with ``tp``
    this rank's slice of the intermediate size); ``down_proj`` is
    row-parallel. The activation layer is chosen here, once
    (``layers/activation.gated_activation``): an unknown name is a ValueError.
    ``bias``: gate, up and down each add a bias (Llama's ``mlp_bias``). ``input_start``: the first of the
    whole MLP's intermediate rows this rank holds (default: the plan's dense ``intermediate``);
    ``reduce=False``: the output stays this rank's partial sum (see ``RowParallelLinear``).
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, tp: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None, prefix: str = "", bias: bool = False,
        input_start: int | None = None, reduce: bool = True,
    ) -> None:
        super().__init__()
        self.act_fn = gated_activation(hidden_act)
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, quant_config, f"{prefix}.gate_up_proj")
        if input_start is None:
            input_start = tp.plan.intermediate[0] if tp is not None else 0
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp, input_start, quant_config,
                                           f"{prefix}.down_proj", reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
