"""Layers with a torch and a native implementation, one of them chosen once (vLLM's ``CustomOp``).

A model says what it computes ("RMSNorm", "SiLU and multiply", "q/k norm
and rotary embedding") and never which kernel runs it. Each such layer
subclasses ``CustomOp``: it writes ``forward_torch`` and ``forward_native``,
and ``select_impl(ops)`` binds one of them as what ``forward`` runs. The
native kernels are known only after the model is built and its weights
loaded (``runner/model_loader.py`` decides whether they run: float32 on the
CPU, kernels built), so the choice is one explicit call at that point,
``select_impls(model, ops)``, not a test in every forward. The native ops
check their own tensors (``kernels/ops.cpp``) and raise ValueError for what
they cannot run; a layer does not check them again per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from pagedllm.layers.native_ops import NativeOps


class CustomOp(nn.Module):
    """A layer whose ``forward`` runs the implementation bound by ``select_impl``: torch until told otherwise.

    Subclasses define ``forward_torch`` and ``forward_native`` with the
    same arguments. ``native`` is the ``NativeOps`` bound (None: torch), for
    ``forward_native`` to call and for callers to inspect.
    """

    def __init__(self) -> None:
        super().__init__()
        self.native: NativeOps | None = None
        self._forward_impl: Callable[..., Any] = self.forward_torch

    def select_impl(self, ops: NativeOps | None) -> None:
        """Run ``forward_native`` through ``ops`` from now on; None: ``forward_torch``.

        Call it after the weights are loaded: a layer may derive what its
        kernel reads from them (``RMSNorm``'s ``1 + w``).
        """
        self.native = ops
        self._forward_impl = self.forward_torch if ops is None else self.forward_native

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 (each layer's own signature)
        """The implementation ``select_impl`` chose, on these arguments."""
        return self._forward_impl(*args, **kwargs)

    def forward_torch(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        """Plain torch ops: runs anywhere, the reference for ``forward_native``."""
        raise NotImplementedError(f"{type(self).__name__} has no torch implementation")

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        """Through ``self.native``; the same result as ``forward_torch`` to float32 rounding."""
        raise NotImplementedError(f"{type(self).__name__} has no native implementation")


def select_impls(model: nn.Module, ops: NativeOps | None) -> None:
    """Every ``CustomOp`` in ``model`` runs through ``ops`` from now on (None: plain torch); after loading weights."""
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.select_impl(ops)


class NativeOpsMixin:
    """Gives a model ``use_native_ops``: the switch between native and torch layers, with no model-specific code."""

    def use_native_ops(self, ops: NativeOps | None) -> None:
        """Run every layer that has a native implementation through ``ops``; None: plain torch (``select_impls``)."""
        if not isinstance(self, nn.Module):
            raise TypeError(f"NativeOpsMixin is for nn.Module models, not {type(self).__name__}")
        select_impls(self, ops)
