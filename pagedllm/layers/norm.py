"""RMSNorm, with the residual add fused in where the native ops are available."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.native_ops import NativeOps


@dataclass(frozen=True)
class NormSpec:
    """Which RMSNorm a model uses: its epsilon, whether the weight is stored as an offset from 1 (Gemma's
    Hugging Face checkpoints), and whether the weight multiplies in float32 before the cast back (Gemma's
    order, implied by ``unit_offset``; a Gemma GGUF file holds ``1 + w`` already, so it sets this alone)."""

    eps: float
    unit_offset: bool = False
    float32_weight: bool = False

    def build(self, dim: int) -> RMSNorm:
        """An ``RMSNorm`` of this kind over ``dim`` features."""
        return RMSNorm(dim, self.eps, self.unit_offset, self.float32_weight)


class RMSNorm(CustomOp):
    """Root-mean-square norm, computed in float32 as the reference does.

    ``unit_offset=False`` (Llama): ``weight * rms_norm(x)``, the weight
    applied in ``x``'s dtype. ``unit_offset=True`` (Gemma): ``rms_norm(x) *
    (1 + weight)`` all in float32, cast back last; checkpoints store the
    weight as an offset from 1. ``float32_weight=True`` alone: ``rms_norm(x)
    * weight`` in float32, cast back last (Gemma's arithmetic on a weight
    that holds ``1 + w`` already, as llama.cpp's converter writes it). The native kernel computes Llama's form,
    ``rms_norm(x) * w``; in float32 that is Gemma's with ``w = 1 + weight``,
    so a unit-offset norm hands it that sum, made once in ``select_impl``
    (after the weights are loaded: it is a copy). The native kernel runs
    float32 only (it raises ValueError otherwise): the runner hands the
    model native ops only when it computes in float32.

    Two entry points, both bound once by ``select_impl``: ``forward(x)``
    and ``add_forward(x, delta)`` (the residual add, then the norm).
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False, float32_weight: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        self.float32_weight = float32_weight or unit_offset
        self.native_weight: torch.Tensor | None = None  # [dim] float32: what the native kernel multiplies by
        self._add_forward_impl: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._add_forward_torch

    def select_impl(self, ops: NativeOps | None) -> None:
        """Run through ``ops`` from now on (None: plain torch); call it after the weights are loaded."""
        super().select_impl(ops)
        if ops is None:
            self.native_weight = None
        elif self.unit_offset:
            self.native_weight = (1.0 + self.weight.detach().float()).contiguous()
        else:
            self.native_weight = self.weight
        self._add_forward_impl = self._add_forward_torch if ops is None else self._add_forward_native

    def use_native(self, ops: NativeOps | None) -> None:
        """``select_impl`` under its earlier name."""
        self.select_impl(ops)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """``rms_norm(x) * native_weight`` in one native pass."""
        return self.native.add_rms_norm(x, None, self.native_weight, self.eps)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The norm in torch ops, Llama's or Gemma's form (see the class docstring)."""
        if self.float32_weight:
            normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
            weight = 1.0 + self.weight.float() if self.unit_offset else self.weight.float()
            return (normed * weight).to(x.dtype)
        # one call instead of five small ops (same arithmetic: x * rsqrt(mean(x^2) + eps));
        # the weight is applied after casting back, in the input dtype, as the reference does
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``x += delta`` in place (the residual add), then the norm of the sum."""
        return self._add_forward_impl(x, delta)

    def _add_forward_native(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self.native.add_rms_norm(x, delta, self.native_weight, self.eps)

    def _add_forward_torch(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self(x.add_(delta))
