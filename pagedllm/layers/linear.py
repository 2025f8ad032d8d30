"""One linear layer class; how it stores and multiplies its weight is its pluggable ``LinearMethod``.

Models are written with ``Linear`` (an ``nn.Linear`` the checkpoint loads
into as usual). After loading, the model loader picks one method from the
config (``runner/model_loader.py``) and ``apply_linear_method`` hands it to
every layer; the method turns the plain weight into its own storage (packed
panels, oneDNN's layout, bf16, int8 / int4 blocks) and from then on computes
the layer's output::

    Linear.forward(x) = quant_method.apply(layer, x)
    quant_method.process_weights_after_loading(layer)   once: weight -> the method's buffers

Methods: ``UnquantizedLinearMethod`` (``F.linear``, below),
``PackedLinearMethod`` / ``PackedBF16LinearMethod`` (``layers/packed_linear.py``),
``OneDnnLinearMethod`` (``layers/onednn_linear.py``), ``TorchBF16LinearMethod``
(``layers/bf16_linear.py``), ``QuantizedLinearMethod`` (``layers/quantized_linear.py``);
``GGUFLinearMethod`` (``layers/gguf_linear.py``) is given by the GGUF loader.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(ABC):
    """How a ``Linear`` stores its weight and computes ``x @ W.T + b``."""

    name: str = "abstract"

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027 - most methods repack, some need nothing
        """Turn the loaded ``layer.weight`` / ``layer.bias`` into this method's storage (once)."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for ``x`` ``[..., in_features]``: ``[..., out_features]``."""


class UnquantizedLinearMethod(LinearMethod):
    """The weight as loaded, through ``F.linear`` (MKL on the CPU, cuBLAS on a GPU)."""

    name = "torch"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


def replace_parameter(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Drop parameter ``name`` of ``layer`` (this module's reference only) and keep ``value`` as a buffer.

    A tied LM head shares its weight with the embedding: deleting the
    attribute here leaves the embedding's parameter alone.
    """
    if name in layer._parameters:
        del layer._parameters[name]
    layer.register_buffer(name, value)


class Linear(nn.Linear):
    """``nn.Linear`` whose storage and matmul belong to ``quant_method`` (unquantized until one is applied)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.quant_method: LinearMethod = UnquantizedLinearMethod()

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: LinearMethod | None = None) -> Linear:
        """A ``Linear`` holding ``linear``'s weight and bias (the same tensors), with ``method`` applied if given.

        ``linear`` itself is left as it was: the method replaces the new
        layer's references only.
        """
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.weight = linear.weight
        if linear.bias is not None:
            layer.bias = linear.bias
        if method is not None:
            layer.quant_method = method
            method.process_weights_after_loading(layer)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.quant_method.name}"


def apply_linear_method(model: nn.Module, method: LinearMethod) -> int:
    """Give every linear layer of ``model`` that is still unquantized ``method``; returns how many.

    Plain ``nn.Linear`` layers are first turned into ``Linear`` sharing
    their tensors. Layers that already have another method are left alone,
    and so is the embedding a tied LM head shares its weight with (the head
    gets the method's own copy).
    """
    targets = [
        (name, mod) for name, mod in model.named_modules()
        if type(mod) is nn.Linear or (isinstance(mod, Linear) and isinstance(mod.quant_method, UnquantizedLinearMethod))
    ]
    for name, mod in targets:
        layer = mod if isinstance(mod, Linear) else Linear.from_linear(mod)
        layer.quant_method = method
        method.process_weights_after_loading(layer)
        if layer is not mod:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return len(targets)
