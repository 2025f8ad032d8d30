"""A branch of the residual stream multiplied by a constant, in place (Granite's ``residual_multiplier``)."""

from __future__ import annotations

import torch

from pagedllm.layers.custom_op import CustomOp
from pagedllm.layers.native_ops import NativeOps


class BranchScale(CustomOp):
    """``x *= multiplier`` in place on rows ``[num_tokens, dim]``; returns ``x``.

    torch: ``x.mul_(multiplier)``, as transformers' Granite scales a branch
    (the float32 product of each element and the multiplier). native: the
    same product through ``row_affine_`` with a ``[dim]`` vector of the
    multiplier made once in ``select_impl``, so that a captured decode step
    keeps it inside its native program rather than as a Python call between
    programs (``runner/capture/step_program.py``).
    """

    def __init__(self, dim: int, multiplier: float) -> None:
        super().__init__()
        self.dim = dim
        self.multiplier = multiplier
        self.native_mul: torch.Tensor | None = None  # [dim] float32, what the native kernel multiplies by

    def select_impl(self, ops: NativeOps | None) -> None:
        """Run through ``ops`` from now on (None: torch), the native multiplier vector made here."""
        super().select_impl(ops)
        self.native_mul = None if ops is None else torch.full((self.dim,), self.multiplier, dtype=torch.float32)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """``row_affine_(x, multiplier vector, None)``: each element times the multiplier, in one native pass."""
        self.native.row_affine_(x, self.native_mul, None)
        return x

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """``x.mul_(multiplier)``."""
        return x.mul_(self.multiplier)
