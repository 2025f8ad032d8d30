"""RMSNorm, with the residual add fused in where the native ops are available."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.native_ops import NativeOps


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as the reference does.

    ``unit_offset=False`` (Llama): ``weight * rms_norm(x)``, the weight
    applied in ``x``'s dtype. ``unit_offset=True`` (Gemma): ``rms_norm(x) *
    (1 + weight)`` all in float32, cast back last; checkpoints store the
    weight as an offset from 1. The native kernel computes Llama's form
    only, so a unit-offset norm never uses it, whatever ``native`` says.
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        self.native: NativeOps | None = None  # see LlamaForCausalLM.use_native_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if self.native is not None:
            return self.native.add_rms_norm(x, None, self.weight, self.eps)
        # one call instead of five small ops (same arithmetic: x * rsqrt(mean(x^2) + eps));
        # the weight is applied after casting back, in the input dtype, as the reference does
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``x += delta`` in place (the residual add), then the norm of the sum."""
        if self.native is not None and not self.unit_offset:
            return self.native.add_rms_norm(x, delta, self.weight, self.eps)
        return self(x.add_(delta))
